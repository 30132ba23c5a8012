"""Claim: LMPM builds FlexAttention BlockMasks analytically from the stencils — ≥10× faster and ≥10×
less peak memory than ``create_block_mask`` — and attention with them is as fast as with a
hand-written mask_mod's BlockMask, and ≥3× faster than SDPA with a dense mask at ≥80% block sparsity.

Prints one JSON line per case: {"benchmark":"masks","case":...,"baseline_s":...,"lmpm_s":...,
"ratio":...,"goal":...,...}.

How it measures (honestly, on CPU):

- every measurement runs in a fresh subprocess (``--worker``), so nothing is cached or shared;
- time: ``time.perf_counter`` around the call. Compiled variants are called once to compile (the
  compile+first-run time is reported as ``*_first_s``), then timed on a second call;
- peak memory: the process's resident-set high-water mark (``VmHWM`` in /proc/self/status) after
  resetting it (``echo 5 > /proc/self/clear_refs``) just before the timed call, minus the resident
  set at that moment. It sees every allocation torch makes (tracemalloc does not);
- a baseline that runs out of memory or past its time limit is reported as such, with the limit:
  that failure is the measurement. It is then also measured at a smaller size where it finishes.
- blocks: the workers save the blocks each BlockMask lists — per side (kv, full kv, and the q
  sides the backward pass reads), ``lmpm.visibility.blockmask.block_sets`` — and the parent
  asserts they are equal (LMPM stores its index rows compactly, so the raw tensors differ past
  each row's ``num_blocks``, which FlexAttention never reads);
- ``lmpm_warm_*`` (reduced sizes, next to the compiled baseline): LMPM measured the way the
  compiled baseline is, a first call in the same process and the second one timed;
- attention: the best of 5 calls after a warm-up (of 3 for calls over a second), at the default
  128-blocks and at the block size with the least block work (``pick_block``, chosen from the
  block structure before anything is timed); video at 8k, 17k and 33k cells shows how the ratio
  to dense SDPA grows with N. Every line carries the block sparsity.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# The seed's video program (its values and four `visible` clauses, as in the seed and the first
# examples/video.lmpm), inline so the hand-written mask_mod below stays its exact equivalent.
VIDEO_SRC = """param T = 4
param W = 32
param H = 32
param N = 64
value Txt : Token[Byte] shape Seq(N)
value Vid : Token[Byte] shape Grid3D(T, W, H)
value MaskPlan : Event shape Set()
visible Vid[t,x,y] <- Vid[t,x+dx,y+dy] when (dx,dy) in N8
visible Vid[t,x,y] <- Vid[t-1,x,y] when t>0
visible Vid[t,x,y] <- Txt[*]
value Coarse : Token[Byte] shape Grid3D(T, W/8, H/8)
visible Vid[t,x,y] <- Coarse[t, x/8, y/8]
"""
WINDOW_SRC = """param N = 131072
param Wnd = 1024
value Txt : Token[Byte] shape Seq(N)
visible Txt[t] <- Txt[t-Wnd+1..t]
"""
# Per baseline subprocess at full size: the baseline's failure to finish is the measurement (its
# ratio is then a lower bound). At the reduced sizes every baseline finishes.
FULL_LIMIT_S = 90
REDUCED_LIMIT_S = 180
MEM_LIMIT_BYTES = 18 * 2**30  # address-space cap per worker (the machine has 24 GiB)
BLOCK = 128


# ---- workers (one measurement per process) -------------------------------------------------
def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def _reset_peak() -> int:
    import gc

    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    return _status("VmRSS")


def _hand_written(case: str, params: dict[str, int]) -> Any:
    """The mask_mod a FlexAttention user writes by hand (raster layout)."""
    import torch

    if case == "window":
        wnd = params.get("Wnd", 1024)

        def window(b: Any, h: Any, q: Any, kv: Any) -> Any:
            return (kv <= q) & (q - kv < wnd)

        return window
    n, t_, w, h_ = params["N"], params["T"], params["W"], params["H"]
    nv = t_ * w * h_
    w8, h8 = w // 8, h_ // 8

    def video(b: Any, h: Any, q: Any, kv: Any) -> Any:
        lq = q - n
        t, x, y = lq // (w * h_), (lq // h_) % w, lq % h_
        lk = kv - n
        kt, kx, ky = lk // (w * h_), (lk // h_) % w, lk % h_
        k_vid = (kv >= n) & (kv < n + nv)
        n8 = (kt == t) & ((kx - x).abs() <= 1) & ((ky - y).abs() <= 1) & ((kx != x) | (ky != y))
        prev = (t > 0) & (kt == t - 1) & (kx == x) & (ky == y)
        lc = kv - n - nv
        coarse = (
            (kv >= n + nv)
            & (lc // (w8 * h8) == t)
            & ((lc // h8) % w8 == x // 8)
            & (lc % h8 == y // 8)
        )
        return (q >= n) & (q < n + nv) & ((k_vid & (n8 | prev)) | (kv < n) | coarse)

    del torch
    return video


def worker(case: str, method: str, params: dict[str, int], out: str) -> None:
    import torch
    from torch.nn.attention.flex_attention import create_block_mask

    from lmpm.ir import compile_source
    from lmpm.ir.eval import bind_params
    from lmpm.visibility import Masks
    from lmpm.visibility.blockmask import SIDES, block_sets

    text = VIDEO_SRC if case == "video" else WINDOW_SRC
    prog = compile_source(text, overrides=params).ir
    env = bind_params(prog, params)
    cells = Masks(prog, env, "raster").cells if not method.startswith("lmpm") else None
    result: dict[str, Any] = {}
    if method in ("lmpm", "lmpm_warm"):

        def run() -> Any:
            return Masks(prog, env, "raster").block_mask(BLOCK)

        if method == "lmpm_warm":  # measured like the compiled baseline: a first call, then timed
            t0 = time.perf_counter()
            run()
            result["first_s"] = time.perf_counter() - t0

    else:
        mod = _hand_written(case, params)
        build = create_block_mask if method == "eager" else torch.compile(create_block_mask)
        assert cells is not None

        def run() -> Any:
            return build(mod, 1, 1, cells, cells, "cpu", BLOCK)

        if method == "compiled":
            t0 = time.perf_counter()
            run()
            result["first_s"] = time.perf_counter() - t0
    if method in ("lmpm", "eager"):
        # One-time torch start-up (lazy kernels, functorch, code pages) is not the algorithm:
        # run the same path once on a tiny causal mask first. The compiled baseline is warmed
        # by its own first call (reduced size) or has its compile time included (full size).
        tiny = compile_source(WINDOW_SRC, overrides={"N": 512, "Wnd": 64}).ir
        if method == "lmpm":
            Masks(tiny, bind_params(tiny, {"N": 512, "Wnd": 64}), "raster").block_mask(BLOCK)
        else:
            create_block_mask(_hand_written("window", {"Wnd": 64}), 1, 1, 512, 512, "cpu", BLOCK)
    base = _reset_peak()
    t0 = time.perf_counter()
    bm = run()
    result["s"] = time.perf_counter() - t0
    result["peak_bytes"] = _status("VmHWM") - base
    sets = block_sets(bm)
    sets.update({f"{side}_num_blocks": getattr(bm, f"{side}_num_blocks") for side in SIDES})
    torch.save(sets, out + ".pt")
    Path(out).write_text(json.dumps(result))


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEM_LIMIT_BYTES, MEM_LIMIT_BYTES))


def measure(case: str, method: str, params: dict[str, int], limit: float) -> dict[str, Any]:
    fd, out = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    cmd = [sys.executable, __file__, "--worker", case, method, json.dumps(params), out]
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=limit, preexec_fn=_limit_memory
        )
    except subprocess.TimeoutExpired:
        return {"status": f"timeout after {limit:.0f} s"}
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["?"])[-1][:160]
        oom = any(
            s in proc.stderr for s in ("MemoryError", "not enough memory", "alloc", "OutOfMemory")
        )
        kind = "out of memory" if oom or proc.returncode in (-9, 137) else "failed"
        return {"status": f"{kind} (limit {MEM_LIMIT_BYTES / 2**30:.0f} GiB): {tail}"}
    res = json.loads(Path(out).read_text())
    res["blocks"] = out + ".pt"
    res["status"] = "ok"
    return res


def same_blocks(a: dict[str, Any], b: dict[str, Any]) -> bool | None:
    import torch

    if a.get("status") != "ok" or b.get("status") != "ok":
        return None
    x, y = torch.load(a["blocks"]), torch.load(b["blocks"])
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def emit(**fields: Any) -> None:
    # The 1-minute load average: other processes on a shared machine make timings noisy.
    load = round(os.getloadavg()[0], 2)
    print(json.dumps({"benchmark": "masks", **fields, "load_avg_1m": load}), flush=True)


def build_cases() -> None:
    cases = [
        ("video", {"T": 16, "W": 64, "H": 64, "N": 77}, {"T": 4, "W": 32, "H": 32, "N": 77}),
        ("window", {"N": 131072, "Wnd": 1024}, {"N": 16384, "Wnd": 1024}),
    ]
    for case, full, small in cases:
        for label, params, limit in (
            ("full", full, FULL_LIMIT_S),
            ("reduced", small, REDUCED_LIMIT_S),
        ):
            mine = measure(case, "lmpm", params, limit)
            warm = measure(case, "lmpm_warm", params, limit) if label == "reduced" else {}
            # At full size the compiled baseline gets one call (compile included) within the
            # limit; at the reduced size it is compiled first and the second call is timed.
            for method in ("eager", "compiled_once" if label == "full" else "compiled"):
                base = measure(case, method, params, limit)
                ok = base.get("status") == "ok" and mine.get("status") == "ok"
                timed_out = base["status"].startswith("timeout")
                emit(
                    case=f"block_mask_build/{case}/{method}/{label}",
                    params=params,
                    baseline="create_block_mask("
                    + ("eager" if method == "eager" else "torch.compile")
                    + ", hand-written mask_mod)"
                    + (", first call incl. compile" if method == "compiled_once" else ""),
                    baseline_status=base["status"],
                    baseline_s=base.get("s"),
                    baseline_first_s=base.get("first_s"),
                    baseline_peak_mib=_mib(base.get("peak_bytes")),
                    lmpm_s=mine.get("s"),
                    lmpm_peak_mib=_mib(mine.get("peak_bytes")),
                    **(
                        {
                            "lmpm_warm_s": warm.get("s"),
                            "lmpm_warm_peak_mib": _mib(warm.get("peak_bytes")),
                            "memory_ratio_warm": _ratio(base["peak_bytes"], warm["peak_bytes"]),
                        }
                        if method == "compiled" and ok and warm.get("status") == "ok"
                        else {}
                    ),
                    ratio=(base["s"] / mine["s"]) if ok else None,
                    ratio_lower_bound=(limit / mine["s"]) if timed_out and "s" in mine else None,
                    memory_ratio=_ratio(base.get("peak_bytes"), mine.get("peak_bytes")),
                    goal="ratio >= 10 and memory_ratio >= 10",
                    identical_blocks=same_blocks(base, mine),
                )
                if ok:
                    assert same_blocks(base, mine), f"{case}/{method}/{label}: blocks differ"


def _ratio(base: int | None, mine: int | None) -> float | None:
    """Peak-memory ratio; None when our peak is under 1 MiB (the resident-set high-water mark
    moves in pages and with allocator reuse, so tiny peaks give meaningless ratios)."""
    if base is None or mine is None or mine < 2**20:
        return None
    return base / mine


def _mib(x: int | None) -> float | None:
    return None if x is None else round(x / 2**20, 1)


# ---- attention forward --------------------------------------------------------------------
CANDIDATE_BLOCKS = (128, 64, 32)


def pick_block(m: Any) -> int:
    """The block size with the least block work — (partial + full blocks) × B², the (q, kv) pairs
    FlexAttention computes — among ``CANDIDATE_BLOCKS`` (ties: the larger block). Chosen from the
    block structure alone, before anything is timed. On a GPU, 128 (the default, a tensor-core
    tile) is the one to use; on CPU smaller blocks waste less work in partial blocks."""

    def work(b: int) -> int:
        c = m.block_counts(b)
        return (c.partial + c.full) * b * b

    return min(CANDIDATE_BLOCKS, key=lambda b: (work(b), -b))


def attention_cases() -> None:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from lmpm.visibility import compile_masks

    torch.manual_seed(0)
    flex = torch.compile(flex_attention)
    cases = [
        ("window", {"N": 8192, "Wnd": 512}),
        ("video", {"T": 8, "W": 32, "H": 32, "N": 77}),
        ("video", {"T": 16, "W": 32, "H": 32, "N": 77}),
        # 33,357 cells: SDPA's dense bool mask is 1.1 GB (and it converts it to a 4.4 GB float
        # mask); shows how the ratio grows with N.
        ("video", {"T": 8, "W": 64, "H": 64, "N": 77}),
    ]

    def timed(fn: Any, *args: Any, **kw: Any) -> tuple[float, Any]:
        out = fn(*args, **kw)  # warm-up (compiles on first use)
        times: list[float] = []
        reps = 5  # best of 5; of 3 for calls over a second (SDPA at 33k cells: ~7 s each)
        while len(times) < reps:
            t0 = time.perf_counter()
            out = fn(*args, **kw)
            times.append(time.perf_counter() - t0)
            reps = 5 if times[0] < 1 else 3
        return min(times), out

    for case, params in cases:
        m = compile_masks(VIDEO_SRC if case == "video" else WINDOW_SRC, layout="raster", **params)
        n = m.cells
        q, k, v = (torch.randn(1, 4, n, 64) for _ in range(3))
        dense = m.dense(canonical=False)
        t_sdpa, o_sdpa = timed(F.scaled_dot_product_attention, q, k, v, attn_mask=dense)
        # Rows that see nothing are 0 in FlexAttention and NaN in plain SDPA; compare the rest.
        seen = dense.any(1)
        del dense
        best = pick_block(m)
        for block in sorted({BLOCK, best}, reverse=True):
            # A fresh compile per case: past dynamo's recompile limit (8 per code object)
            # flex_attention silently falls back to its dense eager path (seconds, not ms).
            torch._dynamo.reset()
            ours = m.block_mask(block)
            hand = create_block_mask(_hand_written(case, params), 1, 1, n, n, "cpu", block)
            t_ours, o_ours = timed(flex, q, k, v, block_mask=ours)
            t_hand, o_hand = timed(flex, q, k, v, block_mask=hand)
            assert torch.allclose(o_ours, o_hand, atol=1e-4)
            assert torch.allclose(o_ours[:, :, seen], o_sdpa[:, :, seen], atol=1e-4)
            c = m.block_counts(block)
            common = {
                "params": params,
                "cells": n,
                "block": block,
                "block_choice": ("default" if block == BLOCK else "")
                + (" least block work" if block == best else ""),
                "blocks": {"partial": c.partial, "full": c.full, "empty": c.empty},
                "block_sparsity": round(c.sparsity, 4),
                "block_sparsity_per_layout_128": {
                    kind: round(x, 4) for kind, x in m.sparsity.items()
                },
                "device": "cpu",
                "threads": torch.get_num_threads(),
            }
            emit(
                case=f"attention/{case}/vs_hand_written_blockmask",
                baseline="flex_attention(torch.compile) with create_block_mask"
                "(hand-written mask_mod), same block size",
                baseline_s=t_hand,
                lmpm_s=t_ours,
                ratio=t_ours / t_hand,
                goal="ratio <= 1.05",
                **common,
            )
            emit(
                case=f"attention/{case}/vs_sdpa_dense",
                baseline="F.scaled_dot_product_attention(attn_mask=dense bool)",
                baseline_s=t_sdpa,
                lmpm_s=t_ours,
                ratio=t_sdpa / t_ours,
                goal="ratio >= 3 at block sparsity >= 0.8",
                **common,
            )
    emit(
        case="attention/gpu",
        status="not measured: no GPU on this machine (CPU-only torch build); "
        "run `python benchmarks/masks.py --attention-only` on a CUDA machine",
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", nargs=4, metavar=("CASE", "METHOD", "PARAMS", "OUT"))
    ap.add_argument("--attention-only", action="store_true")
    ap.add_argument("--build-only", action="store_true")
    args = ap.parse_args()
    if args.worker:
        case, method, params, out = args.worker
        worker(case, method, json.loads(params), out)
        return
    if not args.attention_only:
        build_cases()
    if not args.build_only:
        attention_cases()


if __name__ == "__main__":
    main()
