"""The program as a graph: values, visibility edges, rules, constraints and commits.

Rendered as text (an outline), Graphviz DOT, Mermaid, or SVG: through Graphviz's `dot` binary
when it is installed, else by :func:`to_svg`'s own three-column layout (no dependency).
"""

from __future__ import annotations

from dataclasses import dataclass

from lmpm.ir.nodes import PredKind, Program, RuleKind
from lmpm.ir.printer import access_str, axis_str, binder_str, call_str, expr_str, read_str


@dataclass(frozen=True, slots=True)
class Node:
    id: str
    kind: str  # value | rule | constraint | commit
    label: str


@dataclass(frozen=True, slots=True)
class Edge:
    src: str
    dst: str
    kind: str  # visible | read | emit | constrains | commits
    label: str


def graph(p: Program) -> tuple[list[Node], list[Edge]]:
    nodes: list[Node] = []
    edges: list[Edge] = []
    for v in p.values:
        dims = ", ".join(expr_str(d) for d in v.dims)
        kind = f"Params[{v.module}] " if v.module else ""  # cells: the module's tensors/blocks
        nodes.append(Node(f"v_{v.name}", "value", f"{v.name} : {kind}{v.shape.value}({dims})"))
    for s in p.stencils:
        idx = ", ".join(axis_str(a) for a in s.axes)
        label = f"{s.source}[{idx}]"
        if s.binders:
            label += " for " + " and ".join(binder_str(b) for b in s.binders)
        if s.guard.value != 1 or s.guard.args:
            label += f" when {expr_str(s.guard)}"
        edges.append(Edge(f"v_{s.source}", f"v_{s.target}", "visible", label))
    for r in p.rules:
        nodes.append(Node(f"r_{r.name}", "rule", f"rule {r.name}\\n{call_str(r.proposal)}"))
        for rd in r.reads:
            edges.append(
                Edge(f"v_{rd.source}", f"r_{r.name}", "read", f"{rd.name}: {read_str(rd)}")
            )
        kind = "schedule" if r.kind == RuleKind.SCHEDULE else "propose"
        edges.append(Edge(f"r_{r.name}", f"v_{r.target}", "emit", kind))
    for c in p.constraints:
        if c.pred == PredKind.IN_SET and c.access is not None and c.set is not None:
            pred = f"{access_str(c.access)} in {call_str(c.set)}"
        elif c.pred == PredKind.USER and c.call is not None:
            pred = call_str(c.call)
        else:
            pred = (
                f"{c.pred.value}({access_str(c.access)})" if c.access is not None else c.pred.value
            )
        nodes.append(
            Node(
                f"c_{c.name}",
                "constraint",
                f"{c.name} [{c.priority}] {c.status.value}\\n{c.kind} {pred}",
            )
        )
        if c.access is not None:
            edges.append(Edge(f"c_{c.name}", f"v_{c.access.value}", "constrains", c.kind))
    for i, cm in enumerate(p.commits):
        nodes.append(
            Node(f"m_{i}", "commit", f"commit {access_str(cm.access)}\\n{call_str(cm.policy)}")
        )
        edges.append(Edge(f"m_{i}", f"v_{cm.access.value}", "commits", "agree"))
    return nodes, edges


_DOT_SHAPE = {"value": "box3d", "rule": "ellipse", "constraint": "hexagon", "commit": "note"}
_DOT_EDGE = {
    "visible": "color=steelblue",
    "read": "color=gray40,style=dashed",
    "emit": "color=darkgreen,penwidth=2",
    "constrains": "color=firebrick,style=dotted",
    "commits": "color=purple",
}


