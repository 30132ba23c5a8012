"""Train the video models of examples/video.lmpm (deterministic): the LocalGen proposer (`Model`)
and the coarse-grid proposer (`CoarseGen`).

LocalGen reads exactly the seed's reads (N8 neighbours, the previous frame, the caption, the coarse
cell), gathered through the resolved plan's gather tables, with a random share of the cells unset
(MaskGIT-style). Data: the generated world (world seed 1; held out: world seed 2). Prints one JSON
line with the held-out metrics (token accuracy / NLL, the copy-previous-frame baseline) and writes
OUT/localgen.safetensors and OUT/coarsegen.safetensors.

    python scripts/train_video.py [--steps 600] [--scenes 2000] [--seed 0] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lmpm.models import _weights
from lmpm.models.training import train_video

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "src" / "lmpm" / "models" / "weights"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--scenes", type=int, default=2000)
    ap.add_argument("--heldout", type=int, default=100, help="held-out scenes for the metrics")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    local, coarse, metrics = train_video(
        args.steps,
        args.seed,
        scenes=args.scenes,
        heldout=args.heldout,
        log=lambda s: print(s, file=sys.stderr, flush=True),
    )
    p1 = _weights.save(local, args.out / "localgen.safetensors", {}, metrics=metrics)
    p2 = _weights.save(coarse, args.out / "coarsegen.safetensors", {}, metrics=metrics)
    metrics["bytes"] = {p1.name: p1.stat().st_size, p2.name: p2.stat().st_size}
    print(json.dumps({"model": "localgen+coarsegen", **metrics}), flush=True)


if __name__ == "__main__":
    main()
