"""Vocabularies bound to tokenizers: `Token[NAME]` values that read and write text.

The NAME of ``Token[NAME]`` is bound to a tokenizer with ``--tokenizer NAME=PATH`` (`lmpm run`,
`lmpm check`) or ``tokenizers={"NAME": PATH}`` (Python API): PATH is a ``tokenizer.json`` of the
``tokenizers`` library, or a directory holding one (a ``transformers`` model directory). The
binding gives the vocabulary its size (the parameter NAME; a ``--set NAME=V`` or a declared default
may make it larger, for a model whose vocabulary is padded past its tokenizer's), lets ``--input``
take text (encoded with it), writes ``NAME.txt`` beside each output of such a value, and makes
`lmpm trace` show token strings. A copy of the tokenizer goes into the run directory
(``RUN_DIR/tokenizers/NAME.json``): a run read elsewhere shows its strings offline. That copy is
data: the ``tokenizers`` library parses it as JSON; nothing in it is ever executed.

>>> from pathlib import Path
>>> import tempfile
>>> from tokenizers import Tokenizer, models, pre_tokenizers, trainers
>>> tok = Tokenizer(models.BPE())
>>> tok.pre_tokenizer = pre_tokenizers.Whitespace()
>>> tok.train_from_iterator(["a red square", "a blue sky"], trainers.BpeTrainer(show_progress=False))
>>> path = Path(tempfile.mkdtemp()) / "tokenizer.json"
>>> tok.save(str(path))
>>> v = load_tokenizer("BPE", path)
>>> v.decode(v.encode("a red sky")) == "a red sky"
True
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lmpm.errors import BindError, RunDirError
from lmpm.ir.eval import EvalError, evaluate
from lmpm.ir.nodes import DType, Program
from lmpm.runtime.runfiles import PLAIN_NAME, folder, is_plain_file, read_file, write_file

TOKENIZER_DIR = "tokenizers"  # RUN_DIR/tokenizers/NAME.json: the run's copies
TOKENIZER_FILE = "tokenizer.json"  # what a directory given as PATH must hold

MSG_NO_LIBRARY = (
    "--tokenizer {name}=...: binding a tokenizer needs the `tokenizers` library, which is not "
    "installed"
)


@dataclass(frozen=True, slots=True)
class Vocabulary:
    """A vocabulary name bound to a tokenizer."""

    name: str  # the NAME of Token[NAME]
    path: Path  # the tokenizer.json it was read from
    size: int  # token ids 0..size-1 (added tokens included)
    tokenizer: Any  # tokenizers.Tokenizer
    source: str  # the tokenizer.json text (what the run directory keeps)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, without the special tokens a post-processor would add."""
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Iterable[int]) -> str:
        """The text of ``ids`` (special tokens kept); an id past the tokenizer (a padded model
        vocabulary) reads as ``<id>``."""
        out: list[str] = []
        run: list[int] = []
        for i in ids:
            if 0 <= i < self.size:
                run.append(int(i))
                continue
            if run:
                out.append(self.tokenizer.decode(run, skip_special_tokens=False))
                run = []
            out.append(f"<{int(i)}>")
        if run:
            out.append(self.tokenizer.decode(run, skip_special_tokens=False))
        return "".join(out)

    def token(self, i: int) -> str:
        """One token's text, as it reads in the output (``<id>`` past the tokenizer)."""
        return self.decode([i])


