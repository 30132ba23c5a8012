"""``LMPM_VALIDATE=eager``: a ``--compile`` run checks each epoch against the eager decision.

As tinygrad's ``VALIDATE_WITH_CPU`` runs each kernel again on the CPU and compares, a validated
run keeps a second, eager data plane beside its fused one (a :class:`ShadowPlane`: the same plan,
seed and device, no store, nothing compiled). Each epoch:

1. the shadow gets a copy of the run's state (payload, committed and input flags, every cell's
   metadata, why-codes): the state the run's epoch starts from;
2. the run's epoch runs (its compiled steps and its eager values) and its models' proposals are
   kept (:meth:`EagerValidator.proposed`);
3. the shadow runs the same epoch eagerly on its copy, its models replaced by those proposals
   (models run once: a model with side effects or its own random stream sees one call);
4. both states are compared, value by value in commit order, cell by cell: at the first cell
   where they differ the run stops with :class:`ValidationError` (R085), which names the value,
   the cell, the epoch and both results.

An epoch that runs eagerly in the run itself (``--trace cells``, taps, injected faults) is not
compared. Bound Python predicates run twice (once per path): they must not keep state between
calls, which docs/language.md asks of them anyway.

Example (a program whose value compiles; the eager decision agrees)::

    >>> import os
    >>> from lmpm.runtime.session import Run
    >>> src = '''
    ... value A : Token[4] shape Seq(3)
    ... rule R:
    ...   on A[t]
    ...   emit proposal A[t] := Uniform()
    ... commit A[*] using satisfy
    ... '''
    >>> os.environ["LMPM_VALIDATE"] = "eager"
    >>> run = Run.from_source(src, compile=True)
    >>> del os.environ["LMPM_VALIDATE"]
    >>> res = run.run(2)
    >>> run.engine.dataplane.validator.epochs
    2
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from lmpm.errors import RuntimeFault, UsageError
from lmpm.resolve.plan import Plan
from lmpm.runtime.data.calls import Proposal
from lmpm.runtime.data.dataplane import DataPlane
from lmpm.runtime.protocol import EpochReport, EpochRequest, ProposeRequest
from lmpm.runtime.records import CHECKSUM_POLICIES, CellState

VALIDATE_ENV = "LMPM_VALIDATE"
MODES = ("eager",)  # what LMPM_VALIDATE may name ("" or unset: no validation)

# a cell's state, compared in this order (the first field that differs is named)
FIELDS = ("committed", "payload", "clock", "rule", "epoch", "score", "why")


def mode() -> str | None:
    """``LMPM_VALIDATE``'s mode (None: not set); an unknown one is U120."""
    got = os.environ.get(VALIDATE_ENV, "").strip()
    if not got:
        return None
    if got not in MODES:
        raise UsageError(
            f"{VALIDATE_ENV}={got!r} names no validation mode",
            code="U120",
            hint=f"{VALIDATE_ENV}=eager (a --compile run checks every epoch against eager), "
            "or unset it",
        )
    return got


class ValidationError(RuntimeFault):
    """The compiled and the eager decision of one epoch differ (``LMPM_VALIDATE=eager``)."""


@dataclass(frozen=True, slots=True)
class CellResult:
    """One cell's state after an epoch, as one path left it."""

    committed: bool
    payload: Any  # a number, or a list for a cell with a shape
    clock: int
    rule: int
    epoch: int
    score: float
    why: int | None  # why it stays unset (None: the value has no why-codes)

    def text(self, why: bool) -> str:
        """The fields in words (``why``: with the why-code, which only an unset cell needs)."""
        return (
            f"committed={self.committed} payload={self.payload} clock={self.clock} "
            f"rule={self.rule} epoch={self.epoch} score={self.score:g}"
            + (f" why={self.why}" if why and self.why is not None else "")
        )


class ShadowPlane(DataPlane):
    """The eager data plane a validated run decides each epoch again on: its models are not
    called; it replays the proposals the run's own models made this epoch (:attr:`replay`)."""

    def __init__(self, plan: Plan, backend: Any, seed: int, worker: str) -> None:
        super().__init__(
            plan, backend=backend, seed=seed, worker=worker, checksum_policies=CHECKSUM_POLICIES
        )
        self.replay: tuple[dict[str, list[Proposal]], float] | None = None

    def run_models(self, req: ProposeRequest) -> tuple[dict[str, list[Proposal]], float]:
        assert self.replay is not None, "the shadow decides only epochs whose proposals it got"
        return self.replay


