"""`lmpm check PROGRAM --device cuda`: every bundled example is ready for a GPU; a user's model that
mixes devices, or calls .numpy() on a device tensor, is an error naming the program's call and the
user's own line; one that makes the host wait is a warning with that line (simulated on a machine
without a GPU, run on the real device where there is one)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from lmpm.cli import main

ROOT = Path(__file__).resolve().parents[2]
EX = ROOT / "examples"

# every bundled example, as docs run it (small sizes where the default is large)
EXAMPLES = [
    ["gpt.lmpm", "--set", "N=16"],
    ["text.lmpm", "--input", f"Txt={EX / 'text' / 'prompt.txt'}"],
    ["text_free.lmpm", "--input", f"Txt={EX / 'text' / 'prompt.txt'}"],
    ["video.lmpm", "--set", "T=2", "--input", f"Txt={EX / 'video' / 'caption.txt'}"],
    ["video_free.lmpm", "--set", "T=2", "--input", f"Txt={EX / 'video' / 'caption.txt'}"],
    ["sudoku.lmpm", "--input", f"Grid={EX / 'sudoku' / 'puzzle.json'}"],
    ["latent.lmpm", "--input", f"Z={EX / 'latent' / 'z0.npy'}"],
    ["vm.lmpm", "--bind", str(EX / "vm" / "tools.py")],
    [
        "train_bytelm.lmpm",
        "--input",
        f"Corpus={EX / 'train' / 'corpus.npy'}",
        "--input",
        f"Held={EX / 'train' / 'held.npy'}",
    ],
]
HF = ["--bind", str(EX / "hf" / "model.py"), "--tokenizer", f"BPE={EX / 'hf' / 'model'}",
      "--input", f"Txt={EX / 'hf' / 'prompt.txt'}"]  # fmt: skip
HF_ROWS = [*HF[:4], "--input", f"Txt={EX / 'hf' / 'rows.txt'}"]  # a prompt per row
HF_EXAMPLES = [["hf/story.lmpm", *HF], ["hf/story_free.lmpm", *HF], ["hf/rows.lmpm", *HF_ROWS]]
# the Hugging Face example needs the `hf` extra (transformers), which a bare GPU image may lack
HAS_HF = importlib.util.find_spec("transformers") is not None
if HAS_HF:
    EXAMPLES += HF_EXAMPLES


def test_the_list_covers_every_bundled_example() -> None:
    listed = {e[0] for e in EXAMPLES} | {e[0] for e in HF_EXAMPLES}
    assert listed == {p.relative_to(EX).as_posix() for p in EX.rglob("*.lmpm")}


@pytest.mark.parametrize("args", EXAMPLES, ids=[e[0] for e in EXAMPLES])
def test_every_bundled_example_is_ready_for_cuda(
    args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["check", str(EX / args[0]), *args[1:], "--device", "cuda", "--epochs", "2"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert f"{args[0]}: ready for cuda" in err and "error[" not in err, err


PROG = """param N = 6
value G : Token[4] shape Seq(N)
visible G[t] <- G[t-1..t+1]
rule Grow:
  on G[t]
  read {nb = G[t-1..t+1]}
  emit proposal G[t] := Net(nb)
commit G[*] using satisfy(max_constraints_then_score)
"""

MODELS = """import torch
import lmpm

TABLE = torch.arange(8)  # made once, on the CPU


@lmpm.bind("Net")
def net(inputs, *, vocab, **kw):
    nb = inputs["nb"].clamp(min=0)
    if HOW == "mixed":
        nb = TABLE[nb]  # the line a mixed-device error names
    elif HOW == "numpy":
        nb = torch.as_tensor(nb.numpy())
    elif HOW == "sync":
        if nb.sum() > 0:  # the line a host-sync warning names
            nb = nb + 1
    elif HOW == "h2d":
        nb = nb + torch.tensor([1], device=nb.device)  # host memory copied in, every call
    return {"proposal": nb[:, :2] % vocab, "score": torch.zeros(nb.shape[0], 2, device=nb.device)}


HOW = None
"""


def _write(tmp: Path, how: str | None) -> tuple[Path, Path]:
    (tmp / "prog.lmpm").write_text(PROG)
    (tmp / "models.py").write_text(MODELS.replace("HOW = None", f"HOW = {how!r}"))
    return tmp / "prog.lmpm", tmp / "models.py"


@pytest.mark.parametrize(("how", "code", "line"), [("mixed", "G001", 11), ("numpy", "G002", 13)])
def test_a_model_that_fails_on_a_gpu_is_an_error_with_the_users_line(
    how: str, code: str, line: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prog, models = _write(tmp_path, how)
    capsys.readouterr()
    assert main(["check", str(prog), "--bind", str(models), "--device", "cuda"]) == 1
    err = capsys.readouterr().err
    assert f"error[{code}]" in err, err
    assert f"{prog}:7:" in err and "^^^" in err, err  # the program's call, with a caret
    assert f"(at {models}:{line}, in net)" in err, err  # the user's own line
    assert "not ready for cuda" in err and "Traceback" not in err


@pytest.mark.parametrize(("how", "code", "line"), [("sync", "G101", 15), ("h2d", "G105", 18)])
def test_a_model_that_waits_for_the_gpu_is_a_warning_with_the_users_line(
    how: str, code: str, line: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prog, models = _write(tmp_path, how)
    capsys.readouterr()
    assert main(["check", str(prog), "--bind", str(models), "--device", "cuda"]) == 0
    err = capsys.readouterr().err
    # (on a real GPU PyTorch's sync detector reports every wait alike: G101)
    codes = {code, "G101"} if torch.cuda.is_available() else {code}
    assert any(f"warning[{c}]" in err for c in codes), err
    assert f"(at {models}:{line}, in net)" in err, err
    assert "prog.lmpm: ready for cuda" in err


def test_a_device_clean_model_is_ready_without_warnings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prog, models = _write(tmp_path, None)
    capsys.readouterr()
    assert main(["check", str(prog), "--bind", str(models), "--device", "cuda"]) == 0
    err = capsys.readouterr().err
    assert "warning[" not in err and "prog.lmpm: ready for cuda" in err, err


def test_json_lists_the_device_findings(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prog, models = _write(tmp_path, "mixed")
    capsys.readouterr()
    assert main(["check", str(prog), "--bind", str(models), "--device", "cuda", "--json"]) == 1
    out = capsys.readouterr().out
    assert '"code": "G001"' in out and '"line": 7' in out
