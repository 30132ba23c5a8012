"""`lmpm mask FILE`: compile the program's visibility to a mask (npy), a picture (png) or a summary
(json)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmpm.commands.common import add_set, parse_sets, program_path
from lmpm.errors import UsageError

if TYPE_CHECKING:
    from lmpm.visibility import Masks

HELP = "compile visibility to a dense mask (npy), a picture with its block structure (png) or json"

# A dense (cells, cells) bool array above this many cells is refused: 16384² bytes = 256 MiB.
MAX_DENSE_CELLS = 16384
# The png draws the mask cell by cell up to this size; above it, from the block structure.
MAX_PICTURE_CELLS = 2048
PICTURE_PIXELS = 512  # macro-cells per side when the mask is drawn from blocks

MSG_TOO_BIG = (
    "the dense mask would be {cells} × {cells} = {size} bools ({mib:.0f} MiB), above the limit of "
    "{limit} cells per side"
)
HINT_TOO_BIG = (
    "use --format json (block counts, sparsity) or --format png (drawn from the block structure)"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="the .lmpm program")
    add_set(p)
    p.add_argument(
        "--layout",
        choices=["auto", "raster", "tiled", "morton"],
        default="auto",
        help="sequence layout (auto: the sparsest at --block); npy is always canonical",
    )
    p.add_argument("--block", type=int, default=128, help="BlockMask block size (default 128)")
    p.add_argument(
        "--format",
        choices=["npy", "png", "json"],
        help="output format (default: from the -o suffix, else json)",
    )
    p.add_argument("-o", "--output", help="output file (json: stdout when omitted)")


def run(args: argparse.Namespace) -> int:
    from lmpm.ir import compile_file
    from lmpm.visibility import masks

    path = program_path(args.file)
    fmt = args.format or (Path(args.output).suffix.lstrip(".") if args.output else "json")
    if fmt not in ("npy", "png", "json"):
        raise UsageError(f"cannot tell the format of {args.output!r}; pass --format", code="U020")
    if fmt != "json" and not args.output:
        raise UsageError(f"--format {fmt} needs an output file: -o OUT.{fmt}", code="U020")
    if args.block < 1:
        raise UsageError(f"--block must be positive, got {args.block}", code="U021")
    overrides = parse_sets(args.set)
    front = compile_file(path, overrides=overrides)
    m = masks(front.ir, overrides, args.layout, auto_block=args.block)
    for d in m.degenerate:
        sys.stderr.write(
            f"warning: {d.count} cell{'s' if d.count != 1 else ''} of {d.value} can see nothing "
            f"({'' if d.exact else 'within '}{d.pattern}: {d.reason})\n"
        )
    if fmt == "npy":
        _write_npy(m, args.output)
    elif fmt == "png":
        _write_png(m, args.block, args.output, str(path))
    else:
        text = json.dumps(_summary(m, args.block, str(path)), indent=1)
        if args.output:
            Path(args.output).write_text(text + "\n")
        else:
            sys.stdout.write(text + "\n")
    return 0


def _summary(m: Masks, block: int, file: str) -> dict[str, Any]:
    counts = m.block_counts(block)
    return {
        "file": file,
        "cells": m.cells,
        "values": [
            {"name": v, "dims": list(m.space.dims[v]), "base": m.space.base[v]}
            for v in m.space.names
        ],
        "layout": m.layout,
        "block_size": block,
        "blocks": {"partial": counts.partial, "full": counts.full, "empty": counts.empty},
        "sparsity": {k: round(v, 6) for k, v in m.sparsity_at(block).items()},
        "degenerate": [
            {"value": d.value, "cells": d.count, "pattern": d.pattern, "reason": d.reason}
            for d in m.degenerate
        ],
    }


def _write_npy(m: Masks, out: str) -> None:
    import numpy as np

    if m.cells > MAX_DENSE_CELLS:
        raise UsageError(
            MSG_TOO_BIG.format(
                cells=m.cells, size=m.cells**2, mib=m.cells**2 / 2**20, limit=MAX_DENSE_CELLS
            ),
            hint=HINT_TOO_BIG,
            code="U022",
        )
    np.save(out, m.dense(canonical=True).numpy())


def _write_png(m: Masks, block: int, out: str, file: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import ListedColormap

    if m.cells <= MAX_PICTURE_CELLS:
        picture = m.dense(canonical=False).numpy().astype(np.uint8) * 2  # 0 hidden, 2 visible
        scale = 1
        what = "cells"
    else:
        # Never N×N: each pixel is a macro-block; empty / some visible / all visible.
        scale = -(-m.cells // PICTURE_PIXELS)
        part, full = m.block_flags(scale)
        picture = part.numpy().astype(np.uint8) + 2 * full.numpy().astype(np.uint8)
        what = f"{scale}×{scale} macro-cells"
    part_b, full_b = m.block_flags(block)
    blocks = part_b.numpy().astype(np.uint8) + 2 * full_b.numpy().astype(np.uint8)
    cmap = ListedColormap(["#ffffff", "#9ecae1", "#08306b"])  # empty, partial, full

    fig, axes = plt.subplots(1, 2, figsize=(10, 5), dpi=80)
    ax = axes[0]
    ax.imshow(picture, cmap=cmap, vmin=0, vmax=2, interpolation="nearest")
    for v in m.space.names[1:]:
        edge = m.space.base[v] / scale - 0.5
        ax.axhline(edge, color="#d62728", lw=0.8)
        ax.axvline(edge, color="#d62728", lw=0.8)
    for v in m.space.names:
        mid = (m.space.base[v] + m.space.size(v) / 2) / scale
        ax.text(
            1.01,
            mid,
            v,
            transform=ax.get_yaxis_transform(),
            ha="left",
            va="center",
            fontsize=8,
            color="#d62728",
        )
    ax.set_title(f"mask ({m.layout} layout, {what})", fontsize=9)
    ax.set_xlabel("kv (visible cell)", fontsize=8)
    ax.set_ylabel("q (cell)", fontsize=8)
    ax.tick_params(labelsize=7)
    c = m.block_counts(block)
    ax = axes[1]
    ax.imshow(blocks, cmap=cmap, vmin=0, vmax=2, interpolation="nearest")
    ax.set_title(
        f"{block}-blocks: {c.full} full, {c.partial} partial, {c.empty} empty "
        f"({100 * c.sparsity:.1f}% sparse)",
        fontsize=9,
    )
    ax.set_xlabel("kv block", fontsize=8)
    ax.set_ylabel("q block", fontsize=8)
    ax.tick_params(labelsize=7)
    fig.suptitle(f"{Path(file).name}: {m.cells} cells", fontsize=10)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
