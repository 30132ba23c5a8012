"""Binding call names in a program (Model, Palette, region, SampleTiles, ...) to Python objects.

Three sources, later ones win: the built-in registry (lazy: a built-in is imported only when a
program uses it), modules passed with ``--bind`` (a dotted module name or a ``.py`` path), and the
``bindings=`` mapping of the Python API. A user module binds names either with the decorator::

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


class Bindings:
    """Name -> object for one run: user mappings over --bind modules over built-ins."""

    def __init__(self, modules: Iterable[str] = (), mapping: dict[str, Any] | None = None) -> None:
        self._user: dict[str, Any] = {}
        for m in modules:
            self._user.update(load_module(m))
        self._user.update(mapping or {})

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
