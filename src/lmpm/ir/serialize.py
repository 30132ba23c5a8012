"""Versioned JSON for the Lamport IR, and the JSON Schema it follows.

Every node is an object with a ``"node"`` tag; spans are ``[line, col, end_line, end_col]`` with the
file stored once on the program. ``from_json(to_json(p)) == p`` for every program.

>>> from lmpm.ir import compile_source
>>> p = compile_source("value Txt : Token[Byte] shape Seq(4)\\n").ir
>>> from_json(to_json(p)) == p
True
"""

from __future__ import annotations

import dataclasses
import enum
import json
import types
import typing
from functools import cache
from typing import Any

from lmpm.errors import LmpmError, Span
from lmpm.ir import nodes
from lmpm.ir.nodes import IR_VERSION, Expr, Op, Program

_NODE_TYPES: dict[str, type] = {
    name: obj
    for name, obj in vars(nodes).items()
    if isinstance(obj, type) and dataclasses.is_dataclass(obj) and obj.__module__ == nodes.__name__
}


@cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, vars(nodes))


def _encode(x: Any) -> Any:
    if isinstance(x, Span):
        return x.to_json()
    if isinstance(x, enum.Enum):
        return x.value
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        out: dict[str, Any] = {"node": type(x).__name__}
        for f in dataclasses.fields(x):
            if isinstance(x, Program) and f.name == "file":
                continue
            out[f.name] = _encode(getattr(x, f.name))
        return out
    if isinstance(x, tuple):
        return [_encode(i) for i in x]
    return x


def to_dict(p: Program) -> dict[str, Any]:
    d = _encode(p)
    d["file"] = p.file
    return d


def to_json(p: Program, indent: int | None = None) -> str:
    return json.dumps(to_dict(p), indent=indent, ensure_ascii=False)


class IRFormatError(LmpmError):
    """The JSON is not an IR document this version can read."""


_ARITY = {Op.CONST: 0, Op.VAR: 0, Op.PARAM: 0, Op.NEG: 1, Op.NOT: 1}  # others: 2


def _check_expr(e: Expr) -> Expr:
    """An expression read from JSON is data: a CONST holds an int, a VAR/PARAM an identifier, and
    operators the right number of operands. (Expressions are compiled to Python for speed; a
    string smuggled into a CONST must never reach that compiler.)"""
    if e.op == Op.CONST:
        ok = type(e.value) is int and not e.args
    elif e.op in (Op.VAR, Op.PARAM):
        ok = isinstance(e.value, str) and e.value.isidentifier() and not e.args
    else:
        ok = e.value is None and len(e.args) == _ARITY.get(e.op, 2)
    if not ok:
        raise IRFormatError(
            f"malformed IR expression: op {e.op.value!r} with value {e.value!r} and "
            f"{len(e.args)} operand(s)",
            code="I004",
        )
    return e


def _primitive(x: Any, hint: Any) -> bool:
    """Does a JSON scalar fit a field's primitive type (bool is not an int here)?"""
    if hint is bool:
        return isinstance(x, bool)
    if hint is int:
        return type(x) is int
    if hint is float:
        return type(x) in (int, float)
    if hint is str:
        return isinstance(x, str)
    if hint is type(None):
        return x is None
    return True


def _decode(x: Any, hint: Any, file: str) -> Any:
    origin = typing.get_origin(hint)
    if hint in (int, str, bool):
        if not _primitive(x, hint):
            raise IRFormatError(
                f"malformed IR document: {json.dumps(x)[:40]} is not a {hint.__name__}",
                code="I002",
            )
        return x
    if hint is Span:
        if not (isinstance(x, list) and len(x) == 4 and all(type(i) is int for i in x)):
            raise IRFormatError(f"malformed IR span {json.dumps(x)[:40]}", code="I002")
        return Span.from_json(file, x)
    if origin in (typing.Union, types.UnionType):
        opts = [a for a in typing.get_args(hint) if a is not type(None)]
        if x is None:
            return None
        if isinstance(x, dict):
            return _decode_node(x, file)
        for o in opts:
            if isinstance(o, type) and issubclass(o, enum.Enum):
                return o(x)
            if o is Span:
                return _decode(x, Span, file)
        if not any(_primitive(x, o) for o in opts if o in (int, float, str, bool)):
            raise IRFormatError(
                f"malformed IR document: {json.dumps(x)[:40]} is not one of {hint}", code="I002"
            )
        return x
    if origin is tuple:
        (elem, _ellipsis) = typing.get_args(hint)
        if not isinstance(x, list):
            raise IRFormatError(
                f"malformed IR document: expected a list, got {x!r:.40}", code="I002"
            )
        return tuple(_decode(i, elem, file) for i in x)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return hint(x)
    if isinstance(x, dict):
        return _decode_node(x, file)
    return x


