"""A workflow run's commit log: the runtime's SQLite schema (``lmpm.runtime.control.commitlog``) plus the
VM's own tables, so ``lmpm trace`` reads a workflow run like any other and ``lmpm vm status`` shows
each stream's path.

One step is one epoch, written in one transaction: its ``commits`` rows (built by the runtime's
:func:`~lmpm.runtime.rundir.commit_rows`: forced tokens under the rule ``forced``, tool results
under ``tool``, sampled ones under the program's rule, with their log-probability as the score),
its ``trace_summary`` rows (every ``in Set`` constraint over the value, checked on every committed
token: sampled tokens never violate one, the sampler is masked; a forced token may) and its
``vm_tokens`` rows::

    vm_zones(id, name)
    vm_tokens(epoch, stream, pos, token, zone, token_num, triggers, kind, tags)
    vm_streams(stream, status, decisions, captures, text)        written when the run ends
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from lmpm.ir.nodes import Program
from lmpm.runtime.control.commitlog import program_hash, refuse_existing
from lmpm.runtime.control.trace import TraceRows
from lmpm.runtime.lock import RunLock
from lmpm.runtime.protocol import checksum
from lmpm.runtime.records import INPUT_RULE, committed_sum
from lmpm.runtime.rundir import (
    DB_NAME,
    INSERT_EPOCH,
    KEEP_RULE,
    SCHEMA,
    SCHEMA_VERSION,
    VM_SCHEMA,
    commit_rows,
    connect,
    holds_run,
)
from lmpm.vm.compile import Instructions
from lmpm.vm.core import Forced, StepOut
from lmpm.vm.machine import VM

FORCED_RULE = -3  # rule id of teacher-forced tokens in `commits` and `rule_defs`
TOOL_RULE = -4  # rule id of tool-result tokens


@dataclass
class _ValueEpoch:
    """The fields of the engine's per-value epoch record that ``commit_rows`` reads."""

    value: str
    changed: Tensor
    winner: Tensor
    cells: Tensor
    col_rule: Tensor
    new_clock: Tensor
    score: Tensor
    checksum: Tensor  # (n,) the committed tokens' checksums (the tokens are in vm_tokens)


@dataclass
class _Record:
    epoch: int
    values: list[_ValueEpoch]


class _Costs(Protocol):
    def to_dict(self) -> dict[str, Any]: ...


class LoggedRun(Protocol):
    """What the log reads of a run (:class:`~lmpm.vm.runner.WorkflowRun` is one): the log sits
    below the runner, which writes it."""

    program: Program
    ins: Instructions
    vm: VM
    seed: int

    @property
    def stats(self) -> _Costs: ...