class EagerValidator:
    """Runs the eager decision of every compiled epoch of ``live`` on a copy of its state and
    compares (see the module docstring)."""

    def __init__(self, live: DataPlane) -> None:
        self.live = live
        self.shadow = ShadowPlane(live.plan, live.backend, live.seed, live.worker)
        self.epochs = 0  # epochs compared
        self._proposed: tuple[dict[str, list[Proposal]], float] | None = None

    def proposed(self, per_value: Mapping[str, list[Proposal]], seconds: float) -> None:
        """The run's models proposed ``per_value`` this epoch: kept for the shadow, as copies
        (the run's epoch must not be able to change what the shadow decides from)."""
        self._proposed = (
            {
                name: [
                    Proposal(rp, cells, rep, prop.clone(), sc.clone())
                    for rp, cells, rep, prop, sc in parts
                ]
                for name, parts in per_value.items()
            },
            seconds,
        )

    def summary(self) -> str:
        """One line for the end of a run."""
        epochs = f"{self.epochs} epoch{'s' if self.epochs != 1 else ''}"
        return (
            f"LMPM_VALIDATE=eager: {epochs} of the compiled run decided eagerly too, "
            "every cell the same"
        )

    def begin(self) -> None:
        """Before the live plane's epoch: give the shadow a copy of the state it starts from."""
        self._proposed = None
        self._sync()

    def check(self, req: EpochRequest, report: EpochReport) -> None:
        """After the live plane's epoch ``req`` (which reported ``report``): decide it eagerly on
        the shadow, from the same proposals, and compare (ValidationError at the first cell
        that differs)."""
        if self._proposed is None:  # the epoch ran eagerly (traced, tapped, faulted)
            return
        self.shadow.replay, self._proposed = self._proposed, None
        try:
            self.shadow.epoch(req)  # (nothing compiled there: the eager epoch)
        finally:
            self.shadow.replay = None
        self._compare(req.epoch, [ve.value for ve in report.values])
        self.epochs += 1

    def _sync(self) -> None:
        """Give the shadow a copy of the live state (what the epoch starts from)."""
        live, shadow = self.live, self.shadow
        for name in live.plan.values:
            shadow.payload[name].copy_(live.payload[name])
            shadow.committed[name].copy_(live.committed[name])
            shadow.from_input[name].copy_(live.from_input[name])
            st = live.owner.state[name]
            shadow.owner.restore(
                name,
                CellState(
                    st.committed.clone(),
                    st.clock.clone(),
                    st.rule.clone(),
                    st.epoch.clone(),
                    st.score.clone(),
                ),
            )
        for name, why in live.owner.why.items():
            shadow.owner.why[name].copy_(why)

    def _compare(self, e: int, order: list[str]) -> None:
        """Raise at the first cell whose state differs (values in commit order, then the
        rest)."""
        names = list(dict.fromkeys([*order, *self.live.plan.rules_by_target]))
        for name in names:
            bad = self._differs(name)
            if bad.any():
                cell = int(bad.nonzero()[0, 0])
                got, want = self._cell(self.live, name, cell), self._cell(self.shadow, name, cell)
                field = next(f for f in FIELDS if getattr(got, f) != getattr(want, f))
                n = int(bad.count_nonzero())
                why = field == "why" or not (got.committed and want.committed)
                raise ValidationError(
                    f"LMPM_VALIDATE=eager: epoch {e}: the compiled and the eager decision differ "
                    f"at {_cell_name(self.live, name, cell)} ({field}; {n} cell"
                    f"{'s of' if n != 1 else ' of'} `{name}` differ{'' if n != 1 else 's'})\n"
                    f"  compiled: {got.text(why)}\n  eager:    {want.text(why)}",
                    where={"value": name, "cell": cell, "epoch": e},
                    code="R085",
                    hint="a bug in --compile: please report it with the program; "
                    "run without --compile meanwhile (the eager result is the reference)",
                )

    def _differs(self, name: str) -> Tensor:
        """(N,) bool: the cells of ``name`` whose state differs between the two planes."""
        a, b = self.live, self.shadow
        pa, pb = a.payload[name].cpu(), b.payload[name].cpu()
        same = pa == pb
        if pa.is_floating_point():
            same |= pa.isnan() & pb.isnan()
        if same.dim() > 1:
            same = same.flatten(1).all(dim=1)
        bad = ~same | (a.committed[name].cpu() != b.committed[name].cpu())
        sa, sb = a.owner.state[name], b.owner.state[name]
        for f in ("committed", "clock", "rule", "epoch"):
            bad |= getattr(sa, f) != getattr(sb, f)
        ka, kb = sa.score, sb.score
        bad |= (ka != kb) & ~(ka.isnan() & kb.isnan())
        wa, wb = a.owner.why.get(name), b.owner.why.get(name)
        if wa is not None and wb is not None:
            bad |= wa != wb
        return bad

    @staticmethod
    def _cell(dp: DataPlane, name: str, cell: int) -> CellResult:
        st = dp.owner.state[name]
        why = dp.owner.why.get(name)
        return CellResult(
            bool(st.committed[cell]),
            dp.payload[name][cell].cpu().tolist(),
            int(st.clock[cell]),
            int(st.rule[cell]),
            int(st.epoch[cell]),
            float(st.score[cell]),
            None if why is None else int(why[cell]),
        )


def _cell_name(dp: DataPlane, name: str, cell: int) -> str:
    """``V[i, j]`` for flat cell ``cell`` of ``name``."""
    dims = dp.plan.values[name].dims
    idx = []
    for d in reversed(dims):
        idx.append(cell % d)
        cell //= d
    return f"{name}[{', '.join(map(str, reversed(idx)))}]"


def install(dataplane: Any) -> None:
    """Give a fused data plane (``--compile``) the validator ``LMPM_VALIDATE`` asks for: none
    when unset, U120 for an unknown mode. (A worker group never compiles: U101.)"""
    if mode() is not None and isinstance(dataplane, DataPlane):
        dataplane.validator = EagerValidator(dataplane)
