"""Bad input never crashes the front end: >= 5,000 mutations of the example programs.

Every mutation goes through the real command path, ``lmpm.cli.main(["check", FILE, "--json"])``
in-process (a sample also through a subprocess): the exit code is 0 or 1, never a traceback or an
internal error; every diagnostic's span lies inside the input; exit 1 comes with an error
diagnostic. The hand-written parser must agree with the lark reference on every text it accepts.
"""

from __future__ import annotations

import io
import json
import random
import re
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from lmpm.cli import main
from lmpm.errors import ParseError
from lmpm.lang import fast
from lmpm.lang.parser import parse_lark

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = [p.read_text() for p in sorted((ROOT / "examples").glob("*.lmpm"))]
SEED = (Path(__file__).with_name("seed_verbatim.lmpm")).read_text()
CORPUS = [*EXAMPLES, SEED]

CHUNKS = 10
PER_CHUNK = 520  # 5,200 mutations in all

_TOKEN = re.compile(r"\w+|\.\.\.|\.\.|<-|:=|[<>=!]=|//[^\n]*|\n[ \t]*|[ \t]+|\S")
_INSERTS = [
    "(",
    ")",
    "[",
    "]",
    "{",
    "}",
    "-",
    "+",
    "*",
    "/",
    "not",
    "in",
    "and",
    "or",
    "when",
    ",",
    "..",
    "...",
    "?",
    "=",
    ":=",
    "<-",
    ":",
    "0",
    "-1",
    "999999999999999999999",
    '"s"',
    '"\\q"',
    "\n",
    "\n  ",
    "\n      ",
    "\t",
    "priority",
    "rule",
    "value",
    "param",
    "N8",
    "N26",
    "Set()",
    "Ñame",
    "变量",
    "x̃",
    "é",
    "\u00a0",
    "\r",
    "\f",
    "\u2028",
    "//",
    "e",
    "prev_frame",
    "*",
]


