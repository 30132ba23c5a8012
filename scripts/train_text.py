"""Train ByteLM, the byte-level causal transformer of examples/text.lmpm (deterministic).

The attention mask is compiled from `visible Txt[t] <- Txt[0..t-1] when t > 0` by LMPM's visibility
compiler (see src/lmpm/models/text.py). The data: captions of the generated world (world seed 1;
held out: world seed 2), some in sentence case. Prints one JSON line with the metrics and writes
OUT/bytelm.safetensors (the metrics go into its metadata).

By default the model is trained *through LMPM*: examples/train_bytelm.lmpm (a Params value whose
proposals are `minimize` steps, committed with DiLoCo across --workers Ray workers) on the data of
scripts/gen_corpus.py. `--plain` runs the plain PyTorch loop the shipped weights came from.

    python scripts/train_text.py [--workers 4] [--epochs 20] [--out src/lmpm/models/weights]
    python scripts/train_text.py --plain [--steps 1000] [--seed 0]
    python scripts/train_text.py --workers 1 --epochs 2 --inner 3    # a smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from lmpm.models import weights
from lmpm.models.training import train_text

ROOT = Path(__file__).resolve().parents[1]
PROGRAM = ROOT / "examples" / "train_bytelm.lmpm"
DATA = ROOT / "examples" / "train"

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "src" / "lmpm" / "models" / "weights"
CONFIG = {"d": 64, "layers": 2, "heads": 4, "max_len": 64}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--plain", action="store_true", help="the plain PyTorch loop")
    ap.add_argument("--workers", type=int, default=4, help="LMPM workers (Ray actors)")
    ap.add_argument("--epochs", type=int, default=20, help="LMPM outer steps (H = 50 inner each)")
    ap.add_argument("--inner", type=int, help="LMPM inner steps per epoch (default: H = 50)")
    ap.add_argument("--run-dir", type=Path, help="LMPM run directory (default: a temporary one)")
    args = ap.parse_args()
    if args.plain:
        model, metrics = train_text(
            args.steps, args.seed, log=lambda s: print(s, file=sys.stderr, flush=True), **CONFIG
        )
    else:
        model, metrics = train_lmpm(args.workers, args.epochs, args.seed, args.run_dir, args.inner)
    path = weights.save(model, args.out / "bytelm.safetensors", CONFIG, metrics=metrics)
    metrics["file"] = str(path)
    metrics["bytes"] = path.stat().st_size
    print(json.dumps({"model": "bytelm", **metrics}), flush=True)


def train_lmpm(
    workers: int, epochs: int, seed: int, run_dir: Path | None, inner: int | None = None
) -> tuple[Any, dict[str, Any]]:
    """ByteLM trained by `lmpm run examples/train_bytelm.lmpm` (through the Python API)."""
    import dataclasses
    import tempfile
    import time

    from lmpm.ir import compile_file
    from lmpm.models.text import ByteLM, bits_per_byte
    from lmpm.train.frontend import train_spec
    from lmpm.train.modules import BYTELM_CONFIG
    from lmpm.train.run import Trainer, load_rows, parameters

    assert BYTELM_CONFIG == CONFIG, "the Params module and the shipped model must agree"
    spec = train_spec(compile_file(PROGRAM).ir, {} if inner is None else {"H": inner})
    assert spec is not None
    spec = dataclasses.replace(spec, rule=dataclasses.replace(spec.rule, seed=seed))
    data = {
        d.name: load_rows(DATA / f"{d.name.lower()}.npy", d)
        for d in (*spec.rule.data, *spec.rule.eval_data)
    }
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = run_dir or Path(tmp) / "run"
        res = Trainer(
            spec,
            data,
            epochs=epochs,
            workers=workers,
            run_dir=out,
            progress=lambda r: print(
                f"text epoch {r.epoch}: {r.loss / math.log(2):.3f} bits/byte", file=sys.stderr
            ),
        ).run()
        model = ByteLM(**CONFIG)
        model.load_state_dict(parameters(out / f"{spec.params.name}.safetensors"))
    model.eval()
    held = data["Held"]
    metrics = {
        "heldout_bits_per_byte": round(bits_per_byte(model, held), 4),
        "train_bits_per_byte": round(bits_per_byte(model, data["Corpus"][:512]), 4),
        "steps": epochs * spec.rule.steps,
        "workers": workers,
        "trained_by": str(PROGRAM.relative_to(ROOT)),
        "bytes_exchanged": res.bytes,
        "seconds": round(time.perf_counter() - t0, 1),
        "params": sum(p.numel() for p in model.parameters()),
    }
    return model, metrics


if __name__ == "__main__":
    main()
