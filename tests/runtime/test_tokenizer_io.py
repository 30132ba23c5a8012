"""Vocabularies bound to tokenizers (`--tokenizer NAME=PATH`, ``tokenizers=``): the tokenizer sizes
`Token[NAME]`, encodes text inputs, writes text outputs and gives `lmpm trace` its strings, from the
run directory's own copy; bad bindings are coded errors. A short token input fills the first cells."""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

import numpy as np
import pytest

import lmpm
from lmpm.cli import main

tokenizers = pytest.importorskip("tokenizers")

LINES = [
    "a red square moves left under a blue sky.",
    "a blue circle slides up on the sand.",
    "the green bar goes down over green grass.",
] * 4

PROG = """
param N = 16
value Txt : Token[BPE] shape Seq(N)
value Plan : Event shape Set()
visible Txt[t] <- Txt[0..t-1] when t > 0
rule Gen:
  on Txt[t]
  read {ctx = Txt[0..t-1]}
  emit proposal Txt[t] := Uniform(ctx, k=4)
constraint Few: require Txt[t] in Set(0..40) priority 10
commit Txt[*] using satisfy(max_constraints_then_score)
rule Schedule:
  on Plan
  emit proposal Plan := SampleTiles(strategy="raster", k=1)
"""


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE tokenizer trained on a few lines, saved as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(LINES, trainer)
    d = tmp_path_factory.mktemp("tok")
    tok.save(str(d / "tokenizer.json"))
    return d


@pytest.fixture
def prog(tmp_path: Path) -> Path:
    p = tmp_path / "p.lmpm"
    p.write_text(PROG)
    return p


def _tok(tok_dir: Path) -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_file(str(tok_dir / "tokenizer.json"))


def test_check_sizes_the_vocabulary_from_the_tokenizer(
    prog: Path, tok_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["check", str(prog)]) == 0
    err = capsys.readouterr().err
    assert "warning[W209]" in err and "--tokenizer BPE=" in err  # unsized: says how to size it
    assert "W208" not in err  # (no verdict against a probe size)
    assert main(["check", str(prog), "--tokenizer", f"BPE={tok_dir}"]) == 0
    err = capsys.readouterr().err
    assert "warning" not in err and "ok" in err, err
    size = _tok(tok_dir).get_vocab_size()
    prog.write_text(PROG.replace("Set(0..40)", f"Set(0..{size + 2})"))
    assert main(["check", str(prog), "--tokenizer", f"BPE={tok_dir / 'tokenizer.json'}"]) == 0
    err = capsys.readouterr().err
    assert "warning[W208]" in err and f"(0..{size - 1})" in err, err


def test_text_input_is_encoded_and_outputs_are_written_as_text(
    prog: Path, tok_dir: Path, tmp_path: Path
) -> None:
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("a red square moves\n")  # (the file's final newline is not the prompt's)
    out = tmp_path / "run"
    rc = main(["run", str(prog), "--tokenizer", f"BPE={tok_dir}", "--input", f"Txt={prompt}",
               "--out", str(out), "--until", "stable", "--quiet"])  # fmt: skip
    assert rc == 0
    ids = _tok(tok_dir).encode("a red square moves").ids
    got = json.loads((out / "Txt.json").read_text())
    assert got[: len(ids)] == ids and None not in got  # the prompt, then the model's tokens
    text = (out / "Txt.txt").read_text()
    assert text.startswith("a red square moves") and text == _tok(tok_dir).decode(got) + "\n"
    copy = out / "tokenizers" / "BPE.json"
    assert copy.read_text() == (tok_dir / "tokenizer.json").read_text()
    conn = sqlite3.connect(out / "lmpm.db")
    (meta,) = conn.execute("SELECT value FROM meta WHERE key = 'tokenizers'").fetchone()
    conn.close()
    assert json.loads(meta) == {"BPE": ["Txt"]}