class VMLog:
    """Writes ``RUN_DIR/lmpm.db`` for a :class:`~lmpm.vm.runner.WorkflowRun`."""

    def __init__(self, run_dir: str | Path, run: LoggedRun, source: str) -> None:
        self.run_dir = Path(run_dir)
        self.run = run
        # the directory's lock, as `lmpm run` takes it (never a folder of the user's files, D034),
        # held until the run ends
        self.lock = RunLock(self.run_dir).acquire()
        if holds_run(self.run_dir):
            self.lock.release()
            refuse_existing(self.run_dir)
        ins = run.ins
        self.rule_id = 0
        tmp = self.run_dir / f".{DB_NAME}.tmp"
        for suffix in ("", "-wal", "-shm", "-journal"):
            Path(f"{tmp}{suffix}").unlink(missing_ok=True)
        conn = sqlite3.connect(str(tmp), isolation_level=None)
        conn.execute("BEGIN IMMEDIATE")
        for stmt in (SCHEMA + VM_SCHEMA).split(";"):
            if stmt.strip():
                conn.execute(stmt)
        from lmpm.ir.serialize import to_json

        meta: dict[str, Any] = {
            "schema_version": SCHEMA_VERSION,
            "program_hash": program_hash(run.program),
            "program_file": run.program.file,
            "source": source,
            "params": {},
            "bind": [],
            "seed": run.seed,
            "backend": "vm",
            "epochs": None,
            "until": "done",
            "trace": "summary",
            "trace_region": None,
            "checkpoint_every": 0,
            "inputs": {},
            "ir_json": to_json(run.program),
            "ir_version": run.program.version,
            "workflow": ins.workflow.name,
            "streams": run.vm.core.B,
            "created_at": time.time(),
            "status": "running",
        }
        conn.executemany(
            "INSERT INTO meta VALUES (?, ?)", [(k, json.dumps(v)) for k, v in meta.items()]
        )
        b, n = run.vm.core.B, run.vm.core.N
        conn.execute(
            "INSERT INTO value_defs VALUES (?,?,?,?,?,?,?,?)",
            (0, ins.value, json.dumps([b, n]), b * n, 0, ins.vocab, "int64", "vm"),
        )
        for rid, name, model in (
            (KEEP_RULE, "keep", None),
            (INPUT_RULE, "input", None),
            (FORCED_RULE, "forced", None),
            (TOOL_RULE, "tool", None),
            (self.rule_id, ins.rule.name, ins.rule.proposal.func),
        ):
            conn.execute(
                "INSERT INTO rule_defs VALUES (?,?,?,?,?,?)", (rid, name, ins.value, model, None, 1)
            )
        lines = source.splitlines()
        self.constraints: list[tuple[int, str, Tensor]] = []
        for cid, c in enumerate(run.program.constraints):
            if c.access is None or c.access.value != ins.value or c.pred.value != "in_set":
                continue
            sp = c.span
            text = " ".join(x.strip() for x in lines[sp.line - 1 : sp.end_line]) if lines else None
            conn.execute(
                "INSERT INTO constraint_defs VALUES (?,?,?,?,?,?,?,?,?,?)",
                (
                    cid,
                    c.name,
                    ins.value,
                    c.kind,
                    c.pred.value,
                    c.priority,
                    "evaluated",
                    str(sp),
                    text,
                    b * n,
                ),
            )
            members = next(m for name, _, m in ins.constraints if name == c.name)
            table = torch.zeros(ins.vocab, dtype=torch.bool)
            table[list(members)] = True
            self.constraints.append((cid, c.kind, table))
        for z, name in enumerate(ins.zone_names):
            conn.execute("INSERT INTO vm_zones VALUES (?,?,?)", (z, ins.workflow.name, name))
        conn.execute("COMMIT")
        conn.close()
        tmp.replace(self.run_dir / DB_NAME)
        self.conn = connect(self.run_dir, readonly=False)
        self.log_seconds = 0.0

    def on_step(
        self,
        epoch: int,
        out: StepOut,
        forced: Forced,
        asked: Tensor,
        logp: Tensor | None,
        seconds: float,
        model_seconds: float,
    ) -> None:
        t0 = time.perf_counter()
        core = self.run.vm.core
        rows = out.active.nonzero().flatten().cpu()
        if rows.numel() == 0:
            return
        tok = out.tokens.cpu()[rows]
        pos = (core.pos.cpu()[rows] - 1).clamp(min=0)
        kind = out.kind.cpu()[rows]
        score = torch.zeros(core.B, dtype=torch.float64)
        if logp is not None:
            score[asked.cpu()] = logp.double().cpu()
        # winner column = kind: 0 forced, 1 the rule, 2 tool (col_rule maps columns to rule ids)
        ve = _ValueEpoch(
            self.run.ins.value,
            changed=torch.ones(len(rows), dtype=torch.bool),
            winner=kind,
            cells=rows * core.N + pos,
            col_rule=torch.tensor([FORCED_RULE, self.rule_id, TOOL_RULE]),
            new_clock=pos + 1,  # a token reads every earlier token of its stream
            score=score[rows][:, None].expand(-1, 3).contiguous(),
            checksum=checksum(tok, 0),
        )
        commits = commit_rows(_Record(epoch, [ve]))  # type: ignore[arg-type]
        trace = TraceRows()
        violations = 0
        for cid, kind_c, table in self.constraints:
            inside = table[tok.clamp(0, len(table) - 1)]
            bad = ~inside if kind_c == "require" else inside
            nbad = int(bad.sum())
            violations += nbad
            trace.summary.append((epoch, cid, self.rule_id, len(rows), nbad, 0, 0, None))
        st = out.triggers.cpu()[rows]
        zone = core.st_zone.cpu()[rows, pos]
        num = core.st_num.cpu()[rows, pos]
        tags = out.tags.cpu()[rows]
        vm_rows = list(
            zip(
                [epoch] * len(rows),
                rows.tolist(),
                pos.tolist(),
                tok.tolist(),
                zone.tolist(),
                num.tolist(),
                st.tolist(),
                kind.tolist(),
                tags.tolist(),
            )
        )
        conn = self.conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.executemany("INSERT INTO commits VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)", commits)
            trace.insert(conn)
            conn.executemany("INSERT INTO vm_tokens VALUES (?,?,?,?,?,?,?,?,?)", vm_rows)
            conn.execute(
                INSERT_EPOCH,
                (
                    epoch,
                    len(rows),
                    int(asked.numel()),
                    int(asked.numel()),
                    len(rows),
                    violations,
                    None,
                    seconds,
                    model_seconds,
                    time.perf_counter() - t0,
                    "[]",
                    time.time(),
                    None,  # control_bytes, halo_bytes, driver_cpu_s: not counted (one process)
                    None,
                    None,
                    committed_sum([ve]),  # type: ignore[list-item]
                ),
            )
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        self.log_seconds += time.perf_counter() - t0

    def on_end(self) -> None:
        vm = self.run.vm
        status = vm.stream_status()
        decisions = vm.decisions()
        caps = vm.extract()
        text = vm.generative_sequence()
        conn = self.conn
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("DELETE FROM vm_streams")
        conn.executemany(
            "INSERT INTO vm_streams VALUES (?,?,?,?,?)",
            [
                (b, status[b], json.dumps(decisions[b]), json.dumps(caps[b]), text[b])
                for b in range(vm.core.B)
            ],
        )
        conn.execute(
            "UPDATE meta SET value = ? WHERE key = 'status'",
            (json.dumps("finished" if vm.done else "stopped"),),
        )
        conn.execute(
            "INSERT OR REPLACE INTO meta VALUES ('vm_stats', ?)",
            (json.dumps(self.run.stats.to_dict()),),
        )
        conn.execute("COMMIT")
        self.lock.release()

    def close(self) -> None:
        self.conn.close()
        self.lock.release()


