"""Binding call names in a program (Model, Palette, region, SampleTiles, ...) to Python objects.

Three sources, later ones win: the built-in registry (lazy: a built-in is imported only when a
program uses it), modules passed with ``--bind`` (a dotted module name or a ``.py`` path), and the
``bindings=`` mapping of the Python API.

One rule for every entry point (``lmpm check --bind``, ``lmpm run``, its ``--resume``,
``lmpm.compile``, ``runner()``, ``lmpm.resume``): a run's :class:`Bindings` are loaded first, and
the program is checked against them, so a name the run binds itself (:meth:`Bindings.user_names`)
is held to its own Python signature (the link step, B053), never to the built-in of the same name
(E213). A run directory records each name the program calls that the run binds itself, with where
it came from and its Python signature (:func:`bound_record`); a resumed run must bind the same
names with the same signatures (:func:`bound_differences`), whether it gets them from ``--bind``
modules or a ``bindings=`` mapping: module paths are compared only to decide what may be imported.

A user module binds names either with the decorator::

    import lmpm

    @lmpm.bind("Palette")
    def palette(name: str) -> list[int]:
        return [0, 1, 2]

or with a module-level dict ``LMPM_BINDINGS = {"Palette": palette}``.

A model (or score) may opt in to compilation under ``lmpm run --compile`` / ``Run(compile=True)``:
``@lmpm.bind("Name", compile=True)``, or the attribute ``lmpm_compile`` (:data:`COMPILE_ATTR`) on
the callable itself, which is how ``LMPM_BINDINGS`` and the ``bindings=`` mapping opt in
(``fn.lmpm_compile = True``). See :func:`bind` and docs/models.md, "Compiled models".
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

from lmpm.errors import BindError, UsageError, user_frame

# Built-in names -> "module:attribute", imported on first use. Policies and schedules are resolved
# by the runtime's own registries; they are listed so `check --strict` knows them without torch.
BUILTINS: dict[str, str] = {
    "satisfy": "lmpm.resolve.policies:satisfy",
    "winner_takes_all": "lmpm.resolve.policies:winner_takes_all",
    "average": "lmpm.resolve.policies:average",
    "quorum": "lmpm.resolve.policies:quorum",
    "Set": "lmpm.runtime.data.constraints:set_literal",
    "SampleTiles": "lmpm.resolve.schedules:sample_tiles",
    "Uniform": "lmpm.models.null:uniform_logits",
    "ZeroScore": "lmpm.models.null:zero_score",
    "RandomTokens": "lmpm.models.null:random_tokens",
    "clash": "lmpm.runtime.data.constraints:clash",
    "inputs": "lmpm.runtime.data.constraints:inputs_region",
    "Digits": "lmpm.models.sudoku:digits",
    "Candidates": "lmpm.models.sudoku:candidates",
    "Duplicate": "lmpm.models.sudoku:duplicate",
    "Model": "lmpm.models.video:local_gen",
    "ModelScore": "lmpm.models.video:model_score",
    "CoarseGen": "lmpm.models.video:coarse_gen",
    "Palette": "lmpm.models.world:palette",
    "region": "lmpm.models.world:region",
    "ByteLM": "lmpm.models.text:byte_lm",
    "TextScore": "lmpm.models.text:text_score",
    "Amplify": "lmpm.models.latent:amplify",
    "NormAtMost": "lmpm.models.latent:norm_at_most",
    "Copy": "lmpm.models.latent:copy",
    "BoxMean": "lmpm.models.latent:box_mean",
}

_DECORATED: dict[str, Any] = {}  # filled by @bind while a --bind module is imported

# The attribute by which a bound model or score opts in to compilation under --compile: ``True``
# (the worker calls ``torch.compile(fn)``) or a zero-argument callable returning the compiled model
# to call instead (the model compiles its own heavy part; the built-in models do). lmpm.models.compile
COMPILE_ATTR = "lmpm_compile"

F = TypeVar("F", bound=Callable[..., Any])


def bind(name: str, *, compile: bool | Callable[[], Any] = False) -> Callable[[F], F]:
    """Decorator: bind ``name`` in LMPM programs to the decorated callable or class.

    ``compile`` opts a model (or a score) in to compilation: under ``lmpm run --compile`` /
    ``Run(compile=True)``, and never otherwise, the worker calls a compiled version of it.

    - ``compile=True``: ``torch.compile(fn)`` (dynamo with its default ``dynamic=None``: graph
      breaks are allowed, a second input shape recompiles with dynamic shapes). Suits a model whose
      work is one big tensor computation; Python glue in it (caches, ``int(tensor)``, boolean-mask
      indexing) breaks the graph, and every call pays dynamo's guards (tens of µs).
    - ``compile=factory``: a zero-argument callable the worker calls once, at the first epoch,
      returning the model to call instead, e.g. the same function with only its ``nn.Module``'s
      forward compiled (what the built-in models do, lmpm.models.compile.ModuleGraphs).

    The decorator sets ``obj.lmpm_compile`` (:data:`COMPILE_ATTR`); setting that attribute by hand
    opts in a callable bound through ``LMPM_BINDINGS`` or ``bindings=``. A model that fails to
    compile runs eagerly, with one ``warning:`` line naming its rule (docs/models.md)::

        @lmpm.bind("Denoise", compile=True)
        def denoise(inputs, **kw):
            return {"logits": net(inputs["nbr"].float())}
    """

    def deco(obj: F) -> F:
        if compile is not False:
            try:
                setattr(obj, COMPILE_ATTR, compile)
            except (AttributeError, TypeError):
                raise BindError(
                    f'@lmpm.bind("{name}", compile=...): cannot set `{COMPILE_ATTR}` on '
                    f"{type(obj).__name__} {obj!r}",
                    code="B015",
                    hint="bind a Python function, a class or an nn.Module to opt in to compilation",
                ) from None
        _DECORATED[name] = obj
        return obj

    return deco


def compile_flag(obj: Any) -> bool | Callable[[], Any]:
    """How a bound object opted in to compilation (:data:`COMPILE_ATTR`): False when it did not."""
    flag = getattr(obj, COMPILE_ATTR, False)
    if flag is True or (callable(flag) and not isinstance(flag, bool)):
        return flag  # type: ignore[no-any-return]
    return False


def register_builtin(name: str, target: str) -> None:
    """Add a built-in name (``"package.module:attr"``), e.g. from a plugin package."""
    BUILTINS[name] = target


def _import_failed(spec: str, e: Exception) -> BindError:
    return BindError(
        f"--bind {spec}: importing it raised {type(e).__name__}: {e}{user_frame(e)}", code="B010"
    )


def load_module(spec: str) -> dict[str, Any]:
    """Import a ``--bind`` module (dotted name or .py path) and return the names it binds."""
    _DECORATED.clear()
    path = Path(spec)
    try:
        if spec.endswith(".py") or path.exists():
            if not path.is_file():
                raise UsageError(f"--bind {spec}: no such file", code="U004")
            mod_name = f"lmpm_user_bindings_{abs(hash(str(path.resolve())))}"
            loader_spec = importlib.util.spec_from_file_location(mod_name, path)
            if loader_spec is None or loader_spec.loader is None:
                raise UsageError(f"--bind {spec}: cannot load this file as Python", code="U004")
            module = importlib.util.module_from_spec(loader_spec)
            sys.modules[mod_name] = module
            # as `python FILE` does: the file's folder is importable (its sibling modules)
            folder = str(path.resolve().parent)
            if folder not in sys.path:
                sys.path.insert(0, folder)
            loader_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(spec)
    except UsageError:
        raise
    except ModuleNotFoundError as e:
        if e.name is None or not (spec == e.name or spec.startswith(e.name + ".")):
            raise _import_failed(spec, e) from e  # the module itself imports a missing one
        # a module name is looked up on sys.path, which holds no working directory for `lmpm`
        local = Path(*spec.split(".")).with_suffix(".py")
        hint = f"to load the file, pass its path: --bind ./{local}" if local.is_file() else None
        raise UsageError(
            f"--bind {spec}: module not found ({e.name})", code="U004", hint=hint
        ) from None
    except Exception as e:
        raise _import_failed(spec, e) from e
    names = dict(_DECORATED)
    table = getattr(module, "LMPM_BINDINGS", None)
    if table is not None:
        if not isinstance(table, dict):
            raise BindError(
                f"--bind {spec}: LMPM_BINDINGS must be a dict of name -> object", code="B011"
            )
        names.update(table)
    if not names:
        raise BindError(
            f"--bind {spec}: the module binds no names",
            code="B012",
            hint='decorate functions with @lmpm.bind("Name") or define LMPM_BINDINGS',
        )
    _DECORATED.clear()
    return names


def known_names(modules: Iterable[str] = ()) -> set[str]:
    return set(BUILTINS) | user_names(modules)


def user_names(modules: Iterable[str] = ()) -> set[str]:
    """The names ``modules`` bind (``--bind``)."""
    names: set[str] = set()
    for m in modules:
        names.update(load_module(m))
    return names


def resolve_builtin(name: str) -> Any:
    target = BUILTINS.get(name)
    if target is None:
        raise KeyError(name)
    mod, _, attr = target.partition(":")
    return getattr(importlib.import_module(mod), attr)


MAPPING = "bindings="  # where a name bound by the Python API's mapping comes from


MSG_UNTRUSTED = (
    "{where} was started with --bind {mods}. LMPM imports no Python module a run directory names "
    "unless this command names it too (a run directory from elsewhere could name any module); "
    "nothing was changed."
)


def recorded_modules(
    recorded: Any,
    *,
    where: str,
    given: Iterable[str] | None = None,
    trust: bool = False,
    cli: bool = True,
) -> tuple[str, ...]:
    """The modules a run directory recorded (its meta ``bind``) that may be imported: the one
    place LMPM decides it, for every reader (resume in the CLI and the API, compare). A run
    directory is data (docs/security.md): its modules are imported only when the command names
    them again (``given``, which the caller checked equal to ``recorded``) or trusts the
    directory (``--trust-bind``, ``trust_bind=True``); otherwise UsageError U040.

    >>> recorded_modules([], where="runs/a")
    ()
    >>> recorded_modules(["mods.py"], where="runs/a", trust=True)
    ('mods.py',)
    """
    from lmpm.printable import printable

    if not recorded:
        return ()
    if not isinstance(recorded, (list, tuple)) or not all(isinstance(m, str) for m in recorded):
        from lmpm.errors import RunDirError

        raise RunDirError(
            f"{printable(where)}: the recorded --bind modules are not a list of names; "
            "nothing was imported",
            code="D006",
        )
    mods = tuple(recorded)
    if trust or given:
        return mods
    shown = " --bind ".join(printable(m) for m in mods)
    if cli:
        raise UsageError(
            MSG_UNTRUSTED.format(where=printable(where), mods=shown),
            code="U040",
            hint=f"give --bind {shown} again (or --trust-bind to import what "
            f"{printable(where)} names)",
        )
    raise UsageError(
        f"{printable(where)} was started with bound modules {list(mods)}; LMPM imports them only "
        "when asked",
        code="U040",
        hint="pass bind=[...] naming them again, or trust_bind=True",
    )


class Bindings:
    """Name -> object for one run: user mappings over --bind modules over built-ins."""

    def __init__(self, modules: Iterable[str] = (), mapping: dict[str, Any] | None = None) -> None:
        self.modules = tuple(modules)  # the --bind specs, as given
        self.mapping = dict(mapping or {})  # the bindings= mapping
        self._user: dict[str, Any] = {}
        self._origin: dict[str, str] = {}  # user name -> its module spec, or MAPPING
        for m in self.modules:
            names = load_module(m)
            self._user.update(names)
            self._origin.update(dict.fromkeys(names, m))
        self._user.update(self.mapping)
        self._origin.update(dict.fromkeys(self.mapping, MAPPING))

    def extended(
        self, modules: Iterable[str] = (), mapping: dict[str, Any] | None = None
    ) -> Bindings:
        """These bindings with more modules and mapping entries (later ones win)."""
        return Bindings((*self.modules, *modules), {**self.mapping, **(mapping or {})})

    def origin(self, name: str) -> str | None:
        """Where the run binds ``name`` itself: a ``--bind`` module spec, or :data:`MAPPING`
        (None: a built-in, or unbound)."""
        return self._origin.get(name)

    def names(self) -> set[str]:
        return set(BUILTINS) | set(self._user)

    def user_names(self) -> set[str]:
        """The names this run's modules and mapping bind (a built-in of the same name is
        overridden)."""
        return set(self._user)

    def get(self, name: str, role: str = "name") -> Any:
        if name in self._user:
            return self._user[name]
        try:
            return resolve_builtin(name)
        except KeyError:
            pass
        known = ", ".join(sorted(self.names()))
        raise BindError(
            f"{role} `{name}` is not bound",
            code="B020",
            hint=f'bind it with --bind MODULE (decorate with @lmpm.bind("{name}")); '
            f"bound names: {known} (the built-ins: docs/builtins.md)",
        )


class _Default:
    """Shown for a parameter's default value: a signature records that there is one, not which."""

    def __repr__(self) -> str:
        return "..."


