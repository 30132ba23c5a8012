"""The default trace's cost per epoch against k, the candidates a model proposes per cell.

A causal ``Token[50257]`` text of N cells (raster: one open cell per epoch), a model returning
``Logits(..., k=K, pick="top")`` from a fixed table (so the model costs next to nothing), under
``require Txt[t] in Set(0..19999) priority 10``. The same run at k=8 and at k=V=50257, with the
commit log and the default trace (``summary``), and with ``--trace off``: the log's time per epoch
as the run's own log measures it (``epochs.log_seconds``: the commit log's and the trace's whole
cost), the median epoch of a run, the minimum over ``--repeat`` alternated runs.

Prints one JSON line: ``trace_k``, with the log's ms per epoch at each k and the ratio k=V / k=8
(goal: about 1, the default trace's cost independent of k).

    python benchmarks/trace_k.py [--n 24] [--repeat 3] [--quick]
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from lmpm import Logits
from lmpm.runtime.session import Run

VOCAB = 50257
SOURCE = """
param N = {n}
value Txt : Token[{v}] shape Seq(N)
value MaskPlan : Event shape Set()
visible Txt[t] <- Txt[0..t-1] when t > 0
rule Next:
  on Txt[t]
  read {{context = Txt[0..t-1]}}
  emit proposal Txt[t] := Table(context, k={k}, pick="top")
constraint Low:
  require Txt[t] in Set(0..19999) priority 10
commit Txt[*] using satisfy(max_constraints_then_score)
rule Schedule:
  on MaskPlan
  emit proposal MaskPlan := SampleTiles(strategy="raster", k=1)
"""


def table_model() -> Any:
    table = torch.randn(64, VOCAB, generator=torch.Generator().manual_seed(0))

    def model(inputs: dict[str, torch.Tensor], k: int = 1, pick: str = "top", **_: Any) -> Any:
        return Logits(table[inputs["cells"] % 64], k=int(k), pick=pick)

    return model


def log_ms(n: int, k: int, trace: str) -> float:
    """The log's median ms per epoch of one run (its own measure, epochs.log_seconds; the median
    leaves out the first epoch's one-time costs and a busy machine's outliers)."""
    src = SOURCE.format(n=n, v=VOCAB, k=k)
    with tempfile.TemporaryDirectory() as tmp:
        run = Run.from_source(src, bindings={"Table": table_model()})
        run.log_to(Path(tmp) / "run", source=src, trace=trace)
        run.run(n)
        run.finish()
        with sqlite3.connect(Path(tmp) / "run" / "lmpm.db") as conn:
            seconds = [s for (s,) in conn.execute("SELECT log_seconds FROM epochs")]
        return 1000.0 * statistics.median(seconds)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=24, help="cells (= epochs) per run")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="12 cells, two runs each (indicative)")
    args = ap.parse_args(argv)
    if args.quick:
        args.n, args.repeat = 12, 2
    best: dict[tuple[int, str], float] = {}
    for _ in range(args.repeat):
        for k in (8, VOCAB):
            for trace in ("summary", "off"):
                ms = log_ms(args.n, k, trace)
                best[(k, trace)] = min(best.get((k, trace), ms), ms)
    out = {
        "case": "trace_k",
        "vocab": VOCAB,
        "n": args.n,
        "log_ms_per_epoch_k8": round(best[(8, "summary")], 3),
        "log_ms_per_epoch_kV": round(best[(VOCAB, "summary")], 3),
        "log_ms_per_epoch_k8_trace_off": round(best[(8, "off")], 3),
        "log_ms_per_epoch_kV_trace_off": round(best[(VOCAB, "off")], 3),
        "ratio": round(best[(VOCAB, "summary")] / best[(8, "summary")], 2),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
