"""Compiled models: what the worker calls instead of a bound model under ``--compile``.

A model (or score) opts in with ``@lmpm.bind("Name", compile=...)`` or the attribute
``lmpm_compile`` on the callable (:data:`lmpm.bindings.COMPILE_ATTR`); under ``lmpm run --compile``
/ ``Run(compile=True)``, and never otherwise, the data plane calls :func:`compiled_model`'s wrapper
in its place (``DataPlane.compile_models``). The flag's value says what is compiled:

- ``True``: ``torch.compile(fn)``, dynamo with its defaults (graph breaks allowed, a second input
  shape recompiles with dynamic shapes);
- a zero-argument callable: the model's own compiled version, built once at its first call. The
  built-in models use it to compile their ``nn.Module``'s forward only, as explicit inductor graphs
  (:class:`ModuleGraphs`): no dynamo frame and no guards per call, shapes bucketed by the model.

A model that fails to compile runs eagerly: :class:`CompiledModel` catches the failure, runs the
eager model on the same inputs and, if that succeeds, writes one ``warning:`` line naming the rule
and the model and calls the eager model from then on. If the eager model fails too, its own error
is the model's fault and is reported as usual (``ModelError`` R050 naming the rule).
"""

from __future__ import annotations

import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lmpm.bindings import compile_flag
from lmpm.runtime.data.compiled import signature

Model = Callable[..., Any]


def model_name(fn: Any) -> str:
    """``module.qualname`` of a bound callable (an instance: of its class)."""
    target = fn if hasattr(fn, "__qualname__") else type(fn)
    module = getattr(target, "__module__", None) or "?"
    return f"{module}.{getattr(target, '__qualname__', type(fn).__name__)}"


class CompiledModel:
    """Calls the compiled version of ``eager`` (built at the first call), falling back to
    ``eager`` for good when building or calling it fails and the eager model succeeds."""

    def __init__(self, eager: Model, flag: bool | Callable[[], Model], rule: str, role: str):
        self.eager = eager
        self.flag = flag
        self.rule = rule
        self.role = role  # "model" | "score"
        self.fn: Model | None = None
        self.failed: str | None = None  # why it runs eagerly, once it does
        self.calls = 0  # calls that went through the compiled version

    def build(self) -> Model:
        if self.flag is True:
            return torch.compile(self.eager)
        assert callable(self.flag)
        made = self.flag()
        if not callable(made):
            raise TypeError(
                f"its `lmpm_compile` factory returned a {type(made).__name__}, not a callable"
            )
        return made  # type: ignore[no-any-return]

    def __call__(self, inputs: Any, **kwargs: Any) -> Any:
        if self.failed is not None:
            return self.eager(inputs, **kwargs)
        try:
            if self.fn is None:
                self.fn = self.build()
            out = self.fn(inputs, **kwargs)
        except Exception as exc:
            # The model's own fault raises here again, as the eager model's (ModelError R050); a
            # failure of the compiler alone leaves the eager model working.
            out = self.eager(inputs, **kwargs)
            self.fall_back(exc)
            return out
        self.calls += 1
        return out

    def fall_back(self, exc: BaseException) -> None:
        self.failed = _first_line(exc)
        self.fn = None
        sys.stderr.write(
            f"warning: rule `{self.rule}`: its {self.role} {model_name(self.eager)} could not be "
            f"compiled ({self.failed[:300]}); it runs eagerly\n"
        )


def _first_line(exc: BaseException) -> str:
    """``Type: first line`` of an error; dynamo's ``backend='x' raised:`` with the line it wraps."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    first = lines[0]
    if first.endswith(":") and len(lines) > 1:
        first += " " + lines[1]
    return f"{type(exc).__name__}: {first}"


def compiled_model(fn: Model | None, rule: str, role: str = "model") -> CompiledModel | None:
    """The compiled stand-in for a bound model or score that opted in, else None."""
    if fn is None:
        return None
    flag = compile_flag(fn)
    if flag is False:
        return None
    return CompiledModel(fn, flag, rule, role)


# ---- explicit graphs of a module's forward (the built-in models) -------------------------------


class ModuleGraphs:
    """``fn(forward, *args) -> Tensor`` of one module, compiled once per input signature.

    ``forward(*a, **kw)`` calls the module with its parameters and buffers as graph inputs
    (``torch.func.functional_call``): each signature is traced on fake tensors (``make_fx``) into
    one aten graph and compiled by inductor (``compile_fx``, C++ wrapper on CPU) — no dynamo frame,
    no guards; a call only looks its graph up by the exact dtypes, shapes and strides of ``args``,
    so the caller buckets shapes (each new signature compiles, seconds; inductor's on-disk cache
    keeps the code for later runs). Inference only: the parameters are read, never trained.
    """

    def __init__(self, module: nn.Module, fn: Callable[..., Tensor]) -> None:
        self.module = module
        self.fn = fn
        state = {**dict(module.named_parameters()), **dict(module.named_buffers())}
        self.names = tuple(state)
        self.state = tuple(t.detach() for t in state.values())
        self.graphs: dict[tuple[Any, ...], Callable[..., Any]] = {}
        self.compile_seconds = 0.0

    def _flat(self, *ts: Tensor) -> Tensor:
        k = len(self.names)
        params = dict(zip(self.names, ts[:k]))

        def forward(*a: Any, **kw: Any) -> Any:
            return torch.func.functional_call(self.module, params, a, kw)

        return self.fn(forward, *ts[k:])

    def _build(self, args: Sequence[Tensor]) -> Callable[..., Any]:
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            # inductor's imports and code generation warn about torch internals
            warnings.simplefilter("ignore")
            from torch._inductor import config
            from torch._inductor.compile_fx import compile_fx
            from torch.fx.experimental.proxy_tensor import make_fx

            flat = [*self.state, *args]
            with torch.no_grad():
                gm = make_fx(self._flat, tracing_mode="fake")(*flat)
            options: dict[str, Any] = {}
            if args[0].device.type == "cpu":
                options["cpp_wrapper"] = True  # buffers allocated and kernels called in C++
            with config.patch(options):
                fn: Callable[..., Any] = compile_fx(gm, [t.clone() for t in flat])  # type: ignore[assignment]
        self.compile_seconds += time.perf_counter() - t0
        return fn

    def __call__(self, *args: Tensor) -> Tensor:
        key = signature(args)
        fn = self.graphs.get(key)
        if fn is None:
            fn = self.graphs[key] = self._build(args)
        out = fn(*self.state, *args)
        return out[0] if isinstance(out, list | tuple) else out


def bucket(n: int, least: int = 1) -> int:
    """``n`` rounded up to a power of two, at least ``least`` (shape buckets of compiled graphs).

    >>> [bucket(n, 16) for n in (1, 16, 17, 64)]
    [16, 16, 32, 64]
    """
    return max(least, 1 << max(n - 1, 0).bit_length())
