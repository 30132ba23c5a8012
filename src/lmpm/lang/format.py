"""`lmpm fmt`: the canonical text of a program. Idempotent and comment-preserving.

Style: arithmetic is tight (`x+dx`, `t-1`, `x/8`), comparisons and `and`/`or` are spaced, indices are
separated by `, `, blocks indent by two spaces, at most one blank line between statements.

>>> print(format_source("value  Txt:Token[Byte] shape Seq( 8 )\\nvisible Txt[t]<-Txt[0..t-1] when t>0\\n"), end="")
value Txt : Token[Byte] shape Seq(8) clock Lamport
visible Txt[t] <- Txt[0..t-1] when t > 0
"""

from __future__ import annotations

from dataclasses import dataclass

from lmpm.errors import ParseError
from lmpm.lang import ast
from lmpm.lang.parser import parse

INDENT = "  "
_STR_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\0": "\\0", "\t": "\\t"}

# Binding strength per AST node kind (higher binds tighter), for minimal parentheses.
_OR, _AND, _NOT, _CMP, _RANGE, _ADD, _MUL, _NEG, _ATOM = range(1, 10)


def _prec(e: ast.Expr) -> int:
    match e:
        case ast.Or():
            return _OR
        case ast.And():
            return _AND
        case ast.Not():
            return _NOT
        case ast.Cmp() | ast.In():
            return _CMP
        case ast.Range():
            return _RANGE
        case ast.BinOp(op=op):
            return _ADD if op in "+-" else _MUL
        case ast.Neg():
            return _NEG
    return _ATOM


def fmt_expr(e: ast.Expr, parent: int = 0) -> str:
    p = _prec(e)
    match e:
        case ast.Int(value=v):
            s = str(v)
        case ast.Float(text=t):
            s = t
        case ast.Str(value=v):
            s = '"' + "".join(_STR_ESCAPES.get(ch, ch) for ch in v) + '"'
        case ast.Name(id=n):
            s = n
        case ast.Star():
            s = "*"
        case ast.Dots():
            s = "..."
        case ast.Call(func=f, args=args):
            s = f"{f}({', '.join(fmt_arg(a) for a in args)})"
        case ast.Subscript(base=b, indices=idx):
            s = f"{fmt_expr(b, _ATOM)}[{', '.join(fmt_expr(i) for i in idx)}]"
        case ast.Optional(inner=x):
            s = f"{fmt_expr(x, _ATOM)}?"
        case ast.Tuple(items=items):
            s = f"({', '.join(fmt_expr(i) for i in items)}{',' if len(items) == 1 else ''})"
        case ast.Range(lo=lo, hi=hi):
            s = f"{fmt_expr(lo, _RANGE + 1)}..{fmt_expr(hi, _RANGE + 1)}"
        case ast.BinOp(op=op, lhs=lhs, rhs=rhs):
            s = f"{fmt_expr(lhs, p)}{op}{fmt_expr(rhs, p + 1)}"
        case ast.Neg(operand=x):
            s = f"-{fmt_expr(x, _NEG)}"
        case ast.Cmp(op=op, lhs=lhs, rhs=rhs):
            s = f"{fmt_expr(lhs, _CMP + 1)} {op} {fmt_expr(rhs, _CMP + 1)}"
        case ast.In(lhs=lhs, rhs=rhs):
            s = f"{fmt_expr(lhs, _CMP + 1)} in {fmt_expr(rhs, _CMP + 1)}"
        case ast.And(lhs=lhs, rhs=rhs):
            s = f"{fmt_expr(lhs, _AND)} and {fmt_expr(rhs, _AND + 1)}"
        case ast.Or(lhs=lhs, rhs=rhs):
            s = f"{fmt_expr(lhs, _OR)} or {fmt_expr(rhs, _OR + 1)}"
        case ast.Not(operand=x):
            s = f"not {fmt_expr(x, _NOT)}"
        case ast.Of(count=k, total=n):
            s = f"{fmt_expr(k)} of {fmt_expr(n)}"
    return f"({s})" if p < parent else s


