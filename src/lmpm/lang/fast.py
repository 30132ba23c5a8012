"""A hand-written recursive-descent parser for the grammar in ``lmpm.lark``: the fast path.

The lark grammar is the definition of the language and the error path: :func:`lmpm.lang.parser.parse`
runs this parser first and, when it gives up (:class:`Fallback`), parses again with lark, which either
succeeds or raises the ParseError with its span and expected-token hint. This parser is deliberately
conservative — on anything unusual (a keyword used as a name, a stray indent, odd whitespace, deep
nesting) it gives up rather than guess — so on every text it accepts it builds exactly the AST lark
builds, spans included. ``tests/lang/test_lang_fuzz.py`` checks that on thousands of mutated programs.

Why: lark's LALR driver costs a few microseconds per token in pure Python, which caps the front end
near 10,000 lines/s; this parser runs the same programs several times faster.
"""

from __future__ import annotations

import os
import re
from typing import Any

from lmpm.errors import Span
from lmpm.lang import ast

MAX_NESTING = 64  # the same limit as the lark path (which reports it as P004)
MAX_INT_DIGITS = 30  # longer integer literals are a ParseError (P008), reported by the lark path
# Set (the test suite sets it): an internal failure of this parser (an exception other than a
# deliberate Fallback) is raised instead of being silently retried with lark.
STRICT_ENV = "LMPM_STRICT_FAST_PARSER"

KEYWORDS = frozenset(
    [
        "param",
        "value",
        "shape",
        "clock",
        "visible",
        "when",
        "rule",
        "on",
        "read",
        "emit",
        "proposal",
        "score",
        "constraint",
        "priority",
        "commit",
        "using",
        "or",
        "and",
        "not",
        "in",
        "of",
        "forbid",
        "require",
        # workflow words: lark's contextual lexer accepts them as names elsewhere, so text using
        # one as a name is left to lark
        "workflow",
        "zone",
        "feed",
        "generate",
        "max",
        "until",
        "jump",
        "limit",
        "capture",
        "call",
        "tag",
        "hard",  # `... priority N hard`
    ]
)

# One scanner for every token. Order matters where prefixes overlap: `...` before `..`, `<-` and
# `:=` before `<` and `:`, two-character comparisons before one-character ones.
# Each match is one token with the blanks before it (half as many matches as blanks of their own).
_TOKEN = re.compile(
    r"""
    [ \t\f]*
    (?:
    (?P<COMMENT>//[^\n]*)
  | (?P<NL>\r?\n)
  | (?P<NAME>(?!\d)\w+)
  | (?P<FLOAT>\d+\.\d+(?:[eE][+-]?\d+)?|\d+[eE][+-]?\d+)
  | (?P<INT>\d+)
  | (?P<STRING>"(?:[^"\\\n]|\\.)*")
  | (?P<OP>\.\.\.|\.\.|<-|:=|<=|>=|==|!=|[-+*/%<>=\[\](){},:?])
  | (?P<BAD>.)
    )
    """,
    re.VERBOSE,
)

_OPEN = {"(": ")", "[": "]", "{": "}"}
_CLOSE = {")", "]", "}"}

_OR_PREC, _AND_PREC, _NOT_PREC, _CMP_PREC, _RANGE_PREC, _SUM_PREC, _TERM_PREC = range(1, 8)
_OP_PREC = {
    "<": _CMP_PREC,
    "<=": _CMP_PREC,
    ">": _CMP_PREC,
    ">=": _CMP_PREC,
    "==": _CMP_PREC,
    "!=": _CMP_PREC,
    "..": _RANGE_PREC,
    "+": _SUM_PREC,
    "-": _SUM_PREC,
    "*": _TERM_PREC,
    "/": _TERM_PREC,
    "%": _TERM_PREC,
}
_WORD_PREC = {"or": _OR_PREC, "and": _AND_PREC, "in": _CMP_PREC}
_NON_ASSOC = (_CMP_PREC, _RANGE_PREC)

# Token kinds (small ints compare fastest).
NAME, INT, STRING, OP, NL, INDENT, DEDENT, EOF, FLOAT = range(9)


_ESCAPES = {"\\": "\\", '"': '"', "n": "\n", "t": "\t", "r": "\r", "0": "\0"}


