"""The structure rules of issue 45 on ``scripts/structure.py``'s measurements of src/lmpm
(Python's ``ast``): no function in ``runtime/`` over 80 lines, no class there over 600, no function
over 8 parameters except the public entry points of :data:`PUBLIC_ENTRY_POINTS` (documented API
that takes keyword options), no private name or module of LMPM imported from outside its owner, no
private attribute of another module read (``obj._x``).

The ``*_BEING_SPLIT`` sets are today's offenders in the files another session of issue 45 is
rewriting (d45: the decision core in ``runtime/data``), by qualified name. The test fails on a new
offender, and on an entry that no longer offends (delete it: the sets only shrink).
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Mapping
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import structure as st

# Public entry points that may take more than MAX_PARAMS keyword options (issue 45 allows them:
# "at most the public entry points ... have more than 8 parameters").
PUBLIC_ENTRY_POINTS = {
    # lmpm.vm.WorkflowRun(program, workflow=, tools=, seed=, streams=, device=, compile=, ...):
    # docs/vm.md, `lmpm vm run`'s Python twin
    "vm/runner.py::WorkflowRun.__init__",
    # lmpm.train.run.Trainer(spec, data, epochs=, workers=, driver=, run_dir=, ...):
    # docs/training.md, the Python twin of `lmpm train`
    "train/run.py::Trainer.__init__",
    # lmpm.runtime.devcheck.check_device(program, params=, bind=, inputs=, epochs=, ...): the
    # module's documented example, the Python twin of `lmpm check --device` and its flags
    "runtime/devcheck.py::check_device",
}

# Being split in issue 45 (d45: runtime/data): shrink after merging.
LONG_FUNCTIONS_BEING_SPLIT: set[str] = set()
LONG_CLASSES_BEING_SPLIT: set[str] = set()
MANY_PARAMS_BEING_SPLIT: set[str] = set()
PRIVATE_IMPORTS_BEING_SPLIT: set[str] = set()
# Private attributes read across modules (each needs a public name in the module that owns it).
PRIVATE_ATTRIBUTES_ELSEWHERE: set[str] = set()


FOUND = st.measure()


def _check(offenders: Mapping[str, object], allowed: set[str], what: str) -> None:
    new = sorted(set(offenders) - allowed)
    fixed = sorted(allowed - set(offenders))
    assert not new, f"new {what}: " + "; ".join(f"{k} ({offenders[k]})" for k in new)
    assert not fixed, f"no longer {what}, delete from the allow-list: {', '.join(fixed)}"


def test_no_long_function_in_runtime() -> None:
    found = {k: f"{d.lines} lines" for k, d in FOUND.long_functions.items()}
    _check(found, LONG_FUNCTIONS_BEING_SPLIT, f"functions over {st.MAX_FUNCTION_LINES} lines")


def test_no_long_class_in_runtime() -> None:
    found = {k: f"{d.lines} lines" for k, d in FOUND.long_classes.items()}
    _check(found, LONG_CLASSES_BEING_SPLIT, f"classes over {st.MAX_CLASS_LINES} lines")


def test_few_parameters_except_public_entry_points() -> None:
    found = {
        k: f"{d.params} parameters"
        for k, d in FOUND.many_params.items()
        if k not in PUBLIC_ENTRY_POINTS
    }
    _check(found, MANY_PARAMS_BEING_SPLIT, f"functions over {st.MAX_PARAMS} parameters")


def test_the_public_entry_points_still_need_their_allowance() -> None:
    """An entry point renamed, removed or brought under the limit loses its allowance."""
    stale = sorted(PUBLIC_ENTRY_POINTS - set(FOUND.many_params))
    assert not stale, f"within {st.MAX_PARAMS} parameters or gone, delete the allowance: {stale}"


def test_no_private_import_across_modules() -> None:
    found = {name: "private" for name in FOUND.private_imports}
    _check(found, PRIVATE_IMPORTS_BEING_SPLIT, "private imports across modules")


def test_no_private_attribute_read_across_modules() -> None:
    found = {name: "private" for name in FOUND.private_attributes}
    _check(found, PRIVATE_ATTRIBUTES_ELSEWHERE, "private attributes read across modules")


def test_the_measure_sees_what_it_must() -> None:
    """The walk finds nested functions, methods and parameters, and private imports: a name or
    module of another package, absolute or relative; its own package's are fine."""
    src = (
        "from . import _x\nfrom ._m import y\nfrom ..other import _z\n"
        "from lmpm.a import _b\nimport lmpm.c._d\nfrom torch.utils import _pytree\n"
        "class K:\n    def m(self, a, *b, c, **d):\n        def inner(x):\n            pass\n"
    )
    tree = ast.parse(src)
    defs = {d.where: d for d in st.defs("runtime/p/q.py", tree)}
    assert set(defs) == {"runtime/p/q.py::K", "runtime/p/q.py::K.m", "runtime/p/q.py::K.m.inner"}
    assert defs["runtime/p/q.py::K.m"].params == 4 and defs["runtime/p/q.py::K.m"].lines == 3
    assert defs["runtime/p/q.py::K.m.inner"].params == 1
    assert list(st.private_imports("runtime/p/q.py", tree)) == [
        "runtime/p/q.py: lmpm.runtime.other._z",
        "runtime/p/q.py: lmpm.a._b",
        "runtime/p/q.py: lmpm.c._d",
    ]


def test_the_measure_sees_private_attributes_of_other_modules() -> None:
    """``obj._x`` counts unless ``_x`` is this module's own (a def, a ``self._x``, a name) or the
    read is of a third-party object (rooted in a non-LMPM import, or a known third-party name)."""
    src = (
        "import sys\nimport torch\nfrom lmpm.workers import batch\naten = torch.ops.aten\n"
        "class K:\n    def __init__(self):\n        self._mine = 1\n"
        "    def _helper(self):\n        pass\n"
        "    def g(self):\n        return self.group._calls, self._helper()\n"
        "def f(dp, other, t):\n"
        "    dp._tables[0]; dp._dev(t); other._mine; other._helper(); batch._rule_score\n"
        "    sys._getframe(); torch._C._nn; aten._to_copy; t._version; dp._tables\n"
    )
    got = list(st.private_attributes("m.py", ast.parse(src)))
    assert got == [
        "m.py: self.group._calls",
        "m.py: dp._tables",
        "m.py: dp._dev",
        "m.py: batch._rule_score",
    ]


def test_a_new_offender_fails(tmp_path: Path) -> None:
    """A package with one function too long, too wide, and a private import: each is found."""
    (tmp_path / "runtime").mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(st.MAX_FUNCTION_LINES))
    args = ", ".join(f"a{i}" for i in range(st.MAX_PARAMS + 1))
    (tmp_path / "runtime" / "big.py").write_text(
        f"from lmpm.models.text import _hidden\n\n\ndef big({args}):\n{body}\n"
        "    return a0._tables\n"
    )
    found = st.measure(tmp_path)
    assert list(found.long_functions) == ["runtime/big.py::big"]
    assert list(found.many_params) == ["runtime/big.py::big"]
    assert found.private_imports == ["runtime/big.py: lmpm.models.text._hidden"]
    assert found.private_attributes == ["runtime/big.py: a0._tables"]