def load_tokenizer(name: str, path: str | Path) -> Vocabulary:
    """The tokenizer at ``path`` (a tokenizer.json, or a directory holding one) for vocabulary
    ``name``. A missing file is B090, one the library cannot read B091, no library B094."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise BindError(
            MSG_NO_LIBRARY.format(name=name),
            code="B094",
            hint="install the extra: pip install 'lmpm[hf]' (or pip install tokenizers)",
        ) from None
    p = Path(path)
    file = p / TOKENIZER_FILE if p.is_dir() else p
    if not file.is_file():
        where = f"{p} holds no {TOKENIZER_FILE}" if p.is_dir() else f"no such file: {p}"
        raise BindError(
            f"--tokenizer {name}={path}: {where}",
            code="B090",
            hint="give a tokenizer.json (the `tokenizers` library's format) or the directory of a "
            "transformers model saved with it",
        )
    try:
        source = file.read_text(encoding="utf-8")
        tokenizer = Tokenizer.from_str(source)
    except Exception as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise BindError(
            f"--tokenizer {name}={path}: {file} is not a tokenizer the `tokenizers` library reads "
            f"({first[:200]})",
            code="B091",
            hint="save it with Tokenizer.save(...) or a transformers tokenizer's save_pretrained",
        ) from None
    size = int(tokenizer.get_vocab_size(with_added_tokens=True))
    return Vocabulary(name, file.resolve(), size, tokenizer, source)


def vocabulary_names(program: Program) -> dict[str, list[str]]:
    """Each named vocabulary of the program's token values -> the values of that vocabulary."""
    out: dict[str, list[str]] = {}
    for v in program.values:
        if v.dtype == DType.TOKEN and v.vocab_name is not None:
            out.setdefault(v.vocab_name, []).append(v.name)
    return out


def bind_vocabularies(
    program: Program, specs: Mapping[str, str | Path], params: Mapping[str, int]
) -> tuple[dict[str, Vocabulary], dict[str, int]]:
    """Load the tokenizers ``specs`` names (NAME -> PATH) and size their vocabularies: returns
    them and ``params`` with each NAME that has no value yet set to its tokenizer's size.

    Refused: a NAME no ``Token[NAME]`` of the program uses, or the built-in ``Byte`` (B093); a
    size given by ``--set`` or a default below the tokenizer's (B092)."""
    names = vocabulary_names(program)
    params_of = {p.name: p for p in program.params}
    out = dict(params)
    vocabs: dict[str, Vocabulary] = {}
    for name, path in specs.items():
        if name not in names or name not in params_of:
            used = ", ".join(n for n in names if n in params_of) or "none"
            what = (
                "`Byte` is the built-in vocabulary of bytes; it needs no tokenizer"
                if name == "Byte"
                else f"no value of the program is a `Token[{name}]`"
            )
            raise BindError(
                f"--tokenizer {name}={path}: {what}",
                code="B093",
                hint=f"bind the vocabulary NAME of a `Token[NAME]` value; the program's: {used}",
            )
        vocab = load_tokenizer(name, path)
        given = out.get(name)
        if given is None and params_of[name].default is not None:
            try:
                given = evaluate(params_of[name].default, out)  # type: ignore[arg-type]
            except EvalError:
                given = None
        if given is not None and given < vocab.size:
            raise BindError(
                f"vocabulary `{name}` is bound twice: to {given} tokens (`--set` or the "
                f"parameter's default) and to the tokenizer {vocab.path}, which has {vocab.size}",
                code="B092",
                hint=f"drop the size, or make it at least {vocab.size} (a model's vocabulary "
                "padded past its tokenizer's)",
            )
        if given is None:
            out[name] = vocab.size
        vocabs[name] = vocab
    return vocabs, out


def require_sizes(program: Program, params: Mapping[str, int]) -> None:
    """Before a run: every named vocabulary has a size (B003 otherwise, saying how to give one:
    a tokenizer first, since a named vocabulary usually is one)."""
    params_of = {p.name: p for p in program.params}
    for name, values in vocabulary_names(program).items():
        p = params_of.get(name)
        if p is not None and p.default is None and name not in params:
            raise BindError(
                f"the vocabulary `{name}` of `{values[0]}` has no size",
                code="B003",
                hint=f"bind it to a tokenizer: --tokenizer {name}=tokenizer.json (a transformers "
                f"model directory works too; Python: tokenizers={{'{name}': path}}), or give its "
                f"size: --set {name}=V",
            )


