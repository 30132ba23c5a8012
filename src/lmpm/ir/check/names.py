"""Names: one commit policy per value (E208) and a default one where a value has proposals but no
`commit` (W207); every call name bound to something (W210, or E207 when the run's names are known
and the check is strict)."""

from __future__ import annotations

from lmpm.bindings import BUILTINS
from lmpm.errors import Span
from lmpm.ir.check.facts import TRAIN_ROLES, Facts, name_span, suggest
from lmpm.ir.nodes import DType, RuleKind
from lmpm.signatures import TRAIN_LOSSES, TRAIN_MODULES


def check_commits(f: Facts) -> None:
    seen: dict[str, Span] = {}
    for cm in f.p.commits:
        v = cm.access.value
        if v in seen:
            f.sink.error(
                "E208",
                f"`{v}` already has a commit policy (line {seen[v].line})",
                cm.span,
                "one `commit` per value",
            )
        seen[v] = cm.span
    driven = {w.value for w in f.p.workflows}  # the VM commits these values
    for r in f.p.rules:
        if r.kind == RuleKind.LOCAL and r.target not in seen and r.target not in driven:
            f.sink.warning(
                "W207",
                f"`{r.target}` has proposals (rule `{r.name}`) but no "
                "`commit` statement; it commits by satisfy(max_constraints_then_score)",
                r.span,
                f"add `commit {r.target}[*] using satisfy(max_constraints_then_score)`",
            )
            seen[r.target] = r.span


def check_call_names(f: Facts) -> None:
    """W210 for a name that is not a built-in (the run's names unknown), else E207 (strict);
    a training module or loss nothing binds: W210, else B080/B081 (what the run would raise)."""
    if f.known is None:
        _not_builtin(f)
    else:
        _unbound(f, f.known)
    _training_names(f)


def _training_names(f: Facts) -> None:
    """The training runtime binds its modules and losses itself (lmpm.train.modules; their names
    torch-free in lmpm.signatures): a name it does not bind fails the run, B080 or B081."""
    for p in f.p.values:
        if p.dtype != DType.PARAMS or p.module is None or p.module in TRAIN_MODULES:
            continue
        _training_name(
            f,
            "B080",
            f"no module is bound as `{p.module}` for a Params value",
            p.span,
            f"the modules are {', '.join(TRAIN_MODULES)}",
        )
    for call in f.p.calls():
        if call.role == "loss" and call.func not in TRAIN_LOSSES:
            _training_name(
                f,
                "B081",
                f"no loss is bound as `{call.func}`",
                call.span,
                f"the losses are {', '.join(TRAIN_LOSSES)}",
            )


def _training_name(f: Facts, code: str, msg: str, span: Span, hint: str) -> None:
    if f.known is not None:  # the run's names are known: the run would fail on it
        f.sink.error(code, msg, span, hint)
    else:
        f.sink.warning("W210", f"{msg} (a run fails, {code})", span, hint)


def _not_builtin(f: Facts) -> None:
    reported: set[str] = set()
    for call in f.p.calls():
        if call.func in BUILTINS or call.func in reported or call.role == "policy":
            continue
        if call.func in f.user_bound:
            continue  # bound by a --bind module
        if call.role in TRAIN_ROLES:
            continue  # bound by the training runtime (lmpm.train)
        reported.add(call.func)
        near = suggest(call.func, sorted(BUILTINS))
        f.sink.warning(
            "W210",
            f"`{call.func}` ({call.role}) is not a built-in name; a run must bind it "
            "(--bind MODULE, or bindings= in Python)",
            name_span(call),
            near or "check it with `lmpm check --strict --bind MODULE`",
        )


def _unbound(f: Facts, known: set[str]) -> None:
    reported: set[str] = set()
    params = {v.name for v in f.p.values if v.dtype == DType.PARAMS}
    skip = {id(cm.policy) for cm in f.p.commits if cm.access.value in params}
    for call in f.p.calls():
        if call.func in known or call.func in reported:
            continue
        if call.role in TRAIN_ROLES or id(call) in skip:
            continue  # bound by the training runtime (lmpm.train)
        reported.add(call.func)
        msg = f"`{call.func}` ({call.role}) is not bound to anything"
        hint = (
            "bind it in a module passed with --bind (bind=[...] or a bindings= mapping in "
            "Python), or use a built-in name"
        )
        close = suggest(call.func, sorted(known))
        if close:
            hint = f"{close} ({hint})"
        if f.strict:
            f.sink.error("E207", msg, call.span, hint)
