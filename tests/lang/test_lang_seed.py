"""The seed's program text, verbatim (tests/lang/seed_verbatim.lmpm), passes `lmpm check`."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SEED = Path(__file__).with_name("seed_verbatim.lmpm")
SEED_MD = Path("/work/shared/seeds/lmpm.md")


def test_seed_verbatim_passes_check() -> None:
    res = subprocess.run(
        [sys.executable, "-m", "lmpm.cli", "check", str(SEED)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    assert "error[" not in res.stderr


def test_fixture_is_the_seed_text() -> None:
    if not SEED_MD.exists():  # the seed lives beside the repository, not in it
        return
    md = SEED_MD.read_text()
    section = md[md.index("## What is a LMPM program?") : md.index("## Design principles")]
    assert "".join(re.findall(r"```\n(.*?)```", section, re.S)) == SEED.read_text()