def by_value(program: Program, vocabs: Mapping[str, Vocabulary]) -> dict[str, Vocabulary]:
    """Value name -> the tokenizer of its vocabulary, for the values whose vocabulary has one."""
    return {
        value: vocabs[name]
        for name, values in vocabulary_names(program).items()
        if name in vocabs
        for value in values
    }


def save_tokenizers(run_dir: str | Path, vocabs: Mapping[str, Vocabulary]) -> list[Path]:
    """Copy each bound tokenizer into RUN_DIR/tokenizers/NAME.json (the run's own copy)."""
    written = []
    for name, vocab in vocabs.items():
        # tokenizers/ a real folder of the run: a link in its place is refused (D032)
        write_file(Path(run_dir), f"{TOKENIZER_DIR}/{name}.json", vocab.source.encode("utf-8"))
        written.append(Path(run_dir) / TOKENIZER_DIR / f"{name}.json")
    return written


def saved_tokenizers(run_dir: str | Path) -> dict[str, Path]:
    """The tokenizers a run directory keeps: NAME -> RUN_DIR/tokenizers/NAME.json."""
    try:
        d = folder(Path(run_dir), TOKENIZER_DIR, action="read")  # never a link out of the run
    except RunDirError:
        return {}
    if not d.is_dir():
        return {}
    return {p.stem: p for p in sorted(d.glob("*.json")) if is_plain_file(p)}


def run_vocabularies(run_dir: str | Path, meta: Mapping[str, Any]) -> dict[str, Vocabulary]:
    """Value name -> its tokenizer, for a run directory (``meta``: the run's metadata, whose
    ``tokenizers`` maps NAME -> the values of that vocabulary). A copy that is missing or cannot be
    read is left out: the trace then shows ids, as for a run without one."""
    values = meta.get("tokenizers")
    if not isinstance(values, dict):
        return {}
    saved = saved_tokenizers(run_dir)
    out: dict[str, Vocabulary] = {}
    for name, names in values.items():
        if name not in saved or not isinstance(names, list):
            continue
        try:
            vocab = load_tokenizer(str(name), saved[name])
        except BindError:
            continue
        out.update({str(v): vocab for v in names})
    return out


def tokenizer_meta(program: Program, vocabs: Mapping[str, Vocabulary]) -> dict[str, list[str]]:
    """What a run's metadata records of its tokenizers: NAME -> the values of that vocabulary."""
    names = vocabulary_names(program)
    return {name: names[name] for name in vocabs}


def output_text(ids: np.ndarray, vocab: Vocabulary) -> str:
    """The text of a token output (-1: unset, shown as ``_``), one line per row of a 2-D one."""
    rows = ids.reshape(1, -1) if ids.ndim == 1 else ids
    lines = []
    for row in rows.tolist():
        parts: list[str] = []
        run: list[int] = []
        for i in row:
            if i >= 0:
                run.append(i)
                continue
            if run:
                parts.append(vocab.decode(run))
                run = []
            parts.append("_")
        if run:
            parts.append(vocab.decode(run))
        lines.append("".join(parts))
    return "\n".join(lines) + "\n"


def run_texts(run_dir: str | Path, meta: Mapping[str, Any]) -> dict[str, str]:
    """Value name -> the text of its output in RUN_DIR (``NAME.npy``), for the values of a
    tokenizer's vocabulary whose output is there."""
    out: dict[str, str] = {}
    for value, vocab in run_vocabularies(run_dir, meta).items():
        if not PLAIN_NAME.fullmatch(value):  # a name from the log: never a path out of the run
            continue
        try:
            data = read_file(Path(run_dir), f"{value}.npy")  # a regular file of the run
            ids = np.load(io.BytesIO(data), allow_pickle=False)
        except (OSError, ValueError, EOFError, RunDirError):
            continue
        if ids.ndim in (1, 2) and ids.dtype.kind in "iu":
            out[value] = output_text(ids, vocab)
    return out