def fmt_arg(a: ast.Arg) -> str:
    return f"{a.name}={fmt_expr(a.value)}" if a.name is not None else fmt_expr(a.value)


_Line = tuple[str, ast.Item | ast.RuleStmt | ast.ZoneStmt | None, int]


def _stmt_lines(item: ast.Item) -> list[_Line]:
    """(text, node, source line) per output line of a top-level item."""
    match item:
        case ast.Param(name=n, default=d):
            return [
                (
                    f"param {n}" + (f" = {fmt_expr(d)}" if d is not None else ""),
                    item,
                    item.span.line,
                )
            ]
        case ast.Value(name=n, type=t, shape=sh, clock=c):
            targs = f"[{', '.join(fmt_expr(a) for a in t.args)}]" if t.args else ""
            dims = ", ".join(fmt_expr(d) for d in sh.dims)
            return [
                (
                    f"value {n} : {t.name}{targs} shape {sh.kind}({dims}) clock {c or 'Lamport'}",
                    item,
                    item.span.line,
                )
            ]
        case ast.Visible(target=t, source=s, guard=g):
            when = f" when {fmt_expr(g)}" if g is not None else ""
            return [(f"visible {fmt_expr(t)} <- {fmt_expr(s)}{when}", item, item.span.line)]
        case ast.Rule(name=n, body=body):
            out: list[_Line] = [(f"rule {n}:", None, item.span.line)]
            for st in body:
                out.append((INDENT + _rule_stmt(st), st, st.span.line))
            return out
        case ast.Constraint(name=n, kind=k, pred=pr, priority=prio, hard=hard):
            tail = " hard" if hard else ""
            return [
                (f"constraint {n}:", None, item.span.line),
                (
                    f"{INDENT}{k} {fmt_expr(pr)} priority {fmt_expr(prio)}{tail}",
                    item,
                    prio.span.line,
                ),
            ]
        case ast.Commit(target=t, policy=p):
            return [(f"commit {fmt_expr(t)} using {fmt_expr(p)}", item, item.span.line)]
        case ast.Workflow(name=n, value=v, zones=zones):
            lines: list[_Line] = [(f"workflow {n} on {v}:", None, item.span.line)]
            for z in zones:
                lines.append((f"{INDENT}zone {z.name}:", None, z.span.line))
                for zs in z.body:
                    lines.append((INDENT * 2 + _zone_stmt(zs), zs, zs.span.line))
            return lines
    raise AssertionError(type(item))


def _zone_stmt(st: ast.ZoneStmt) -> str:
    match st:
        case ast.Feed(value=v):
            return f"feed {fmt_expr(v)}"
        case ast.Generate(max=m, allowed=a):
            return (
                "generate"
                + (f" max {fmt_expr(m)}" if m is not None else "")
                + (f" in {fmt_expr(a)}" if a is not None else "")
            )
        case ast.Until(pattern=p, jump=j, limit=lim):
            return (
                f"until {fmt_expr(p)}"
                + (f" jump {j}" if j is not None else "")
                + (f" limit {fmt_expr(lim)}" if lim is not None else "")
            )
        case ast.Capture(name=n):
            return f"capture {n}"
        case ast.ToolCall(call=c):
            return f"call {fmt_expr(c)}"
        case ast.Tag(name=n):
            return f"tag {n}"
    raise AssertionError(type(st))


def _rule_stmt(st: ast.RuleStmt) -> str:
    match st:
        case ast.On(pattern=p, guard=g):
            return f"on {fmt_expr(p)}" + (f" when {fmt_expr(g)}" if g is not None else "")
        case ast.Read(items=items):
            # A named read is a binding (`ctx = Txt[...]`), spaced unlike a keyword argument.
            reads = (
                f"{a.name} = {fmt_expr(a.value)}" if a.name is not None else fmt_expr(a.value)
                for a in items
            )
            return f"read {{{', '.join(reads)}}}"
        case ast.Emit(target=t, call=c):
            return f"emit proposal {fmt_expr(t)} := {fmt_expr(c)}"
        case ast.Score(call=c):
            return f"score {fmt_expr(c)}"
    raise AssertionError(type(st))


