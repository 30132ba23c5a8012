"""The committed JSON Schema is the generated one, and every example's IR validates against it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

# a dev dependency; a GPU image may lack it (scripts/gpu_check.sh --download-wheels brings it)
jsonschema = pytest.importorskip("jsonschema")

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


def test_from_json_never_turns_strings_into_code(tmp_path: Path) -> None:
    """A CONST holding a string (or a VAR that is no identifier) is refused when read, and the
    expression compiler never gets to see it."""
    from lmpm.ir import compile_source
    from lmpm.ir.serialize import IRFormatError, from_json, to_dict

    marker = tmp_path / "pwned"
    src = "param N = 4\nvalue T : Token[Byte] shape Seq(N)\nvisible T[t] <- T[0..t-1] when t > 0\n"
    good = to_dict(compile_source(src).ir)
    text = json.dumps(good)
    payload = f"__import__('pathlib').Path({str(marker)!r}).write_text('x')"
    for bad in (
        text.replace('"value": 0', json.dumps({"value": payload})[1:-1], 1),
        text.replace('"value": "t"', '"value": "t) or (1"', 1),
        text.replace('"value": 0', '"value": true', 1),
    ):
        assert bad != text
        with pytest.raises(IRFormatError, match="malformed IR"):
            from_json(bad)
    assert not marker.exists()


def test_expression_compiler_refuses_a_non_integer_constant() -> None:
    from lmpm.ir.eval import EvalError, compile_expr
    from lmpm.ir.nodes import Expr, Op

    with pytest.raises(EvalError, match="not an integer"):
        compile_expr(Expr(Op.CONST, (), "__import__('os').getpid()"), ())
