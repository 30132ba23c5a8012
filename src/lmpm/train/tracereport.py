"""`lmpm trace RUN_DIR` of a training run: what each epoch committed, what the constraints did on
the parameters, which workers failed and were respawned, and the resumes. Reads ``train.db`` only
(no torch).
"""

from __future__ import annotations

from typing import Any

from lmpm.train.log import TrainHistory, status
from lmpm.train.units import UNIT, fmt


def report(h: TrainHistory) -> dict[str, Any]:
    """The report as plain data (``--json``)."""
    m = h.meta
    cons: dict[str, dict[str, Any]] = {}
    for c in h.constraints:
        k = cons.setdefault(
            c["name"],
            {"kind": c["kind"], "epochs": 0, "checked": 0, "violations": 0, "actions": {}},
        )
        k["epochs"] += 1
        k["checked"] += c["checked"]
        k["violations"] += c["violations"]
        k["actions"][c["action"]] = k["actions"].get(c["action"], 0) + 1
    return {
        "kind": "train",
        "program": m.get("program"),
        "module": m.get("module"),
        "status": status(m),
        "error": m.get("error"),
        "policy": m.get("policy"),
        "workers": m.get("workers"),
        "driver": m.get("driver"),
        "steps": m.get("steps"),
        "batch": m.get("batch"),
        "epochs_planned": m.get("epochs"),
        "epochs": h.epochs,
        "constraints": cons,
        "faults": h.faults,
        "restarts": {w["worker"]: w["restarts"] for w in h.workers if w["restarts"]},
        "resumes": m.get("resumes", []),
    }


def _bits(x: float | None) -> str:
    return fmt(x)


def render(rep: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    pol = rep.get("policy") or {}
    args = ", ".join(f"{k}={v}" for k, v in pol.items() if k != "kind")
    done = rep["epochs"][-1]["epoch"] if rep["epochs"] else 0
    console.print(
        f"[bold]training run[/] {rep['program']} ({rep['module']}): [bold]{rep['status']}[/], "
        f"epoch {done} of {rep['epochs_planned']}, {rep['workers']} worker(s) ({rep['driver']}), "
        f"{pol.get('kind')}({args}), H = {rep['steps']}, batch {rep['batch']}",
        highlight=False,
    )
    if rep.get("error"):
        console.print(f"[red]error[/]: {rep['error']}", highlight=False)
    t = Table(title=f"epochs (loss in {UNIT})", title_justify="left")
    for col in ("epoch", "loss", "held-out", "tokens", "s", "bytes", "changed", "frozen",
                "projected", "rejected", "clock", "checksum"):  # fmt: skip
        t.add_column(col, justify="right")
    for e in rep["epochs"]:
        t.add_row(
            str(e["epoch"]),
            _bits(e["loss"]),
            _bits(e["eval_loss"]),
            f"{e['tokens']:,}",
            f"{e['seconds']:.2f}",
            f"{e['bytes']:,}",
            str(e["changed"]),
            str(e["frozen"]),
            str(e["projected"]),
            str(e["rejected"]),
            str(e["clock"]),
            e["checksum"],
        )
    console.print(t)
    if rep["constraints"]:
        console.print("[bold]constraints on the parameters[/]")
        for name, c in rep["constraints"].items():
            acts = ", ".join(f"{a} in {n} epoch(s)" for a, n in c["actions"].items())
            console.print(
                f"  {name} ({c['kind']}): {c['checked']:,} cell checks, {c['violations']:,} "
                f"violations; {acts}",
                highlight=False,
            )
    else:
        console.print("no constraints on the parameters")
    if rep["faults"]:
        console.print("[bold]worker faults[/] (the supervisor replaced the worker)")
        for f in rep["faults"]:
            console.print(
                f"  epoch {f['epoch']}: {f['worker']} {f['cause']} in {f['phase']} (pid "
                f"{f['pid']}), workers ready again after {f['seconds']:.2f} s",
                highlight=False,
            )
        console.print(
            "  restarts: " + ", ".join(f"{w} {n}" for w, n in rep["restarts"].items()),
            highlight=False,
        )
    else:
        console.print("no worker faults")
    for r in rep["resumes"]:
        console.print(f"resumed after epoch {r['from']}", highlight=False)
