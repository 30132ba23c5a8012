"""docs/builtins.md against the registry, each declaration against the object it describes, and
docs/ against claims about features that are built."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from lmpm.bindings import BUILTINS, resolve_builtin
from lmpm.builtins_doc import render
from lmpm.signatures import PALETTE_NAMES, SIGNATURES

ROOT = Path(__file__).resolve().parents[1]


def test_the_page_is_generated_from_the_registry() -> None:
    page = (ROOT / "docs" / "builtins.md").read_text(encoding="utf-8")
    assert page == render(), "docs/builtins.md is stale: run python scripts/gen_builtins.py"


@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_every_builtin_is_declared_with_what_it_returns_and_an_example(name: str) -> None:
    sig = SIGNATURES.get(name)
    assert sig is not None, f"{name} is bound but not declared in lmpm.signatures"
    assert sig.doc and sig.returns and sig.example
    assert re.search(rf"(?<![\w.]){re.escape(name)}\b", sig.example), sig.example
    assert f"## {name}\n" in render()


@pytest.mark.parametrize(
    "name", sorted(n for n in BUILTINS if SIGNATURES[n].role in ("model", "score"))
)
def test_declared_keywords_are_the_models_keywords(name: str) -> None:
    params = inspect.signature(resolve_builtin(name)).parameters
    for p in SIGNATURES[name].params:
        assert p.name in params, f"{name} declares `{p.name}`, which it does not take"


def test_palettes_and_regions_are_the_worlds() -> None:
    from lmpm.models import world

    assert tuple(world.PALETTES) == PALETTE_NAMES
    for name in SIGNATURES["region"].params[0].choices:
        assert world.region(name, shape=(4, 8)).shape == (4, 8)


def test_an_example_line_passes_check_in_a_program() -> None:
    """The latent example's lines, as documented, in a program that checks clean."""
    from lmpm.ir import compile_source

    lines = "\n".join(SIGNATURES[n].example for n in ("Amplify", "Copy", "BoxMean", "NormAtMost"))
    assert "Amplify(nb, k=4)" in lines
    src = (ROOT / "examples" / "latent.lmpm").read_text(encoding="utf-8")
    for n in ("Amplify", "Copy", "BoxMean"):
        assert SIGNATURES[n].example.strip() in src
    compile_source(src.replace("priority 10", "priority 10 hard"), "latent.lmpm")


# Phrases that put a feature off to an unnamed later time ("numeric payloads for later issues",
# "Tensor[D] values, which it cannot run yet"): what is missing is said with the error that
# refuses it (U101: "--compile runs one worker in this process"), never as a vague promise.
STALE = re.compile(
    r"later issues?|future issues?|cannot (yet )?run (it |them )?yet|which it cannot run|"
    r"\bTODO\b|\bTBD\b",
    re.IGNORECASE,
)


def test_the_stale_claims_of_issue_35_would_be_found() -> None:
    for claim in (
        "| `Float`, `Tensor[D]` | numeric payloads for later issues |",
        "`average`, and `Tensor[D]` values, which it cannot run yet) the test file keeps",
    ):
        assert STALE.search(claim), claim


def test_docs_make_no_claims_about_unbuilt_features() -> None:
    found = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for i, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            if STALE.search(line):
                found.append(f"{page.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not found, "claims about unbuilt features:\n" + "\n".join(found)
