"""The generated mask_mod costs at most ``OPS_GOAL`` × the aten ops of a careful hand-written one
(``benchmarks/masks.py --ops``: the same cases, counted the same way), and equals it."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

from lmpm.visibility import compile_masks

ROOT = Path(__file__).resolve().parents[2]


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_masks", ROOT / "benchmarks" / "masks.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


BENCH = _bench()


def test_op_counts_meet_the_goal() -> None:
    rows = BENCH.op_counts()
    assert {r["case"] for r in rows} >= {
        "ops_video",
        "ops_n4",
        "ops_box5",
        "ops_window",
        "ops_causal",
        "ops_prefix_lm",
    }
    for r in rows:
        assert r["lmpm_ops"] <= BENCH.OPS_GOAL * r["hand_ops"], r


@pytest.mark.parametrize("case", [c for c, _ in BENCH.OPS_CASES])
def test_hand_written_mask_mods_are_the_programs(case: str) -> None:
    """Each hand-written baseline is the program's mask, at a small size: the op ratio compares
    equals."""
    small = {
        "video": {"T": 3, "W": 16, "H": 16, "N": 5},
        "n4": {"H": 6, "W": 7},
        "box5": {"H": 6, "W": 7},
        "window": {"N": 40, "Wnd": 6},
        "causal": {"N": 20},
        "causal_strict": {"N": 20},
        "prefix_lm": {"N": 20, "P": 6},
    }[case]
    m = compile_masks(BENCH.SOURCES[case], layout="raster", **small)
    dense = m.dense(canonical=False)
    for mod in (m.mask_mod, BENCH._hand_written(case, small)):
        assert torch.equal(create_mask(mod, 1, 1, m.cells, m.cells, "cpu")[0, 0], dense)


def test_count_ops_sees_an_unrolled_neighbourhood() -> None:
    """The counter counts what the kernel runs: eight equality tests cost more than a range."""
    unrolled = BENCH.count_ops(
        lambda b, h, q, kv: ((kv - q == -1) | (kv - q == 1)) | ((kv - q == -2) | (kv - q == 2))
    )
    folded = BENCH.count_ops(lambda b, h, q, kv: (kv - q).abs() <= 2)
    assert (unrolled, folded) == (11, 3)


def test_pick_block_never_picks_what_the_cuda_kernel_refuses() -> None:
    m = compile_masks(BENCH.VIDEO_SRC, layout="raster", T=2, W=32, H=32, N=77)
    assert BENCH.pick_block(m, "cpu") == 32  # least block work; the CPU kernel takes any size
    assert BENCH.pick_block(m, "cuda") % BENCH.CUDA_BLOCK_MULTIPLE == 0


@pytest.mark.parametrize(
    ("case", "small", "large"),
    [
        ("video", {"T": 2, "W": 16, "H": 16, "N": 77}, {"T": 8, "W": 64, "H": 64, "N": 77}),
        ("window", {"N": 1024, "Wnd": 128}, {"N": 65536, "Wnd": 512}),
    ],
)
def test_block_mask_host_syncs_do_not_grow_with_cells(
    case: str, small: dict[str, int], large: dict[str, int]
) -> None:
    """Host syncs (values read back, data-dependent sizes) cost ~10-50 µs each on a GPU: the
    build has a number of them set by the program, not by the number of cells."""
    counts = []
    for params in (small, large):
        m = compile_masks(BENCH.SOURCES[case], layout="raster", **params)
        syncs, bm = BENCH.count_syncs(lambda m=m: m.block_mask(128))
        assert bm.kv_indices.is_contiguous()
        counts.append(syncs)
    assert counts[0] == counts[1] and counts[0] <= 150, counts