def unescape(raw: str) -> str:
    """The value of a string literal's body: ``\\\\ \\" \\n \\t \\r \\0`` are escapes; a backslash
    before any other character stands for itself."""
    if "\\" not in raw:
        return raw
    out: list[str] = []
    i = 0
    while i < len(raw):
        ch = raw[i]
        if ch == "\\" and i + 1 < len(raw) and raw[i + 1] in _ESCAPES:
            out.append(_ESCAPES[raw[i + 1]])
            i += 2
            continue
        out.append(ch)
        i += 1
    return "".join(out)


class Fallback(Exception):
    """The fast parser declines this text; the lark parser decides."""


def tokenize(text: str) -> list[tuple[int, str, int, int]]:
    """(kind, text, line, col) tokens with the layout already applied (NL / INDENT / DEDENT).

    ``text`` ends with a newline. Newlines inside brackets are dropped; blank and comment-only lines
    produce nothing; a logical line ends with one NL token, then INDENT/DEDENTs for the next line.
    """
    out: list[tuple[int, str, int, int]] = []
    append = out.append
    line = 1
    line_start = 0
    depth = 0
    levels = [0]
    at_line_start = True  # no token yet on the current logical line
    pending_nl: tuple[int, int] | None = None  # (line, col) of a newline ending a logical line
    for m in _TOKEN.finditer(text):
        kind = m.lastgroup or "BAD"  # (every match has a group: BAD takes any other character)
        start = m.start(kind)  # (after the blanks)
        if at_line_start and "\f" in text[m.start() : start]:
            raise Fallback  # lark's indentation ignores form feeds; not worth mirroring
        if kind == "COMMENT":
            continue
        if kind == "NL":
            if depth == 0 and not at_line_start:
                pending_nl = (line, start - line_start + 1)
                at_line_start = True
            line += 1
            line_start = m.end()
            continue
        if kind == "BAD":
            raise Fallback
        col = start - line_start + 1
        if at_line_start and depth == 0:
            # The first token of a logical line: settle the previous line and the indentation.
            indent_text = text[line_start:start]
            if indent_text.strip(" \t"):
                raise Fallback
            indent = indent_text.count(" ") + indent_text.count("\t") * 8
            if pending_nl is not None:
                append((NL, "\n", pending_nl[0], pending_nl[1]))
                pending_nl = None
                if indent > levels[-1]:
                    levels.append(indent)
                    append((INDENT, "", line, col))
                else:
                    while indent < levels[-1]:
                        levels.pop()
                        append((DEDENT, "", line, col))
                    if indent != levels[-1]:
                        raise Fallback
            elif indent:
                raise Fallback  # an indented first line: leave it to lark
            at_line_start = False
        value = m.group(kind)
        if kind == "OP":
            if value in _OPEN:
                depth += 1
                if depth > MAX_NESTING:
                    raise Fallback
            elif value in _CLOSE:
                depth -= 1
                if depth < 0:
                    raise Fallback
            append((OP, value, line, col))
        elif kind == "NAME":
            append((NAME, value, line, col))
        elif kind == "INT":
            append((INT, value, line, col))
        elif kind == "FLOAT":
            append((FLOAT, value, line, col))
        else:
            append((STRING, value, line, col))
    if depth != 0:
        raise Fallback
    if pending_nl is not None:
        append((NL, "\n", pending_nl[0], pending_nl[1]))
    for _ in levels[1:]:
        append((DEDENT, "", line, 1))
    append((EOF, "", line, 1))
    return out