def _q(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\\\\n", "\\n") + '"'


def to_dot(p: Program) -> str:
    nodes, edges = graph(p)
    out = [
        "digraph lmpm {",
        "  rankdir=LR;",
        '  node [fontname="Helvetica", fontsize=10];',
        '  edge [fontname="Helvetica", fontsize=9];',
    ]
    for n in nodes:
        out.append(f"  {n.id} [label={_q(n.label)}, shape={_DOT_SHAPE[n.kind]}];")
    for e in edges:
        out.append(f"  {e.src} -> {e.dst} [label={_q(e.label)}, {_DOT_EDGE[e.kind]}];")
    out.append("}")
    return "\n".join(out) + "\n"


_SVG_COLUMN = {"constraint": 0, "commit": 0, "value": 1, "rule": 2}
_SVG_FILL = {"value": "#e8f0fe", "rule": "#e6f4ea", "constraint": "#fce8e6", "commit": "#f3e8fd"}
_SVG_STROKE = {
    "visible": "steelblue",
    "read": "#666666",
    "emit": "darkgreen",
    "constrains": "firebrick",
    "commits": "purple",
}
_CHAR_W, _LINE_H, _PAD, _GAP_Y, _GAP_X = 7.0, 15.0, 8.0, 18.0, 150.0


def _x(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


def to_svg(p: Program) -> str:
    """The graph as a standalone SVG without Graphviz: constraints and commits on the left, values
    in the middle, rules on the right; edges are labelled curves (a value's `visible` edges to
    itself or another value bulge to the left of the middle column)."""
    nodes, edges = graph(p)
    pos, width, height = _svg_layout(nodes)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
        f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="Helvetica, Arial, sans-serif">',
        '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" '
        'markerHeight="7" orient="auto-start-reverse"><path d="M 0 0 L 10 5 L 0 10 z" '
        'fill="context-stroke"/></marker></defs>',
    ]
    loops: dict[str, int] = {}  # self-loops drawn per node, to stack their labels
    for e in edges:
        if e.src in pos and e.dst in pos:
            out += _svg_edge(e, pos[e.src], pos[e.dst], loops)
    for n in nodes:
        nx, ny, nw, nh = pos[n.id]
        rx = 14 if n.kind == "rule" else 3
        out.append(
            f'<g id="{_x(n.id)}"><rect x="{nx:.1f}" y="{ny:.1f}" width="{nw:.1f}" '
            f'height="{nh:.1f}" rx="{rx}" fill="{_SVG_FILL[n.kind]}" stroke="#333333"/>'
        )
        for i, line in enumerate(n.label.split("\\n")):
            out.append(
                f'<text x="{nx + _PAD:.1f}" y="{ny + _PAD / 2 + (i + 0.8) * _LINE_H:.1f}" '
                f'font-size="11">{_x(line)}</text>'
            )
        out.append("</g>")
    out.append("</svg>")
    return "\n".join(out) + "\n"


_Box = tuple[float, float, float, float]  # x, y, w, h


def _svg_layout(nodes: list[Node]) -> tuple[dict[str, _Box], float, float]:
    """Each node's box (three columns, top to bottom), and the drawing's width and height."""
    cols: list[list[Node]] = [[], [], []]
    for n in nodes:
        cols[_SVG_COLUMN[n.kind]].append(n)
    size = {}
    for n in nodes:
        lines = n.label.split("\\n")
        size[n.id] = (max(len(x) for x in lines) * _CHAR_W + 2 * _PAD, len(lines) * _LINE_H + _PAD)
    widths = [max((size[n.id][0] for n in c), default=0.0) for c in cols]
    pos: dict[str, _Box] = {}
    x = 40.0
    height = 0.0
    for c, w in zip(cols, widths):
        y = 20.0
        for n in c:
            nw, nh = size[n.id]
            pos[n.id] = (x + (w - nw) / 2, y, nw, nh)
            y += nh + _GAP_Y
        height = max(height, y)
        x += w + _GAP_X if w else 0.0
    return pos, x, height


def _svg_edge(e: Edge, src: _Box, dst: _Box, loops: dict[str, int]) -> list[str]:
    """An edge's curve and its label."""
    sx, sy, sw, sh = src
    dx, dy, dw, dh = dst
    y1, y2 = sy + sh / 2, dy + dh / 2
    if e.src == e.dst:  # a value that sees itself: a loop on its left side
        path = f"M {sx:.1f} {y1 - 6:.1f} C {sx - 70:.1f} {y1 - 40:.1f} {sx - 70:.1f} "
        path += f"{y1 + 40:.1f} {sx:.1f} {y1 + 6:.1f}"
        loops[e.src] = loops.get(e.src, 0) + 1
        lx, ly = sx - 60, y1 - 30 - 11 * (loops[e.src] - 1)
    elif abs((sx + sw / 2) - (dx + dw / 2)) < 1:  # same column: an arc on the left
        x1, x2 = sx, dx
        bend = 60 + abs(y2 - y1) / 4
        path = f"M {x1:.1f} {y1:.1f} C {x1 - bend:.1f} {y1:.1f} {x2 - bend:.1f} {y2:.1f} "
        path += f"{x2:.1f} {y2:.1f}"
        lx, ly = min(x1, x2) - bend * 0.75, (y1 + y2) / 2
    else:
        x1 = sx + sw if sx < dx else sx
        x2 = dx if sx < dx else dx + dw
        mx = (x1 + x2) / 2
        path = f"M {x1:.1f} {y1:.1f} C {mx:.1f} {y1:.1f} {mx:.1f} {y2:.1f} {x2:.1f} {y2:.1f}"
        lx, ly = mx, (y1 + y2) / 2
    dash = ' stroke-dasharray="4 3"' if e.kind in ("read", "constrains") else ""
    return [
        f'<path d="{path}" fill="none" stroke="{_SVG_STROKE[e.kind]}"{dash} '
        'marker-end="url(#arrow)"/>',
        f'<text x="{lx:.1f}" y="{ly - 3:.1f}" font-size="9" text-anchor="middle" '
        f'fill="{_SVG_STROKE[e.kind]}">{_x(e.label)}</text>',
    ]


def _mm(s: str) -> str:
    return s.replace('"', "#quot;").replace("\\n", "<br/>").replace("<-", "&lt;-")


def to_mermaid(p: Program) -> str:
    nodes, edges = graph(p)
    shapes = {
        "value": ('[["', '"]]'),
        "rule": ('(["', '"])'),
        "constraint": ('{{"', '"}}'),
        "commit": ('[/"', '"/]'),
    }
    arrows = {
        "visible": "-->",
        "read": "-.->",
        "emit": "==>",
        "constrains": "-.-x",
        "commits": "-->",
    }
    out = ["flowchart LR"]
    for n in nodes:
        a, b = shapes[n.kind]
        out.append(f"  {n.id}{a}{_mm(n.label)}{b}")
    for e in edges:
        out.append(f'  {e.src} {arrows[e.kind]}|"{_mm(e.label)}"| {e.dst}')
    return "\n".join(out) + "\n"


def to_text(p: Program) -> str:
    nodes, edges = graph(p)
    label = {n.id: n.label.split("\\n")[0] for n in nodes}
    for v in p.values:
        label.setdefault(f"v_{v.name}", v.name)
    out = []
    for kind, title in (
        ("value", "values"),
        ("rule", "rules"),
        ("constraint", "constraints"),
        ("commit", "commits"),
    ):
        group = [n for n in nodes if n.kind == kind]
        if not group:
            continue
        out.append(f"{title}:")
        for n in group:
            out.append("  " + n.label.replace("\\n", "  —  "))
            for e in edges:
                if e.dst == n.id and kind == "value":
                    out.append(
                        f"    <- {e.kind}: {e.label}"
                        + ("" if e.kind == "visible" else f" ({label.get(e.src, e.src)})")
                    )
                if e.src == n.id and kind == "rule" and e.kind == "emit":
                    out.append(f"    -> {e.label} {label.get(e.dst, e.dst)}")
                if e.dst == n.id and kind == "rule":
                    out.append(f"    <- read {e.label}")
    if p.workflows:
        from lmpm.ir.printer import workflow_lines

        out.append("workflows:")
        for w in p.workflows:
            out.extend("  " + line for line in workflow_lines(w))
    return "\n".join(out) + "\n"