def _decode_node(d: dict[str, Any], file: str) -> Any:
    cls = _NODE_TYPES.get(d.get("node", ""))
    if cls is None:
        raise IRFormatError(f"unknown IR node {d.get('node')!r}", code="I002")
    hints = _hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if cls is Program and f.name == "file":
            kwargs["file"] = file
            continue
        if f.name not in d and f.default is not dataclasses.MISSING:
            continue  # a field added with a default (Constraint.hard): older documents lack it
        if f.name not in d:
            raise IRFormatError(f"IR node {cls.__name__} lacks field {f.name!r}", code="I002")
        kwargs[f.name] = _decode(d[f.name], hints[f.name], file)
    node = cls(**kwargs)
    return _check_expr(node) if isinstance(node, Expr) else node


def from_dict(d: dict[str, Any]) -> Program:
    if not isinstance(d, dict) or d.get("node") != "Program":
        raise IRFormatError("not an LMPM IR document (no top-level Program node)", code="I001")
    version = d.get("version")
    if version != IR_VERSION:
        raise IRFormatError(
            f"IR version {version} is not supported (this LMPM reads version {IR_VERSION})",
            code="I003",
        )
    try:
        prog = _decode_node(d, str(d.get("file", "<ir>")))
    except (KeyError, TypeError, ValueError) as e:
        raise IRFormatError(f"malformed IR document: {e}", code="I002") from None
    assert isinstance(prog, Program)
    return prog


def from_json(text: str) -> Program:
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise IRFormatError(f"not JSON: {e}", code="I001") from None
    return from_dict(d)


# ---- JSON Schema ---------------------------------------------------------------------------------


def _schema_of(hint: Any) -> dict[str, Any]:
    origin = typing.get_origin(hint)
    if hint is Span:
        return {"$ref": "#/$defs/Span"}
    if hint is int:
        return {"type": "integer"}
    if hint is float:
        return {"type": "number"}
    if hint is str:
        return {"type": "string"}
    if hint is bool:
        return {"type": "boolean"}
    if hint is type(None):
        return {"type": "null"}
    if origin in (typing.Union, types.UnionType):
        return {"anyOf": [_schema_of(a) for a in typing.get_args(hint)]}
    if origin is tuple:
        return {"type": "array", "items": _schema_of(typing.get_args(hint)[0])}
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return {"enum": [m.value for m in hint]}
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return {"$ref": f"#/$defs/{hint.__name__}"}
    raise AssertionError(f"no schema for {hint!r}")


def json_schema() -> dict[str, Any]:
    """The JSON Schema of the IR document (committed as schema/lmpm-ir.schema.json)."""
    defs: dict[str, Any] = {
        "Span": {
            "type": "array",
            "items": {"type": "integer"},
            "minItems": 4,
            "maxItems": 4,
            "description": "[line, col, end_line, end_col], 1-based, end_col exclusive",
        },
    }
    for name, cls in sorted(_NODE_TYPES.items()):
        hints = _hints(cls)
        props: dict[str, Any] = {"node": {"const": name}}
        required = ["node"]
        for f in dataclasses.fields(cls):
            props[f.name] = _schema_of(hints[f.name])
            if f.default is dataclasses.MISSING:
                required.append(f.name)
        defs[name] = {
            "type": "object",
            "properties": props,
            "required": required,
            "additionalProperties": False,
        }
    root = dict(defs["Program"])
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"https://lmpm.dev/schema/lmpm-ir-v{IR_VERSION}.json",
        "title": f"LMPM Lamport IR, version {IR_VERSION}",
        **root,
        "$defs": defs,
    }
