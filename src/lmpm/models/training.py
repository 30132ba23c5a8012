"""Training and held-out evaluation of the built-in models (used by scripts/train_*.py, benchmarks).

Deterministic: fixed seeds, ``torch.use_deterministic_algorithms(True)``, data drawn from the world
generator with seeded ``random.Random`` / ``torch.Generator``; training seeds and held-out seeds are
disjoint (world seed 1 trains, world seed 2 is held out).

The video model is trained on exactly what the runtime will hand it: its inputs are gathered
through the gather tables of the resolved plan of ``examples/video.lmpm`` (the same ``index`` /
``valid`` tables the engine uses), with a random share of the cells unset (MaskGIT-style).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from lmpm.models import world
from lmpm.models.text import BYTES, ByteLM, bits_per_byte
from lmpm.models.video import CoarseGen, LocalGen

TRAIN_WORLD, HELDOUT_WORLD = 1, 2
ROOT = Path(__file__).resolve().parents[3]
VIDEO_PROGRAM = ROOT / "examples" / "video.lmpm"


# ---- text -------------------------------------------------------------------------------------
def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:]


def text_corpus(n: int, seed: int, length: int = 64) -> Tensor:
    """(n, length) byte rows: captions of random scenes joined by ". ", each row starting at a
    caption. About a third of the rows are in sentence case ("A red square ... . The sky ...")."""
    r = random.Random(seed)
    rows = []
    k = 0
    for _ in range(n):
        prose = r.random() < 0.35
        parts: list[str] = []
        while len(". ".join(parts)) < length:
            scene = world.sample_scene(seed * 9_999_991 + k)
            k += 1
            cap = world.caption(scene, style=r.randrange(3)).decode()
            if prose:
                cap = _sentence(cap)
            parts.append(cap)
        text = (". ".join(parts) + ".").encode()[:length]
        rows.append(list(text))
    return torch.tensor(rows, dtype=torch.long)


def train_text(
    steps: int,
    seed: int = 0,
    *,
    batch: int = 32,
    lr: float = 3e-3,
    log: Callable[[str], None] = print,
    **config: Any,
) -> tuple[ByteLM, dict[str, Any]]:
    g = _deterministic(seed)
    model = ByteLM(**config)
    data = text_corpus(max(steps * batch // 4, 512), TRAIN_WORLD)
    held = text_corpus(512, HELDOUT_WORLD)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    t0 = time.perf_counter()
    for step in range(steps):
        _cosine(opt, lr, step, steps)
        idx = torch.randint(0, data.shape[0], (batch,), generator=g)
        x = data[idx]
        loss = F.cross_entropy(model(x).reshape(-1, BYTES), x.reshape(-1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 200 == 0 or step == steps - 1:
            log(f"text step {step}: {loss.item() / math.log(2):.3f} bits/byte")
    model.eval()
    metrics = {
        "heldout_bits_per_byte": round(bits_per_byte(model, held), 4),
        "train_bits_per_byte": round(bits_per_byte(model, data[:512]), 4),
        "steps": steps,
        "seconds": round(time.perf_counter() - t0, 1),
        "params": sum(p.numel() for p in model.parameters()),
    }
    return model, metrics


# ---- video ------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Tables:
    """The LocalGen reads of the resolved video plan: (cells, K) index / valid per read."""

    neighbors: tuple[Tensor, Tensor]
    prev_frame: tuple[Tensor, Tensor]
    coarse: tuple[Tensor, Tensor]
    coords: Tensor  # (cells, 3)
    coarse_coords: Tensor  # (coarse cells, 3)
    dims: tuple[int, int, int]


def video_tables(params: dict[str, int] | None = None, program: Path = VIDEO_PROGRAM) -> Tables:
    from lmpm.bindings import Bindings
    from lmpm.ir import compile_file
    from lmpm.models.null import uniform_logits, zero_score
    from lmpm.resolve.plan import resolve

    p = dict(params or {})
    front = compile_file(program, overrides=p)
    null = {"Model": uniform_logits, "ModelScore": zero_score, "CoarseGen": uniform_logits}
    plan = resolve(front.ir, p, Bindings((), null))
    rp = next(r for r in plan.rules if r.name == "LocalGen")
    reads = {r.args[0]: (r.index, r.valid) for r in rp.reads}
    vd = plan.values["Vid"].dims
    return Tables(
        reads["neighbors"],
        reads["prev_frame"],
        reads["coarse"],
        plan.values["Vid"].coords,
        plan.values["Coarse"].coords,
        (vd[0], vd[1], vd[2]),
    )


def caption_rows(
    captions: tuple[bytes, ...] | list[bytes], length: int = 64
) -> tuple[Tensor, Tensor]:
    """(n, length) bytes and mask (committed) of captions, as the runtime's `txt` read shows them."""
    txt = torch.zeros(len(captions), length, dtype=torch.long)
    mask = torch.zeros(len(captions), length, dtype=torch.bool)
    for i, c in enumerate(captions):
        b = list(c[:length])
        txt[i, : len(b)] = torch.tensor(b, dtype=torch.long)
        mask[i, : len(b)] = True
    return txt, mask