def test_trace_shows_token_strings_from_the_run_directory_alone(
    prog: Path, tok_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    moved = tmp_path / "tok"
    shutil.copytree(tok_dir, moved)
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("a blue circle")
    out = tmp_path / "run"
    rc = main(["run", str(prog), "--tokenizer", f"BPE={moved}", "--input", f"Txt={prompt}",
               "--out", str(out), "--epochs", "3", "--trace", "cells", "--quiet"])  # fmt: skip
    assert rc == 0
    shutil.rmtree(moved)  # a run received elsewhere: only its directory
    n = len(_tok(tok_dir).encode("a blue circle").ids)
    capsys.readouterr()
    assert main(["trace", str(out), "--cell", f"Txt[{n}]", "--json"]) == 0
    story = json.loads(capsys.readouterr().out)
    tok = _tok(tok_dir)
    (commit,) = story["commits"]
    assert commit["token"] == tok.decode([commit["payload"]])
    cands = [c for a in story["attempts"] for c in a["candidates"] if c["payload"] is not None]
    assert cands and all(c["token"] == tok.decode([c["payload"]]) for c in cands)
    assert main(["trace", str(out), "--cell", "Txt[0]"]) == 0
    assert repr(tok.decode([tok.encode("a blue circle").ids[0]])) in capsys.readouterr().out
    assert main(["trace", str(out), "--json"]) == 0
    texts = json.loads(capsys.readouterr().out)["texts"]
    assert texts["Txt"].startswith("a blue circle")


def test_resume_keeps_the_tokenizer_of_the_run_directory(
    prog: Path, tok_dir: Path, tmp_path: Path
) -> None:
    moved = tmp_path / "tok.json"
    shutil.copy(tok_dir / "tokenizer.json", moved)
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("the green bar")
    out = tmp_path / "run"
    rc = main(["run", str(prog), "--tokenizer", f"BPE={moved}", "--input", f"Txt={prompt}",
               "--out", str(out), "--epochs", "2", "--quiet"])  # fmt: skip
    assert rc == 0
    moved.unlink()
    assert main(["run", "--resume", str(out), "--epochs", "20", "--quiet"]) == 0
    assert (out / "Txt.txt").read_text().startswith("the green bar")
    assert -1 not in np.load(out / "Txt.npy").tolist()
    assert main(["render", str(out), "--out", str(tmp_path / "pics")]) == 0  # text, not a grid
    assert (tmp_path / "pics" / "Txt.txt").read_text() == (out / "Txt.txt").read_text()


def test_python_api_binds_tokenizers(prog: Path, tok_dir: Path, tmp_path: Path) -> None:
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("a red square")
    run = lmpm.compile(prog).runner(
        tokenizers={"BPE": tok_dir / "tokenizer.json"},
        inputs={"Txt": prompt},
        run_dir=tmp_path / "run",
    )
    run.run(20, until_stable=True)
    files = run.finish()
    assert tmp_path / "run" / "Txt.txt" in files
    assert (tmp_path / "run" / "tokenizers" / "BPE.json").is_file()
    assert run.params["BPE"] == _tok(tok_dir).get_vocab_size()


@pytest.mark.parametrize(
    ("flags", "code", "text"),
    [
        (["--tokenizer", "BPE=nowhere.json"], "B090", "no such file"),
        (["--tokenizer", "BPE={bad}"], "B091", "is not a tokenizer"),
        (["--tokenizer", "BPE={tok}", "--tokenizer", "BPE={tok}"], "B092", "bound twice"),
        (["--tokenizer", "BPE={tok}", "--set", "BPE=10"], "B092", "which has"),
        (["--tokenizer", "Q={tok}"], "B093", "no value of the program is a `Token[Q]`"),
        (["--tokenizer", "Byte={tok}"], "B093", "built-in vocabulary of bytes"),
        (["--tokenizer", "BPE"], "usage error", "NAME=PATH"),
    ],
)
def test_bad_tokenizer_bindings_are_coded_errors(
    flags: list[str],
    code: str,
    text: str,
    prog: Path,
    tok_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"model": ')
    flags = [f.format(bad=bad, tok=tok_dir) for f in flags]
    for command in (["check", str(prog)], ["run", str(prog), "--out", str(tmp_path / "r")]):
        assert main([*command, *flags]) != 0
        err = capsys.readouterr().err
        assert (
            (f"[{code}]" if code[0].isupper() else code) in err
            and text in err
            and "Traceback" not in err
        ), err
    assert not (tmp_path / "r").exists()


def test_text_for_an_unbound_vocabulary_says_how_to_bind_one(
    prog: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("a red square")
    rc = main(["run", str(prog), "--set", "BPE=50", "--input", f"Txt={prompt}",
               "--out", str(tmp_path / "r")])  # fmt: skip
    assert rc == 1
    err = capsys.readouterr().err
    assert "error[R008]" in err and "--tokenizer NAME=tokenizer.json" in err, err


def test_a_run_without_a_size_for_the_vocabulary_says_how_to_give_one(
    prog: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["run", str(prog), "--out", str(tmp_path / "r")]) == 1
    err = capsys.readouterr().err
    assert "error[B003]" in err and "--tokenizer BPE=tokenizer.json" in err, err
    assert "--set BPE=V" in err


def test_text_longer_than_the_value_is_refused(
    prog: Path, tok_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(" ".join(LINES))
    rc = main(["run", str(prog), "--tokenizer", f"BPE={tok_dir}", "--input", f"Txt={prompt}",
               "--out", str(tmp_path / "r")])  # fmt: skip
    assert rc == 1
    err = capsys.readouterr().err
    assert "error[R009]" in err and "tokens of BPE; the value holds 16" in err, err


SHORT = """
param N = 6
value T : Token[5] shape Seq(N)
value G : Token[5] shape Grid2D(2, 4)
visible T[t] <- T[0..t-1] when t > 0
rule Gen:
  on T[t]
  read {ctx = T[0..t-1]}
  emit proposal T[t] := RandomTokens(ctx, k=2)
"""


@pytest.mark.parametrize(
    ("value", "name", "data", "expected"),
    [
        ("T", "t.npy", np.array([3, 1]), [3, 1, -1, -1, -1, -1]),
        ("T", "t.json", [3, None, 2], [3, -1, 2, -1, -1, -1]),
        ("G", "g.npy", np.array([[1], [2]]), [[1, -1, -1, -1], [2, -1, -1, -1]]),
        ("G", "g.json", [[1, 2], [4]], [[1, 2, -1, -1], [4, -1, -1, -1]]),
    ],
)
def test_a_short_token_input_fills_the_first_cells(
    value: str, name: str, data: object, expected: list[object], tmp_path: Path
) -> None:
    prog = tmp_path / "p.lmpm"
    prog.write_text(SHORT)
    path = tmp_path / name
    if name.endswith(".npy"):
        np.save(path, data, allow_pickle=False)
    else:
        path.write_text(json.dumps(data))
    run = lmpm.compile(prog).runner(inputs={value: path})  # the state before epoch 0
    assert run.outputs()[value].tolist() == expected


def test_a_token_input_too_long_says_a_prompt_may_be_shorter(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prog = tmp_path / "p.lmpm"
    prog.write_text(SHORT)
    path = tmp_path / "t.npy"
    np.save(path, np.zeros(9, dtype=np.int64), allow_pickle=False)
    rc = main(["run", str(prog), "--input", f"T={path}", "--out", str(tmp_path / "r")])
    assert rc == 1
    err = capsys.readouterr().err
    assert "error[R004]" in err and "a prompt of up to 6 tokens" in err, err


GRID = """
value Txt : Token[BPE] shape Grid2D(3, 8)
visible Txt[b, t] <- Txt[b, 0..t-1] when t > 0
rule Gen:
  on Txt[b, t]
  read {ctx = Txt[b, 0..t-1]}
  emit proposal Txt[b, t] := Uniform(ctx)
"""


def test_a_grid_of_rows_takes_a_prompt_per_line(tok_dir: Path, tmp_path: Path) -> None:
    prog = tmp_path / "g.lmpm"
    prog.write_text(GRID)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red square\nthe green bar goes\n")  # two prompts for three rows
    run = lmpm.compile(prog).runner(tokenizers={"BPE": tok_dir}, inputs={"Txt": prompts})
    got = run.outputs()["Txt"].tolist()
    tok = _tok(tok_dir)
    for row, text in zip(got, ["a red square", "the green bar goes", ""], strict=True):
        ids = tok.encode(text).ids
        assert row == ids + [-1] * (8 - len(ids))
    prompts.write_text("a\nb\nc\nd\n")
    with pytest.raises(lmpm.errors.InputError) as err:
        lmpm.compile(prog).runner(tokenizers={"BPE": tok_dir}, inputs={"Txt": prompts})
    assert err.value.code == "R009" and "4 lines; the value holds 3 rows" in str(err.value)


def test_compile_takes_the_tokenizers_as_run_takes_them(tok_dir: Path, tmp_path: Path) -> None:
    """``lmpm.compile(tokenizers=...)`` is `--tokenizer`: the size binds the parameter, the run
    binds the tokenizer, a name no value uses is B093 (as `lmpm check --tokenizer`)."""
    size = _tok(tok_dir).get_vocab_size()
    prompts = tmp_path / "prompt.txt"
    prompts.write_text("a red square")
    prog = lmpm.compile(text=GRID, tokenizers={"BPE": tok_dir})
    assert prog.params["BPE"] == size and prog.tokenizers == {"BPE": str(tok_dir)}
    run = prog.runner(inputs={"Txt": prompts})  # the prompt is text: the tokenizer encodes it
    ids = _tok(tok_dir).encode("a red square").ids
    assert run.outputs()["Txt"].tolist()[0][: len(ids)] == ids
    run.close()
    path = tmp_path / "g.lmpm"
    path.write_text(GRID)
    assert lmpm.compile(path, tokenizers={"BPE": tok_dir / "tokenizer.json"}).params == {
        "BPE": size
    }
    with pytest.raises(lmpm.BindError) as err:
        lmpm.compile(path, tokenizers={"GPT2": tok_dir})
    assert err.value.code == "B093"
