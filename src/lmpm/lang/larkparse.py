"""The reference parser: lark (LALR(1)) over ``lmpm.lark`` with an indentation post-lexer.

:func:`lmpm.lang.parser.parse` tries the hand-written parser in :mod:`lmpm.lang.fast` first and comes
here when it declines — for every syntax error (this module turns lark's exceptions into
ParseErrors with spans and expected-token hints) and for rare constructs the fast path leaves alone.
Imported lazily: a program that parses on the fast path never loads lark.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from functools import cache
from pathlib import Path
from typing import Any

from lark import Lark, Token, Transformer, v_args
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken
from lark.lark import PostLex

from lmpm.errors import ParseError, Span
from lmpm.lang import ast, fast

MAX_NESTING = (
    fast.MAX_NESTING
)  # brackets deeper than this are refused: nobody writes them, fuzzers do

_OPEN = {"LPAR": "RPAR", "LSQB": "RSQB", "LBRACE": "RBRACE"}
_CLOSE = {v: k for k, v in _OPEN.items()}

# Friendly names for the parser's expected-token sets.
_TOKEN_NAMES = {
    "_NL": "end of line",
    "_INDENT": "an indented block",
    "_DEDENT": "end of block",
    "NAME": "a name",
    "INT": "an integer",
    "FLOAT": "a decimal number",
    "STRING": "a string",
    "LPAR": "'('",
    "RPAR": "')'",
    "LSQB": "'['",
    "RSQB": "']'",
    "LBRACE": "'{'",
    "RBRACE": "'}'",
    "COMMA": "','",
    "COLON": "':'",
    "EQUAL": "'='",
    "CMP": "a comparison",
    "ADDOP": "'+' or '-'",
    "MULOP": "'*', '/' or '%'",
    "MINUS": "'-'",
    "STAR": "'*'",
    "KIND": "'forbid' or 'require'",
    "QMARK": "'?'",
    "ARROW": "'<-'",
    "ASSIGN": "':='",
    "DOTDOT": "'..'",
    "ELLIPSIS": "'...'",
}


def _span_of_token(file: str, tok: Token) -> Span:
    line = tok.line or 1
    col = tok.column or 1
    end_line = tok.end_line or line
    end_col = tok.end_column or col + 1
    return Span(file, line, col, end_line, max(end_col, col + 1) if end_line == line else end_col)


class _Layout(PostLex):
    """Turns newlines into INDENT/DEDENT tokens; newlines inside brackets are dropped.

    A hand-written version of lark's Indenter so every fault is a ParseError with a span.
    """

    always_accept = ("_NL",)

    def __init__(self) -> None:
        self.file = "<input>"

    def process(self, stream: Iterator[Token]) -> Iterator[Token]:
        stack: list[Token] = []  # open brackets
        levels = [0]
        last: Token | None = None
        for tok in stream:
            last = tok
            if tok.type == "_NL":
                if stack:
                    continue
                yield tok
                indent_str = tok.rsplit("\n", 1)[1]
                indent = indent_str.count(" ") + indent_str.count("\t") * 8
                if indent > levels[-1]:
                    levels.append(indent)
                    yield Token.new_borrow_pos("_INDENT", indent_str, tok)
                else:
                    while indent < levels[-1]:
                        levels.pop()
                        yield Token.new_borrow_pos("_DEDENT", indent_str, tok)
                    if indent != levels[-1]:
                        raise ParseError(
                            f"this line is indented to column {indent + 1}, which matches no "
                            f"enclosing block (blocks start at column {levels[-1] + 1})",
                            span=Span(
                                self.file, (tok.end_line or 1), 1, (tok.end_line or 1), indent + 2
                            ),
                            hint="indent the line like the block it belongs to",
                            code="P003",
                        )
                continue
            if tok.type in _OPEN:
                stack.append(tok)
                if len(stack) > MAX_NESTING:
                    raise ParseError(
                        f"brackets nested more than {MAX_NESTING} deep",
                        span=_span_of_token(self.file, tok),
                        code="P004",
                        hint="split the expression; LMPM indices and guards are shallow",
                    )
            elif tok.type in _CLOSE:
                if not stack or stack[-1].type != _CLOSE[tok.type]:
                    opened = (
                        f" (the open one is {stack[-1].value!r} at line {stack[-1].line})"
                        if stack
                        else ""
                    )
                    raise ParseError(
                        f"unbalanced {tok.value!r}{opened}",
                        span=_span_of_token(self.file, tok),
                        code="P005",
                        hint="every '(', '[' and '{' needs its matching closer",
                    )
                stack.pop()
            yield tok
        if stack:
            raise ParseError(
                f"{stack[-1].value!r} is never closed",
                span=_span_of_token(self.file, stack[-1]),
                code="P005",
                hint="add the matching closer",
            )
        while len(levels) > 1:
            levels.pop()
            if last is not None:
                yield Token.new_borrow_pos("_DEDENT", "", last)
            else:
                yield Token("_DEDENT", "")


@v_args(meta=False, inline=True)
class _Builder(Transformer[Token, Any]):
    """Builds AST nodes during the LALR parse (no intermediate tree)."""

    def __init__(self) -> None:
        super().__init__()
        self.file = "<input>"

    # spans --------------------------------------------------------------------------------------
    def _tok(self, tok: Token) -> Span:
        return _span_of_token(self.file, tok)

    @staticmethod
    def _join(a: Span, b: Span) -> Span:
        return Span(a.file, a.line, a.col, b.end_line, b.end_col)

    def _sp(self, *parts: Any) -> Span:
        spans = [s for p in parts if p is not None and (s := self._span_of(p)) is not None]
        return self._join(spans[0], spans[-1])

    def _span_of(self, p: Any) -> Span | None:
        if isinstance(p, Token):
            return self._tok(p) if p.line is not None else None
        return getattr(p, "span", None)

    # expressions --------------------------------------------------------------------------------
    def int_(self, tok: Token) -> ast.Int:
        if len(tok) > fast.MAX_INT_DIGITS:
            raise ParseError(
                f"integer literal with {len(tok)} digits; at most {fast.MAX_INT_DIGITS} are allowed",
                span=self._tok(tok),
                code="P008",
                hint="LMPM integers are sizes, indices and priorities",
            )
        return ast.Int(int(tok), self._tok(tok))

    def float_(self, tok: Token) -> ast.Float:
        value = float(tok)
        if value in (float("inf"), float("-inf")):
            raise ParseError(
                f"decimal literal {str(tok)!r} is out of range",
                span=self._tok(tok),
                code="P009",
                hint="decimals are 64-bit floats (at most about 1.8e308)",
            )
        return ast.Float(value, str(tok), self._tok(tok))

    def string(self, tok: Token) -> ast.Str:
        return ast.Str(fast.unescape(tok[1:-1]), self._tok(tok))

    def name(self, tok: Token) -> ast.Name:
        return ast.Name(str(tok), self._tok(tok))

    def ellipsis(self, tok: Token) -> ast.Dots:
        return ast.Dots(self._tok(tok))

    def star(self, tok: Token) -> ast.Star:
        return ast.Star(self._tok(tok))

    def call(self, name: Token, lpar: Token, *rest: Any) -> ast.Call:
        *args, rpar = rest
        return ast.Call(
            str(name),
            tuple(a for a in args if isinstance(a, ast.Arg)),
            self._join(self._tok(name), self._tok(rpar)),
        )

    def kwarg(self, name: Token, _eq: Token, value: Any) -> ast.Arg:
        return ast.Arg(str(name), value, self._join(self._tok(name), value.span))

    def arg(self, value: Any) -> ast.Arg:
        return ast.Arg(None, value, value.span)

    def of_arg(self, count: Any, _kw: Token, total: Any) -> ast.Arg:
        span = self._join(count.span, total.span)
        return ast.Arg(None, ast.Of(count, total, span), span)

    def subscript(self, base: Any, _lsqb: Token, *rest: Any) -> ast.Subscript:
        *indices, rsqb = rest
        return ast.Subscript(
            base,
            tuple(i for i in indices if not isinstance(i, Token)),
            self._join(base.span, self._tok(rsqb)),
        )

    def optional(self, inner: Any, q: Token) -> ast.Optional:
        return ast.Optional(inner, self._join(inner.span, self._tok(q)))

    def paren(self, lpar: Token, inner: Any, rpar: Token) -> Any:
        # No node for parentheses: the inner expression, its span widened to include them.
        return replace(inner, span=self._join(self._tok(lpar), self._tok(rpar)))

    def tuple_(self, lpar: Token, *rest: Any) -> ast.Tuple:
        *items, rpar = rest
        return ast.Tuple(
            tuple(i for i in items if not isinstance(i, Token)),
            self._join(self._tok(lpar), self._tok(rpar)),
        )

    def range(self, lo: Any, _dots: Token, hi: Any) -> ast.Range:
        return ast.Range(lo, hi, self._join(lo.span, hi.span))

    def binop(self, lhs: Any, op: Token, rhs: Any) -> ast.BinOp:
        return ast.BinOp(str(op), lhs, rhs, self._join(lhs.span, rhs.span))

    def neg(self, minus: Token, operand: Any) -> ast.Neg:
        return ast.Neg(operand, self._join(self._tok(minus), operand.span))

    def cmp(self, lhs: Any, op: Token, rhs: Any) -> ast.Cmp:
        return ast.Cmp(str(op), lhs, rhs, self._join(lhs.span, rhs.span))

    def in_(self, lhs: Any, _kw: Token, rhs: Any) -> ast.In:
        return ast.In(lhs, rhs, self._join(lhs.span, rhs.span))

    def and_(self, lhs: Any, _kw: Token, rhs: Any) -> ast.And:
        return ast.And(lhs, rhs, self._join(lhs.span, rhs.span))

    def or_(self, lhs: Any, _kw: Token, rhs: Any) -> ast.Or:
        return ast.Or(lhs, rhs, self._join(lhs.span, rhs.span))

    def not_(self, kw: Token, operand: Any) -> ast.Not:
        return ast.Not(operand, self._join(self._tok(kw), operand.span))

    # statements ---------------------------------------------------------------------------------
    def param(self, kw: Token, name: Token, *rest: Any) -> ast.Param:
        default = rest[1] if len(rest) >= 3 else None
        return ast.Param(str(name), default, self._join(self._tok(kw), self._end(rest, name)))

    def type(self, name: Token, *rest: Any) -> ast.TypeRef:
        args = tuple(r for r in rest if not isinstance(r, Token))
        end = rest[-1] if rest else name
        return ast.TypeRef(str(name), args, self._join(self._tok(name), self._sp(end)))

    def shape(self, name: Token, lpar: Token, *rest: Any) -> ast.ShapeRef:
        *dims, rpar = rest
        return ast.ShapeRef(
            str(name),
            tuple(d for d in dims if not isinstance(d, Token)),
            self._join(self._tok(name), self._tok(rpar)),
        )

    def value(
        self,
        kw: Token,
        name: Token,
        _colon: Token,
        type_: ast.TypeRef,
        _shape_kw: Token,
        shape: ast.ShapeRef,
        *rest: Any,
    ) -> ast.Value:
        clock = None
        end: Any = shape
        if len(rest) >= 2 and isinstance(rest[1], Token) and rest[1].type == "NAME":
            clock = str(rest[1])
            end = rest[1]
        return ast.Value(str(name), type_, shape, clock, self._join(self._tok(kw), self._sp(end)))

    def visible(
        self, kw: Token, target: Any, _arrow: Token, source: Any, *rest: Any
    ) -> ast.Visible:
        guard = rest[1] if len(rest) >= 2 and not isinstance(rest[1], Token) else None
        end = guard if guard is not None else source
        return ast.Visible(target, source, guard, self._join(self._tok(kw), end.span))

    def on_stmt(self, kw: Token, pattern: Any, *rest: Any) -> ast.On:
        guard = rest[1] if len(rest) >= 2 and not isinstance(rest[1], Token) else None
        end = guard if guard is not None else pattern
        return ast.On(pattern, guard, self._join(self._tok(kw), end.span))

    def read_stmt(self, kw: Token, _lbrace: Token, *rest: Any) -> ast.Read:
        items = tuple(r for r in rest if isinstance(r, ast.Arg))
        rbrace = next(r for r in reversed(rest) if isinstance(r, Token) and r.type == "RBRACE")
        return ast.Read(items, self._join(self._tok(kw), self._tok(rbrace)))

    def emit_stmt(
        self, kw: Token, _prop: Token, target: Any, _assign: Token, call: Any, _nl: Token
    ) -> ast.Emit:
        return ast.Emit(target, call, self._join(self._tok(kw), call.span))

    def score_stmt(self, kw: Token, call: Any, _nl: Token) -> ast.Score:
        return ast.Score(call, self._join(self._tok(kw), call.span))

    def rule(
        self, kw: Token, name: Token, _colon: Token, _nl: Token, _indent: Token, *rest: Any
    ) -> ast.Rule:
        body = tuple(r for r in rest if not isinstance(r, Token))
        end = body[-1].span if body else self._tok(name)
        return ast.Rule(str(name), body, self._join(self._tok(kw), end), self._tok(name))

    def con_body(
        self, kind: Token, pred: Any, _kw: Token, priority: Any, hard: Token | None = None
    ) -> tuple[Any, ...]:
        return (kind, pred, priority, hard)

    def constraint(self, kw: Token, name: Token, _colon: Token, *rest: Any) -> ast.Constraint:
        kind, pred, priority, hard = next(r for r in rest if isinstance(r, tuple))
        end = self._tok(hard) if hard is not None else priority.span
        return ast.Constraint(
            str(name),
            str(kind),
            pred,
            priority,
            self._join(self._tok(kw), end),
            self._tok(name),
            hard is not None,
        )

    def commit(self, kw: Token, target: Any, _using: Token, policy: Any, _nl: Token) -> ast.Commit:
        return ast.Commit(target, policy, self._join(self._tok(kw), policy.span))

    # workflows ----------------------------------------------------------------------------------
    def _stmt_end(self, kw: Token, rest: tuple[Any, ...]) -> Span:
        return self._join(self._tok(kw), self._end(rest, kw))

    def feed_stmt(self, kw: Token, value: Any, _nl: Token) -> ast.Feed:
        return ast.Feed(value, self._join(self._tok(kw), value.span))

    def gen_stmt(self, kw: Token, *rest: Any) -> ast.Generate:
        max_: Any = None
        allowed: Any = None
        for i, r in enumerate(rest):
            if isinstance(r, Token) and r.type == "MAX":
                max_ = rest[i + 1]
            elif isinstance(r, Token) and r.type == "IN":
                allowed = rest[i + 1]
        return ast.Generate(max_, allowed, self._stmt_end(kw, rest))

    def until_stmt(self, kw: Token, pattern: Any, *rest: Any) -> ast.Until:
        jump: str | None = None
        limit: Any = None
        for i, r in enumerate(rest):
            if isinstance(r, Token) and r.type == "JUMP":
                jump = str(rest[i + 1])
            elif isinstance(r, Token) and r.type == "LIMIT":
                limit = rest[i + 1]
        return ast.Until(pattern, jump, limit, self._stmt_end(kw, (pattern, *rest)))

    def capture_stmt(self, kw: Token, name: Token, _nl: Token) -> ast.Capture:
        return ast.Capture(str(name), self._join(self._tok(kw), self._tok(name)))

    def call_stmt(self, kw: Token, call: Any, _nl: Token) -> ast.ToolCall:
        return ast.ToolCall(call, self._join(self._tok(kw), call.span))

    def tag_stmt(self, kw: Token, name: Token, _nl: Token) -> ast.Tag:
        return ast.Tag(str(name), self._join(self._tok(kw), self._tok(name)))

    def zone(
        self, kw: Token, name: Token, _colon: Token, _nl: Token, _indent: Token, *rest: Any
    ) -> ast.Zone:
        body = tuple(r for r in rest if not isinstance(r, Token))
        return ast.Zone(str(name), body, self._join(self._tok(kw), body[-1].span), self._tok(name))

    def workflow(
        self, kw: Token, name: Token, _on: Token, value: Token, _colon: Token, *rest: Any
    ) -> ast.Workflow:
        zones = tuple(r for r in rest if isinstance(r, ast.Zone))
        return ast.Workflow(
            str(name),
            str(value),
            zones,
            self._join(self._tok(kw), zones[-1].span),
            self._tok(name),
            self._tok(value),
        )

    def start(self, *items: Any) -> list[Any]:
        return [i for i in items if not isinstance(i, Token)]

    def _end(self, rest: tuple[Any, ...], fallback: Token) -> Span:
        for r in reversed(rest):
            s = self._span_of(r)
            if s is not None and not (isinstance(r, Token) and r.type == "_NL"):
                return s
        return self._tok(fallback)


@cache
def _parser() -> tuple[Lark, _Layout, _Builder]:
    layout = _Layout()
    builder = _Builder()
    grammar = (Path(__file__).with_name("lmpm.lark")).read_text()
    lark = Lark(
        grammar,
        parser="lalr",
        lexer="contextual",
        postlex=layout,
        transformer=builder,
        keep_all_tokens=True,
        maybe_placeholders=False,
        cache=True,  # the grammar analysis is cached in the temp dir: the error path stays fast
    )
    return lark, layout, builder


def _expected(e: UnexpectedInput) -> str:
    exp = sorted(getattr(e, "expected", None) or getattr(e, "allowed", None) or [])
    names = []
    for t in exp:
        n = _TOKEN_NAMES.get(t)
        if n is None:
            n = f"'{t.lower()}'" if t.isupper() and t.isalpha() else t
        if n not in names:
            names.append(n)
    if not names:
        return ""
    if len(names) > 8:
        names = [*names[:8], "…"]
    return "expected " + ", ".join(names)


def _describe(tok: Token) -> str:
    if tok.type == "_NL":
        return "end of line"
    if tok.type == "_INDENT":
        return "indentation (this line is indented deeper than the one above it)"
    if tok.type == "_DEDENT":
        return "the end of the block"
    if tok.type == "$END":
        return "the end of the file"
    return repr(str(tok))


def parse(text: str, file: str = "<input>") -> ast.Program:
    """Parse with lark; the error path of :func:`lmpm.lang.parser.parse`.

    ``text`` must end with a newline and hold no NUL (``lmpm.lang.parser.parse`` sees to both).
    """
    lark, layout, builder = _parser()
    layout.file = file
    builder.file = file
    try:
        items = lark.parse(text)
    except ParseError:
        raise
    except UnexpectedCharacters as e:
        pos = e.pos_in_stream if e.pos_in_stream is not None else -1
        ch = text[pos] if 0 <= pos < len(text) else ""
        span = Span(file, e.line, e.column, e.line, e.column + 1)
        hint = _expected(e) or None
        if ch == ".":
            hint = (
                "a decimal needs digits on both sides of the point (`0.5`, `1.0`, `1e-3`); "
                "`a..b` is a range"
            )
        raise ParseError(
            f"unexpected character {ch!r}", span=span, code="P001", hint=hint
        ) from None
    except UnexpectedToken as e:
        tok = e.token
        if tok.type == "$END":
            span = _eof_span(text, file)
        else:
            span = _span_of_token(file, tok)
            if tok.type in ("_NL", "_DEDENT", "_INDENT"):
                span = _line_end_span(text, file, tok)
        raise ParseError(
            f"unexpected {_describe(tok)}", span=span, code="P002", hint=_expected(e) or None
        ) from None
    except UnexpectedEOF as e:
        raise ParseError(
            "unexpected end of file",
            span=_eof_span(text, file),
            code="P002",
            hint=_expected(e) or None,
        ) from None
    except UnexpectedInput as e:  # pragma: no cover - lark's remaining kinds
        raise ParseError(str(e).splitlines()[0], span=_eof_span(text, file), code="P000") from None
    except RecursionError:
        raise ParseError(
            "program nested too deeply", span=_eof_span(text, file), code="P004"
        ) from None
    return ast.Program(file, tuple(items))  # type: ignore[arg-type]  # the builder returns a list


def _eof_span(text: str, file: str) -> Span:
    lines = text.rstrip("\n").split("\n")
    line = max(len(lines), 1)
    col = len(lines[-1]) + 1 if lines else 1
    return Span(file, line, col, line, col + 1)


def _line_end_span(text: str, file: str, tok: Token) -> Span:
    # A newline token: point just past the last character of the line it ends.
    line = tok.line or 1
    lines = text.split("\n")
    if tok.type in ("_INDENT", "_DEDENT"):
        line = tok.end_line or line
        if line >= len(lines):  # a block closed by the end of the file (a nested block at EOF)
            return _eof_span(text, file)
        text_line = lines[line - 1] if line - 1 < len(lines) else ""
        indent = len(text_line) - len(text_line.lstrip(" \t"))
        return Span(file, line, indent + 1, line, indent + 2)
    text_line = lines[line - 1] if line - 1 < len(lines) else ""
    code = text_line.split("//", 1)[0].rstrip()
    col = len(code) + 1
    return Span(file, line, col, line, col + 1)