def local_batch(
    tables: Tables,
    videos: Tensor,
    coarse: Tensor,
    committed: Tensor,
    coarse_committed: Tensor,
    cells: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """Inputs of ``cells`` (B, m) of each video, gathered through the plan's tables.

    videos (B, ncells), coarse (B, ncoarse), committed masks alike. Returns tokens (B*m, 10),
    visible (B*m, 10), coords (B*m, 3)."""
    b = videos.shape[0]
    rows = torch.arange(b)[:, None, None]
    toks, vis = [], []
    for (index, valid), src, com in (
        (tables.neighbors, videos, committed),
        (tables.prev_frame, videos, committed),
        (tables.coarse, coarse, coarse_committed),
    ):
        idx = index[cells]  # (B, m, K)
        toks.append(src[rows, idx])
        vis.append(valid[cells] & com[rows, idx])
    tokens = torch.cat(toks, -1).reshape(b * cells.shape[1], -1)
    visible = torch.cat(vis, -1).reshape(b * cells.shape[1], -1)
    return tokens, visible, tables.coords[cells.reshape(-1)]


def _masks(g: torch.Generator, b: int, n: int, nc: int) -> tuple[Tensor, Tensor]:
    rate = torch.rand(b, 1, generator=g)
    rate = torch.where(torch.rand(b, 1, generator=g) < 0.1, torch.ones_like(rate), rate)
    committed = torch.rand(b, n, generator=g) >= rate
    coarse_on = torch.rand(b, 1, generator=g) < 0.85
    coarse_committed = coarse_on & (torch.rand(b, nc, generator=g) < 0.9)
    return committed, coarse_committed


def _focus_cells(g: torch.Generator, videos: Tensor, frames: int, m: int, focus: float) -> Tensor:
    """(B, m) cells of each video to learn from: drawn with weight ``1 + focus`` where a shape passes
    (its colour in any frame at that column and row), 1 elsewhere. The object covers ~1% of a
    video and its motion fewer cells still; drawn uniformly, they hardly weigh in the loss and the
    model learns the textures, not where the caption's object goes (docs/models.md)."""
    b = videos.shape[0]
    if focus <= 0:
        return torch.randint(0, videos.shape[1], (b, m), generator=g)
    v = videos.reshape(b, frames, -1)
    shapes = world.PALETTES["shapes"]
    near = ((v >= min(shapes)) & (v <= max(shapes))).any(1, keepdim=True).expand_as(v)
    weights = 1.0 + focus * near.reshape(b, -1).float()
    return torch.multinomial(weights, m, replacement=True, generator=g)


@dataclass(frozen=True, slots=True)
class VideoRecipe:
    """How :func:`train_video` trains LocalGen and CoarseGen (the committed weights: these)."""

    scenes: int = 2000  # training scenes of the world generator
    batch: int = 16  # videos per LocalGen step
    cells_per_video: int = 512  # cells predicted per video per step
    lr: float = 2e-3  # peak learning rate (cosine schedule), both models
    focus: float = 20.0  # extra weight of cells near a shape when sampling them (0: uniform)
    coarse_steps: int | None = None  # CoarseGen's steps (None: a third of LocalGen's)
    heldout: int = 100  # held-out scenes for the metrics
    threads: int = 2  # torch threads (the thread count changes how torch sums)


def train_video(
    steps: int,
    seed: int = 0,
    recipe: VideoRecipe = VideoRecipe(),
    *,
    log: Callable[[str], None] = print,
) -> tuple[LocalGen, CoarseGen, dict[str, Any]]:
    r = recipe
    batch, cells_per_video, lr = r.batch, r.cells_per_video, r.lr
    g = _deterministic(seed, r.threads)
    tables = video_tables()
    t0 = time.perf_counter()
    w = world.generate(r.scenes, TRAIN_WORLD, split="train")  # no held-out (colour, direction) pair
    n_videos = w.videos.shape[0]
    videos = w.videos.reshape(n_videos, -1)
    coarse = w.coarse.reshape(n_videos, -1)
    txt, txt_mask = caption_rows(w.captions)
    log(f"world: {n_videos} scenes in {time.perf_counter() - t0:.1f}s")

    model = LocalGen()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    n, nc = videos.shape[1], coarse.shape[1]
    frames = tables.dims[0]
    for step in range(steps):
        _cosine(opt, lr, step, steps)
        vid = torch.randint(0, n_videos, (batch,), generator=g)
        committed, coarse_committed = _masks(g, batch, n, nc)
        cells = _focus_cells(g, videos[vid], frames, cells_per_video, r.focus)
        tokens, visible, coords = local_batch(
            tables, videos[vid], coarse[vid], committed, coarse_committed, cells
        )
        t, m = txt[vid], txt_mask[vid]
        newline = torch.rand(batch, generator=g) < 0.1  # captions typed into a file end with \n
        ends = m.sum(1).clamp(max=t.shape[1] - 1)
        t = t.clone()
        m = m.clone()
        t[newline, ends[newline]] = 10
        m[newline, ends[newline]] = True
        cap = model.cap(t, m).repeat_interleave(cells_per_video, 0)
        logits = model(tokens, visible, cap, coords)
        target = videos[vid[:, None], cells].reshape(-1)
        loss = F.cross_entropy(logits, target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 200 == 0 or step == steps - 1:
            log(f"video step {step}: nll {loss.item():.3f}")
    model.eval()

    coarse_model = CoarseGen()
    copt = torch.optim.AdamW(coarse_model.parameters(), lr=lr, weight_decay=0.01)
    csteps = r.coarse_steps if r.coarse_steps is not None else max(steps // 3, 1)
    for step in range(csteps):
        _cosine(copt, lr, step, csteps)
        vid = torch.randint(0, n_videos, (64,), generator=g)
        cap = coarse_model.cap(txt[vid], txt_mask[vid]).repeat_interleave(nc, 0)
        coords = tables.coarse_coords.repeat(64, 1)
        loss = F.cross_entropy(coarse_model(cap, coords), coarse[vid].reshape(-1))
        copt.zero_grad()
        loss.backward()
        copt.step()
        if step % 200 == 0 or step == csteps - 1:
            log(f"coarse step {step}: nll {loss.item():.3f}")
    coarse_model.eval()
    metrics = heldout_video(model, coarse_model, tables, scenes=r.heldout)
    metrics.update(
        steps=steps,
        coarse_steps=csteps,
        seconds=round(time.perf_counter() - t0, 1),
        params=sum(p.numel() for p in model.parameters()),
        coarse_params=sum(p.numel() for p in coarse_model.parameters()),
    )
    return model, coarse_model, metrics


def heldout_video(
    model: LocalGen, coarse_model: CoarseGen, tables: Tables | None = None, scenes: int = 100
) -> dict[str, Any]:
    """Held-out token accuracy / NLL of the proposer (at 0% and 50% of the other cells unset), the
    copy-previous-frame baseline on the same cells (t > 0), and CoarseGen's accuracy."""
    tables = tables or video_tables()
    w = world.generate(scenes, HELDOUT_WORLD, split="heldout")  # only held-out pairs
    b = w.videos.shape[0]
    videos = w.videos.reshape(b, -1)
    coarse = w.coarse.reshape(b, -1)
    txt, txt_mask = caption_rows(w.captions)
    n, nc = videos.shape[1], coarse.shape[1]
    later = tables.coords[:, 0] > 0  # cells with a previous frame
    cells = later.nonzero().squeeze(1).expand(b, -1)
    g = torch.Generator().manual_seed(1234)
    out: dict[str, Any] = {"heldout_scenes": scenes}
    with torch.no_grad():
        cap_all = model.cap(txt, txt_mask)
        for rate in (0.0, 0.5):
            committed = torch.rand(b, n, generator=g) >= rate
            tokens, visible, coords = local_batch(
                tables, videos, coarse, committed, torch.ones(b, nc, dtype=torch.bool), cells
            )
            cap = cap_all.repeat_interleave(cells.shape[1], 0)
            logits = model(tokens, visible, cap, coords)
            target = videos[torch.arange(b)[:, None], cells].reshape(-1)
            acc = (logits.argmax(-1) == target).float().mean()
            nll = F.cross_entropy(logits, target)
            out[f"accuracy_unset{int(rate * 100)}"] = round(float(acc), 4)
            out[f"nll_unset{int(rate * 100)}"] = round(float(nll), 4)
        prev_idx = tables.prev_frame[0][cells][..., 0]
        copy = videos[torch.arange(b)[:, None], prev_idx] == videos[torch.arange(b)[:, None], cells]
        out["copy_prev_accuracy"] = round(float(copy.float().mean()), 4)
        moving = ~copy  # cells the motion changed: where copying fails
        committed = torch.ones(b, n, dtype=torch.bool)
        tokens, visible, coords = local_batch(
            tables, videos, coarse, committed, torch.ones(b, nc, dtype=torch.bool), cells
        )
        logits = model(tokens, visible, cap_all.repeat_interleave(cells.shape[1], 0), coords)
        target = videos[torch.arange(b)[:, None], cells].reshape(-1)
        hit = (logits.argmax(-1) == target).reshape(b, -1)
        out["accuracy_on_changed_cells"] = round(float(hit[moving].float().mean()), 4)
        ccap = coarse_model.cap(txt, txt_mask).repeat_interleave(nc, 0)
        clog = coarse_model(ccap, tables.coarse_coords.repeat(b, 1))
        out["coarse_accuracy"] = round(
            float((clog.argmax(-1) == coarse.reshape(-1)).float().mean()), 4
        )
    return out


# ---- helpers ----------------------------------------------------------------------------------
def _deterministic(seed: int, threads: int = 2) -> torch.Generator:
    from lmpm.models.weights import deterministic

    return deterministic(seed, threads)


def _cosine(opt: torch.optim.Optimizer, lr: float, step: int, steps: int) -> None:
    warm = max(steps // 20, 1)
    f = (step + 1) / warm if step < warm else 0.5 * (1 + math.cos(math.pi * step / steps))
    for grp in opt.param_groups:
        grp["lr"] = lr * max(f, 0.02)


# ---- held-out generation: a caption in, a video out, the object checked -----------------------
VIDEO_ALONE = ROOT / "examples" / "video_free.lmpm"
# (colour, direction) pairs the models were trained on, to set the held-out numbers against
TRAINED_PAIRS = (("red", "left"), ("black", "right"), ("yellow", "up"), ("purple", "down"))


def object_iou(video: Tensor, truth: Tensor, token: int) -> Tensor:
    """(T,) IoU per frame of the cells holding ``token`` in ``video`` vs ``truth`` (T, W, H)."""
    a, b = video == token, truth == token
    inter = (a & b).flatten(1).sum(1).float()
    union = (a | b).flatten(1).sum(1).float()
    return torch.where(union > 0, inter / union.clamp(min=1), torch.ones_like(union))


def _centroid(mask: Tensor) -> Tensor | None:
    idx = mask.nonzero().float()
    return idx.mean(0) if idx.numel() else None


def motion_ok(video: Tensor, token: int, direction: str) -> list[bool]:
    """Per frame t ≥ 1: the ``token`` cells' centroid moved the way ``direction`` says."""
    dx, dy = world.DIRECTIONS[direction]
    want = torch.tensor([dx, dy], dtype=torch.float32)
    out = []
    for t in range(1, video.shape[0]):
        a, b = _centroid(video[t - 1] == token), _centroid(video[t] == token)
        out.append(a is not None and b is not None and float((b - a) @ want) > 0.25)
    return out


def generate_video(
    caption: bytes, *, program: Path = VIDEO_ALONE, epochs: int = 16, seed: int = 0, **params: int
) -> Tensor:
    """Run ``program`` (default: the model alone) on a caption; the final ``Vid`` (T, W, H)."""
    import tempfile

    from lmpm.runtime.session import Run

    with tempfile.TemporaryDirectory() as tmp:
        cap = Path(tmp) / "caption.txt"
        cap.write_bytes(caption)
        run = Run.from_file(program, params=params, inputs={"Txt": str(cap)}, seed=seed)
        run.run(epochs)
        return run.payloads()["Vid"].reshape(run.plan.values["Vid"].dims).clone()


def _generated(
    scene: world.Scene, *, program: Path = VIDEO_ALONE, epochs: int = 16, seed: int = 0
) -> tuple[Tensor, Tensor, int]:
    """``program`` run on ``scene``'s caption: the video, the scene itself (the truth) and the
    object's token."""
    (shape,) = scene.shapes
    dims = {"T": scene.T, "W": scene.W, "H": scene.H}
    video = generate_video(world.caption(scene), program=program, epochs=epochs, seed=seed, **dims)
    return video, world.render(scene), world.NAMES.index(shape.colour)


def heldout_generation(
    pairs: tuple[tuple[str, str], ...] | None = None,
    *,
    program: Path = VIDEO_ALONE,
    epochs: int = 16,
    seed: int = 0,
    T: int = 4,
    W: int = 32,
    H: int = 32,
) -> dict[str, Any]:
    """Generate a video from the caption of each (colour, direction) pair (default: the held-out
    ones, never in training), with the model alone, and check the object against the scene the
    caption describes: IoU of the object's cells per frame; the copy-previous-frame baseline (the
    *true* previous frame held still) on frames t ≥ 1; whether the object moved the right way;
    the share of shape-coloured cells that have the caption's colour."""
    pairs = tuple(sorted(world.HELDOUT_PAIRS)) if pairs is None else pairs
    ious, ious_later, copies, moves, colour_ok = [], [], [], [], []
    captions = []
    for i, (colour, direction) in enumerate(pairs):
        kind = world.SHAPE_KINDS[i % len(world.SHAPE_KINDS)]
        scene = world.staged(world.Description(colour, kind, direction), T=T, W=W, H=H)
        captions.append(world.caption(scene).decode())
        video, truth, tok = _generated(scene, program=program, epochs=epochs, seed=seed)
        iou = object_iou(video, truth, tok)
        ious.append(float(iou.mean()))
        ious_later.append(float(iou[1:].mean()))
        copies.append(float(object_iou(truth[:-1], truth[1:], tok).mean()))
        moves.extend(motion_ok(video, tok, direction))
        shaped = (video >= min(world.PALETTES["shapes"])) & (video <= max(world.PALETTES["shapes"]))
        colour_ok.append(float((video[shaped] == tok).float().mean()) if shaped.any() else 0.0)
    n = max(len(pairs), 1)
    return {
        "captions": captions,
        "object_iou": round(sum(ious) / n, 4),
        "object_iou_t_ge_1": round(sum(ious_later) / n, 4),
        "copy_prev_iou_t_ge_1": round(sum(copies) / n, 4),
        "moves_right_way": round(sum(moves) / max(len(moves), 1), 4),
        "colour_fidelity": round(sum(colour_ok) / n, 4),
    }


SETTINGS = (("grass", False), ("sand", False), ("grass", True))  # plain, on the sand, cloudy


def heldout_sweep(*, epochs: int = 16, seed: int = 3) -> dict[str, Any]:
    """The model alone on every held-out (colour, direction) pair × shape × speed (1, or 2: "fast")
    × setting (grass, sand, a cloud): 72 captions, none trained on. Per speed: the mean object IoU
    with the scene the caption describes and the share of frames (t ≥ 1) where it moved the
    caption's way; ``worst``: the captions with an IoU under 0.8."""
    import itertools

    by_speed: dict[int, list[tuple[float, float]]] = {}
    worst = []
    for (colour, direction), kind, speed, (ground, cloud) in itertools.product(
        sorted(world.HELDOUT_PAIRS), world.SHAPE_KINDS, (1, 2), SETTINGS
    ):
        scene = world.staged(world.Description(colour, kind, direction, speed, ground, cloud))
        video, truth, tok = _generated(scene, epochs=epochs, seed=seed)
        iou = float(object_iou(video, truth, tok).mean())
        moved = motion_ok(video, tok, direction)
        by_speed.setdefault(speed, []).append((iou, sum(moved) / len(moved)))
        if iou < 0.8:
            worst.append({"caption": world.caption(scene).decode(), "object_iou": round(iou, 3)})
    out: dict[str, Any] = {"captions": sum(len(v) for v in by_speed.values()), "worst": worst}
    for speed, rows in sorted(by_speed.items()):
        out[f"speed{speed}"] = {
            "object_iou": round(sum(a for a, _ in rows) / len(rows), 4),
            "moves_right_way": round(sum(b for _, b in rows) / len(rows), 4),
        }
    return out
