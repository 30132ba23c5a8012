"""`lmpm trace RUN_DIR`: which constraints blocked which proposals, where and when.

Reads RUN_DIR/lmpm.db (written by `lmpm run`; schema in docs/trace.md) without importing torch.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from lmpm.printable import printable_tree

HELP = "report a run's constraint trace: blocked proposals, where, when; or one cell's story"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="the --out directory of `lmpm run`")
    p.add_argument(
        "--cell",
        metavar="CELL",
        help="the story of one cell, e.g. 'Vid[3,10,12]': every attempt, candidates, verdicts",
    )
    p.add_argument("--json", action="store_true", help="the report as JSON on stdout")
    p.add_argument("--plot", metavar="OUT.png", help="plot violations per constraint per epoch")


def run(args: argparse.Namespace) -> int:
    from lmpm.train.log import holds_training

    if holds_training(args.run_dir) and not (Path(args.run_dir) / "lmpm.db").exists():
        return _training(args)

    from lmpm.runtime.control.trace import cell_story, plot, report
    from lmpm.runtime.received import interpreting
    from lmpm.runtime.rundir import connect, db_path

    conn = connect(args.run_dir)
    # the report and its rendering read values of the log: one LMPM never writes is D043
    with interpreting(db_path(args.run_dir)):
        try:
            if args.cell:
                story = printable_tree(cell_story(conn, args.run_dir, args.cell))
                if args.json:
                    sys.stdout.write(json.dumps(story, indent=1) + "\n")
                else:
                    _render_story(printable_tree(story, markup=True), _console())
                return 0
            rep = printable_tree(report(conn, args.run_dir))  # names from the log: no escapes
        finally:
            conn.close()
        if args.plot:
            path = plot(rep, args.plot)
            sys.stderr.write(f"wrote {path}\n")
        if args.json:
            sys.stdout.write(json.dumps(rep, indent=1) + "\n")
        elif not args.plot:
            _render_report(printable_tree(rep, markup=True), _console())
    return 0


def _training(args: argparse.Namespace) -> int:
    """A training run's trace: epochs, constraints on the parameters, faults, resumes."""
    from lmpm.errors import UsageError
    from lmpm.runtime.received import interpreting
    from lmpm.train import log as tlog
    from lmpm.train.tracereport import render, report

    if args.cell or args.plot:
        raise UsageError(
            "--cell and --plot apply to cell runs; for a training run see `lmpm render RUN_DIR` "
            "(the loss curve) and `lmpm top RUN_DIR`",
            code="U095",
        )
    with interpreting(tlog.db_path(args.run_dir)):
        rep = printable_tree(report(tlog.read(args.run_dir)))
        if args.json:
            sys.stdout.write(json.dumps(rep, indent=1) + "\n")
        else:
            render(printable_tree(rep, markup=True), _console())
    return 0


def _console() -> Any:
    from rich.console import Console

    # Piped output (a file, `head`) gets 120 columns instead of rich's 80, so tables stay legible.
    return Console(width=None if sys.stdout.isatty() else 120)


def _stop_text(stop: dict[str, Any]) -> str:
    """Why the run stopped, from the log's meta ``stop`` (see ``lmpm.runtime.records.StopReason``)."""
    kind = {"stable": "stable", "epochs": "the epoch limit was reached"}.get(
        str(stop.get("kind")), str(stop.get("kind"))
    )
    unset = stop.get("unset") or {}
    total = sum(int(c) for reasons in unset.values() for c in reasons.values())
    if not total:
        lines = [f"stopped after {stop.get('epoch')} epochs: {kind}, every cell set"]
    else:
        lines = [
            f"stopped after {stop.get('epoch')} epochs: {kind}, [bold yellow]{total} cell"
            f"{'s' if total != 1 else ''} left unset[/]:"
        ]
        for name, reasons in unset.items():
            for why, count in reasons.items():
                lines.append(f"  {name}: {count} {why}")
    broken = stop.get("broken") or {}  # (older logs have none)
    for name, by in broken.items():
        for constraint, count in by.items():
            lines.append(
                f"  [bold yellow]{name}: {count} committed cell{'s' if count != 1 else ''} "
                f"break{'' if count != 1 else 's'} `{constraint}`[/]"
            )
    return "\n".join(lines)


