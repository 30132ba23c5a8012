"""The committed JSON Schema is the generated one, and every example's IR validates against it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = ROOT / "schema" / "lmpm-ir.schema.json"
EXAMPLES = sorted((ROOT / "examples").glob("*.lmpm"))


def test_committed_schema_is_current() -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gen_schema
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    assert SCHEMA.read_text() == gen_schema.render(), "run python scripts/gen_schema.py"
    jsonschema.Draft202012Validator.check_schema(json.loads(SCHEMA.read_text()))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_emitted_ir_validates(path: Path) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "lmpm.cli", "check", str(path), "--emit-ir", "json"],
        capture_output=True,
        text=True,
        check=True,
    )
    doc = json.loads(res.stdout)
    jsonschema.validate(doc, json.loads(SCHEMA.read_text()), cls=jsonschema.Draft202012Validator)
    assert doc["version"] == 1


def test_schema_rejects_a_broken_document() -> None:
    from lmpm.ir import compile_file
    from lmpm.ir.serialize import to_dict

    doc = to_dict(compile_file(EXAMPLES[0]).ir)
    doc["values"][0]["shape"] = "Cube"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, json.loads(SCHEMA.read_text()))
