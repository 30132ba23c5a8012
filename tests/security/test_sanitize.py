"""Printable output: strings from a received log reach the terminal escaped, tables and --json
alike; rich markup in them is shown as written."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from received_run import ROOT, copy_run, pristine_training, run_cli, sql

from lmpm.printable import printable, printable_lines, printable_tree

CLEAR = "\x1b[2J"
OSC52 = "\x1b]52;c;aGVsbG8=\x07"  # write "hello" to the clipboard
HOSTILE = f"Low{CLEAR}{OSC52}[link=https://x.example]y[/link]\u202e"


def test_printable_escapes_controls_and_keeps_unicode() -> None:
    assert printable("café → 猫") == "café → 猫"
    assert printable(CLEAR) == "\\x1b[2J"
    assert printable("\x9b1m") == "\\x9b1m"  # C1 CSI
    assert printable("a\u202eb") == "a\\u202eb"  # right-to-left override
    assert printable_lines("a\x07\nb") == "a\\x07\nb"
    assert printable_tree({"k\x1b": ("[b]x", 1)}, markup=True) == {"k\\x1b": ("\\[b]x", 1)}


def _hostile_run(tmp_path: Path) -> Path:
    run = copy_run(tmp_path / "run")
    sql(
        run / "lmpm.db",
        f"UPDATE constraint_defs SET name = '{HOSTILE}'",
        f"""UPDATE meta SET value = '{json.dumps(HOSTILE)}' WHERE key = 'program_file'""",
    )
    return run


def test_trace_shows_no_escape_from_the_log(tmp_path: Path) -> None:
    run = _hostile_run(tmp_path)
    for argv in (["trace", str(run)], ["trace", str(run), "--json"]):
        rc, out, err = run_cli(argv)
        assert rc == 0, err
        assert "\x1b" not in out and "\x07" not in out and "\u202e" not in out
        assert "\\x1b[2J" in out
    rc, out, _ = run_cli(["trace", str(run)])
    assert "[link=https://x.example]" in out  # shown as written, not a hyperlink


def test_a_cell_story_shows_no_escape_from_the_log(tmp_path: Path) -> None:
    run = _hostile_run(tmp_path)
    sql(run / "lmpm.db", f"UPDATE trace_cells SET coord = '{HOSTILE}'")
    for extra in ([], ["--json"]):
        rc, out, err = run_cli(["trace", str(run), "--cell", "G[1,2]", *extra])
        assert rc == 0, err
        assert "\x1b" not in out and "\x07" not in out


def test_an_error_quoting_the_log_shows_no_escape(tmp_path: Path) -> None:
    run = copy_run(tmp_path / "run")
    sql(run / "lmpm.db", f'CREATE TRIGGER "{HOSTILE}" AFTER INSERT ON meta BEGIN SELECT 1; END')
    rc, _, err = run_cli(["trace", str(run)])
    assert rc == 1 and "[D040]" in err
    assert "\x1b" not in err and "\x07" not in err


def test_vm_status_shows_no_escape_from_the_log(tmp_path: Path) -> None:
    """A workflow run's decisions, captures and text from a received log (issue 44: `lmpm vm
    status` printed them raw)."""
    run = tmp_path / "vm"
    tools = str(ROOT / "examples" / "vm" / "tools.py")
    prog = str(ROOT / "examples" / "vm.lmpm")
    rc, _, err = run_cli(["vm", "run", prog, "--set", "B=2", "--out", str(run), "--bind", tools])
    assert rc == 0, err
    sql(
        run / "lmpm.db",
        f"UPDATE vm_streams SET decisions = '{json.dumps([HOSTILE])}', "
        f"captures = '{json.dumps({HOSTILE: HOSTILE})}', status = '{HOSTILE}'",
        f"UPDATE vm_zones SET name = '{HOSTILE}'",
    )
    for extra in ([], ["--json"], ["--stream", "0"]):
        rc, out, err = run_cli(["vm", "status", str(run), *extra])
        assert rc == 0, err
        assert "\x1b" not in out + err and "\x07" not in out + err and "\\x1b[2J" in out


def test_top_shows_no_escape_from_a_training_log(tmp_path: Path) -> None:
    run = copy_run(tmp_path / "t", pristine_training())
    sql(
        run / "train.db",
        f"""UPDATE meta SET value = '{json.dumps(HOSTILE)}' WHERE key = 'program_file'""",
        f"UPDATE workers SET host = '{HOSTILE}', backend = '{HOSTILE}'",
        f"INSERT INTO worker_faults VALUES (1, 1, 'w0', '{HOSTILE}', '{HOSTILE}', 0.5, 1, 0)",
        f"INSERT INTO constraint_events VALUES (1, '{HOSTILE}', 'require', 1, 1, 'rejected')",
    )
    rc, out, err = run_cli(["top", str(run), "--once"])
    assert rc == 0, err
    assert "\x1b" not in out + err and "\x07" not in out + err and "\\x1b" in out
