"""Train ByteLM, the byte-level causal transformer of examples/text.lmpm (deterministic).

The attention mask is compiled from `visible Txt[t] <- Txt[0..t-1] when t > 0` by LMPM's visibility
compiler (see src/lmpm/models/text.py). The data: captions of the generated world (world seed 1;
held out: world seed 2), some in sentence case. Prints one JSON line with the metrics and writes
OUT/bytelm.safetensors (the metrics go into its metadata).

    python scripts/train_text.py [--steps 1000] [--seed 0] [--out src/lmpm/models/weights]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lmpm.models import _weights
from lmpm.models.training import train_text

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "src" / "lmpm" / "models" / "weights"
CONFIG = {"d": 64, "layers": 2, "heads": 4, "max_len": 64}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    model, metrics = train_text(
        args.steps, args.seed, log=lambda s: print(s, file=sys.stderr, flush=True), **CONFIG
    )
    path = _weights.save(model, args.out / "bytelm.safetensors", CONFIG, metrics=metrics)
    metrics["file"] = str(path)
    metrics["bytes"] = path.stat().st_size
    print(json.dumps({"model": "bytelm", **metrics}), flush=True)


if __name__ == "__main__":
    main()
