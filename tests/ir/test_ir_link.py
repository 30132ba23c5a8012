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


WRONG = """import lmpm

@lmpm.bind("MyModel")
def my_model(inputs, k, temperature, step):  # no **kwargs: the run adds vocab, seed, epoch
    return {}
"""


def test_a_model_whose_signature_cannot_take_the_call_fails_check_and_run(tmp_path: Path) -> None:
    """B053 at the call, under `check --bind` and before the first epoch of `lmpm run`."""
    binds = tmp_path / "binds.py"
    binds.write_text(WRONG)
    prog = tmp_path / "p.lmpm"
    prog.write_text(PROGRAM)
    assert _cli("check", str(prog))[0] == 0  # without the bindings there is nothing to link
    rc, out, _ = _cli("check", str(prog), "--bind", str(binds), "--json")
    found = json.loads(out.splitlines()[-1])
    assert rc == 1 and found["code"] == "B053"
    assert "unexpected keyword argument 'vocab'" in found["message"]
    assert "my_model(inputs, k, temperature, step)" in found["message"]
    line = PROGRAM.split("\n")[7]
    assert (found["line"], found["col"]) == (8, line.index("MyModel(") + 1)
    out_dir = tmp_path / "run"
    rc, _, err = _cli(
        "run", str(prog), "--bind", str(binds), "--epochs", "1", "--out", str(out_dir)
    )
    assert rc == 1 and "error[B053]" in err and "^^^" in err
    assert not (out_dir / "lmpm.db").exists()  # refused before the first epoch


def _link(model: object, program: str = PROGRAM) -> None:
    link(compile_source(program).ir, Bindings(mapping={"MyModel": model}), {"N": 8, "K": 3})


def test_the_signature_check_names_a_missing_parameter() -> None:
    def needs_n(inputs: object, n: int, **kw: object) -> dict[str, object]:
        return {}

    with pytest.raises(BindError) as e:
        _link(needs_n)
    assert e.value.code == "B053" and "missing a required argument: 'n'" in str(e.value)


def test_callables_that_take_the_call_or_say_nothing_are_accepted() -> None:
    class Net:
        def __call__(self, inputs: object, **kw: object) -> dict[str, object]:
            return {}

    _link(lambda inputs, **kw: {})
    _link(lambda inputs, k, temperature, step, vocab, seed, epoch: {})  # every keyword named
    _link(Net())
    _link(max)  # no signature Python can read: taken as it is


def test_scores_and_positional_literals_are_held_to_how_the_run_calls_them() -> None:
    scored = PROGRAM.replace("step=e+1)", "step=e+1)\n  score MyScore(...)")
    with pytest.raises(BindError) as e:
        link(
            compile_source(scored).ir,
            Bindings(mapping={"MyModel": lambda inputs, **kw: {}, "MyScore": lambda inputs: 0}),
            {"N": 8, "K": 3},
        )
    assert e.value.code == "B053" and "MyScore(inputs, epoch=...)" in str(e.value)
    positional = PROGRAM.replace("k=K*2", "K*2")
    with pytest.raises(BindError, match=r"MyModel\(inputs, arg1=\.\.\., temperature"):
        _link(lambda inputs, k, temperature, step, **kw: {}, positional)


def test_a_workflow_tool_is_held_to_the_vm_s_call(tmp_path: Path) -> None:
    """`check --bind` links a workflow as the VM does: its model with `vocab` and no seed or
    epoch, its tools with one argument list."""
    prog = tmp_path / "w.lmpm"
    prog.write_text(Path("examples/vm.lmpm").read_text())
    binds = tmp_path / "tools.py"
    binds.write_text(
        "import lmpm\n\n@lmpm.bind('ByteLM')\ndef model(inputs, vocab):\n    return None\n\n"
        "@lmpm.bind('Count')\ndef count(args, more):\n    return []\n"
    )
    rc, out, _ = _cli("check", str(prog), "--bind", str(binds), "--json")
    found = json.loads(out.splitlines()[-1])
    assert rc == 1 and found["code"] == "B053" and "Count(args)" in found["message"]


def test_the_vm_runner_binds_its_model_and_tools_through_the_link_step() -> None:
    from lmpm.vm import WorkflowRun

    ir = compile_source(Path("examples/vm.lmpm").read_text(), overrides={"B": 2}).ir
    with pytest.raises(BindError) as e:
        WorkflowRun(ir, overrides={"B": 2}, tools={"Count": lambda: []})
    assert e.value.code == "B053" and e.value.span == ir.workflows[0].zones[3].tool.span  # type: ignore[union-attr]


def test_the_trainer_binds_its_module_and_losses_through_the_link_step() -> None:
    from lmpm.ir.link import link_training
    from lmpm.train.frontend import train_spec
    from lmpm.train.modules import LOSSES, MODULES

    text = Path("examples/train_bytelm.lmpm").read_text()
    spec = train_spec(compile_source(text).ir, {})
    assert spec is not None
    bound = link_training(spec)
    assert bound.module is MODULES["ByteLM"] and bound.loss is LOSSES["NextByteLoss"]
    assert bound.eval_loss is LOSSES["NextByteLoss"]
    # (the check refuses it too, B080: the link step is what a program that skipped it meets)
    front = compile_source(text.replace("Params[ByteLM]", "Params[Nope]"), raise_errors=False)
    unknown = train_spec(front.ir, {})
    assert unknown is not None
    with pytest.raises(BindError) as e:
        link_training(unknown)
    assert e.value.code == "B080"


def test_check_names_the_training_module_and_loss_nothing_binds() -> None:
    """`lmpm check` refuses what `link_training` would refuse at run time (B080, B081), at the
    statement; the check's torch-free names are the trainer's."""
    from lmpm.signatures import TRAIN_LOSSES, TRAIN_MODULES
    from lmpm.train.modules import LOSSES, MODULES

    assert tuple(MODULES) == TRAIN_MODULES and tuple(LOSSES) == TRAIN_LOSSES
    text = Path("examples/train_bytelm.lmpm").read_text()
    bad = text.replace("Params[ByteLM]", "Params[Nope]").replace("NextByteLoss", "NopeLoss")
    front = compile_source(bad, raise_errors=False)
    got = [(d.code, d.span.line) for d in front.errors]
    lines = bad.splitlines()
    want = [("B080", next(i for i, s in enumerate(lines, 1) if "Params[Nope]" in s))]
    want += [("B081", i) for i, s in enumerate(lines, 1) if "NopeLoss(" in s]
    assert got == want