class Parser:
    """Recursive descent over :func:`tokenize`'s tokens, one method per grammar rule."""

    def __init__(self, text: str, file: str) -> None:
        self.file = file
        self.toks = tokenize(text)
        self.i = 0

    # ---- tokens and spans ----------------------------------------------------------------------
    def _span(self, tok: tuple[int, str, int, int]) -> Span:
        return Span(self.file, tok[2], tok[3], tok[2], tok[3] + len(tok[1]))

    @staticmethod
    def _join(a: Span, b: Span) -> Span:
        return Span(a.file, a.line, a.col, b.end_line, b.end_col)

    def _op(self, value: str) -> tuple[int, str, int, int]:
        tok = self.toks[self.i]
        if tok[0] != OP or tok[1] != value:
            raise Fallback
        self.i += 1
        return tok

    def _kw(self, word: str) -> tuple[int, str, int, int]:
        tok = self.toks[self.i]
        if tok[0] != NAME or tok[1] != word:
            raise Fallback
        self.i += 1
        return tok

    def _name(self) -> tuple[int, str, int, int]:
        tok = self.toks[self.i]
        if tok[0] != NAME or tok[1] in KEYWORDS:
            raise Fallback
        self.i += 1
        return tok

    def _expect(self, kind: int) -> tuple[int, str, int, int]:
        tok = self.toks[self.i]
        if tok[0] != kind:
            raise Fallback
        self.i += 1
        return tok

    def _is_op(self, value: str) -> bool:
        tok = self.toks[self.i]
        return tok[0] == OP and tok[1] == value

    def _is_kw(self, word: str) -> bool:
        tok = self.toks[self.i]
        return tok[0] == NAME and tok[1] == word

    # ---- program -------------------------------------------------------------------------------
    def program(self) -> list[Any]:
        items: list[Any] = []
        toks = self.toks
        while True:
            tok = toks[self.i]
            if tok[0] == EOF:
                return items
            if tok[0] != NAME:
                raise Fallback
            word = tok[1]
            if word == "param":
                items.append(self._param())
            elif word == "value":
                items.append(self._value())
            elif word == "visible":
                items.append(self._visible())
            elif word == "rule":
                items.append(self._rule())
            elif word == "constraint":
                items.append(self._constraint())
            elif word == "commit":
                items.append(self._commit())
            elif word == "workflow":
                items.append(self._workflow())
            else:
                raise Fallback

    def _param(self) -> ast.Param:
        kw = self._kw("param")
        name = self._name()
        end = self._span(name)
        default = None
        if self._is_op("="):
            self.i += 1
            default = self.expr()
            end = default.span
        self._expect(NL)
        return ast.Param(name[1], default, self._join(self._span(kw), end))

    def _value(self) -> ast.Value:
        kw = self._kw("value")
        name = self._name()
        self._op(":")
        tname = self._name()
        targs: list[Any] = []
        tend = tname
        if self._is_op("["):
            self.i += 1
            if not self._is_op("]"):
                targs.append(self.expr())
                while self._is_op(","):
                    self.i += 1
                    targs.append(self.expr())
            tend = self._op("]")
        type_ = ast.TypeRef(tname[1], tuple(targs), self._join(self._span(tname), self._span(tend)))
        self._kw("shape")
        sname = self._name()
        self._op("(")
        dims: list[Any] = []
        if not self._is_op(")"):
            dims.append(self.expr())
            while self._is_op(","):
                self.i += 1
                dims.append(self.expr())
        rpar = self._op(")")
        shape = ast.ShapeRef(sname[1], tuple(dims), self._join(self._span(sname), self._span(rpar)))
        clock = None
        end = shape.span
        if self._is_kw("clock"):
            self.i += 1
            ctok = self._name()
            clock = ctok[1]
            end = self._span(ctok)
        self._expect(NL)
        return ast.Value(name[1], type_, shape, clock, self._join(self._span(kw), end))

    def _visible(self) -> ast.Visible:
        kw = self._kw("visible")
        target = self.expr()
        self._op("<-")
        source = self.expr()
        guard = None
        if self._is_kw("when"):
            self.i += 1
            guard = self.expr()
        self._expect(NL)
        end = guard if guard is not None else source
        return ast.Visible(target, source, guard, self._join(self._span(kw), end.span))

    def _open_block(self) -> None:
        """``:`` NEWLINE INDENT: the header's end and the start of an indented body."""
        self._op(":")
        self._expect(NL)
        self._expect(INDENT)

    def _block_word(self, started: bool) -> tuple[int, str, int, int] | None:
        """The next statement's leading word of an indented body, or None (consumed) at the
        DEDENT that ends a body with at least one statement (``started``)."""
        tok = self.toks[self.i]
        if tok[0] == DEDENT and started:
            self.i += 1
            return None
        if tok[0] != NAME:
            raise Fallback
        return tok

    def _rule(self) -> ast.Rule:
        kw = self._kw("rule")
        name = self._name()
        self._open_block()
        body: list[Any] = []
        while True:
            tok = self._block_word(bool(body))
            if tok is None:
                break
            word = tok[1]
            start = self._span(tok)
            self.i += 1
            if word == "on":
                pattern = self.expr()
                guard = None
                if self._is_kw("when"):
                    self.i += 1
                    guard = self.expr()
                end = guard if guard is not None else pattern
                body.append(ast.On(pattern, guard, self._join(start, end.span)))
            elif word == "read":
                self._op("{")
                items: list[ast.Arg] = []
                while not self._is_op("}"):
                    items.append(self._arg())
                    if self._is_op(","):
                        self.i += 1
                    elif not self._is_op("}"):
                        raise Fallback
                rbrace = self._op("}")
                body.append(ast.Read(tuple(items), self._join(start, self._span(rbrace))))
            elif word == "emit":
                self._kw("proposal")
                target = self.expr()
                self._op(":=")
                call = self.expr()
                body.append(ast.Emit(target, call, self._join(start, call.span)))
            elif word == "score":
                call = self.expr()
                body.append(ast.Score(call, self._join(start, call.span)))
            else:
                raise Fallback
            self._expect(NL)
        return ast.Rule(
            name[1], tuple(body), self._join(self._span(kw), body[-1].span), self._span(name)
        )

    def _constraint(self) -> ast.Constraint:
        kw = self._kw("constraint")
        name = self._name()
        self._op(":")
        block = self.toks[self.i][0] == NL
        if block:
            self.i += 1
            self._expect(INDENT)
        ktok = self.toks[self.i]
        if ktok[0] != NAME or ktok[1] not in ("forbid", "require"):
            raise Fallback
        self.i += 1
        pred = self.expr()
        self._kw("priority")
        priority = self.expr()
        end = priority.span
        hard = self.toks[self.i][0] == NAME and self.toks[self.i][1] == "hard"
        if hard:
            end = self._span(self.toks[self.i])
            self.i += 1
        self._expect(NL)
        if block:
            self._expect(DEDENT)
        return ast.Constraint(
            name[1],
            ktok[1],
            pred,
            priority,
            self._join(self._span(kw), end),
            self._span(name),
            hard,
        )

    def _commit(self) -> ast.Commit:
        kw = self._kw("commit")
        target = self.expr()
        self._kw("using")
        policy = self.expr()
        self._expect(NL)
        return ast.Commit(target, policy, self._join(self._span(kw), policy.span))

    def _workflow(self) -> ast.Workflow:
        kw = self._kw("workflow")
        name = self._name()
        self._kw("on")
        value = self._name()
        self._open_block()
        zones: list[ast.Zone] = []
        while True:
            tok = self.toks[self.i]
            if tok[0] == DEDENT and zones:
                self.i += 1
                break
            zones.append(self._zone())
        return ast.Workflow(
            name[1],
            value[1],
            tuple(zones),
            self._join(self._span(kw), zones[-1].span),
            self._span(name),
            self._span(value),
        )

    def _zone(self) -> ast.Zone:
        kw = self._kw("zone")
        name = self._name()
        self._open_block()
        body: list[Any] = []
        while True:
            tok = self._block_word(bool(body))
            if tok is None:
                break
            word = tok[1]
            start = self._span(tok)
            self.i += 1
            if word == "feed":
                value = self.expr()
                body.append(ast.Feed(value, self._join(start, value.span)))
            elif word == "generate":
                max_: Any = None
                allowed: Any = None
                end = start
                if self._is_kw("max"):
                    self.i += 1
                    max_ = self.expr(_SUM_PREC)
                    end = max_.span
                if self._is_kw("in"):
                    self.i += 1
                    allowed = self.expr()
                    end = allowed.span
                body.append(ast.Generate(max_, allowed, self._join(start, end)))
            elif word == "until":
                pattern = self.expr()
                end = pattern.span
                jump: str | None = None
                limit: Any = None
                if self._is_kw("jump"):
                    self.i += 1
                    target = self._name()
                    jump = target[1]
                    end = self._span(target)
                    if self._is_kw("limit"):
                        self.i += 1
                        limit = self.expr(_SUM_PREC)
                        end = limit.span
                body.append(ast.Until(pattern, jump, limit, self._join(start, end)))
            elif word in ("capture", "tag"):
                target = self._name()
                cls = ast.Capture if word == "capture" else ast.Tag
                body.append(cls(target[1], self._join(start, self._span(target))))
            elif word == "call":
                call = self.expr()
                body.append(ast.ToolCall(call, self._join(start, call.span)))
            else:
                raise Fallback
            self._expect(NL)
        return ast.Zone(
            name[1], tuple(body), self._join(self._span(kw), body[-1].span), self._span(name)
        )

    # ---- expressions ---------------------------------------------------------------------------
    # Precedence climbing over the grammar's levels (loosest first): or, and, not (prefix), cmp/in
    # (non-associative), `..` (non-associative), + -, * / %, unary minus, postfix.

    def expr(self, min_prec: int = 1) -> Any:
        toks = self.toks
        tok = toks[self.i]
        if tok[0] == NAME and tok[1] == "not" and min_prec <= _NOT_PREC:
            self.i += 1
            operand = self.expr(_NOT_PREC)
            lhs: Any = ast.Not(operand, self._join(self._span(tok), operand.span))
        elif tok[0] == OP and tok[1] == "-":
            lhs = self._factor()
        else:
            lhs = self._postfix()
        while True:
            tok = toks[self.i]
            if tok[0] == OP:
                prec = _OP_PREC.get(tok[1], 0)
            elif tok[0] == NAME:
                prec = _WORD_PREC.get(tok[1], 0)
            else:
                return lhs
            if prec < min_prec:  # also stops at tokens that are no operator (prec 0)
                return lhs
            self.i += 1
            rhs = self.expr(prec + 1)
            op = tok[1]
            span = self._join(lhs.span, rhs.span)
            if prec == _CMP_PREC:
                lhs = ast.In(lhs, rhs, span) if op == "in" else ast.Cmp(op, lhs, rhs, span)
            elif prec == _RANGE_PREC:
                lhs = ast.Range(lhs, rhs, span)
            elif prec >= _SUM_PREC:
                lhs = ast.BinOp(op, lhs, rhs, span)
            elif prec == _AND_PREC:
                lhs = ast.And(lhs, rhs, span)
            else:
                lhs = ast.Or(lhs, rhs, span)
            if prec in _NON_ASSOC:
                nxt = toks[self.i]
                if (
                    _OP_PREC.get(nxt[1], 0) == prec
                    if nxt[0] == OP
                    else (nxt[0] == NAME and _WORD_PREC.get(nxt[1], 0) == prec)
                ):
                    raise Fallback  # `a < b < c`, `a..b..c`: a syntax error, lark reports it

    def _factor(self) -> Any:
        minuses = []
        while self._is_op("-"):
            minuses.append(self.toks[self.i])
            self.i += 1
        e = self._postfix()
        for m in reversed(minuses):
            e = ast.Neg(e, self._join(self._span(m), e.span))
        return e

    def _postfix(self) -> Any:
        e = self._atom()
        toks = self.toks
        while True:
            tok = toks[self.i]
            if tok[0] != OP:
                return e
            if tok[1] == "[":
                self.i += 1
                indices: list[Any] = []
                if not self._is_op("]"):
                    indices.append(self._index())
                    while self._is_op(","):
                        self.i += 1
                        indices.append(self._index())
                rsqb = self._op("]")
                e = ast.Subscript(e, tuple(indices), self._join(e.span, self._span(rsqb)))
            elif tok[1] == "?":
                self.i += 1
                e = ast.Optional(e, self._join(e.span, self._span(tok)))
            else:
                return e

    def _index(self) -> Any:
        tok = self.toks[self.i]
        if tok[0] == OP and tok[1] == "*":
            self.i += 1
            return ast.Star(self._span(tok))
        return self.expr()

    def _atom(self) -> Any:
        tok = self.toks[self.i]
        kind = tok[0]
        if kind == NAME:
            if tok[1] in KEYWORDS:
                raise Fallback
            self.i += 1
            nxt = self.toks[self.i]
            if nxt[0] == OP and nxt[1] == "(":
                self.i += 1
                args: list[ast.Arg] = self._int_args()
                if not self._is_op(")"):
                    args.append(self._arg())
                    while self._is_op(","):
                        self.i += 1
                        args.append(self._arg())
                rpar = self._op(")")
                return ast.Call(tok[1], tuple(args), self._join(self._span(tok), self._span(rpar)))
            return ast.Name(tok[1], self._span(tok))
        if kind == INT:
            if len(tok[1]) > MAX_INT_DIGITS:
                raise Fallback
            self.i += 1
            return ast.Int(int(tok[1]), self._span(tok))
        if kind == FLOAT:
            value = float(tok[1])
            if value != value or value in (float("inf"), float("-inf")):
                raise Fallback  # out of range: the lark path reports it (P009)
            self.i += 1
            return ast.Float(value, tok[1], self._span(tok))
        if kind == STRING:
            self.i += 1
            return ast.Str(unescape(tok[1][1:-1]), self._span(tok))
        if kind == OP:
            if tok[1] == "(":
                self.i += 1
                first = self.expr()
                if self._is_op(")"):
                    rpar = self._op(")")
                    span = self._join(self._span(tok), self._span(rpar))
                    return _with_span(first, span)
                self._op(",")
                items = [first]
                if not self._is_op(")"):
                    items.append(self.expr())
                    while self._is_op(","):
                        self.i += 1
                        items.append(self.expr())
                rpar = self._op(")")
                return ast.Tuple(tuple(items), self._join(self._span(tok), self._span(rpar)))
            if tok[1] == "...":
                self.i += 1
                return ast.Dots(self._span(tok))
        raise Fallback

    def _int_args(self) -> list[ast.Arg]:
        """A leading run of bare integer arguments (``Set(0, 1, 2, ...)``, maybe 10^5 of them),
        in one tight loop; the rest of the arguments go through :meth:`_arg`."""
        toks, i, file = self.toks, self.i, self.file
        out: list[ast.Arg] = []
        Arg, Int = ast.Arg, ast.Int
        while True:
            tok, nxt = toks[i], toks[i + 1]
            if tok[0] != INT or nxt[0] != OP or len(tok[1]) > MAX_INT_DIGITS:
                break
            if nxt[1] == ",":
                if toks[i + 2][0] == OP and toks[i + 2][1] == ")":
                    break  # a trailing comma: left to the general path
                step = 2
            elif nxt[1] == ")":
                step = 1
            else:
                break
            line, col, text = tok[2], tok[3], tok[1]
            span = Span(file, line, col, line, col + len(text))
            out.append(Arg(None, Int(int(text), span), span))
            i += step
            if step == 1:
                break
        self.i = i
        return out

    def _arg(self) -> ast.Arg:
        tok = self.toks[self.i]
        if tok[0] == EOF:
            raise Fallback
        nxt = self.toks[self.i + 1]
        if (
            tok[0] == INT
            and nxt[0] == OP
            and (nxt[1] == "," or nxt[1] == ")")
            and len(tok[1]) <= MAX_INT_DIGITS
        ):
            # A bare integer argument (the elements of a big `Set(...)`): skip the precedence
            # climb, which costs several calls per element.
            self.i += 1
            span = Span(self.file, tok[2], tok[3], tok[2], tok[3] + len(tok[1]))
            return ast.Arg(None, ast.Int(int(tok[1]), span), span)
        if tok[0] == NAME and nxt[0] == OP and nxt[1] == "=":
            if tok[1] in KEYWORDS:
                raise Fallback
            self.i += 2
            value = self.expr()
            return ast.Arg(tok[1], value, self._join(self._span(tok), value.span))
        value = self.expr()
        tok = self.toks[self.i]
        if tok[0] == NAME and tok[1] == "of":  # `k of n` (quorum(2 of 3, ...))
            self.i += 1
            total = self.expr()
            span = self._join(value.span, total.span)
            return ast.Arg(None, ast.Of(value, total, span), span)
        return ast.Arg(None, value, value.span)


def _with_span(e: Any, span: Span) -> Any:
    from dataclasses import replace

    return replace(e, span=span)


def parse_items(text: str, file: str) -> list[Any]:
    """The program's items, or :class:`Fallback` when the lark parser should decide."""
    try:
        return Parser(text, file).program()
    except Fallback:
        raise
    except RecursionError:
        raise Fallback from None  # nesting deeper than Python's stack: lark reports P004
    except Exception:
        if os.environ.get(STRICT_ENV):
            raise  # a bug in this parser: never hidden by the lark retry under tests
        raise Fallback from None
