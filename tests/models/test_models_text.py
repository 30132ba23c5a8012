"""ByteLM: the mask comes from the program, no NaN on the empty row, flex == SDPA, the text program
runs and honours its constraint, deterministically; the training script's smoke test."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from lmpm.models import text
from lmpm.runtime.session import Run

ROOT = Path(__file__).resolve().parents[2]
TEXT = ROOT / "examples" / "text.lmpm"
PROMPT = ROOT / "examples" / "text" / "prompt.txt"
ALLOWED = set(range(97, 123)) | set(b" ,.")


def test_mask_is_the_programs_plus_the_diagonal() -> None:
    m = text.program_mask(6)
    assert m.int().tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 0],
        [1, 1, 1, 1, 1, 1],
    ]


def test_no_nan_and_causal() -> None:
    torch.manual_seed(0)
    model = text.ByteLM(d=32, layers=2, heads=4, max_len=16).eval()
    x = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        a = model(x)
        y = x.clone()
        y[:, 9:] = torch.randint(0, 256, (2, 7))  # change the future of position 9
        b = model(y)
    assert torch.isfinite(a).all()
    assert torch.allclose(a[:, :10], b[:, :10], atol=1e-5)  # row t sees Txt[0..t-1] only
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_flex_attention_matches_sdpa() -> None:
    torch.manual_seed(1)
    model = text.ByteLM(d=32, layers=1, heads=2, max_len=16).eval()
    x = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        assert torch.allclose(model(x), model(x, attention="flex"), atol=1e-5)


def _run(tmp: Path, seed: int, n: int = 40) -> np.ndarray:
    run = Run.from_file(TEXT, params={"N": n}, inputs={"Txt": str(PROMPT)}, seed=seed)
    res = run.run()
    assert res.stable
    return np.asarray(run.outputs()["Txt"])


def test_text_program_honours_constraint_and_is_deterministic(tmp_path: Path) -> None:
    out = _run(tmp_path, seed=3)
    prompt = PROMPT.read_bytes()
    assert bytes(out[: len(prompt)].tolist()) == prompt  # inputs are never reopened
    gen = out[len(prompt) :].tolist()
    assert len(gen) == 40 - len(prompt) and all(b in ALLOWED for b in gen)
    assert np.array_equal(out, _run(tmp_path, seed=3))


@pytest.mark.parametrize(
    ("how", "steps"),
    [(["--plain", "--steps", "3"], 3), (["--workers", "1", "--epochs", "2", "--inner", "3"], 6)],
)
def test_train_text_smoke(tmp_path: Path, how: list[str], steps: int) -> None:
    """The plain loop, and training through LMPM (examples/train_bytelm.lmpm)."""
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "train_text.py"), *how, "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    metrics = json.loads(r.stdout.strip().splitlines()[-1])
    assert metrics["steps"] == steps and metrics["heldout_bits_per_byte"] > 0
    assert (tmp_path / "bytelm.safetensors").stat().st_size < 5_000_000


@pytest.mark.parametrize("name", ["bytelm", "localgen", "coarsegen"])
def test_committed_weights_are_small(name: str) -> None:
    p = ROOT / "src" / "lmpm" / "models" / "weights" / f"{name}.safetensors"
    assert p.is_file() and p.stat().st_size <= 5_000_000


def test_pick_top_proposes_the_k_best_distinct_bytes() -> None:
    prompt = torch.tensor(list(b"a red square moves left. "), dtype=torch.long)
    n = prompt.numel()
    inputs = {
        "cells": torch.tensor([n]),
        "context": prompt[None, :],
        "context_mask": torch.ones(1, n, dtype=torch.bool),
    }
    logp = text.next_byte_logp(inputs)
    top = text.byte_lm(inputs, k=8, pick="top")["proposal"]
    assert top.shape == (1, 8) and len(set(top[0].tolist())) == 8
    assert top[0].tolist() == logp[0].argsort(descending=True)[:8].tolist()
    with pytest.raises(ValueError, match="unknown pick"):
        text.byte_lm(inputs, k=8, pick="best")
