"""Bad input, in every input form, is an InputError naming the value, the bad entry and the expected
form; bad flags are usage errors before anything is allocated."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from lmpm.cli import main

PROG = """
param N = 4
value T : Token[5] shape Seq(N)
value X : Float shape Seq(N)
visible T[t] <- T[0..t-1] when t > 0
rule Gen:
  on T[t]
  read {ctx = T[0..t-1]}
  emit proposal T[t] := RandomTokens(ctx, k=2)
"""


@pytest.fixture
def prog(tmp_path: Path) -> Path:
    p = tmp_path / "p.lmpm"
    p.write_text(PROG)
    return p


def _write(path: Path, data: object) -> Path:
    if path.suffix == ".npy":
        np.save(path, data, allow_pickle=False)
    elif path.suffix == ".pt":
        torch.save(data, path)
    else:
        path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def _run(prog: Path, tmp_path: Path, *extra: str) -> int:
    out = tmp_path / "run"
    return main(["run", str(prog), "--epochs", "2", "--out", str(out), "--quiet", *extra])


CASES = [
    # (value, file, contents, code, text in the message)
    ("T", "t.npy", np.array([1, 2, 3, 4], dtype=np.complex64), "R013", "is complex"),
    ("T", "t.pt", torch.tensor([1, 2, 3, 4], dtype=torch.complex64), "R013", "is complex"),
    ("X", "x.npy", np.array([1.0, 2.0, 3.0, 4.0]) + 1j, "R013", "is complex"),
    ("T", "t.npy", np.array(["a", "b", "c", "d"]), "R013", "dtype <U1"),
    ("T", "t.npy", np.array([1.0, np.inf, 0, 0]), "R014", "has inf at cell 1"),
    ("X", "x.npy", np.array([1.0, 0, -np.inf, 0]), "R014", "has -inf at cell 2"),
    ("X", "x.json", "[1, 2, Infinity, 4]", "R014", "has inf at cell 2"),
    ("T", "t.npy", np.array([1e30, 0, 0, 0]), "R006", "token 1e+30 at cell 0"),
    ("T", "t.json", [0, 10**30, 0, 0], "R006", "token 1e+30 at cell 1"),
    ("T", "t.json", [0, 0, 10**400, 0], "R015", "401-digit integer at cell 2"),
    ("X", "x.npy", np.array([1e39, 0, 0, 0]), "R015", "beyond float32"),
    ("T", "t.npy", np.array([0, -2, 1, 1]), "R016", "negative token -2 at cell 1"),
    ("T", "t.pt", torch.tensor([0, 1, -7, 1]), "R016", "negative token -7 at cell 2"),
    ("T", "t.json", [0, 1, 1, -2], "R016", "negative token -2 at cell 3"),
    ("T", "t.npy", np.array([0.5, 1, 1, 1]), "R005", "non-integer 0.5 at cell 0"),
    ("T", "t.npy", np.array([0, 1, 2, 5]), "R006", "token 5 at cell 3"),
    ("T", "t.npy", np.array([[0, 1], [2, 3]]), "R004", "shape [2, 2]"),
    ("T", "t.npy", np.array([0, 1, 2, 2**64 - 1], dtype=np.uint64), "R015", "at cell 3"),
]


@pytest.mark.parametrize(("value", "name", "data", "code", "text"), CASES)
def test_bad_inputs_name_the_value_and_the_expected_form(
    value: str,
    name: str,
    data: object,
    code: str,
    text: str,
    prog: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = _write(tmp_path / name, data)
    assert _run(prog, tmp_path, "--input", f"{value}={path}") == 1
    err = capsys.readouterr().err
    assert f"error[{code}]" in err and f"`{value}`" in err and text in err, err
    assert ("expected" in err or "vocabulary [0, 5)" in err) and "internal error" not in err
    assert not (tmp_path / "run").exists()  # refused before the run directory was made


def test_minus_one_and_null_mean_unset_in_every_form(
    prog: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for name, data in [
        ("a.npy", np.array([3, -1, 2, -1])),
        ("b.npy", np.array([3.0, -1.0, 2.0, np.nan])),
        ("c.json", [3, None, 2, -1]),
        ("d.pt", torch.tensor([3, -1, 2, -1])),
    ]:
        path = _write(tmp_path / name, data)
        out = tmp_path / f"run-{name}"
        rc = main(["run", str(prog), "--epochs", "1", "--trace", "off", "--out", str(out),
                   "--input", f"T={path}", "--quiet"])  # fmt: skip
        assert rc == 0, capsys.readouterr().err
        got = np.load(out / "T.npy")
        assert got[0] == 3 and got[2] == 2, name  # the given tokens are committed as given


def test_duplicate_input_is_an_error(
    prog: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = _write(tmp_path / "a.json", [0, 1, 2, 3])
    b = _write(tmp_path / "b.json", [3, 2, 1, 0])
    assert _run(prog, tmp_path, "--input", f"T={a}", "--input", f"T={b}") == 2
    err = capsys.readouterr().err
    assert "--input T is given twice" in err and str(a) in err and str(b) in err


@pytest.mark.parametrize(
    ("flags", "text"),
    [
        (["--epochs", "99999999999999999999"], "--epochs must be between 1 and 2,147,483,647"),
        (["--epochs", "0"], "--epochs must be between 1"),
        (["--seed", "99999999999999999999"], "--seed must fit in 64 bits"),
        (["--set", "N=1000000000000"], "`T`: 1,000,000,000,000"),
        (["--set", "N=99999999999999999999999"], "dimensions must be between 1 and"),
    ],
)
def test_out_of_range_flags_are_refused_before_allocating(
    flags: list[str], text: str, prog: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(["run", str(prog), "--out", str(tmp_path / "run"), "--quiet", *flags])
    err = capsys.readouterr().err
    assert rc in (1, 2) and text in err, err
    assert "internal error" not in err
    assert not (tmp_path / "run").exists()