def _render_report(rep: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    r = rep["run"]  # every string already printable and markup-escaped (printable_tree)
    params = " ".join(f"{k}={v}" for k, v in (r["params"] or {}).items())
    workers = f"{r['workers']} worker{'s' if r['workers'] != 1 else ''}"
    replaced = len(rep["faults"])
    if replaced:
        workers += f" ({replaced} worker fault{'s' if replaced != 1 else ''} survived)"
    commits = f"{r['commits']:,} commits"
    if r["unattempted"]:  # the VM's forced and tool tokens: no model was asked for them
        commits += f" ({r['unattempted']:,} forced or tool tokens, no model asked)"
    console.print(
        f"[bold]{r['program']}[/] {params}  seed {r['seed']}  {r['epochs']} epochs ({r['status']})  "
        f"{workers}  {commits}, {r['attempts']:,} model attempts  trace {r['trace']}"
        + (f" {r['trace_region']}" if r["trace_region"] else "")
    )
    stop = r.get("stop")
    if isinstance(stop, dict):
        console.print(_stop_text(stop), highlight=False)
    if r.get("error"):
        console.print(f"[bold red]the run failed:[/] {r['error']}", highlight=False)
    if r["trace"] == "off":
        console.print("the constraint trace was off (run with --trace summary or --trace cells)")
    else:
        console.print(
            f"{r['decided']:,} decisions were decided by a constraint (the score favourite lost)"
        )

    t = Table(title="constraints", title_justify="left")
    for col in (
        "constraint",
        "priority",
        "kind",
        "status",
        "checked",
        "violations",
        "lost",
        "won",
        "fired in epochs",
    ):
        t.add_column(
            col,
            justify="right"
            if col in ("priority", "checked", "violations", "lost", "won")
            else "left",
        )
    for c in rep["constraints"]:
        proved = c["status"] == "proved"
        t.add_row(
            c["name"],
            str(c["priority"]),
            f"{c['kind']} {c['pred']}",
            "proved at compile time" if proved else "evaluated",
            "—" if proved else f"{c['checked']:,}",
            "—" if proved else f"{c['violations']:,}",
            "—" if proved else f"{c['lost']:,}",
            "—" if proved else f"{c['won']:,}",
            c["fired_epochs"] or "—",
        )
    if rep["constraints"]:
        console.print(t)
    else:
        console.print("the program declares no constraint")

    if rep["blocked"]:
        b = Table(
            title="blocked proposals (decisions lost because of a constraint)", title_justify="left"
        )
        for col in ("constraint", "blocked candidates of", "decisions", "where", "when (epochs)"):
            b.add_column(col, justify="right" if col == "decisions" else "left")
        for row in rep["blocked"]:
            b.add_row(
                row["constraint"],
                row["rule"],
                f"{row['decisions']:,}",
                row["where"] or "—",
                row["when"],
            )
        console.print(b)
    elif r["trace"] != "off":
        console.print("no constraint decided any decision")
    if rep["never_fired"]:
        console.print("never fired: " + ", ".join(rep["never_fired"]))
    if rep["proved"]:
        console.print("proved at compile time (never evaluated): " + ", ".join(rep["proved"]))
    if rep.get("ruleset"):
        console.print("RuleSet changes (the constraints that count, from the epoch on):")
        for ch in rep["ruleset"]:
            console.print(
                f"  epoch {ch['epoch']}: {ch['change']} {ch['constraint']} by {ch['by']} "
                f"(clock {ch['clock']}) -> active: {', '.join(ch['active']) or 'none'}",
            )

    if rep.get("faults"):
        console.print("worker faults survived (each epoch redone from the durable state):")
        for f in rep["faults"]:
            # "epoch": the worker's one call of the epoch (older logs name its phase)
            where = "" if f["phase"] == "epoch" else f" in {f['phase']}"
            console.print(
                f"  epoch {f['epoch']}: worker {f['worker']} {f['cause']}{where} "
                f"(pid {f['pid']}), {f['seconds']:.2f} s lost",
            )

    if rep.get("dissent"):
        _print_dissent(console, rep["dissent"])

    for value, text in (rep.get("texts") or {}).items():  # values of a tokenizer's vocabulary
        console.print(f"[bold]{value}[/] (its tokenizer's text):", highlight=False)
        console.print(text.rstrip("\n"), highlight=False, markup=False)

    if rep["epochs"]:
        console.print(_epochs_table(rep["epochs"]))


def _epochs_table(epochs: list[dict[str, Any]]) -> Any:
    """Per epoch: cells, commits, time; the driver's CPU time where logged, and the bytes into
    and out of the control plane and worker to worker where any crossed (multi-worker runs)."""
    from rich.table import Table

    def kb(n: int | None) -> str:
        return "—" if n is None else f"{n / 1000:,.1f}"

    cpu = any(ep["driver_cpu_s"] is not None for ep in epochs)
    moved = any(ep["control_bytes"] or ep["halo_bytes"] for ep in epochs)
    cols = ["epoch", "open", "candidates", "commits", "violations", "decided", "ms", "log ms"]
    if cpu:
        cols.append("cpu ms")
    if moved:
        cols += ["control kB", "halo kB"]
    e = Table(title="epochs", title_justify="left")
    for col in cols:
        e.add_column(col, justify="right")
    shown = epochs if len(epochs) <= 12 else [*epochs[:5], None, *epochs[-5:]]
    for ep in shown:
        if ep is None:
            e.add_row("…", *[""] * (len(cols) - 1))
            continue
        row = [
            str(ep["epoch"]),
            f"{ep['open_cells']:,}",
            f"{ep['candidates']:,}",
            f"{ep['commits']:,}",
            f"{ep['violations']:,}",
            "—" if ep["decided"] is None else f"{ep['decided']:,}",
            f"{1000 * ep['seconds']:.1f}",
            f"{1000 * ep['log_seconds']:.1f}",
        ]
        if cpu:
            s = ep["driver_cpu_s"]
            row.append("—" if s is None else f"{1000 * s:.1f}")
        if moved:
            row += [kb(ep["control_bytes"]), kb(ep["halo_bytes"])]
        e.add_row(*row)
    return e


def _shown(entry: dict[str, Any]) -> str:
    """A payload as the story prints it: a token's id with its string (``id 'text'``) where the
    run has the value's tokenizer."""
    if entry.get("payload") is None:
        return "unset"
    if "token" in entry:
        return f"{entry['payload']} {entry['token']!r}"
    return str(entry["payload"])


def _render_story(s: dict[str, Any], console: Any) -> None:
    from rich.markup import escape
    from rich.table import Table

    console.print(f"[bold]{s['cell']}[/] (cell id {s['id']} of {s['value']})")
    if s["start"] is not None:
        st = s["start"]
        console.print(
            f"given as {st['rule']}: {escape(_shown(st))} (clock {st['clock']})", highlight=False
        )
    if s["commits"]:
        t = Table(title="commits", title_justify="left")
        for col in ("epoch", "rule", "payload", "score", "clock"):
            t.add_column(col, justify="left" if col == "rule" else "right")
        for c in s["commits"]:
            t.add_row(
                str(c["epoch"]), c["rule"], escape(_shown(c)), f"{c['score']:g}", str(c["clock"])
            )
        console.print(t)
    else:
        console.print("never committed by a rule")
    if s.get("proposed") is False:
        console.print(
            f"no rule proposes `{s['value']}`: its cells hold what the inputs gave, and no "
            "epoch attempts them (nothing to trace)"
        )
        return
    if not s["traced"]:
        console.print(
            "attempts were not traced for this cell: run with --trace cells "
            f"(optionally --trace-region '{s['cell']}') to record candidates and verdicts"
        )
        return
    names = [c["name"] for c in s["constraints"]]
    for a in s["attempts"]:
        t = Table(title=f"epoch {a['epoch']}: {a['why']}", title_justify="left")
        for col in ("", "candidate", "rule", "payload", "score", *names):
            t.add_column(col)
        for c in a["candidates"]:
            mark = "★" if c["winner"] else ("·" if c["favourite"] else "")
            score = "—" if c["score"] is None else f"{c['score']:g}"
            payload = escape(_shown(c))
            verdicts = [
                {"ok": "ok", "violated": "[red]violated[/]", "n/a": "—", "proved": "proved"}[
                    c["verdicts"][n]
                ]
                for n in names
            ]
            t.add_row(mark, str(c["col"]), c["rule"], payload, score, *verdicts)
        console.print(t)
        console.print(
            f"  → {escape(_shown(a))}, clock {a['clock']}  (★ winner, · score favourite)",
            highlight=False,
        )


def _print_dissent(console: Any, rows: list[dict[str, Any]]) -> None:
    """Quorum replicas outvoted: per value, replica and worker, the epochs and cells."""
    console.print("quorum replicas outvoted (their proposal differed from the committed one):")
    groups: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for d in rows:
        groups.setdefault((d["value"], d["replica"], d["worker"]), []).append(d)
    for (value, replica, worker), ds in groups.items():
        epochs = [d["epoch"] for d in ds]
        span = f"epoch {epochs[0]}" if len(epochs) == 1 else f"epochs {epochs[0]}..{epochs[-1]}"
        cells = sum(d["cells"] for d in ds)
        console.print(
            f"  {value} replica {replica} on worker {worker}: {cells} cell"
            f"{'s' if cells != 1 else ''} in {len(epochs)} epoch{'s' if len(epochs) != 1 else ''} "
            f"({span})",
        )
