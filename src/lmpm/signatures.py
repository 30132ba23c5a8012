"""What each built-in name accepts, declared without importing it (no torch): the checker's source.

A built-in model reads its inputs by name (``ByteLM`` reads ``context``), a commit policy works on
some value types only (``average`` needs numbers), a schedule knows a fixed set of strategies. These
facts are declared here so ``lmpm check`` (and ``lmpm run`` before epoch 0) decides them with a
location instead of a ``KeyError`` in a worker. ``tests/test_signatures.py`` ties each declaration
to the Python object it describes.

>>> SIGNATURES["ByteLM"].reads
('context',)
"""

from __future__ import annotations

from dataclasses import dataclass

# Kinds of literal arguments, as the IR's ArgKind values: "int", "float", "str", "name", "expr"
# (an integer expression, possibly using the epoch `e`), "call", "read", "of" (`k of n`).
NUMBER = ("int", "float", "expr")
INTEGER = ("int", "expr")


@dataclass(frozen=True, slots=True)
class Param:
    """One argument: its name, the argument kinds it takes, and the values it allows."""

    name: str
    kinds: tuple[str, ...]
    choices: tuple[str, ...] = ()  # str/name arguments: the allowed values (empty: any)
    minimum: float | None = None  # numbers: the smallest allowed literal
    positive: bool = False  # numbers: strictly greater than 0


@dataclass(frozen=True, slots=True)
class Signature:
    """A built-in call name: its role and what it accepts."""

    role: str  # model | score | policy | schedule | predicate | set | region
    params: tuple[Param, ...] = ()  # keyword arguments (policies: positional, in order)
    reads: tuple[str, ...] = ()  # input names the model needs (a read, or an argument keyword)
    optional_reads: tuple[str, ...] = ()  # input names the model uses when present
    positional_reads: bool = True  # models: positional arguments name reads
    dtypes: tuple[str, ...] = ()  # policies/models: value types it works on (empty: any)
    vocab: int | None = None  # models: the vocabulary size it proposes (None: any)
    doc: str = ""

    def param(self, name: str) -> Param | None:
        return next((p for p in self.params if p.name == name), None)


_K = Param("k", INTEGER, minimum=1)  # candidates per cell
_TEMPERATURE = Param("temperature", NUMBER, positive=True)

STRATEGIES = ("all", "raster", "red-black", "independent", "random", "confidence")
SATISFY_MODES = ("max_constraints_then_score",)

SIGNATURES: dict[str, Signature] = {
    # ---- commit policies (positional arguments) ----
    "satisfy": Signature(
        "policy",
        (Param("mode", ("name", "str"), SATISFY_MODES),),
        doc="satisfy(max_constraints_then_score)",
    ),
    "winner_takes_all": Signature("policy", doc="winner_takes_all"),
    "average": Signature("policy", dtypes=("float", "tensor"), doc="average (numeric values)"),
    "quorum": Signature(
        "policy",
        (Param("k", (*INTEGER, "of"), minimum=1), Param("inner", ("name", "call", "str"))),
        doc="quorum(k, inner_policy) or quorum(k of n, inner_policy)",
    ),
    # ---- schedules ----
    "SampleTiles": Signature(
        "schedule",
        (
            Param("strategy", ("str", "name"), STRATEGIES),
            Param("epoch", INTEGER),
            Param("k", INTEGER, minimum=1),
            Param("steps", INTEGER, minimum=1),
        ),
        positional_reads=False,
        doc='SampleTiles(strategy="red-black", epoch=e, k=1, steps=16)',
    ),
    # ---- models ----
    "ByteLM": Signature(
        "model",
        (_K, _TEMPERATURE, Param("pick", ("str", "name"), ("sample", "top"))),
        reads=("context",),
        dtypes=("token",),
        vocab=256,
        doc='ByteLM(context, k=1, temperature=1.0, pick="sample"|"top") with a read named `context`',
    ),
    "TextScore": Signature("score", reads=("context",), doc="TextScore(...)"),
    "Model": Signature(
        "model",
        (_K, _TEMPERATURE),
        reads=("txt",),
        optional_reads=("neighbors", "prev_frame", "coarse"),
        dtypes=("token",),
        vocab=16,
        doc="Model(neighbors, prev, txt, coarse) with reads `txt` (and optionally `neighbors`, "
        "`prev_frame`, `coarse`)",
    ),
    "ModelScore": Signature(
        "score", reads=("txt",), optional_reads=("neighbors", "prev_frame", "coarse")
    ),
    "CoarseGen": Signature(
        "model", (_K,), reads=("txt",), dtypes=("token",), vocab=16, doc="CoarseGen(txt)"
    ),
    "Uniform": Signature("model", (_K,), dtypes=("token",), doc="Uniform(..., k=1)"),
    "RandomTokens": Signature("model", (_K,), dtypes=("token",), doc="RandomTokens(..., k=1)"),
    "ZeroScore": Signature("score"),
    "Digits": Signature(
        "model",
        (Param("patience", INTEGER, minimum=0),),
        reads=("row", "col", "box", "crow", "ccol", "cbox"),
        dtypes=("token",),
        doc="Digits(row, col, box, crow, ccol, cbox, patience=3)",
    ),
    "Candidates": Signature(
        "model",
        (Param("patience", INTEGER, minimum=0),),
        reads=("row", "col", "box", "crow", "ccol", "cbox"),
        dtypes=("token",),
        doc="Candidates(row, col, box, crow, ccol, cbox, patience=3)",
    ),
}

POLICIES = tuple(n for n, s in SIGNATURES.items() if s.role == "policy")
