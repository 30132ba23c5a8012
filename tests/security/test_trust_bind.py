"""No code from a run directory without --trust-bind: every entry point that builds bindings from a
run's recorded modules goes through lmpm.bindings.recorded_modules, and each refuses untrusted."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from received_run import PROG, run_cli

import lmpm
from lmpm.compare import compare
from lmpm.errors import UsageError

SRC = Path(lmpm.__file__).parent
ROOT = SRC.parent.parent

# Every place that builds Bindings, and where its modules come from. A new one must be added here
# after checking that it never takes modules from a run directory without recorded_modules.
BINDINGS_BUILDERS = {
    "commands/vm.py",  # `lmpm vm run`: the command line's --bind
    "commands/run.py",  # `lmpm run`: the command line's --bind
    "api.py",  # lmpm.compile: the caller's bind= and bindings=
    "bindings.py",  # Bindings.extended: the modules it holds and the ones given
    "runtime/session.py",  # Run(bind=...): the caller's --bind, or what recorded_modules allowed
    "runtime/data/raygroup.py",  # a Ray worker rebuilds the driver's Run bindings
    "runtime/devcheck.py",  # `lmpm check --device`: the command line's --bind
    "commands/check.py",  # the command line's --bind
    "commands/show.py",  # the command line's --bind
    "vm/runner.py",  # tools passed in Python
    "models/training.py",  # no modules
    "resolve/plan.py",  # the empty default
    "ir/link.py",  # a docstring
    "compare.py",  # a run's recorded modules, through recorded_modules
}
# Every place that reads a run's recorded modules (meta "bind") must call recorded_modules.
RECORDED_READERS = {"runtime/session.py", "compare.py"}
# A fallback before the trust check: stored_workers & co. name no modules; check_meta types them.
BIND_READ = re.compile(r"""meta(?:\.get\(|\[)["']bind["']""")


def _files() -> dict[str, str]:
    paths = [*SRC.rglob("*.py"), ROOT / "scripts" / "compare.py"]
    return {
        str(p.relative_to(SRC)) if SRC in p.parents else f"scripts/{p.name}": p.read_text()
        for p in paths
    }


def test_every_entry_point_that_builds_bindings_is_known() -> None:
    builders = {name for name, text in _files().items() if "Bindings(" in text}
    assert builders == BINDINGS_BUILDERS


def test_every_reader_of_recorded_modules_asks_recorded_modules() -> None:
    readers = {name for name, text in _files().items() if BIND_READ.search(text)}
    assert readers <= RECORDED_READERS | {"runtime/session.py"}
    for name in RECORDED_READERS:
        assert "recorded_modules(" in _files()[name], name


@pytest.fixture(scope="module")
def bound_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run started with --bind of a module that records it was imported."""
    root = tmp_path_factory.mktemp("bound")
    mod = root / "mods.py"
    marker = root / "imported"
    mod.write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('yes')\n"
        "import lmpm\nfrom lmpm.models.null import random_tokens\n"
        "lmpm.bind('MyTokens')(random_tokens)\n"
    )
    prog = root / "prog.lmpm"
    prog.write_text(PROG.replace("RandomTokens", "MyTokens"))
    out = root / "run"
    argv = ["run", str(prog), "--bind", str(mod), "--out", str(out), "--epochs", "3"]
    rc, _, err = run_cli([*argv, "--trace", "cells", "--quiet"])
    assert rc == 0, err
    marker.unlink()
    return out


def test_resume_in_the_cli_refuses_without_trust(bound_run: Path) -> None:
    rc, _, err = run_cli(["run", "--resume", str(bound_run), "--epochs", "4", "--quiet"])
    assert rc == 2 and "--trust-bind" in err, err
    assert not (bound_run.parent / "imported").exists()


def test_resume_in_the_api_refuses_without_trust(bound_run: Path) -> None:
    with pytest.raises(UsageError) as info:
        lmpm.resume(bound_run, epochs=4)
    assert info.value.code == "U040"
    assert not (bound_run.parent / "imported").exists()


def test_compare_refuses_without_trust_and_imports_with_it(bound_run: Path) -> None:
    with pytest.raises(UsageError) as info:
        compare(bound_run, bound_run, "G")
    assert info.value.code == "U040"
    assert not (bound_run.parent / "imported").exists()
    cmp = compare(bound_run, bound_run, "G", trust_bind=True)
    assert cmp.numbers()["cells_differ"] == 0
    assert (bound_run.parent / "imported").exists()
