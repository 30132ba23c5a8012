"""The program as a graph: values, visibility edges, rules, constraints and commits.

Rendered as text (an outline), Graphviz DOT, or Mermaid; SVG goes through Graphviz's `dot` binary.
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
        nodes.append(Node(f"v_{v.name}", "value", f"{v.name} : {v.shape.value}({dims})"))
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