def signature_text(obj: Any) -> str:
    """``obj``'s Python signature as the run calls it (an ``nn.Module``'s ``forward``): its
    parameters' names and kinds and which have defaults, without annotations (``(inputs, *,
    src, k=..., **_)``), or ``?`` for an object whose signature Python cannot read."""
    target = obj
    if not inspect.isroutine(obj) and not inspect.isclass(obj):
        target = getattr(obj, "forward", obj)  # a module instance is called through forward
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        return "?"
    default = _Default()
    params = [
        p.replace(
            annotation=inspect.Parameter.empty,
            default=inspect.Parameter.empty if p.default is inspect.Parameter.empty else default,
        )
        for p in sig.parameters.values()
    ]
    return str(sig.replace(parameters=params, return_annotation=inspect.Signature.empty))


def bound_record(bindings: Bindings, used: Iterable[str]) -> dict[str, dict[str, str]]:
    """What a run directory records of its bindings: each name of ``used`` (the program's call
    names) that the run binds itself -> where from (``from``: a module spec or ``bindings=``) and
    its Python signature (``signature``)."""
    return {
        name: {"from": bindings.origin(name) or "", "signature": signature_text(bindings.get(name))}
        for name in sorted(set(used) & bindings.user_names())
    }


def bound_differences(
    stored: dict[str, dict[str, str]], given: dict[str, dict[str, str]]
) -> list[str]:
    """How the names a resumed run binds itself differ from the ones its run recorded (empty:
    the same names with the same signatures; modules and mappings are interchangeable)."""
    out: list[str] = []
    for name, was in stored.items():
        now = given.get(name)
        if now is None:
            out.append(
                f"`{name}` was bound by {origin_words(was)} as `{name}{was['signature']}`; "
                "nothing binds it now (the built-in, or nothing, would run)"
            )
        elif now["signature"] != was["signature"]:
            out.append(
                f"`{name}` was bound as `{name}{was['signature']}`; now as "
                f"`{name}{now['signature']}` ({origin_words(now)})"
            )
    for name, now in given.items():
        if name not in stored:
            out.append(f"`{name}` is now bound by {origin_words(now)}; the run used the built-in")
    return out


def origin_words(entry: dict[str, str]) -> str:
    """Where a recorded binding came from, in words: ``--bind MODULE`` or the mapping."""
    return (
        "the bindings= mapping" if entry.get("from") == MAPPING else f"--bind {entry.get('from')}"
    )
