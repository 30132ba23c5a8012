"""The video program on the embedded models, at a small size: hard constraints hold, the same seed
gives the same video; the model's input contract; the training script's smoke test."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from lmpm.models import video, world
from lmpm.runtime.session import Run

ROOT = Path(__file__).resolve().parents[2]
VIDEO = ROOT / "examples" / "video.lmpm"
CAPTION = ROOT / "examples" / "video" / "caption.txt"
SMALL = {"T": 2, "W": 16, "H": 16, "x1": 4, "x2": 11, "y1": 8, "y2": 13}


@pytest.fixture(scope="module")
def patch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    scene = world.render(world.demo_scene(2, 16, 16)).numpy()
    p = np.full_like(scene, -1)
    xs, ys = slice(SMALL["x1"], SMALL["x2"] + 1), slice(SMALL["y1"], SMALL["y2"] + 1)
    p[:, xs, ys] = scene[:, xs, ys]
    path = tmp_path_factory.mktemp("video") / "patch.npy"
    np.save(path, p)
    return path


def _run(patch: Path, seed: int, epochs: int = 8) -> dict[str, np.ndarray]:
    run = Run.from_file(
        VIDEO, params=SMALL, inputs={"Txt": str(CAPTION), "Vid": str(patch)}, seed=seed
    )
    run.run(epochs)
    return {k: np.asarray(v) for k, v in run.outputs().items()}


def test_video_program_hard_constraints_and_determinism(patch: Path) -> None:
    out = _run(patch, seed=1)
    vid, given = out["Vid"], np.load(patch)
    locked = given >= 0
    assert locked.sum() == 2 * 8 * 6 and np.array_equal(vid[locked], given[locked])  # HardLock
    assert (vid >= 0).all()  # every cell committed (red-black: 2 epochs cover the grid)
    sky = world.region("sky", shape=(16, 16)).numpy()
    blue = np.isin(vid[:, sky], world.palette("blue-ish"))
    assert blue.mean() > 0.9  # TextPaint: the model offers blue for almost every sky cell
    assert (out["Coarse"] >= 0).all()
    again = _run(patch, seed=1)
    assert all(np.array_equal(out[k], again[k]) for k in out)
    other = _run(patch, seed=2)
    assert not np.array_equal(out["Vid"], other["Vid"])


def test_model_contract() -> None:
    n = 5
    inputs = {
        "cells": torch.arange(n),
        "coords": torch.tensor([[0, 1, 2], [1, 3, 4], [0, 0, 0], [1, 5, 20], [0, 2, 30]]),
        "neighbors": torch.randint(0, 16, (n, 8)),
        "neighbors_mask": torch.rand(n, 8) < 0.5,
        "prev_frame": torch.randint(0, 16, (n, 1)),
        "prev_frame_mask": torch.tensor([[False], [True], [False], [True], [False]]),
        "txt": torch.tensor(list(b"a red square moves left".ljust(32, b" ")))[None].expand(n, 32),
        "txt_mask": torch.ones(1, 32, dtype=torch.bool).expand(n, 32),
        "coarse": torch.randint(0, 16, (n, 1)),
        "coarse_mask": torch.ones(n, 1, dtype=torch.bool),
    }
    out = video.local_gen(inputs, vocab=16)["logits"]
    assert out.shape == (n, 16) and torch.isfinite(out).all()
    prop = torch.tensor([[0, 1]] * n)
    score = video.model_score({**inputs, "proposal": prop})
    assert score.shape == (n, 2) and torch.allclose(score.float(), out.gather(1, prop), atol=1e-6)
    k2 = video.local_gen(inputs, vocab=16, k=3)["logits"]
    assert k2.shape == (n, 3, 16)
    c = video.coarse_gen({k: inputs[k] for k in ("cells", "coords", "txt", "txt_mask")}, vocab=16)
    assert c["logits"].shape == (n, 16)


def test_train_video_smoke(tmp_path: Path) -> None:
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "train_video.py"),
            "--steps",
            "3",
            "--scenes",
            "16",
            "--heldout",
            "4",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    metrics = json.loads(r.stdout.strip().splitlines()[-1])
    assert metrics["steps"] == 3 and 0 <= metrics["accuracy_unset0"] <= 1
    gen = metrics["generation_heldout"]  # generated with the weights just written
    assert len(gen["captions"]) == 4 and 0 <= gen["object_iou"] <= 1
    assert all(
        any(c in cap and d in cap for cap in gen["captions"]) for c, d in world.HELDOUT_PAIRS
    )
    assert {p.name for p in tmp_path.iterdir()} >= {"localgen.safetensors", "coarsegen.safetensors"}


def test_model_alone_draws_the_object_of_a_heldout_caption() -> None:
    # "a yellow circle moves right ...": yellow + right never occurs in training
    from lmpm.models.training import generate_video, motion_ok, object_iou

    assert ("yellow", "right") in world.HELDOUT_PAIRS
    vid = generate_video(world.HELDOUT_CAPTION + b"\n", seed=0)
    truth = world.render(world.heldout_scene())
    yellow = world.NAMES.index("yellow")
    shapes = torch.isin(vid, torch.tensor(world.palette("shapes")))
    assert (vid[shapes] == yellow).float().mean() > 0.9  # the caption's colour, not another
    assert object_iou(vid, truth, yellow).mean() > 0.8  # where the caption puts it, frame by frame
    assert motion_ok(vid, yellow, "right") == [True, True, True]  # and it moves the caption's way
    # and the cloud the caption asks for: white in the sky band (what TextPaint overrules)
    sky = world.region("sky", shape=(32, 32))
    assert (vid[:, sky] == world.NAMES.index("white")).sum() >= 8


def test_training_draws_its_cells_where_the_object_passes() -> None:
    from lmpm.models.training import _focus_cells

    w = world.generate(8, 1, split="train")
    videos = w.videos.reshape(8, -1)
    shapes = torch.tensor(world.palette("shapes"))
    passes = torch.isin(videos.reshape(8, 4, -1), shapes).any(1, keepdim=True).expand(-1, 4, -1)
    passes = passes.reshape(8, -1)
    share = passes.float().mean()  # the object's columns and rows: a few % of the video
    g = torch.Generator().manual_seed(0)
    focused = _focus_cells(g, videos, 4, 4096, 20.0)
    uniform = _focus_cells(g, videos, 4, 4096, 0.0)
    hit = passes.gather(1, focused).float().mean()
    assert share < 0.1 and hit > 0.4  # weight 21 vs 1: most cells drawn where the object passes
    assert abs(passes.gather(1, uniform).float().mean() - share) < 0.03  # focus 0: uniform
