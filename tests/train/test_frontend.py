"""The language side of training programs: Params values, `minimize`, parameter constraints, the
commit policies of a Params value, and `lmpm.train.frontend.train_spec` (E150–E162)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmpm.errors import BindError, CheckError, LmpmError
from lmpm.ir import compile_file, compile_source, lint
from lmpm.ir.printer import print_ir
from lmpm.ir.serialize import from_json, to_json
from lmpm.train.frontend import is_training, train_spec
from lmpm.train.spec import (
    OPTIMIZERS,
    SCHEDULES,
    DataSpec,
    MinimizeSpec,
    ParamConstraint,
    ParamsSpec,
    PolicySpec,
    TrainSpec,
)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_bytelm.lmpm"

FIT = (
    'minimize(NextByteLoss(Theta, data), steps=H, batch=8, optimizer="adamw", lr=3e-3, '
    'weight_decay=0.01, clip=1.0, schedule="cosine", warmup=0, seed=0)'
)
TRAIN = f"""param H = 50

value Corpus : Token[Byte] shape Grid2D(64, 4096) clock Lamport
value Held   : Token[Byte] shape Grid2D(64, 512) clock Lamport
value Theta  : Params[ByteLM] shape Tensors() clock Lamport

rule Fit:
  on Theta[*]
  read {{data = Corpus[*], held = Held[*]}}
  emit proposal Theta[*] := {FIT}
  score NextByteLoss(Theta, held)

constraint Frozen:
  forbid change(Theta["pos.*"]) priority 1000

constraint Bounded:
  require NormAtMost(Theta["blocks.*"], 40) priority 10

