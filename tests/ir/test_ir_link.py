"""The link step (lmpm.ir.link): names bound once, literals evaluated once, the same step for
`lmpm check --bind` and for a run."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from lmpm.bindings import Bindings
from lmpm.cli import main
from lmpm.errors import BindError
from lmpm.ir import compile_source
from lmpm.ir.link import RUNTIME, link
from lmpm.resolve.plan import resolve

PROGRAM = """param N = 8
param K = 3
value Txt : Token[Byte] shape Seq(N)
visible Txt[t] <- Txt[0..t-1] when t > 0
rule Next:
  on Txt[t] when t > 0
  read {context = Txt[0..t-1]}
  emit proposal Txt[t] := MyModel(context, k=K*2, temperature=0.5, step=e+1)
commit Txt[*] using satisfy(max_constraints_then_score)
"""

BINDS = """import lmpm

@lmpm.bind("MyModel")
def my_model(inputs, **kw):
    return {}
"""


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main(list(argv))
    return rc, out.getvalue(), err.getvalue()


def test_literals_are_evaluated_once_with_the_parameters() -> None:
    ir = compile_source(PROGRAM).ir
    call = ir.rules[0].proposal
    linked = link(ir, Bindings(mapping={"MyModel": lambda inputs, **kw: {}}), {"N": 8, "K": 3})
    assert linked.args(call) == (RUNTIME, 6, 0.5, RUNTIME)  # a read; `e+1` is evaluated per epoch
    assert linked.kwargs(call) == {"k": 6, "temperature": 0.5}
    assert callable(linked.bound(call))


def test_the_plan_reads_the_linked_literals() -> None:
    ir = compile_source(PROGRAM).ir
    plan = resolve(ir, {"K": 5}, Bindings(mapping={"MyModel": lambda inputs, **kw: {}}))
    (rp,) = plan.rules
    assert rp.kwargs == {"k": 10, "temperature": 0.5}
    assert set(rp.epoch_args) == {"step"}


def test_a_model_bound_to_something_not_callable_fails_the_link() -> None:
    ir = compile_source(PROGRAM).ir
    with pytest.raises(BindError) as e:
        link(ir, Bindings(mapping={"MyModel": 3}), {"N": 8, "K": 3})
    assert e.value.code == "B052"


def test_check_bind_runs_the_link_step(tmp_path: Path) -> None:
    """An access given to a model cannot be a literal: `check --bind` fails at the call, as the
    run would (before the link step the check accepted it and the run failed without a place)."""
    binds = tmp_path / "binds.py"
    binds.write_text(BINDS)
    good = tmp_path / "good.lmpm"
    good.write_text(PROGRAM)
    assert _cli("check", str(good), "--bind", str(binds))[0] == 0
    bad = tmp_path / "bad.lmpm"
    bad.write_text(PROGRAM.replace("temperature=0.5", "temperature=Txt[0]"))
    assert _cli("check", str(bad))[0] == 0  # without the bindings there is nothing to link
    rc, out, _ = _cli("check", str(bad), "--bind", str(binds), "--json")
    found = json.loads(out.splitlines()[-1])
    assert rc == 1 and found["code"] == "B050"
    line = bad.read_text().split("\n")[7]
    assert (found["line"], found["col"]) == (8, line.index("MyModel(") + 1)  # at the call
    with pytest.raises(BindError) as e:
        resolve(compile_source(bad.read_text()).ir, None, Bindings([str(binds)]))
    assert e.value.code == "B050"


def test_check_bind_refuses_a_model_that_is_not_callable(tmp_path: Path) -> None:
    """What the run refuses (B052), `check --bind` refuses too, at the call."""
    binds = tmp_path / "binds.py"
    binds.write_text("LMPM_BINDINGS = {'MyModel': 3}\n")
    prog = tmp_path / "p.lmpm"
    prog.write_text(PROGRAM)
    rc, out, _ = _cli("check", str(prog), "--bind", str(binds), "--json")
    found = json.loads(out.splitlines()[-1])
    assert rc == 1 and found["code"] == "B052" and "not callable" in found["message"]
