"""Generate the world the video and text models learn from (deterministic), and the demo's inputs.

    python scripts/gen_world.py --demo   # examples/video/{caption.txt,patch.npy,scene.npy}, heldout/
    python scripts/gen_world.py --count 100 --seed 1 --out world.npz   # a dataset to look at

The demo patch is the red square's neighbourhood of the demo scene (`lmpm.models.world.demo_scene`)
over every frame — the cells `Vid[t, x1..x2, y1..y2]` that examples/video.lmpm locks (HardLock) —
and -1 (unset) everywhere else. ``examples/video/heldout/`` holds the README demo's caption, a
held-out (colour, direction) pair (`lmpm.models.world.heldout_scene`), and the scene it describes.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from lmpm.models import world

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "video"
CAPTION = b"a red square moves left under a blue sky"
PATCH = {"x1": 8, "x2": 23, "y1": 16, "y2": 27}  # the defaults of examples/video.lmpm


def demo(out: Path = DEMO, T: int = 4, W: int = 32, H: int = 32) -> None:
    out.mkdir(parents=True, exist_ok=True)
    video = world.render(world.demo_scene(T, W, H)).numpy()
    patch = np.full_like(video, -1)
    xs = slice(PATCH["x1"], PATCH["x2"] + 1)
    ys = slice(PATCH["y1"], PATCH["y2"] + 1)
    patch[:, xs, ys] = video[:, xs, ys]
    np.save(out / "patch.npy", patch.astype(np.int64), allow_pickle=False)
    np.save(out / "scene.npy", video.astype(np.int64), allow_pickle=False)
    (out / "caption.txt").write_bytes(CAPTION + b"\n")
    held = out / "heldout"
    held.mkdir(exist_ok=True)
    truth = world.render(world.heldout_scene(T, W, H)).numpy()
    np.save(held / "scene.npy", truth.astype(np.int64), allow_pickle=False)
    (held / "caption.txt").write_bytes(world.HELDOUT_CAPTION + b"\n")
    print(f"wrote {out}/patch.npy, scene.npy, caption.txt, heldout/caption.txt, heldout/scene.npy")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--demo", action="store_true", help="write the demo's caption and patch")
    ap.add_argument("--count", type=int, default=0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("world.npz"))
    args = ap.parse_args()
    if args.demo:
        demo()
    if args.count:
        w = world.generate(args.count, args.seed)
        np.savez_compressed(
            args.out,
            videos=w.videos.numpy(),
            coarse=w.coarse.numpy(),
            captions=np.array([c.decode() for c in w.captions]),
        )
        print(f"wrote {args.count} scenes to {args.out}")


if __name__ == "__main__":
    main()
