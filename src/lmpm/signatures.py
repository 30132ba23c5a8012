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
    doc: str = ""  # the call as written in a program
    returns: str = ""  # what it gives the runtime (docs/builtins.md)
    example: str = ""  # one program line using it (docs/builtins.md)

    def param(self, name: str) -> Param | None:
        return next((p for p in self.params if p.name == name), None)


_K = Param("k", INTEGER, minimum=1)  # candidates per cell
_TEMPERATURE = Param("temperature", NUMBER, positive=True)

STRATEGIES = ("all", "raster", "frontier", "red-black", "independent", "random", "confidence")
PALETTE_NAMES = ("blue-ish", "sky", "ground", "shapes", "all")  # lmpm.models.world.PALETTES
SATISFY_MODES = ("max_constraints_then_score",)
# a training program's module (`Params[M]`) and loss names (lmpm.train.modules.MODULES, LOSSES)
TRAIN_MODULES = ("ByteLM",)
TRAIN_LOSSES = ("NextByteLoss",)

SIGNATURES: dict[str, Signature] = {
    # ---- commit policies (positional arguments) ----
    "satisfy": Signature(
        "policy",
        (Param("mode", ("name", "str"), SATISFY_MODES),),
        doc="satisfy(max_constraints_then_score)",
        returns="per cell, the candidate with the most satisfied constraints from the highest "
        "priority down, then the highest score, then the lowest candidate id (keep-current is "
        "candidate 0)",
        example="commit Vid[*] using satisfy(max_constraints_then_score)",
    ),
    "winner_takes_all": Signature(
        "policy",
        doc="winner_takes_all",
        returns="per cell, the highest-scoring proposal whatever the constraints say (they are "
        "still traced); a cell with no proposal keeps its value",
        example="commit Txt[*] using winner_takes_all",
    ),
    "average": Signature(
        "policy",
        dtypes=("float", "tensor"),
        doc="average (numeric values)",
        returns="per cell, the mean of the valid proposals (Float and Tensor[D] values), computed "
        "by the worker holding the payload",
        example="commit M[*] using average",
    ),
    "quorum": Signature(
        "policy",
        (Param("k", (*INTEGER, "of"), minimum=1), Param("inner", ("name", "call", "str"))),
        doc="quorum(k, inner_policy) or quorum(k of n, inner_policy)",
        returns="runs every rule of the value as k (or n) replicas; a proposal is eligible when "
        "k replicas proposed the same payload; `inner_policy` picks among the eligible",
        example="commit Txt[*] using quorum(2 of 3, satisfy)",
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
        returns="the schedule: which cells are open in each epoch. Strategies: "
        + ", ".join(STRATEGIES)
        + " (docs/runtime.md, Schedules); `k`: cells per epoch (raster, random; per row: frontier); `steps`: "
        "epochs to set every cell in (confidence; default --epochs, else 16)",
        example='emit proposal MaskPlan := SampleTiles(strategy="red-black", epoch=e)',
    ),
    # ---- models ----
    "ByteLM": Signature(
        "model",
        (_K, _TEMPERATURE, Param("pick", ("str", "name"), ("sample", "top"))),
        reads=("context",),
        dtypes=("token",),
        vocab=256,
        doc='ByteLM(context, k=1, temperature=1.0, pick="sample"|"top") with a read named `context`',
        returns="k next-byte proposals per cell from the embedded byte model (sampled at "
        "`temperature`, or the top k), scored by their log-probability",
        example="emit proposal Txt[t] := ByteLM(context, k=4)",
    ),
    "TextScore": Signature(
        "score",
        reads=("context",),
        doc="TextScore(...)",
        returns="the byte model's log-probability of each candidate, (cells, candidates)",
        example="score TextScore(...)",
    ),
    "Model": Signature(
        "model",
        (_K, _TEMPERATURE),
        reads=("txt",),
        optional_reads=("neighbors", "prev_frame", "coarse"),
        dtypes=("token",),
        vocab=16,
        doc="Model(neighbors, prev, txt, coarse) with reads `txt` (and optionally `neighbors`, "
        "`prev_frame`, `coarse`)",
        returns="k video-token proposals per cell from the embedded LocalGen model (16 colours), "
        "conditioned on the caption, the 3x3 neighbours, the previous frame and the coarse grid",
        example="emit proposal Vid[t,x,y] := Model(neighbors, prev, txt, coarse)",
    ),
    "ModelScore": Signature(
        "score",
        reads=("txt",),
        optional_reads=("neighbors", "prev_frame", "coarse"),
        doc="ModelScore(...)",
        returns="LocalGen's log-probability of each candidate, (cells, candidates)",
        example="score ModelScore(...)",
    ),
    "CoarseGen": Signature(
        "model",
        (_K,),
        reads=("txt",),
        dtypes=("token",),
        vocab=16,
        doc="CoarseGen(txt)",
        returns="k proposals per coarse cell: the caption's likely colour of that 8x8 block",
        example="emit proposal Coarse[t,i,j] := CoarseGen(txt)",
    ),
    "Uniform": Signature(
        "model",
        (_K,),
        dtypes=("token",),
        doc="Uniform(..., k=1)",
        returns="k uniformly random tokens per cell, all with the same score (a null model)",
        example="emit proposal Txt[t] := Uniform(ctx)",
    ),
    "RandomTokens": Signature(
        "model",
        (_K,),
        dtypes=("token",),
        doc="RandomTokens(..., k=1)",
        returns="k random tokens per cell, score 0, from the counter-based RNG (the same seed, "
        "cell and epoch give the same tokens)",
        example="emit proposal A[t] := RandomTokens(ctx, k=4)",
    ),
    "ZeroScore": Signature(
        "score",
        doc="ZeroScore(...)",
        returns="0 for every candidate (ties then break by candidate order)",
        example="score ZeroScore(...)",
    ),
    "Digits": Signature(
        "model",
        (Param("patience", INTEGER, minimum=0),),
        reads=("row", "col", "box", "crow", "ccol", "cbox"),
        dtypes=("token",),
        doc="Digits(row, col, box, crow, ccol, cbox, patience=3)",
        returns="sudoku digit proposals per open cell from its row, column and box (and their "
        "pencil marks); `patience`: epochs without progress before it guesses",
        example="emit proposal Grid[x,y] := Digits(row, col, box, crow, ccol, cbox)",
    ),
    "Candidates": Signature(
        "model",
        (Param("patience", INTEGER, minimum=0),),
        reads=("row", "col", "box", "crow", "ccol", "cbox"),
        dtypes=("token",),
        doc="Candidates(row, col, box, crow, ccol, cbox, patience=3)",
        returns="one token per cell encoding its pencil marks (the digits still possible), calm "
        "and alarm counters (examples/sudoku.lmpm's Cand value)",
        example="emit proposal Cand[x,y] := Candidates(row, col, box, crow, ccol, cbox)",
    ),
    "Amplify": Signature(
        "model",
        (_K,),
        dtypes=("tensor",),
        doc="Amplify(nb, k=4)",
        returns="k vectors per cell: the mean of the committed vectors read, scaled by 1, 1.5, "
        "2, ... plus a little counter-based noise, each scored by its norm",
        example="emit proposal Z[x, y] := Amplify(nb, k=4)",
    ),
    "Copy": Signature(
        "model",
        reads=("own",),
        dtypes=("float", "tensor"),
        doc="Copy(own) with a read named `own` (one cell)",
        returns="one proposal per cell: the payload of the cell read as `own`, score 0",
        example="emit proposal M[x, y] := Copy(own)",
    ),
    "BoxMean": Signature(
        "model",
        reads=("around",),
        dtypes=("tensor",),
        doc="BoxMean(around) with a read named `around`",
        returns="one proposal per cell: the mean of the committed vectors read as `around`, "
        "score 0",
        example="emit proposal M[x, y] := BoxMean(around)",
    ),
    # ---- constraint predicates, sets and regions ----
    "NormAtMost": Signature(
        "predicate",
        (Param("bound", NUMBER),),
        doc="NormAtMost(A[...], R)",
        returns="per candidate: its Euclidean norm is at most R (Tensor[D] and Float cells)",
        example="constraint Bounded: require NormAtMost(Z[x, y], R) priority 10 hard",
    ),
    "clash": Signature(
        "predicate",
        doc="clash(A[...], B[...])",
        returns="per candidate: it equals a committed cell of B other than the cell itself "
        "(with `forbid`: all-different)",
        example="constraint Row: forbid clash(A[x, y], A[*, y]) priority 100",
    ),
    "Duplicate": Signature(
        "predicate",
        doc="Duplicate(A[...], B[...])",
        returns="per candidate: a digit (not 0) that a committed cell of B other than the cell "
        "itself holds (sudoku's all-different, blanks allowed)",
        example="constraint Row: forbid Duplicate(Grid[x, y], Grid[*, y]) priority 100",
    ),
    "Set": Signature(
        "set",
        doc='Set(1, 3..5, "ab")',
        returns="a set of tokens: integers, inclusive ranges a..b, and strings (their UTF-8 bytes)",
        example='constraint Plain: require Txt[t] in Set(32..126, "\\n") priority 10',
    ),
    "Palette": Signature(
        "set",
        (Param("name", ("str",), PALETTE_NAMES),),
        doc='Palette("blue-ish")',
        returns="the video tokens of a named colour group of the generated world: "
        + ", ".join(PALETTE_NAMES),
        example='constraint TextPaint: require Vid[t, region("sky")] in Palette("blue-ish") '
        "priority 50",
    ),
    "region": Signature(
        "region",
        (Param("name", ("str",), ("sky", "ground")),),
        doc='region("sky")',
        returns="in an index slot, a boolean mask over the remaining (x, y) axes: the sky band "
        "(the top 3/8 of the rows) or the ground (the rest)",
        example='constraint TextPaint: require Vid[t, region("sky")] in Palette("blue-ish") '
        "priority 50",
    ),
    "inputs": Signature(
        "region",
        doc="inputs()",
        returns="in an index slot, the cells committed from input files (the givens)",
        example="constraint Givens: forbid change(Grid[inputs()]) priority 1000",
    ),
}

POLICIES = tuple(n for n, s in SIGNATURES.items() if s.role == "policy")
