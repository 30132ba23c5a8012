"""Printed IR of every example against golden files; JSON round trip; the IR lint."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lmpm.ir import compile_file, lint
from lmpm.ir.printer import print_ir
from lmpm.ir.serialize import from_json, to_json

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).with_name("golden")
EXAMPLES = sorted((ROOT / "examples").glob("*.lmpm"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_printed_ir_matches_golden(path: Path) -> None:
    front = compile_file(path)
    text = print_ir(front.ir).replace(str(path), f"examples/{path.name}")
    golden = GOLDEN / f"{path.stem}.ir.txt"
    if os.environ.get("LMPM_UPDATE_GOLDEN") or not golden.exists():
        golden.write_text(text)
    assert text == golden.read_text()


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_json_round_trip_and_lint(path: Path) -> None:
    ir = compile_file(path).ir
    assert lint(ir) == []
    assert from_json(to_json(ir)) == ir
