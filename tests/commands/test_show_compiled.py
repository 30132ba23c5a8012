"""`lmpm show FILE --compiled`: which values' epoch steps compile and why the others run eagerly,
what each graph bakes in, and the traced graph summarized (traced with fake tensors, never
compiled); and the note `lmpm run --compile` prints before a step compiles."""

from __future__ import annotations

import io
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import torch

from lmpm.cli import main
from lmpm.commands._compiled_view import op_counts, written_inputs
from lmpm.commands.run import compiling_note

ROOT = Path(__file__).resolve().parents[2]
EX = ROOT / "examples"


def cli(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lmpm.cli", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def inproc(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main(list(argv))
    return rc, out.getvalue(), err.getvalue()


def test_text_compiles_with_its_spec_and_graph() -> None:
    proc = cli("show", str(EX / "text.lmpm"), "--compiled", "--graph")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "--compile: 1 of 1 value compiled" in out
    assert "Txt: compiled" in out
    # a built-in model that compiles itself is still an eager island: it runs outside the step
    assert "│ model (own lmpm_compile) │ ByteLM    │ rule NextByte │ Txt   │" in out
    assert "│ score (own lmpm_compile) │ TextScore │ rule NextByte │ Txt   │" in out
    assert "NextByte (rule 0) proposes it: ByteLM(context, k=8" in out
    assert "satisfy(max_constraints_then_score)" in out
    assert 'Plain  require Txt[t] in Set(97..122, " ,.")  priority 10, on every cell' in out
    assert "Txt (its own clocks): per cell" in out
    assert "reads        context: a compiled gather per open-cell bucket" in out
    # what --backend cuda captures as a CUDA graph, and what it leaves out
    assert "on cuda      captured: the step, one CUDA graph per bucket" in out
    assert "not captured: the model ByteLM" in out
    # epoch 0 opens one cell; the rule's k=8 proposals are unrolled into the graph
    assert "traced at 1 open cell (what epoch 0 opens)" in out
    assert "8 proposals per cell" in out
    assert "index_put_ ×8" in out and "aten ops:" in out
    assert "18 inputs: e, cells, prop, sc, fired, payload" in out and "vtables[Plain]" in out
    assert "9 outputs: winner, changed" in out
    written = next(line for line in out.splitlines() if "written in place:" in line)
    for name in ("payload", "committed", "clock", "rule", "epoch", "kept_score", "why"):
        assert name in written
    assert "from_input" not in written  # only an `inputs()` constraint writes it
    # --graph: the traced graph's code, its inputs named
    assert "arg5_1 = payload" in out and "def forward(" in out
    assert "torch.ops.aten.index_put_.default(arg5_1" in out
    assert "Traceback" not in proc.stderr


def test_sudoku_grid_eager_cand_compiled() -> None:
    proc = cli("show", str(EX / "sudoku.lmpm"), "--compiled")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "--compile: 1 of 2 values compiled" in out
    assert "Cand: compiled" in out
    assert "Grid: eager island: constraint `Row` is a bound Python predicate" in out
    # the tables: every value, and the eager islands (models, bound predicates)
    assert "│ Cand  │ compiled " in out
    assert "│ Grid  │ eager island: constraint `Row` is a bound Python predicate │" in out
    assert "│ model     │ Candidates │ rule Notes        │ Cand  │" in out
    for c in ("Row", "Column", "Box"):
        assert f"│ predicate │ Duplicate  │ constraint {c:<6} │ Grid  │" in out
    assert "on cuda nothing of it is captured as a CUDA graph" in out
    assert "winner_takes_all" in out and "constraints  none checked at run time" in out
    # Cand's clock reads Grid's clocks: Grid's clock array is an input of Cand's graph
    assert "clock_src[Grid]" in out
    assert "traced at 41 open cells padded to 64" in out
    assert "index_put_ ×" in out
    assert "def forward(" not in out  # no --graph


def test_latent_two_rules_compiled_predicate_eager() -> None:
    proc = cli("show", str(EX / "latent.lmpm"), "--compiled")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "--compile: 1 of 2 values compiled" in out
    assert "Z: eager island: constraint `Bounded` is a bound Python predicate" in out
    # M's two rules: one graph with both rules' columns, each rule's clock reads
    assert "M: compiled" in out
    assert "Own (rule 1) proposes it: Copy(own)" in out
    assert "Around (rule 2) proposes it: BoxMean(around)" in out
    assert "Z (rule Around): per cell, up to 9 cells, masked" in out
    assert "not captured: the models Copy and BoxMean" in out
    assert "2 proposals per cell" in out and "aten ops" in out


@pytest.mark.parametrize(
    "flags",
    [
        ["--compiled", "--format", "dot"],
        ["--compiled", "--plan"],
        ["--compiled", "--vm"],
        ["--graph"],
    ],
)
def test_bad_combinations_are_usage_errors(flags: list[str]) -> None:
    proc = cli("show", str(EX / "text.lmpm"), *flags, timeout=60)
    assert proc.returncode == 2
    assert "usage error" in proc.stderr and "--compiled" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_bindings_come_from_bind(tmp_path: Path) -> None:
    """A program's own model names are bound with --bind, as for `lmpm run`; unbound, it is the
    run's binding error (no traceback)."""
    prog = tmp_path / "p.lmpm"
    prog.write_text(
        "param N = 8\n"
        "value A : Token[Byte] shape Seq(N) clock Lamport\n"
        "visible A[t] <- A[0..t-1] when t > 0\n"
        "rule Gen:\n"
        "  on A[t]\n"
        "  read {context = A[0..t-1]}\n"
        "  emit proposal A[t] := MyGen(context, k=3)\n"
        "constraint Lower:\n"
        "  require A[t] in Set(97..122) priority 10\n"
        "commit A[*] using winner_takes_all\n"
    )
    binds = tmp_path / "binds.py"
    binds.write_text(
        "from lmpm.models.null import random_tokens\n\n"
        "def my_gen(inputs, **kw):\n    return random_tokens(inputs, **kw)\n\n"
        "LMPM_BINDINGS = {'MyGen': my_gen}\n"
    )
    rc, out, err = inproc("show", str(prog), "--compiled", "--bind", str(binds))
    assert rc == 0, err
    assert "A: compiled" in out and "MyGen(context, k=3)" in out
    assert "3 proposals per cell" in out and "Lower  require" in out
    # the user's own model may write into its inputs: it gets eager copies
    assert "reads        gathered eagerly (a bound model gets copies" in out
    rc, out, err = inproc("show", str(prog), "--compiled")
    assert rc == 1 and "MyGen" in err and "Traceback" not in err


def test_graph_summary_helpers() -> None:
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x: torch.Tensor, y: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        x.index_put_((i,), y.index_select(0, i))  # writes x
        x[0].add_(1)  # writes x through a view
        return torch.where(y > 0, y, -y) + torch.where(y < 0, y, y)  # reads y

    gm = make_fx(f, tracing_mode="fake")(torch.zeros(4), torch.ones(4), torch.tensor([1, 2]))
    ops = op_counts(gm)
    assert ops["where"] == 2 and ops["index_put_"] == 1 and ops["add_"] == 1
    assert written_inputs(gm) == [0]


def test_compiling_note_words() -> None:
    assert compiling_note("Txt", 1) == "compiling the epoch step of Txt (1 open cell)…"
    assert (
        compiling_note("Vid", 2048) == "compiling the epoch step of Vid (up to 2,048 open cells)…"
    )


def test_run_compile_says_it_is_compiling(tmp_path: Path) -> None:
    """Not --quiet, stderr not a terminal (no progress bar): the note is a plain line on stderr
    before the first epoch's step compiles; --quiet prints no note."""
    prompt = str(EX / "text" / "prompt.txt")
    base = ["run", str(EX / "text.lmpm"), "--input", f"Txt={prompt}", "--compile", "--epochs", "2"]
    proc = cli(*base, "--out", str(tmp_path / "a"))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert lines[0] == "compiling the epoch step of Txt (1 open cell)…", proc.stderr
    assert "compiled 1 of 1 values" in proc.stderr
    assert "\x1b[" not in proc.stderr  # plain text: no terminal codes
    quiet = cli(*base, "--out", str(tmp_path / "b"), "--quiet")
    assert quiet.returncode == 0, quiet.stderr
    assert "compiling the epoch step" not in quiet.stderr
    assert "compiled 1 of 1 values" in quiet.stderr


def test_every_value_is_listed_inputs_too(tmp_path: Path) -> None:
    """A value no rule proposes is listed as an input; the summary counts the proposed ones."""
    prog = tmp_path / "p.lmpm"
    prog.write_text(
        "value S : Token[4] shape Seq(3)\n"
        "value A : Token[4] shape Seq(3)\n"
        "visible A[t] <- S[t]\n"
        "rule R:\n"
        "  on A[t]\n"
        "  read {s = S[t]}\n"
        "  emit proposal A[t] := Uniform(s)\n"
        "commit A[*] using satisfy\n"
    )
    rc, out, err = inproc("show", str(prog), "--compiled")
    assert rc == 0, err
    assert f"{prog}: --compile: 1 of 1 value compiled" in out
    assert "│ A     │ compiled " in out
    assert "│ S     │ input: no rule proposes it (no decision to compile) │" in out
    assert "│ model │ Uniform │ rule R │ A     │" in out


def test_quorum_replicas_compile(tmp_path: Path) -> None:
    prog = tmp_path / "q.lmpm"
    prog.write_text(
        "value Txt : Token[3] shape Seq(4)\n"
        "rule A:\n  on Txt[t]\n  emit proposal Txt[t] := Uniform(k=2)\n"
        "commit Txt[*] using quorum(2 of 3, satisfy)\n"
    )
    proc = cli("show", str(prog), "--compiled")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "Txt: compiled" in out
    assert "A (rule 0, 3 replicas) proposes it: Uniform(k=2)" in out
    assert "quorum(2 of 3, satisfy) (a payload 2 replicas proposed; then satisfy)" in out
    assert "6 proposals per cell" in out  # 3 replicas of k=2, unrolled
    assert "11 outputs: winner, changed" in out and "was, lost, checksums," in out
