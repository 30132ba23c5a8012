"""The generated mask_mod is plain source (no closure for torch.compile to guard), written in the
hand-written order, and the analytic BlockMask is built once per block size and device."""

from __future__ import annotations

import torch

from lmpm.visibility import compile_masks

WINDOW = """param N = 64
param Wnd = 8
value Txt : Token[Byte] shape Seq(N)
visible Txt[t] <- Txt[t-Wnd+1..t]
"""
TILED = """param H = 16
param W = 16
value G : Token[Byte] shape Grid2D(H, W)
visible G[x,y] <- G[x+dx, y+dy] when (dx,dy) in N4
"""


def test_mask_mod_is_a_plain_function_with_literal_constants() -> None:
    m = compile_masks(WINDOW, layout="raster", N=64, Wnd=8)
    fn = m.mask_mod
    assert fn.__closure__ is None  # nothing for dynamo to guard but the code itself
    src = fn.lmpm_source  # type: ignore[attr-defined]
    assert src.startswith("def mask_mod(b, h, q_idx, kv_idx):")
    assert "-7" in src  # the window's bound as a literal, not read from an object
    q, kv = torch.meshgrid(torch.arange(64), torch.arange(64), indexing="ij")
    z = torch.zeros((), dtype=torch.long)
    assert torch.equal(fn(z, z, q, kv), (kv <= q) & (q - kv < 8))


def test_chains_fold_left_and_differences_do_not_stay_live() -> None:
    video = """param T = 2
param W = 8
param H = 8
value Vid : Token[Byte] shape Grid3D(T, W, H)
visible Vid[t,x,y] <- Vid[t, x+dx, y+dy] when (dx,dy) in N8
"""
    src = compile_masks(video, layout="raster", T=2, W=8, H=8).mask_mod.lmpm_source  # type: ignore[attr-defined]
    body = [line.strip() for line in src.splitlines()[3:]]
    # N8 is |dx| <= 1 & |dy| <= 1 & (x != kx | y != ky): the last compares coordinates, never
    # a difference against 0, and each test joins the running conjunction as soon as it exists
    assert not any(line.endswith("!= 0") for line in body), src
    ands = [line for line in body if " & " in line]
    assert len({line.split(" = ")[0] for line in ands}) == 1, src  # one running tile


def test_tiled_layout_reads_its_table_as_a_global() -> None:
    m = compile_masks(TILED, layout="tiled", H=32, W=32)
    fn = m.mask_mod
    assert fn.__closure__ is None and "_table[q_idx]" in fn.lmpm_source  # type: ignore[attr-defined]
    dense = m.dense(canonical=False)
    n = m.cells
    q, kv = torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij")
    z = torch.zeros((), dtype=torch.long)
    assert torch.equal(fn(z, z, q, kv), dense)


def test_block_mask_is_built_once_per_block_and_device() -> None:
    m = compile_masks(WINDOW, layout="raster", N=256, Wnd=16)
    first = m.block_mask(32)
    assert m.block_mask(32) is first
    assert m.block_mask((32, 32)) is first
    assert m.block_mask(64) is not first
    fresh = m.block_mask(32, cache=False)
    assert fresh is not first
    for side in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        assert torch.equal(getattr(fresh, side), getattr(first, side))