commit Theta[*] using diloco(outer_lr=0.7, momentum=0.9)
"""


def test_the_example_gives_the_expected_spec() -> None:
    ir = compile_source(TRAIN, "t.lmpm").ir
    assert is_training(ir) and lint(ir) == []
    spec = train_spec(ir, {})
    assert spec is not None
    corpus = DataSpec("Corpus", "data", length=64, rows=4096, vocab=256)
    held = DataSpec("Held", "held", length=64, rows=512, vocab=256)
    assert spec.params == ParamsSpec("Theta", "ByteLM", "tensors", spec.params.span)
    assert spec.rule == MinimizeSpec(
        "Fit",
        "NextByteLoss",
        (corpus,),
        steps=50,
        batch=8,
        optimizer="adamw",
        lr=3e-3,
        weight_decay=0.01,
        clip=1.0,
        schedule="cosine",
        warmup=0,
        seed=0,
        eval_loss="NextByteLoss",
        eval_data=(held,),
        span=spec.rule.span,
    )
    assert spec.policy == PolicySpec("diloco", outer_lr=0.7, momentum=0.9, nesterov=True)
    assert [(c.name, c.kind, c.select, c.priority, c.bound) for c in spec.constraints] == [
        ("Frozen", "freeze", ("pos.*",), 1000, None),
        ("Bounded", "norm", ("blocks.*",), 10, 40.0),
    ]
    assert spec.file == "t.lmpm"
    # spans travel: the value line, the rule, each constraint
    assert spec.params.span is not None and spec.params.span.line == 5
    assert spec.rule.span is not None and spec.rule.span.line == 7
    assert all(isinstance(c, ParamConstraint) and c.span is not None for c in spec.constraints)
    # parameters bind: steps=H follows --set
    spec2 = train_spec(ir, {"H": 7})
    assert spec2 is not None and spec2.rule.steps == 7


def test_seq_data_blocks_average_and_best() -> None:
    src = (
        "value Txt : Token[Byte] shape Seq(300)\n"
        "value P : Params[Tiny] shape Blocks()\n"
        "rule R:\n  on P\n  read {{Txt}}\n  emit proposal P := minimize(L(P, txt), steps=1, batch=1)\n"
        "commit P[*] using {}\n"
    )
    a = train_spec(compile_source(src.format("average")).ir, {})
    assert a is not None and a.policy == PolicySpec("average")
    assert a.params.granularity == "blocks"
    assert a.rule.data == (DataSpec("Txt", "txt", length=300, rows=1, vocab=256),)
    assert a.rule.eval_loss is None and a.rule.eval_data == ()
    assert a.rule == MinimizeSpec("R", "L", a.rule.data, steps=1, batch=1, span=a.rule.span)
    b = train_spec(compile_source(src.format("satisfy(max_constraints_then_score)")).ir, {})
    assert b is not None and b.policy.kind == "best"
    d = train_spec(compile_source(src.format("diloco(outer_lr=1, momentum=0, nesterov=0)")).ir, {})
    assert d is not None and d.policy == PolicySpec("diloco", 1.0, 0.0, nesterov=False)


def test_a_program_without_params_is_no_training_program() -> None:
    ir = compile_file(ROOT / "examples" / "text.lmpm").ir
    assert not is_training(ir) and train_spec(ir, {}) is None


def test_a_bound_parameter_out_of_range_is_located() -> None:
    ir = compile_source(TRAIN, "t.lmpm").ir
    with pytest.raises(CheckError) as ei:
        train_spec(ir, {"H": 0})
    assert ei.value.code == "E156" and "steps" in ei.value.message


def test_unbound_and_unknown_parameters_are_bind_errors() -> None:
    ir = compile_source(TRAIN.replace("param H = 50", "param H"), "t.lmpm").ir
    with pytest.raises(BindError) as ei:
        train_spec(ir, {})
    assert ei.value.code == "B003"
    spec = train_spec(ir, {"H": 3})
    assert spec is not None and spec.rule.steps == 3
    with pytest.raises(BindError) as ei:
        train_spec(ir, {"Q": 3})
    assert ei.value.code == "B001"


def test_an_option_that_cannot_be_evaluated_is_located() -> None:
    front = compile_source(TRAIN.replace("steps=H", "steps=H/0"), "t.lmpm", raise_errors=False)
    (d,) = front.errors
    assert d.code == "E156" and d.span is not None and (d.span.line, d.span.col) == (10, 71)


def test_ir_round_trips_and_prints() -> None:
    ir = compile_source(TRAIN, "t.lmpm").ir
    assert from_json(to_json(ir)) == ir
    text = print_ir(ir)
    assert "value Theta : Params[ByteLM] Tensors() clock Lamport" in text
    assert "rule Fit (minimize) on Theta" in text
    assert 'forbid change(Theta["pos.*"])' in text
    assert 'NormAtMost(Theta["blocks.*"], 40)' in text


# ---- located errors ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Mistake:
    name: str
    old: str  # replaced in TRAIN...
    new: str  # ...by this
    code: str
    at: str  # the text the caret starts on (its first occurrence in the first changed line)
    base: str = TRAIN

    def source(self) -> str:
        assert self.old in self.base, self.name
        return self.base.replace(self.old, self.new, 1)

    def where(self) -> tuple[int, int]:
        lines = self.source().split("\n")
        for i, (a, b) in enumerate(zip(lines, self.base.split("\n")), start=1):
            if a != b and self.at in a:
                return i, a.index(self.at) + 1
        for i, a in enumerate(lines, start=1):
            if self.at in a:
                return i, a.index(self.at) + 1
        raise AssertionError(self.name)


TOKENS = """value A : Token[Byte] shape Seq(8)
visible A[t] <- A[0..t-1] when t > 0
rule R:
  on A[t]
  read {ctx = A[0..t-1]}
  emit proposal A[t] := ByteLM(ctx)
