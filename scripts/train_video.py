"""Train the video models of examples/video.lmpm (deterministic): the LocalGen proposer (`Model`)
and the coarse-grid proposer (`CoarseGen`).

LocalGen reads exactly the seed's reads (N8 neighbours, the previous frame, the caption, the coarse
cell), gathered through the resolved plan's gather tables, with a random share of the cells unset
(MaskGIT-style), learning mostly from cells where an object passes. Data: the generated world
(world seed 1) without the held-out (colour, direction) pairs (`lmpm.models.world.HELDOUT_PAIRS`);
held out: world seed 2, only those pairs. Then it
generates a video from a caption of each held-out pair with the model alone
(examples/video_free.lmpm) and checks the object against the scene the caption describes. Prints one
JSON line with the held-out metrics (token accuracy / NLL, the copy-previous-frame baseline, the
generated object's IoU and motion) and writes OUT/localgen.safetensors and OUT/coarsegen.safetensors.
Two torch threads by default (the committed weights were trained so; another count may change the
last bits): 3,000 steps in about 6 minutes of wall time on 2 cores (the committed run: 359 s, 486 s
user + 207 s system), the held-out generation included.

    python scripts/train_video.py [--steps 3000] [--scenes 2000] [--seed 0] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from lmpm.models import weights
from lmpm.models.training import TRAINED_PAIRS, VideoRecipe, heldout_generation, train_video

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "src" / "lmpm" / "models" / "weights"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--scenes", type=int, default=2000)
    ap.add_argument("--heldout", type=int, default=100, help="held-out scenes for the metrics")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--threads", type=int, default=2, help="torch threads (the weights: 2)")
    ap.add_argument("--no-generate", action="store_true", help="skip the generation metrics")
    args = ap.parse_args()
    local, coarse, metrics = train_video(
        args.steps,
        args.seed,
        VideoRecipe(threads=args.threads, scenes=args.scenes, heldout=args.heldout),
        log=lambda s: print(s, file=sys.stderr, flush=True),
    )
    p1 = weights.save(local, args.out / "localgen.safetensors", {}, metrics=metrics)
    p2 = weights.save(coarse, args.out / "coarsegen.safetensors", {}, metrics=metrics)
    if not args.no_generate:  # with the weights just written
        os.environ["LMPM_WEIGHTS"] = str(args.out)
        weights.clear_cache()
        metrics["generation_heldout"] = heldout_generation()
        metrics["generation_trained"] = heldout_generation(TRAINED_PAIRS)
        p1 = weights.save(local, p1, {}, metrics=metrics)
        p2 = weights.save(coarse, p2, {}, metrics=metrics)
    metrics["bytes"] = {p1.name: p1.stat().st_size, p2.name: p2.stat().st_size}
    print(json.dumps({"model": "localgen+coarsegen", **metrics}), flush=True)


if __name__ == "__main__":
    main()