def _mutate(rng: random.Random, text: str) -> str | bytes:
    kind = rng.randrange(12)
    if kind == 8 and rng.random() > 0.15:
        kind = 0  # 100k-character lines are slow to diagnose; a few dozen are enough
    toks = _TOKEN.findall(text)
    i = rng.randrange(len(toks))
    if kind == 0:
        del toks[i]
    elif kind == 1:
        toks.insert(i, toks[i])
    elif kind == 2:
        j = rng.randrange(len(toks))
        toks[i], toks[j] = toks[j], toks[i]
    elif kind == 3:
        toks.insert(i, rng.choice(_INSERTS))
    elif kind == 4:
        del toks[i : i + rng.randrange(2, 12)]
    elif kind == 5:  # unicode identifiers
        names = sorted({t for t in toks if t.isidentifier()})
        old = rng.choice(names)
        new = rng.choice(["Ñ", "变量", "Δt", "ｘ", "𝓥id", "_", "x_1"]) + old
        toks = [new if t == old else t for t in toks]
    elif kind == 6:  # random bytes (often invalid UTF-8)
        data = bytearray("".join(toks).encode())
        for _ in range(rng.randrange(1, 6)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        return bytes(data)
    elif kind == 7:  # NUL
        toks.insert(i, "\x00")
    elif kind == 8:  # a 100k-character line
        filler = rng.choice(["x", " ", "1", "// ", "é", "a+", "Vid[t], "])
        size = 100_000 if len(filler) == 1 or filler == "// " else 6_000  # many tokens: shorter
        toks.insert(i, filler * (size // len(filler)))
    elif kind == 9:  # deep nesting
        depth = rng.choice([63, 64, 65, 200, 3000])
        toks.insert(
            i, rng.choice(["(" * depth + "t" + ")" * depth, "-" * depth + "t", "not " * depth])
        )
    elif kind == 10:  # truncation
        return "".join(toks)[: rng.randrange(len(text))]
    else:  # two token edits
        return _mutate(rng, _mutate_text(rng, toks))
    return "".join(toks)


def _mutate_text(rng: random.Random, toks: list[str]) -> str:
    i = rng.randrange(len(toks))
    toks = toks[:i] + toks[i + 1 :]
    return "".join(toks)


def _lines(data: bytes) -> list[int]:
    """Length of every line, in the larger of characters and bytes (spans of P007 count bytes)."""
    text = data.decode("utf-8", "replace")
    out = []
    for raw, line in zip(data.split(b"\n"), text.split("\n")):
        out.append(max(len(raw), len(line)))
    return out


def _check_one(path: Path, data: bytes) -> None:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main(["check", str(path), "--json"])
    assert rc in (0, 1), (rc, err.getvalue()[-2000:], data[:300])
    assert "Traceback" not in err.getvalue() and "internal error" not in err.getvalue()
    diags = [json.loads(line) for line in out.getvalue().splitlines() if line.strip()]
    lines = _lines(data)
    for d in diags:
        if "line" not in d:
            continue
        assert 1 <= d["line"] <= len(lines), (d, len(lines))
        assert 1 <= d["col"] <= lines[d["line"] - 1] + 1, (d, lines[d["line"] - 1])
    if rc == 1:
        assert any(d["severity"] == "error" for d in diags), diags
    else:
        assert not any(d["severity"] == "error" for d in diags), diags


def _agree(text: str) -> None:
    """The fast parser accepts a text only if lark parses it to the same AST."""
    if "\x00" in text:
        return
    if not text.endswith("\n"):
        text += "\n"
    try:
        items = tuple(fast.parse_items(text, "f"))
    except fast.Fallback:
        return
    try:
        ref = parse_lark(text, "f").items
    except ParseError as e:  # pragma: no cover - a failure of this test
        pytest.fail(f"fast parser accepted a text lark rejects ({e.code}): {text[:300]!r}")
    try:
        same = ref == items
    except RecursionError:
        return
    assert same, text[:500]


def _cases(chunk: int) -> list[str | bytes]:
    rng = random.Random(20240 + chunk)
    return [_mutate(rng, rng.choice(CORPUS)) for _ in range(PER_CHUNK)]


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_mutations_in_process(chunk: int, tmp_path: Path) -> None:
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 1000))
    for k, case in enumerate(_cases(chunk)):
        data = case if isinstance(case, bytes) else case.encode("utf-8", "surrogatepass")
        path = tmp_path / f"m{k}.lmpm"
        path.write_bytes(data)
        _check_one(path, data)
        if isinstance(case, str):
            _agree(case)


@pytest.mark.parametrize("chunk", range(2))
def test_mutations_through_the_real_cli(chunk: int, tmp_path: Path) -> None:
    cases = _cases(100 + chunk)[:20]
    for k, case in enumerate(cases):
        data = case if isinstance(case, bytes) else case.encode("utf-8", "surrogatepass")
        path = tmp_path / f"m{k}.lmpm"
        path.write_bytes(data)
        res = subprocess.run(
            [sys.executable, "-m", "lmpm.cli", "check", str(path)],
            capture_output=True,
            text=True,
            errors="replace",
            check=False,
        )
        assert res.returncode in (0, 1), res.stderr[-2000:]
        assert "Traceback" not in res.stderr and "internal error" not in res.stderr
        if res.returncode == 1:
            assert re.search(r"error\[[A-Z]\d{3}\]", res.stderr), res.stderr[-2000:]
        else:
            assert ": ok" in res.stderr


def test_fast_parser_agrees_with_lark_on_the_corpus() -> None:
    for text in CORPUS:
        assert tuple(fast.parse_items(text, "f")) == parse_lark(text, "f").items


@pytest.mark.parametrize(
    "text",
    [
        "param N = 4   \nvalue A : Token[4] shape Seq(N) clock Lamport\t \n",  # trailing blanks
        "param N = 4\n   \n\t\nvalue A : Token[4] shape Seq( N )\tclock Lamport\n",  # blank lines
        "param N = 4  // a comment after blanks\n  // an indented comment line\n",
        "param\fN = 4\n",  # a form feed inside a line: a blank
        "\fparam N = 4\n",  # ... at a line's start: the fast parser declines
        "rule R:\n  on A[t]\n\t\n  emit proposal A[t] := M(k=1)\n",
    ],
)
def test_fast_parser_agrees_with_lark_on_blanks(text: str) -> None:
    if text.startswith("\f"):
        with pytest.raises(fast.Fallback):
            fast.parse_items(text, "f")
        return
    assert tuple(fast.parse_items(text, "f")) == parse_lark(text, "f").items