@dataclass(frozen=True, slots=True)
class _Comment:
    line: int
    text: str  # including the leading //
    own_line: bool  # alone on its line (else trailing code)


def _comments(text: str) -> list[_Comment]:
    out = []
    for n, line in enumerate(text.split("\n"), start=1):  # lines as the parser counts them
        in_str = False
        i = 0
        while i < len(line):
            ch = line[i]
            if in_str:
                if ch == "\\":
                    i += 1
                elif ch == '"':
                    in_str = False
            elif ch == '"':
                in_str = True
            elif line.startswith("//", i):
                out.append(_Comment(n, line[i:].rstrip(), not line[:i].strip()))
                break
            i += 1
    return out


def format_program(prog: ast.Program, text: str) -> str:
    comments = _comments(text)
    own = [c for c in comments if c.own_line]
    trailing = {c.line: c for c in comments if not c.own_line}
    src_lines = text.split("\n")
    out: list[str] = []
    k = 0  # next own-line comment to place
    prev_end = 0
    for item in prog.items:
        start, end = item.span.line, item.span.end_line
        # Blank line before the item (or before its leading comments) if the source had one.
        lead = []
        while k < len(own) and own[k].line < start:
            lead.append(own[k])
            k += 1
        first_line = lead[0].line if lead else start
        if out and any(
            not src_lines[i - 1].strip()
            for i in range(prev_end + 1, first_line)
            if 0 < i <= len(src_lines)
        ):
            out.append("")
        for j, c in enumerate(lead):
            if j and any(not src_lines[i - 1].strip() for i in range(lead[j - 1].line + 1, c.line)):
                out.append("")
            out.append(c.text)
        if lead and any(not src_lines[i - 1].strip() for i in range(lead[-1].line + 1, start)):
            out.append("")
        lines = _stmt_lines(item)
        for idx, (line, node, src_line) in enumerate(lines):
            # Own-line comments inside a block go before the statement they precede.
            while k < len(own) and own[k].line < src_line:
                out.append((INDENT if idx else "") + own[k].text)
                k += 1
            last_line = node.span.end_line if node is not None else src_line
            if idx == len(lines) - 1:
                last_line = max(last_line, end)
            tails = [trailing[n].text for n in range(src_line, last_line + 1) if n in trailing]
            for n in range(src_line, last_line + 1):
                trailing.pop(n, None)
            out.append(line + (_TAIL + " ".join(tails) if tails else ""))
        prev_end = end
    rest = own[k:] + sorted(trailing.values(), key=lambda c: c.line)
    if rest and out:
        if any(not src_lines[i - 1].strip() for i in range(prev_end + 1, rest[0].line)):
            out.append("")
    out.extend(c.text for c in rest)
    return "\n".join(_align_tails(out)) + "\n" if out else ""


_TAIL = "  \x00"  # marks where a trailing comment starts until _align_tails places it


def _align_tails(lines: list[str]) -> list[str]:
    """Trailing comments on consecutive lines start in one column, two spaces after the longest
    code among them (as gofmt does)."""
    out = list(lines)
    i = 0
    while i < len(out):
        if _TAIL not in out[i]:
            i += 1
            continue
        j = i
        while j < len(out) and _TAIL in out[j]:
            j += 1
        width = max(len(out[k].split(_TAIL, 1)[0]) for k in range(i, j))
        for k in range(i, j):
            code, comment = out[k].split(_TAIL, 1)
            out[k] = f"{code.ljust(width)}  {comment}"
        i = j
    return out


def format_source(text: str, file: str = "<input>") -> str:
    """Canonical text of ``text`` (raises ParseError on a malformed program)."""
    return format_program(parse(text, file), text)


def format_checked(prog: ast.Program, text: str) -> str:
    """:func:`format_program`, with absurdly deep expressions reported as a ParseError."""
    try:
        return format_program(prog, text)
    except RecursionError:
        span = None
        for item in prog.items:
            try:
                _stmt_lines(item)
            except RecursionError:
                span = item.span
                break
        raise ParseError(
            "an expression is nested too deeply to format",
            span=span,
            code="P004",
            hint="split the expression",
        ) from None
