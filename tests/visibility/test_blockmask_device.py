"""The BlockMask build on a device: sizes known on the host, no host sync, the same tensors.

The simulated CUDA device (``lmpm.workers.simcuda``) records every value read on the host and
every op whose output size depends on the data; a cold build must make none of them, and give the
CPU build's tensors exactly."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from blockmask_checks import assert_dense_layout
from hypothesis import given
from hypothesis import strategies as st
from test_visibility_random import SETTINGS, build, programs, render
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn.attention.flex_attention import BlockMask

from lmpm.visibility import Masks, compile_masks
from lmpm.visibility.blockmask import SIDES
from lmpm.visibility.dense import dense_mask
from lmpm.workers.simcuda import simulated_cuda

WINDOW = "param N = 1024\nvalue Txt : Token[Byte] shape Seq(N)\nvisible Txt[t] <- Txt[t-127..t]\n"
PREFIX = (
    "param N = 1024\nparam P = 100\nvalue Txt : Token[Byte] shape Seq(N)\n"
    "visible Txt[t] <- Txt[0..t]\nvisible Txt[t] <- Txt[0..P-1]\n"
)
N4 = (
    "param H = 24\nparam W = 20\nvalue G : Token[Byte] shape Grid2D(H, W)\n"
    "visible G[x,y] <- G[x+dx, y+dy] when (dx,dy) in N4\n"
)
VIDEO = """param T = 3
param W = 16
param H = 24
value Txt : Token[Byte] shape Seq(77)
value Vid : Token[Byte] shape Grid3D(T, W, H)
visible Vid[t,x,y] <- Vid[t,x+dx,y+dy] when (dx,dy) in N8
visible Vid[t,x,y] <- Vid[t-1,x,y] when t>0
visible Vid[t,x,y] <- Txt[*]
value Coarse : Token[Byte] shape Grid3D(T, W/8, H/8)
visible Vid[t,x,y] <- Coarse[t, x/8, y/8]
visible Vid[t,x,y] <- Vid[0..t-1, x-2..x+2, *]
visible Vid[t,x,y] <- Vid[t-2, 0..W-1, 0..H-1] when t > 1
"""
CASES = {"window": WINDOW, "prefix_lm": PREFIX, "n4": N4, "video_n8": VIDEO}


def _earlier_build() -> ModuleType:
    """benchmarks/blockmask_v1.py: the build before the static rewrite, frozen."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "blockmask_v1.py"
    spec = importlib.util.spec_from_file_location("blockmask_v1", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


V1 = _earlier_build()


def _tensors(bm: BlockMask) -> dict[str, torch.Tensor]:
    return {f"{s}_{t}": getattr(bm, f"{s}_{t}") for s in SIDES for t in ("num_blocks", "indices")}


def _on_simulated_cuda(m: Masks, block: int) -> tuple[dict[str, torch.Tensor], list[str]]:
    """A cold build of ``m`` on the simulated device: its tensors (copied to the host), and what
    the device saw during the build (host syncs, data-dependent sizes, host copies, errors)."""
    with simulated_cuda() as sim:
        bm = m.block_mask(block, device="cuda", cache=False)
        seen = [f"{e.kind} {e.op} at {e.where()}" for e in (*sim.warnings, *sim.errors)]
        assert all(t.device.type == "cuda" for t in _tensors(bm).values())
        host = {k: t.cpu() for k, t in _tensors(bm).items()}
    return host, seen


def _assert_equal(host: dict[str, torch.Tensor], ref: BlockMask, context: object) -> None:
    for name, t in host.items():
        assert torch.equal(t, _tensors(ref)[name]), (name, context)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("layout", ["raster", "tiled"])
def test_a_cold_build_on_the_device_makes_no_host_sync(case: str, layout: str) -> None:
    m = compile_masks(CASES[case], layout=layout)
    host, seen = _on_simulated_cuda(m, 128)
    assert seen == [], seen
    _assert_equal(host, m.block_mask(128, cache=False), case)


@SETTINGS
@given(programs(), st.sampled_from(["raster", "tiled", "morton"]), st.data())
def test_the_device_build_is_the_cpu_build(spec: dict[str, Any], layout: str, data: Any) -> None:
    """Random programs (per-cell binder ranges, divisions, guards): on the simulated device the
    build reads nothing back and gives the CPU build's tensors (themselves equal to
    ``create_block_mask``'s: test_visibility_random)."""
    m = build(spec, layout, tile=(2, 3))
    block = data.draw(st.sampled_from([1, 2, 3, 8, 128]))
    host, seen = _on_simulated_cuda(m, block)
    assert seen == [], (seen, render(spec))
    _assert_equal(host, m.block_mask(block, cache=False), render(spec))


@SETTINGS
@given(programs())
def test_the_static_expansion_sees_what_the_expansion_sees(spec: dict[str, Any]) -> None:
    """Boxes expanded with host bounds only (none dropped, clips and tests the bounds prove
    needless left out) cover the same cells; each box spans at most ``most`` cells per axis."""
    from lmpm.visibility._stencil import cell_stencils, expand_stencil

    m = build(spec, "raster")
    both = []
    for static in (False, True):
        clauses = [
            expand_stencil(m.program, m.env, s, m.space, static=static)
            for s in cell_stencils(m.program, m.space)
        ]
        both.append(dense_mask(m.space, [c.materialize() for c in clauses]))
        if static:
            for c in clauses:
                boxes = c.materialize()
                ext = (boxes.hi - boxes.lo + 1).clamp(min=0)  # (boxes, cells, rank)
                most = torch.tensor([b.most for b in c.boxes]).view(len(c.boxes), 1, len(c.sdims))
                assert bool((~boxes.ok.unsqueeze(-1) | (ext <= most)).all()), render(spec)
    assert torch.equal(both[0], both[1]), render(spec)


def test_the_build_traces_into_one_static_graph() -> None:
    """With fake tensors (no values at all) the build traces: no op reads a value or sizes its
    output from the data — what a compiled (captured) build needs."""
    m = compile_masks(VIDEO, layout="raster")
    m.mask_mod_on("cpu")  # (made once per device, outside the build)
    graph = make_fx(lambda: _tensors(m.block_mask(128, cache=False)), tracing_mode="fake")()
    ops = [n for n in graph.graph.nodes if n.op == "call_function"]
    assert 0 < len(ops) < 400, len(ops)


@SETTINGS
@given(programs(), st.sampled_from(["raster", "tiled", "morton"]), st.data())
def test_groups_and_order_chunks_give_the_whole_build(
    spec: dict[str, Any], layout: str, data: Any
) -> None:
    """Small ``ROW_CHUNK``/``DIFF_CAP``/``ORDER_CHUNK`` (several groups of q blocks, several
    ordering chunks, as a 1M-cell video has): the tensors of one group and one chunk."""
    from lmpm.visibility import blockmask

    m = build(spec, layout, tile=(2, 3))
    block = data.draw(st.sampled_from([1, 2, 3]))
    whole = _tensors(m.block_mask(block, cache=False))
    saved = blockmask.ROW_CHUNK, blockmask.DIFF_CAP, blockmask.ORDER_CHUNK
    try:
        blockmask.ROW_CHUNK = data.draw(st.integers(1, 8))
        blockmask.DIFF_CAP = data.draw(st.integers(1, 64))
        blockmask.ORDER_CHUNK = data.draw(st.integers(1, 64))
        chunked_mask = m.block_mask(block, cache=False)
    finally:
        blockmask.ROW_CHUNK, blockmask.DIFF_CAP, blockmask.ORDER_CHUNK = saved
    chunked = _tensors(chunked_mask)
    for name, t in whole.items():
        assert torch.equal(chunked[name], t), (name, render(spec))
    assert_dense_layout(chunked_mask, render(spec))


@SETTINGS
@given(programs(), st.sampled_from(["raster", "tiled", "morton"]), st.data())
def test_the_build_is_the_earlier_build(spec: dict[str, Any], layout: str, data: Any) -> None:
    """The static build against the one it replaced (benchmarks/blockmask_v1.py, which sized
    its tensors from their values), tensor by tensor."""
    m = build(spec, layout, tile=(2, 3))
    block = data.draw(st.sampled_from([1, 2, 3, 5, 8, 128]))
    ours = _tensors(m.block_mask(block, cache=False))
    for name, t in _tensors(V1.build(m, block)).items():
        assert torch.equal(ours[name], t), (name, render(spec))