commit A[*] using satisfy(max_constraints_then_score)
"""
EVENTS = "value S : Event shape Set()\nrule R:\n  on S\n  emit proposal S := SampleTiles()\n"
LOSS = "NextByteLoss(Theta, data)"
MISTAKES = [
    # E150: the Params type and its shapes
    Mistake("params of a number", "Params[ByteLM]", "Params[3]", "E150", "Params"),
    Mistake("params on a grid", "shape Tensors()", "shape Seq(8)", "E150", "Seq"),
    Mistake("tensors of tokens", "shape Grid2D(64, 512)", "shape Tensors()", "E150", "Tensors"),
    # E151: accesses of a Params value
    Mistake("index a params value", '["pos.*"]', "[3]", "E151", "3]"),
    Mistake("two indices", '["pos.*"]', '["a", "b"]', "E151", 'Theta["a"'),
    Mistake("rule on some cells", "on Theta[*]", 'on Theta["a"]', "E151", 'Theta["a"]'),
    # E152: visible clauses
    Mistake(
        "visible into params",
        "\nrule Fit",
        "\nvisible Theta[*] <- Corpus[*]\nrule Fit",
        "E152",
        "Theta",
    ),
    Mistake(
        "visible from params",
        "\nrule Fit",
        "\nvisible Held[x, y] <- Theta[*]\nrule Fit",
        "E152",
        "Theta",
    ),
    # E153: a Params value as cells or as data
    Mistake("params read by a rule", "held = Held[*]}", "held = Theta[*]}", "E153", "Theta[*]}"),
    Mistake("params as data", LOSS, "NextByteLoss(Theta, Theta)", "E153", "Theta)"),
    Mistake(
        "params read by a cell rule",
        "read {ctx = A[0..t-1]}",
        "read {ctx = A[0..t-1], p = P[*]}",
        "E153",
        "P[*]",
        TOKENS.replace("value A", "value P : Params[M] shape Tensors()\nvalue A"),
    ),
    # E154: minimize on discrete cells; a Params rule without minimize
    Mistake(
        "minimize tokens", "ByteLM(ctx)", "minimize(L(ctx), steps=1)", "E154", "minimize", TOKENS
    ),
    Mistake(
        "minimize events", "SampleTiles()", "minimize(L(S), steps=1)", "E154", "minimize", EVENTS
    ),
    Mistake("no minimize", FIT, "ByteLM(data)", "E154", "ByteLM"),
    Mistake("a guard", "on Theta[*]", "on Theta[*] when e > 0", "E154", "e > 0"),
    # E155: the loss
    Mistake("first argument not a call", LOSS, "data", "E155", "data,"),
    Mistake("loss without params", LOSS, "NextByteLoss(data)", "E155", "data)"),
    Mistake("params not first", LOSS, "NextByteLoss(data, Theta)", "E155", "data, Theta"),
    Mistake("unknown data", LOSS, "NextByteLoss(Theta, dta)", "E155", "dta"),
    Mistake("no data", LOSS, "NextByteLoss(Theta)", "E155", "NextByteLoss(Theta)"),
    Mistake("loss keyword first", "minimize(" + LOSS, "minimize(loss=" + LOSS, "E155", "loss="),
    Mistake("score not a call", "score NextByteLoss(Theta, held)", "score held", "E155", "held"),
    # E156: minimize's options
    Mistake("unknown option", "warmup=0", "warmups=0", "E156", "warmups"),
    Mistake("steps zero", "steps=H", "steps=0", "E156", "0, batch"),
    Mistake("batch a decimal", "batch=8", "batch=8.5", "E156", "8.5"),
    Mistake("optimizer unknown", '"adamw"', '"adamz"', "E156", '"adamz"'),
    Mistake("lr zero", "lr=3e-3", "lr=0", "E156", "0, weight"),
    Mistake("negative weight decay", "weight_decay=0.01", "weight_decay=-0.01", "E156", "-0.01"),
    Mistake("momentum one", "clip=1.0", "momentum=1, clip=1.0", "E156", "1, clip"),
    Mistake("clip zero", "clip=1.0", "clip=0.0", "E156", "0.0, sched"),
    Mistake("schedule unknown", '"cosine"', '"linear"', "E156", '"linear"'),
    Mistake("warmup negative", "warmup=0", "warmup=-1", "E156", "-1"),
    Mistake("seed a string", "seed=0", 'seed="x"', "E156", '"x"'),
    Mistake("steps missing", "steps=H, ", "", "E156", "minimize"),
    Mistake("option twice", "seed=0", "seed=0, seed=1", "E156", "seed=1"),
    Mistake("positional option", "steps=H", "H", "E156", "H, batch"),
    # E157: data
    Mistake("part of the data", "data = Corpus[*]", "data = Corpus[0, *]", "E157", "data ="),
    Mistake(
        "3-D data",
        "Grid2D(64, 4096)",
        "Grid3D(2, 64, 4096)",
        "E157",
        "data =",
    ),
    # E159: constraints on parameters
    Mistake("require change", "forbid change(Theta", "require change(Theta", "E159", "change"),
    Mistake("forbid a norm", "require NormAtMost", "forbid NormAtMost", "E159", "NormAtMost"),
    Mistake("norm bound zero", '"blocks.*"], 40)', '"blocks.*"], 0)', "E159", "0)"),
    Mistake("norm bound a name", '"blocks.*"], 40)', '"blocks.*"], H)', "E159", "H)"),
    Mistake("read_future", "change(Theta", "read_future(Theta", "E159", "read_future"),
    Mistake("in a set", 'NormAtMost(Theta["blocks.*"], 40)', "Theta[*] in Set(1)", "E159", "Theta"),
    Mistake("user predicate", "NormAtMost(", "Small(", "E159", "Small"),
    # E160: commit policies
    Mistake(
        "unknown policy",
        "diloco(outer_lr=0.7, momentum=0.9)",
        "winner_takes_all",
        "E160",
        "winner_takes_all",
    ),
    Mistake("diloco without momentum", ", momentum=0.9)", ")", "E160", "diloco"),
    Mistake("outer_lr zero", "outer_lr=0.7", "outer_lr=0", "E160", "0,"),
    Mistake("momentum one", "momentum=0.9)", "momentum=1.0)", "E160", "1.0"),
    Mistake("nesterov two", "momentum=0.9)", "momentum=0.9, nesterov=2)", "E160", "2)"),
    Mistake("diloco positional", "outer_lr=0.7", "0.7", "E160", "0.7"),
    Mistake(
        "diloco on tokens",
        "satisfy(max_constraints_then_score)",
        "diloco(outer_lr=0.7, momentum=0.9)",
        "E160",
        "diloco",
        TOKENS,
    ),
    # E161: no commit line
    Mistake(
        "no commit",
        "commit Theta[*] using diloco(outer_lr=0.7, momentum=0.9)\n",
        "",
        "E161",
        "value Theta",
    ),
    # E162: scope
    Mistake(
        "two params values",
        "\nrule Fit",
        "\nvalue Phi : Params[ByteLM] shape Blocks()\nrule Fit",
        "E162",
        "value Phi",
    ),
    Mistake(
        "two minimize rules",
        "\nconstraint Frozen",
        "\nrule Fit2:\n  on Theta[*]\n  read {data = Corpus[*]}\n  emit proposal Theta[*] := minimize(NextByteLoss(Theta, data), steps=1, batch=1)\nconstraint Frozen",
        "E162",
        "rule Fit2",
    ),
    Mistake(
        "a rule on data",
        "\nconstraint Frozen",
        "\nrule Gen:\n  on Held[x, y]\n  emit proposal Held[x, y] := ByteLM()\nconstraint Frozen",
        "E162",
        "rule Gen",
    ),
    Mistake(
        "a constraint on data",
        'change(Theta["pos.*"])',
        "change(Held[x, y])",
        "E162",
        "constraint Frozen",
    ),
    Mistake(
        "no minimize rule",
        "average",
        "average",
        "E162",
        "value Theta",
        "value Theta : Params[M] shape Tensors()\ncommit Theta[*] using average\n",
    ),
]


def _diags(mk: Mistake) -> list[tuple[str, int, int, str]]:
    try:
        front = compile_source(mk.source(), "mistake.lmpm", raise_errors=False)
        diags = list(front.diagnostics)
    except LmpmError as e:  # a syntax error
        diags = e.diagnostics
    return [(d.code, d.span.line, d.span.col, d.render()) for d in diags if d.span is not None]


@pytest.mark.parametrize("mk", MISTAKES, ids=[mk.name for mk in MISTAKES])
def test_mistake_is_located(mk: Mistake) -> None:
    line, col = mk.where()
    found = _diags(mk)
    hits = [r for c, ln, cl, r in found if (c, ln, cl) == (mk.code, line, col)]
    assert hits, [r for *_, r in found]
    rendered = hits[0]
    assert f"mistake.lmpm:{line}:{col}: error[{mk.code}]" in rendered
    assert "^" in rendered  # the source line with a caret
    assert "hint:" in rendered or mk.code in ("E156", "E160"), rendered


def test_no_traceback_for_a_broken_training_program() -> None:
    bad = TRAIN.replace(LOSS, "NextByteLoss(Theta[1..2], data)")
    front = compile_source(bad, "b.lmpm", raise_errors=False)
    assert front.errors


def test_the_base_is_clean() -> None:
    front = compile_source(TRAIN, "t.lmpm", raise_errors=False, strict=True, known_names=set())
    assert not front.diagnostics, [d.render() for d in front.diagnostics]


# ---- the command line --------------------------------------------------------------------------


def _lmpm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lmpm", *args], capture_output=True, text=True, check=False
    )


def test_check_and_show_the_example() -> None:
    r = _lmpm("check", str(EXAMPLE))
    assert r.returncode == 0, r.stderr
    assert "warning" not in r.stdout + r.stderr
    r = _lmpm("show", str(EXAMPLE), "--format", "text")
    assert r.returncode == 0 and "Theta" in r.stdout, r.stderr


def test_fmt_round_trips_the_training_program(tmp_path: Path) -> None:
    path = tmp_path / "t.lmpm"
    path.write_text(TRAIN)
    assert _lmpm("fmt", str(path)).returncode == 0
    assert _lmpm("fmt", str(path), "--check").returncode == 0
    before = print_ir(compile_source(TRAIN, "P").ir)
    assert print_ir(compile_source(path.read_text(), "P").ir) == before
    assert _lmpm("fmt", str(EXAMPLE), "--check").returncode == 0


# ---- options round-trip into the spec ----------------------------------------------------------

_NUM = st.one_of(
    st.integers(1, 1000).map(float),
    st.floats(1e-6, 100.0, allow_nan=False, allow_infinity=False),
)


@st.composite
def _options(draw: st.DrawFn) -> dict[str, object]:
    opts: dict[str, object] = {
        "steps": draw(st.integers(1, 10**6)),
        "batch": draw(st.integers(1, 4096)),
    }
    if draw(st.booleans()):
        opts["optimizer"] = draw(st.sampled_from(OPTIMIZERS))
    if draw(st.booleans()):
        opts["lr"] = draw(_NUM)
    if draw(st.booleans()):
        opts["weight_decay"] = draw(st.one_of(st.just(0.0), _NUM))
    if draw(st.booleans()):
        opts["momentum"] = draw(st.floats(0.0, 0.999, allow_nan=False))
    if draw(st.booleans()):
        opts["clip"] = draw(_NUM)
    if draw(st.booleans()):
        opts["schedule"] = draw(st.sampled_from(SCHEDULES))
    if draw(st.booleans()):
        opts["warmup"] = draw(st.integers(0, 10**5))
    if draw(st.booleans()):
        opts["seed"] = draw(st.integers(-(10**9), 10**9))
    keys = draw(st.permutations(sorted(opts)))
    return {k: opts[k] for k in keys}


def _lit(v: object) -> str:
    if isinstance(v, str):
        return f'"{v}"'
    if isinstance(v, float):
        return repr(v)
    return str(v)


@st.composite
def _policy(draw: st.DrawFn) -> tuple[str, PolicySpec]:
    kind = draw(st.sampled_from(("diloco", "average", "best")))
    if kind == "average":
        return "average", PolicySpec("average")
    if kind == "best":
        return "satisfy(max_constraints_then_score)", PolicySpec("best")
    lr = draw(_NUM)
    mom = draw(st.floats(0.0, 0.999, allow_nan=False))
    nest = draw(st.sampled_from((None, 0, 1)))
    text = f"diloco(outer_lr={lr!r}, momentum={mom!r}" + (
        f", nesterov={nest})" if nest is not None else ")"
    )
    return text, PolicySpec("diloco", lr, mom, nest != 0)


@settings(max_examples=60, deadline=None)
@given(_options(), _policy(), st.integers(1, 64), st.integers(1, 512))
def test_valid_options_round_trip_into_the_spec(
    opts: dict[str, object], policy: tuple[str, PolicySpec], length: int, rows: int
) -> None:
    body = ", ".join(f"{k}={_lit(v)}" for k, v in opts.items())
    src = (
        f"value D : Token[Byte] shape Grid2D({length}, {rows})\n"
        "value P : Params[M] shape Tensors()\n"
        "rule R:\n  on P[*]\n  read {d = D[*]}\n"
        f"  emit proposal P[*] := minimize(Loss(P, d), {body})\n"
        f"commit P[*] using {policy[0]}\n"
    )
    spec = train_spec(compile_source(src).ir, {})
    assert spec is not None
    assert spec == TrainSpec(
        ParamsSpec("P", "M", "tensors", spec.params.span),
        MinimizeSpec(
            "R",
            "Loss",
            (DataSpec("D", "d", length, rows, 256),),
            span=spec.rule.span,
            **opts,  # type: ignore[arg-type]
        ),
        policy[1],
        (),
        "<input>",
    )
