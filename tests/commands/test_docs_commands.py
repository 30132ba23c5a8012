"""The documentation's quick commands work as written: every `lmpm check`, `show`, `fmt` and
`mask` line of a code block in README.md and docs/*.md, run from a directory holding the
repository's examples, exits as its comment says (an error only where the comment says so)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from lmpm.cli import main

ROOT = Path(__file__).resolve().parents[2]
QUICK = ("check", "show", "fmt", "mask")


def _commands() -> list[tuple[str, str, str]]:
    """(doc:line, command, comment) of each quick `lmpm` command in a fenced code block."""
    found = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        lines = doc.read_text().splitlines()
        fenced = False
        i = 0
        while i < len(lines):
            line = lines[i]
            start = i
            i += 1
            if line.startswith("```"):
                fenced = not fenced
                continue
            text = line.strip()
            while fenced and text.endswith("\\") and i < len(lines):  # continuation lines
                text = text[:-1] + " " + lines[i].strip()
                i += 1
            if not fenced or not text.startswith("lmpm "):
                continue
            command, _, comment = text.partition(" #")
            words = shlex.split(command)
            if len(words) > 1 and words[1] in QUICK and not any("FILE" in w for w in words):
                found.append((f"{doc.relative_to(ROOT)}:{start + 1}", command, comment))
    return found


COMMANDS = _commands()


def test_the_docs_have_quick_commands() -> None:
    assert len(COMMANDS) >= 12, COMMANDS  # the parser above still finds them


@pytest.mark.parametrize(("where", "command", "comment"), COMMANDS, ids=[c[0] for c in COMMANDS])
def test_a_documented_command_works_as_written(
    where: str, command: str, comment: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    monkeypatch.chdir(tmp_path)
    rc = main(shlex.split(command)[1:])
    if re.search(r"\berror\b", comment):
        assert rc == 1, (where, command, rc)
    elif "fmt" in command and "--check" in command and "video.lmpm" in command:
        assert rc in (0, 1), (where, command, rc)  # the seed's hand-aligned text (README)
    else:
        assert rc == 0, (where, command, rc)
