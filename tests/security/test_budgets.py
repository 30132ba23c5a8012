"""Budgets before work: a plan past the memory is refused with its number before anything is
built; .npy headers are checked before their data is read; render's colours and a program path
that is not a regular file cannot exhaust memory or hang."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from received_run import copy_run, run_cli

from lmpm.ir import compile_file, compile_source
from lmpm.ir.eval import bind_params
from lmpm.resolve.budget import TABLE_BYTES_PER_ENTRY, machine_memory, table_bound
from lmpm.visibility.gather import gather_table, table_costs

ROOT = Path(__file__).resolve().parents[2]

CAUSAL = """\
param N = {n}
value Txt : Token[Byte] shape Seq(N)
visible Txt[t] <- Txt[0..t-1] when t > 0
rule R:
  on Txt[t]
  read {{ctx = Txt[0..t-1]}}
  emit proposal Txt[t] := RandomTokens(ctx, k=2)
commit Txt[*] using satisfy(max_constraints_then_score)
"""


def test_the_table_cost_is_the_table_built() -> None:
    ir = compile_source(CAUSAL.format(n=50)).ir
    costs = table_costs(ir, {"N": 50})
    s = ir.stencils[0]
    built = gather_table(ir, {"N": 50}, "Txt", "Txt", s.axes, s.binders, s.guard, s.vars)
    assert [(c.rows, c.columns) for c in costs] == [(50, built.K)] * 2  # the union and the read


def test_a_causal_n_of_20000_is_counted_without_building_it() -> None:
    ir = compile_source(CAUSAL.format(n=20000)).ir
    need = sum(c.nbytes() for c in table_costs(ir, {"N": 20000}))
    assert need == 2 * 20000 * 19999 * TABLE_BYTES_PER_ENTRY  # ~19 GiB, counted from two boxes


@pytest.mark.parametrize("example", sorted(p.name for p in (ROOT / "examples").glob("*.lmpm")))
def test_the_bound_from_the_sizes_holds_what_the_boxes_count(example: str) -> None:
    """`lmpm check` stays torch-free when this bound fits: it must never be below the boxes'."""
    ir = compile_file(ROOT / "examples" / example).ir
    env = bind_params(ir, {})
    exact = sum(c.nbytes() for c in table_costs(ir, env))
    bound = table_bound(ir, env)
    assert bound is not None and exact <= bound <= 32 * exact + 2**20  # and not far above


def test_a_plain_check_refuses_a_causal_plan_past_this_machine(tmp_path: Path) -> None:
    """No --max-memory: the machine's memory is the limit, as for `lmpm run` (issue 44: N = 20000
    needs 19.4 GiB, so an N past this machine is chosen)."""
    ram = machine_memory()
    assert ram is not None
    n = int((ram / (2 * TABLE_BYTES_PER_ENTRY)) ** 0.5) + 1000  # two tables of n x (n-1)
    prog = tmp_path / "causal.lmpm"
    prog.write_text(CAUSAL.format(n=n))
    rc, _, err = run_cli(["check", str(prog)])
    need = 2 * n * (n - 1) * TABLE_BYTES_PER_ENTRY + n * 64
    assert rc == 2 and "gather tables need about" in err and f"({need:,} bytes)" in err, err
    assert "this machine has" in err
    rc, out, _ = run_cli(["check", str(prog), "--json"])
    assert rc == 1 and '"code": "U049"' in out  # (--json: diagnostics, exit 1)
    rc, _, err = run_cli(["check", str(prog), "--set", "N=2000"])
    assert rc == 0, err


def test_run_refuses_a_plan_past_max_memory_before_any_work(tmp_path: Path) -> None:
    prog = tmp_path / "causal.lmpm"
    prog.write_text(CAUSAL.format(n=3000))
    out = tmp_path / "out"
    rc, _, err = run_cli(["run", str(prog), "--out", str(out), "--max-memory", "100M"])
    assert rc == 2 and "gather tables need about" in err and "--max-memory allows" in err, err
    assert not out.exists()
    rc, _, err = run_cli(["run", str(prog), "--out", str(out), "--max-memory", "lots"])
    assert rc == 2 and "not a size" in err


def test_check_counts_the_tables_when_asked(tmp_path: Path) -> None:
    prog = tmp_path / "causal.lmpm"
    prog.write_text(CAUSAL.format(n=3000))
    rc, _, err = run_cli(["check", str(prog), "--max-memory", "100M"])
    assert rc == 2 and "gather tables need about" in err, err
    rc, _, err = run_cli(["check", str(prog), "--max-memory", "4G"])
    assert rc == 0, err


def test_an_npy_header_is_checked_before_its_data(tmp_path: Path) -> None:
    """A 2 GiB array in a sparse file: refused by its header's shape (R004), nothing loaded."""
    prog = tmp_path / "p.lmpm"
    prog.write_text(CAUSAL.format(n=8))
    big = tmp_path / "big.npy"
    with open(big, "wb") as f:
        np.lib.format.write_array_header_1_0(
            f, {"descr": "<i8", "fortran_order": False, "shape": (2**28,)}
        )
        f.truncate(2**31 + 128)
    out = tmp_path / "out"
    rc, _, err = run_cli(["run", str(prog), "--input", f"Txt={big}", "--out", str(out)])
    assert rc == 1 and "[R004]" in err and "268435456" in err, err
    short = tmp_path / "short.npy"
    np.save(short, np.arange(8))
    short.write_bytes(short.read_bytes()[:-9])
    rc, _, err = run_cli(["run", str(prog), "--input", f"Txt={short}", "--out", str(out)])
    assert rc == 1 and "[R003]" in err and "truncated" in err, err


def test_render_colours_a_token_of_ten_to_the_twelve(tmp_path: Path) -> None:
    run = copy_run(tmp_path / "run")
    (run / "lmpm.db").unlink()  # no program: the vocabulary is guessed from the tokens
    grid = np.zeros((6, 4), dtype=np.int64)
    grid[2, 3] = 10**12
    np.save(run / "G.npy", grid)
    rc, _, err = run_cli(["render", str(run)])
    assert rc == 0, err
    assert (run / "render" / "G.png").is_file()


def test_render_refuses_a_bad_npy_with_a_code(tmp_path: Path) -> None:
    run = copy_run(tmp_path / "run")
    (run / "G.npy").write_bytes(b"\x93NUMPY\x01\x00{'descr': '<i8', 'shape': (")
    rc, _, err = run_cli(["render", str(run)])
    assert rc == 1 and "[D035]" in err, err


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_program_path_must_be_a_regular_file(tmp_path: Path, kind: str) -> None:
    if kind == "fifo":
        path = tmp_path / "prog.lmpm"
        os.mkfifo(path)
    else:
        path = Path("/dev/zero")
    for cmd in ("check", "run"):
        rc, _, err = run_cli([cmd, str(path)])
        assert rc == 2 and "not a regular file" in err, err
