"""Write the training data of examples/train_bytelm.lmpm: captions of the generated world as byte rows.

examples/train/corpus.npy: 8192 rows of 64 bytes from world seed 1 (the seed scripts/train_text.py
trains on); examples/train/held.npy: 512 rows from world seed 2 (held out). Arrays are stored in
the LMPM input layout of a `Grid2D(64, R)` value: shape [64, R] (axis x first), uint8.

    python scripts/gen_corpus.py [--rows 8192] [--held 512] [--out examples/train]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from lmpm.models.training import HELDOUT_WORLD, TRAIN_WORLD, text_corpus

OUT = Path(__file__).resolve().parents[1] / "examples" / "train"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--held", type=int, default=512)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name, rows, world in (
        ("corpus", args.rows, TRAIN_WORLD),
        ("held", args.held, HELDOUT_WORLD),
    ):
        arr = text_corpus(rows, world).numpy().astype(np.uint8).T  # [64, rows]
        np.save(args.out / f"{name}.npy", np.ascontiguousarray(arr))
        print(f"wrote {args.out / f'{name}.npy'}: {rows} rows of 64 bytes")


if __name__ == "__main__":
    main()
