"""The bundled Hugging Face example (examples/hf/): its model loads offline from the committed
directory, its tokenizer sizes `Token[BPE]`, and its constraint NoRed changes what the model writes
(the free program writes "red", the constrained one never does); scripts/train_hf.py writes a
directory `from_pretrained` loads (a smoke run)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lmpm.cli import main

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
HF = ROOT / "examples" / "hf"


def test_the_committed_model_is_small_and_loads_offline() -> None:
    files = {p.name for p in (HF / "model").iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= files
    assert (HF / "model" / "model.safetensors").stat().st_size < 5_000_000
    model = transformers.AutoModelForCausalLM.from_pretrained(HF / "model", local_files_only=True)
    tok = transformers.AutoTokenizer.from_pretrained(HF / "model", local_files_only=True)
    assert model.config.vocab_size == len(tok)


def test_check_knows_the_vocabulary_from_the_tokenizer(capsys: pytest.CaptureFixture[str]) -> None:
    for prog in ("story.lmpm", "story_free.lmpm"):
        args = ["check", str(HF / prog), "--strict", "--bind", str(HF / "model.py")]
        assert main([*args, "--tokenizer", f"BPE={HF / 'model'}"]) == 0
        err = capsys.readouterr().err
        assert "warning" not in err and "ok" in err, err


@pytest.mark.slow
def test_the_constraint_keeps_red_out_of_what_the_model_writes(tmp_path: Path) -> None:
    texts = {}
    for prog in ("story_free.lmpm", "story.lmpm"):
        out = tmp_path / prog
        rc = main(["run", str(HF / prog), "--bind", str(HF / "model.py"),
                   "--tokenizer", f"BPE={HF / 'model'}", "--input", f"Txt={HF / 'prompt.txt'}",
                   "--epochs", "14", "--out", str(out), "--quiet"])  # fmt: skip
        assert rc == 0
        texts[prog] = (out / "Txt.txt").read_text()
    prompt = (HF / "prompt.txt").read_text()
    free, constrained = (texts[p].removeprefix(prompt) for p in ("story_free.lmpm", "story.lmpm"))
    assert " red" in free  # the model alone writes a red shape within 14 tokens
    assert "red" not in constrained.rstrip("_\n")
    assert texts["story.lmpm"].startswith(prompt)


@pytest.mark.slow
def test_train_hf_writes_a_directory_from_pretrained_loads(tmp_path: Path) -> None:
    out = tmp_path / "model"
    res = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "train_hf.py"),
            "--steps",
            "2",
            "--rows",
            "40",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    metrics = json.loads(res.stdout.strip().splitlines()[-1])
    assert metrics["steps"] == 2 and metrics["vocab"] > 256
    model = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert model.config.vocab_size == metrics["vocab"]