def stream_report(conn: sqlite3.Connection, stream: int | None = None) -> dict[str, Any]:
    """What ``lmpm vm status`` prints: per stream its status, path and captures; with ``stream``,
    also its tokens with zone, token_num, triggers and kind (aligned with the raw stream)."""
    zones = dict(conn.execute("SELECT id, name FROM vm_zones").fetchall())
    streams = [
        {
            "stream": s,
            "status": st,
            "decisions": json.loads(d),
            "captures": json.loads(c),
            "text": t,
        }
        for s, st, d, c, t in conn.execute(
            "SELECT stream, status, decisions, captures, text FROM vm_streams ORDER BY stream"
        )
    ]
    out: dict[str, Any] = {"zones": [zones[k] for k in sorted(zones)], "streams": streams}
    meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
    out["workflow"] = json.loads(meta.get("workflow", "null"))
    out["stats"] = json.loads(meta.get("vm_stats", "null"))
    if stream is not None:
        kinds = ["forced", "generated", "tool"]
        out["tokens"] = [
            {
                "pos": pos,
                "epoch": e,
                "token": tok,
                "char": bytes([tok]).decode("latin-1") if 0 <= tok < 256 else "",
                "zone": zones.get(z, str(z)),
                "token_num": num,
                "triggers": trig,
                "kind": kinds[k] if 0 <= k < 3 else str(k),
                "tags": tags,
            }
            for e, pos, tok, z, num, trig, k, tags in conn.execute(
                "SELECT epoch, pos, token, zone, token_num, triggers, kind, tags FROM vm_tokens "
                "WHERE stream = ? ORDER BY pos",
                (stream,),
            )
        ]
    return out
