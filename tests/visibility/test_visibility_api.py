"""The visibility API on the examples: gather-table contract, layouts, degenerate cells, attention."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from blockmask_checks import assert_dense_layout, assert_same_blocks
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from lmpm.errors import BindError, UsageError
from lmpm.ir import compile_file, compile_source
from lmpm.ir.eval import bind_params
from lmpm.visibility import Masks, compile_masks, gather_table, masks, sdpa, visible_union
from lmpm.visibility.layout import make_layout

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
# The seed's video program with its four clauses, kept fixed for exact expectations (the example
# in examples/ grows with the runtime).
VIDEO = ROOT / "docs" / "img" / "seed_video.lmpm"
GPT = EXAMPLES / "gpt.lmpm"
SMALL_VIDEO = {"T": 3, "W": 16, "H": 16, "N": 5}

# Eager flex_attention (no torch.compile) is the documented dense fallback on CPU; it warns once.
EAGER_FLEX = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
# torch.compile's import chain touches a deprecated torch.jit API (a warning, not our code).
COMPILED = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated")


def test_causal_gather_table_contract() -> None:
    prog = compile_file(GPT).ir
    s = prog.stencils[0]
    g = gather_table(prog, {"N": 6}, "Txt", "Txt", s.axes, s.binders, s.guard, s.vars)
    assert g.index.dtype == torch.long and g.valid.dtype == torch.bool
    assert g.index.shape == (6, 5)  # K = N - 1
    assert g.counts.tolist() == [0, 1, 2, 3, 4, 5]
    assert g.index[5].tolist() == [0, 1, 2, 3, 4]
    assert g.index[2].tolist() == [0, 1, 0, 0, 0]  # padded with 0


def test_rule_read_through_gather_table() -> None:
    # The runtime calls gather_table for rule reads: `neighbors in N8` relative to the rule's vars.
    prog = compile_file(VIDEO).ir
    env = bind_params(prog, SMALL_VIDEO)
    read = prog.rules[0].reads[0]
    g = gather_table(prog, env, "Vid", read.source, read.axes, read.binders, None, ("t", "x", "y"))
    assert g.K == 8
    # Cell (0, 0, 0) is a corner: 3 neighbours, (0,0,1), (0,1,0), (0,1,1) → 1, 16, 17.
    assert g.index[0][g.valid[0]].tolist() == [1, 16, 17]
    interior = 1 * 256 + 5 * 16 + 5
    assert g.counts[interior] == 8
    whole = gather_table(
        prog, env, "Vid", "Txt", prog.rules[0].reads[2].axes, (), None, ("t", "x", "y")
    )
    assert whole.K == 5 and bool(whole.valid.all())


def test_visible_union_and_merged_tables() -> None:
    m = compile_masks(VIDEO, **SMALL_VIDEO)
    tables = m.gather("Vid")
    prog, env = m.program, m.env
    u = visible_union(prog, env, "Vid", "Vid")
    assert torch.equal(u.index, tables["Vid<-Vid"].index)
    # The merged table is the union of the N8 clause (#0) and the previous-frame clause (#1).
    for c in (0, 300, 700):
        a = set(tables["Vid<-Vid#0"].index[c][tables["Vid<-Vid#0"].valid[c]].tolist())
        b = set(tables["Vid<-Vid#1"].index[c][tables["Vid<-Vid#1"].valid[c]].tolist())
        assert sorted(a | b) == u.index[c][u.valid[c]].tolist()
    coarse = tables["Vid<-Coarse"]
    assert coarse.K == 1 and coarse.index[16 * 16 + 9 * 16 + 12].item() == 1 * 4 + 1 * 2 + 1
    assert visible_union(prog, env, "Txt", "Vid").K == 0


def test_dense_rows_agree_with_gather_tables() -> None:
    m = compile_masks(VIDEO, **SMALL_VIDEO)
    dense = m.dense()
    base = m.space.base
    for src in ("Vid", "Txt", "Coarse"):
        t = m.gather("Vid")[f"Vid<-{src}"]
        rows = torch.zeros((m.space.size("Vid"), m.space.size(src)), dtype=torch.bool)
        who = torch.arange(t.index.shape[0]).unsqueeze(1).expand_as(t.index)
        rows[who[t.valid], t.index[t.valid]] = True
        vid = slice(base["Vid"], base["Vid"] + m.space.size("Vid"))
        assert torch.equal(dense[vid, base[src] : base[src] + m.space.size(src)], rows)


@pytest.mark.parametrize("kind", ["raster", "tiled", "morton"])
def test_layout_encode_decode_roundtrip(kind: str) -> None:
    m = compile_masks(VIDEO, layout=kind, **SMALL_VIDEO)
    lay = make_layout(m.space, kind, (4, 8))
    pos = torch.arange(m.cells)
    which, coords = lay.decode(pos)
    for k, v in enumerate(m.space.names):
        sel = which == k
        rank = len(m.space.dims[v])
        assert torch.equal(lay.encode(v, [c[sel] for c in coords[:rank]]), pos[sel])


def test_tiled_and_morton_orders() -> None:
    sp = compile_masks("value G : Token[Byte] shape Grid2D(4, 4)\n").space
    tiled = make_layout(sp, "tiled", (2, 2))
    assert tiled.to_canon is not None
    # First tile = rows 0-1, cols 0-1 → canonical 0, 1, 4, 5.
    assert tiled.to_canon[:8].tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    morton = make_layout(sp, "morton")
    assert morton.to_canon is not None
    assert morton.to_canon[:8].tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    odd = make_layout(compile_masks("value G : Token[Byte] shape Grid2D(3, 5)\n").space, "morton")
    assert odd.to_canon is not None and sorted(odd.to_canon.tolist()) == list(range(15))


def test_degenerate_cells_are_reported() -> None:
    m = compile_masks(GPT, N=8)
    (d,) = m.degenerate
    assert (d.value, d.count, d.pattern, d.exact) == ("Txt", 1, "Txt[0]", True)
    video = compile_masks(VIDEO, **SMALL_VIDEO)
    # In the seed's program neither the caption nor the coarse grid has a `visible` clause.
    assert {(d.value, d.reason) for d in video.degenerate} == {
        ("Txt", "no visible clause"),
        ("Coarse", "no visible clause"),
    }
    current = compile_masks(EXAMPLES / "video.lmpm", T=2, W=16, H=16, N=8)
    assert ("Txt", "no visible clause") in {(d.value, d.reason) for d in current.degenerate}


def test_sdpa_fallback_never_nan() -> None:
    m = compile_masks(GPT, N=16)
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    out = sdpa(q, k, v, m.dense())
    assert not bool(out.isnan().any())
    assert bool((out[:, :, 0] == 0).all())  # Txt[0] sees nothing → zeros


@EAGER_FLEX
@pytest.mark.parametrize("kind", ["raster", "tiled", "morton"])
def test_flex_attention_matches_sdpa(kind: str) -> None:
    m = compile_masks(VIDEO, layout=kind, T=2, W=8, H=8, N=5)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, m.cells, 16) for _ in range(3))
    out = flex_attention(q, k, v, block_mask=m.block_mask(32))
    ref = sdpa(q, k, v, m.dense(canonical=False))
    assert torch.allclose(out, ref, atol=1e-5)


@COMPILED
def test_flex_attention_compiled_matches_sdpa() -> None:
    # Compiled, the CPU kernel reads the compact index tensors (eager flex only runs mask_mod).
    m = compile_masks(VIDEO, layout="tiled", **SMALL_VIDEO)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, m.cells, 16) for _ in range(3))
    bm = m.block_mask(32)
    assert_dense_layout(bm)
    out = torch.compile(flex_attention)(q, k, v, block_mask=bm)
    assert torch.allclose(out, sdpa(q, k, v, m.dense(canonical=False)), atol=1e-5)


# Programs the GPU test compares: a sliding window (the case the aliased index rows broke on an
# H200), causal, prefix-LM and the seed's video (tiled, so the mask_mod's layout table is read on
# the device too).
GPU_PROGRAMS = {
    "window": (
        "param N = 8\nvalue Txt : Token[Byte] shape Seq(N)\nvisible Txt[t] <- Txt[t-255..t]\n",
        {"N": 1024},
        "raster",
    ),
    "causal": (
        "param N = 8\nvalue Txt : Token[Byte] shape Seq(N)\nvisible Txt[t] <- Txt[0..t]\n",
        {"N": 700},
        "raster",
    ),
    "prefix_lm": (
        "param N = 8\nparam P = 2\nvalue Txt : Token[Byte] shape Seq(N)\n"
        "visible Txt[t] <- Txt[0..t]\nvisible Txt[t] <- Txt[0..P-1]\n",
        {"N": 700, "P": 200},
        "raster",
    ),
    "video": (VIDEO, SMALL_VIDEO, "tiled"),
}


@pytest.mark.gpu
@COMPILED
@pytest.mark.parametrize("name", sorted(GPU_PROGRAMS))
def test_flex_attention_forward_and_backward_on_gpu_match_sdpa(name: str) -> None:
    """Compiled flex_attention on CUDA with LMPM's BlockMask (built on the device, 128-blocks:
    the Triton kernel refuses smaller ones) against SDPA with the dense mask, float32: the output
    and the gradients of q, k and v (the backward pass reads the q-side indices)."""
    src, params, layout = GPU_PROGRAMS[name]
    m = compile_masks(src, layout=layout, **params)
    torch.manual_seed(0)
    qkv = [torch.randn(1, 2, m.cells, 64, device="cuda", requires_grad=True) for _ in range(3)]
    bm = m.block_mask(128, device="cuda")
    assert_dense_layout(bm)
    out = torch.compile(flex_attention)(*qkv, block_mask=bm)
    grads = torch.autograd.grad(out.sum(), qkv)
    ref = sdpa(*qkv, m.dense(canonical=False).cuda())
    ref_grads = torch.autograd.grad(ref.sum(), qkv)
    assert (out - ref).abs().max() < 1e-4, name
    for g, r, which in zip(grads, ref_grads, "qkv"):
        # k's and v's gradients sum over every query that reads them (hundreds of terms): float32
        # rounding grows with their size, so the bound is relative (benchmarks/masks.py --gpu on an
        # H200: 1.3e-3 absolute on the 16x32x32 video's gradients, 5e-6 on the 8k window's)
        scale = max(1.0, float(r.abs().max()))
        assert (g - r).abs().max() < 1e-4 * scale, (name, which)


@pytest.mark.parametrize("block", [16, 64, 128, (64, 32)])
def test_block_mask_blocks_match_create_block_mask_on_video(block: int | tuple[int, int]) -> None:
    m = compile_masks(VIDEO, layout="tiled", **SMALL_VIDEO)
    ours = m.block_mask(block)
    ref = create_block_mask(m.mask_mod, 1, 1, m.cells, m.cells, "cpu", BLOCK_SIZE=block)
    assert_same_blocks(ours, ref, block)


def test_sliding_window_is_analytic_at_long_length() -> None:
    # 131072 cells: the analytic path touches O(cells) runs; no N×N tensor anywhere.
    src = "param N = 8\nvalue Txt : Token[Byte] shape Seq(N)\nvisible Txt[t] <- Txt[t-255..t]\n"
    m = compile_masks(src, N=131072)
    c = m.block_counts(128)
    assert (c.full, c.partial) == (1023, 1024 + 1022)  # diagonal + two below it
    bm = m.block_mask(128)
    assert bm.kv_num_blocks.shape == (1, 1, 1024)
    # Index tensors in create_block_mask's dense layout (4 MiB each here), never overlapping rows.
    assert_dense_layout(bm)
    # q block 5 (cells 640..767) sees 385..767: kv blocks 3 and 5 partial, then the empty ones.
    assert bm.kv_indices[0, 0, 5, :4].tolist() == [3, 5, 0, 1]
    assert bm.kv_num_blocks[0, 0, 5] == 2 and bm.full_kv_indices[0, 0, 5, 0] == 4


def test_current_video_example_compiles() -> None:
    m = compile_masks(EXAMPLES / "video.lmpm", T=2, W=16, H=16, N=8)
    assert m.dense().shape == (m.cells, m.cells)
    assert m.block_counts(32).partial > 0


def test_errors_name_the_problem() -> None:
    with pytest.raises(UsageError, match="unknown layout"):
        compile_masks(GPT, layout="hilbert")
    prog = compile_source(
        "param K\nvalue A : Token[Byte] shape Seq(4)\nvisible A[i] <- A[i + K]\n"
    ).ir
    with pytest.raises(BindError, match="`K`"):
        masks(prog)
    assert masks(prog, {"K": 1}).dense().sum() == 3
    with pytest.raises(UsageError, match="not a value with cells"):
        compile_masks(GPT).gather("Nope")


def test_masks_api_shapes() -> None:
    m = Masks(compile_file(GPT).ir, {"N": 300}, layout="raster")
    assert m.cells == 300 and m.layout == "raster"
    assert m.dense().shape == (300, 300)
    assert set(m.sparsity) == {"raster", "tiled", "morton"}
    bm = m.block_mask(block_size=(64, 32))
    assert bm.BLOCK_SIZE == (64, 32) and bm.kv_num_blocks.shape == (1, 1, 5)
