"""A simulated CUDA device: GPU-readiness proven on a machine without a GPU.

Inside :func:`simulated_cuda`, ``torch.device("cuda")`` works on a CPU-only build of PyTorch.
Tensors made on it (``torch.zeros(..., device="cuda")``, ``t.cuda()``, ``t.to("cuda")``,
``nn.Module.cuda()``) are :class:`SimTensor`\\ s: they say ``cuda:0`` (``.device``, ``.is_cuda``)
and compute on the CPU with real values, so data-dependent code (``int(slot.max())``) runs as it
would on a GPU. Every operation is checked against what a real GPU does:

- **errors** (raised at once, as PyTorch on a GPU would raise them): a CPU tensor combined with a
  CUDA one (``cpu + cuda``, ``torch.cat([cpu, cuda])``, ``cpu_table[cuda_index]``,
  ``cpu.index_select(0, cuda_index)``), ``.numpy()`` of a CUDA tensor. A 0-dim CPU tensor may
  meet a CUDA tensor, and a CUDA tensor may be indexed by CPU indices, as on a real GPU;
- **warnings** (recorded, the call goes on): what works on a GPU but makes the host wait for it
  on every call — a tensor's value read on the host (``.item()``, ``int()``, ``float()``,
  ``bool()``, an ``if`` on a tensor), ``.tolist()``, a copy to the host (``.cpu()``), and
  operations whose output size depends on the data (``nonzero``, boolean-mask indexing,
  ``unique``, ``masked_select``).

Why a value-carrying tensor subclass, and not PyTorch's ``FakeTensorMode``: fake tensors carry no
values, so a model that looks at a tensor's value (ByteLM's ``int(slot.max())``) cannot run under
them; they let ``cpu_tensor[cuda_index]`` through, which fails on a GPU; and on a CPU-only build
their CUDA device guard is missing, so even ``cuda_tensor[0]`` raises. A :class:`SimTensor` is a
CPU tensor inside (its C++ device is the CPU, so PyTorch's own device guards stay quiet) whose
Python-visible device is ``cuda:0``; the dispatch handler of this module unwraps, checks the
devices of every argument, runs the CPU kernel and wraps the result.

Example:
    >>> import torch
    >>> from lmpm.workers.simcuda import SimulatedDeviceError, simulated_cuda
    >>> with simulated_cuda() as sim:
    ...     x = torch.arange(4.0, device="cuda")
    ...     y = (x * 2).sum()
    ...     v = float(y)                             # works, and waits for the GPU: a warning
    ...     try:
    ...         torch.ones(4) + x                    # a CPU tensor meets a CUDA one: an error
    ...     except SimulatedDeviceError as e:
    ...         err = str(e).split(" (")[0]
    >>> x.device.type, v, [w.kind for w in sim.warnings], err
    ('cuda', 12.0, ['sync'], 'Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu!')
"""

from __future__ import annotations

import contextlib
import sys
import sysconfig
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from lmpm.errors import BackendUnavailable
from lmpm.workers.cuda import CudaBackend

__all__ = [
    "DeviceEvent",
    "SimTensor",
    "SimulatedDeviceError",
    "Simulation",
    "active",
    "make_backend",
    "simulated_cuda",
]

SIM_DEVICE = torch.device("cuda", 0)
_CPU = torch.device("cpu")
aten = torch.ops.aten

MSG_MIXED = (
    "Expected all tensors to be on the same device, but found at least two devices, cuda:0 and "
    "cpu! (in {op}; simulated CUDA: this fails on a real GPU)"
)
MSG_INDEX = (
    "indices should be either on cpu or on the same device as the indexed tensor (cpu) (in {op}; "
    "simulated CUDA: this fails on a real GPU)"
)
MSG_NUMPY = (
    "can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor to "
    "host memory first. (simulated CUDA: this fails on a real GPU)"
)
HINT_MIXED = (
    "make every tensor on the inputs' device: `torch.zeros(n, device=x.device)`, move tables and "
    "weights once (`self.table = self.table.to(x.device)`, or register them as buffers of an "
    "nn.Module, which LMPM moves to the worker's device)"
)

# Ops that read a value on the host (the host waits for the device), and ops whose output size
# depends on the data (they read a count on the host): both work on a GPU, and both stall it.
_SYNC_OPS = {
    aten._local_scalar_dense.default: "sync",
    aten.item.default: "sync",  # (what arrives under torch.inference_mode)
    aten.is_nonzero.default: "sync",  # bool(t), an `if` on a tensor
    aten.equal.default: "sync",  # torch.equal answers a Python bool
    aten.nonzero.default: "data-dependent",
    aten.masked_select.default: "data-dependent",
    aten._unique2.default: "data-dependent",
    aten.unique_dim.default: "data-dependent",
    aten.unique_consecutive.default: "data-dependent",
}
# Ops that may take CPU index tensors into a CUDA tensor (PyTorch moves them), and copies.
_INDEX_OPS = {
    aten.index.Tensor,
    aten.index_put.default,
    aten.index_put_.default,
    aten._index_put_impl_.default,
}
_COPY_OPS = {
    aten.copy_.default,
    aten._to_copy.default,
    aten.lift_fresh.default,
    aten._has_compatible_shallow_copy_type.default,  # a type question (nn.Module._apply asks it)
}

_SKIP_DIRS = (
    str(Path(torch.__file__).resolve().parent),
    sysconfig.get_paths()["stdlib"],
    str(Path(__file__).resolve()),
)


class SimulatedDeviceError(RuntimeError):
    """What PyTorch raises on a real GPU for the same code (the simulated device raises it)."""


@dataclass(frozen=True, slots=True)
class DeviceEvent:
    """One thing the simulated device saw: where user or model code did it, and in which call."""

    kind: str  # "sync", "data-dependent", "host-copy", "h2d", "tolist" (warnings) or "error"
    op: str  # the aten op or Tensor method
    file: str  # the innermost frame outside torch and LMPM's runtime: the model's own line
    line: int
    func: str
    call: tuple[str, str] | None  # ("model"|"score"|"predicate", rule or constraint) or None

    def where(self) -> str:
        return f"{self.file}:{self.line}, in {self.func}"


@dataclass(slots=True)
class Simulation:
    """The state of one :func:`simulated_cuda` block: what it saw."""

    warnings: list[DeviceEvent] = field(default_factory=list)
    errors: list[DeviceEvent] = field(default_factory=list)
    ops: int = 0  # aten ops dispatched on the simulated device
    # Called for every event with (event, frame stack); the check command narrows events to
    # model calls with it.
    locate: Callable[[], tuple[str, str] | None] | None = None

    def record(self, kind: str, op: str) -> DeviceEvent:
        file, line, func = _user_frame()
        ev = DeviceEvent(kind, op, file, line, func, self.locate() if self.locate else None)
        (self.errors if kind == "error" else self.warnings).append(ev)
        return ev


_state = threading.local()


def active() -> Simulation | None:
    """The simulation of the innermost :func:`simulated_cuda` block on this thread, if any."""
    return getattr(_state, "sim", None)


def _user_frame() -> tuple[str, int, str]:
    """The innermost frame outside torch, the standard library and this module."""
    f = sys._getframe(1)
    while f is not None:
        name = f.f_code.co_filename
        if not name.startswith("<") and not str(Path(name).resolve()).startswith(_SKIP_DIRS):
            return name, f.f_lineno, f.f_code.co_name
        f = f.f_back  # type: ignore[assignment]
    return "<unknown>", 0, "?"


class SimTensor(Tensor):
    """A tensor on the simulated CUDA device: a CPU tensor inside, ``cuda:0`` to its user."""

    _elem: Tensor

    @staticmethod
    def __new__(cls, elem: Tensor) -> SimTensor:
        r = Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls,
            elem.size(),
            strides=elem.stride(),
            storage_offset=elem.storage_offset(),
            dtype=elem.dtype,
            layout=elem.layout,
            device=_CPU,
            requires_grad=elem.requires_grad,
        )
        r._elem = elem
        return r

    # The wrapper's C++ device is the CPU (so PyTorch's device guards stay quiet on a CPU-only
    # build); Python code sees cuda:0.
    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return SIM_DEVICE

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True

    @property
    def is_cpu(self) -> bool:  # type: ignore[override]
        return False

    def get_device(self) -> int:
        return 0

    # The wrapper's C++ device is the CPU, so PyTorch alone would hand it back unchanged from
    # .cpu() and .to("cpu"): these copy to the host, as on a GPU (also outside the block).
    def cpu(self, memory_format: Any = None) -> Tensor:  # type: ignore[override]
        return aten._to_copy.default(self, device=_CPU)  # type: ignore[no-any-return]

    def to(self, *args: Any, **kwargs: Any) -> Tensor:  # type: ignore[override]
        parse = {k: v for k, v in kwargs.items() if k != "copy"}
        device, dtype, _non_blocking, _fmt = torch._C._nn._parse_to(*args, **parse)
        if args and isinstance(args[0], SimTensor):  # .to(other): other's device and dtype
            device, dtype = SIM_DEVICE, args[0].dtype
        out: Tensor = self
        if device is not None and not _names_cuda(device):
            out = aten._to_copy.default(self, device=torch.device(device))
        if dtype is not None and dtype != out.dtype:
            out = aten._to_copy.default(out, dtype=dtype)
        return out

    def numpy(self, *args: Any, **kwargs: Any) -> Any:
        sim = active()
        if sim is not None:
            sim.record("error", "Tensor.numpy")
        raise SimulatedDeviceError(MSG_NUMPY)

    def tolist(self) -> Any:
        sim = active()
        if sim is not None:
            sim.record("tolist", "Tensor.tolist")
        return self._elem.tolist()

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"{self._elem!r}"[:-1] + ", device='cuda:0')"

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        return _dispatch(func, args, kwargs or {})


def _is_cpu(t: Any) -> bool:
    """A real CPU tensor that a CUDA kernel cannot read (0-dim CPU tensors are scalars to it)."""
    return isinstance(t, Tensor) and not isinstance(t, SimTensor) and t.device.type == "cpu"


def _check_devices(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    if func in _COPY_OPS:
        return
    if func in _INDEX_OPS:
        self = args[0]
        indices = [i for i in args[1] if isinstance(i, Tensor)]
        if _is_cpu(self) and self.dim() > 0 and any(isinstance(i, SimTensor) for i in indices):
            raise _error(MSG_INDEX, func)
        # a CUDA tensor indexed by CPU indices is fine; the values put must be on its device
        rest = [a for a in (*args[2:], *kwargs.values()) if isinstance(a, Tensor)]
        if isinstance(self, SimTensor) and any(_is_cpu(t) and t.dim() > 0 for t in rest):
            raise _error(MSG_MIXED, func)
        return
    flat = pytree.arg_tree_leaves(*args, **kwargs)
    if any(isinstance(t, SimTensor) for t in flat) and any(
        _is_cpu(t) and t.dim() > 0 for t in flat
    ):
        raise _error(MSG_MIXED, func)


def _error(msg: str, func: Any) -> SimulatedDeviceError:
    sim = active()
    op = str(getattr(func, "__name__", func))
    if sim is not None:
        sim.record("error", op)
    return SimulatedDeviceError(msg.format(op=op))


def _targets_cuda(kwargs: dict[str, Any]) -> bool | None:
    """True/False: the call names the CUDA / another device; None: it names none."""
    dev = kwargs.get("device")
    if dev is None:
        return None
    return torch.device(dev).type == "cuda"


def _blocking_h2d(func: Any, args: tuple[Any, ...]) -> bool:
    """A copy of a CPU tensor to the device, as ``.to("cuda")`` or ``torch.tensor(..., device=)``
    make it (a scalar's too: the host still waits for the stream)."""
    return func is aten._to_copy.default and _is_cpu(args[0])


def _unwrap(x: Any) -> Any:
    return x._elem if isinstance(x, SimTensor) else x


def _dispatch(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    sim = active()
    if sim is not None:
        sim.ops += 1
    to_cuda = _targets_cuda(kwargs)
    if to_cuda:
        kwargs = {**kwargs, "device": _CPU}
    if kwargs.get("pin_memory"):
        kwargs = {**kwargs, "pin_memory": False}  # pinned memory needs a CUDA build
    _check_devices(func, args, kwargs)
    has_sim = any(isinstance(t, SimTensor) for t in pytree.arg_tree_leaves(*args, **kwargs))
    if sim is not None and has_sim:
        kind = _SYNC_OPS.get(func)
        if func is aten.index.Tensor and any(
            isinstance(i, Tensor) and i.dtype == torch.bool for i in args[1] if i is not None
        ):
            kind = "data-dependent"  # boolean-mask indexing counts the mask on the host
        if func is aten._to_copy.default and to_cuda is False:
            kind = "host-copy"
        if kind is not None:
            sim.record(kind, str(func.__name__))
    if sim is not None and to_cuda and not kwargs.get("non_blocking") and _blocking_h2d(func, args):
        # PyTorch copies host memory to a GPU with cudaMemcpyAsync, then waits for the stream
        # unless the copy is non_blocking: the host waits for every queued kernel
        sim.record("h2d", "copy to the device (not non_blocking)")
    uargs, ukwargs = pytree.tree_map(_unwrap, (args, kwargs))
    out = func(*uargs, **ukwargs)
    if func is aten._to_copy.default:
        wrap = to_cuda if to_cuda is not None else isinstance(args[0], SimTensor)
    elif to_cuda is not None:
        wrap = to_cuda
    else:
        wrap = has_sim
    if not wrap:
        return out
    # An in-place op returns its own argument: hand back the same wrapper, not a new one.
    inputs = {id(a._elem): a for a in pytree.arg_tree_leaves(*args) if isinstance(a, SimTensor)}

    def wrap_one(t: Any) -> Any:
        if not isinstance(t, Tensor) or isinstance(t, SimTensor):
            return t
        same = inputs.get(id(t))
        if same is not None:
            return same
        if torch.is_inference_mode_enabled() and not t.is_inference():
            # a view of a tensor made outside inference mode: its wrapper must not be an
            # inference tensor either (PyTorch gives the view its base's version counter)
            with torch.inference_mode(False):
                return SimTensor(t)
        return SimTensor(t)

    return pytree.tree_map(wrap_one, out)


class _SimMode(TorchDispatchMode):
    """Catches factories and copies that name the CUDA device (no tensor argument to dispatch
    on), so that they make :class:`SimTensor`\\ s."""

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        return _dispatch(func, args, kwargs or {})


class _SimEvent:
    """A CUDA event of the simulated device: the work before it is done when it is recorded."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass


class _SimStream:
    """A CUDA stream of the simulated device: work runs at once on the CPU, in program order."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.device = SIM_DEVICE

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def record_event(self, event: Any = None) -> _SimEvent:
        return event if event is not None else _SimEvent()


_CURRENT_STREAM = _SimStream()


def _to_sim(t: Tensor, non_blocking: bool = False) -> Tensor:
    """``t`` on the simulated device (a copy, as ``.cuda()`` makes one; itself when already)."""
    if isinstance(t, SimTensor):
        return t
    # through the mode: a SimTensor
    return aten._to_copy.default(t, device=SIM_DEVICE, non_blocking=non_blocking)


def _names_cuda(device: Any) -> bool:
    return device is not None and torch.device(device).type == "cuda"


def _entry_points() -> dict[tuple[Any, str], Any]:
    """The Python entry points that reach PyTorch's CUDA guard before any dispatch (so neither
    the mode nor the subclass could see them): each becomes "make it on the CPU, then copy it to
    the simulated device"."""
    tensor, as_tensor = torch.tensor, torch.as_tensor
    to = Tensor.to

    def sim_tensor(data: Any, *args: Any, device: Any = None, **kwargs: Any) -> Tensor:
        if not _names_cuda(device):
            return tensor(data, *args, device=device, **kwargs)  # type: ignore[misc]
        grad = kwargs.pop("requires_grad", False)
        kwargs.pop("pin_memory", None)
        return _to_sim(tensor(data, *args, **kwargs)).requires_grad_(grad)

    def sim_as_tensor(data: Any, dtype: Any = None, device: Any = None) -> Tensor:
        if not _names_cuda(device):
            return as_tensor(data, dtype=dtype, device=device)
        if isinstance(data, SimTensor):
            return data if dtype is None else data.to(dtype)
        return _to_sim(as_tensor(data, dtype=dtype))

    def sim_to(self: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        """A plain tensor's .to(): one naming the CUDA device makes a SimTensor."""
        parse = {k: v for k, v in kwargs.items() if k != "copy"}  # (to a device: a copy anyway)
        device, dtype, non_blocking, _fmt = torch._C._nn._parse_to(*args, **parse)
        if args and isinstance(args[0], SimTensor):  # .to(other): other's device and dtype
            device, dtype = SIM_DEVICE, args[0].dtype
        if not _names_cuda(device):
            return to(self, *args, **kwargs)
        out = _to_sim(self, bool(non_blocking))
        return out if dtype is None or dtype == out.dtype else out.to(dtype)

    def sim_cuda(self: Tensor, device: Any = None, non_blocking: bool = False, **kw: Any) -> Tensor:
        return _to_sim(self, non_blocking)

    return {
        (torch, "tensor"): sim_tensor,
        (torch, "as_tensor"): sim_as_tensor,
        (Tensor, "to"): sim_to,
        (Tensor, "cuda"): sim_cuda,
        # torch.cuda as a machine with one GPU shows it (the CUDA lazy-init that a factory naming
        # "cuda" triggers is a no-op too)
        (torch.cuda, "is_available"): lambda: True,
        (torch.cuda, "device_count"): lambda: 1,
        (torch.cuda, "current_device"): lambda: 0,
        (torch.cuda, "synchronize"): lambda device=None: None,
        (torch.cuda, "_lazy_init"): lambda: None,
        (torch.cuda, "is_initialized"): lambda: True,
        (torch.cuda, "get_device_name"): lambda device=None: "simulated CUDA device (CPU)",
        # streams, events and pinned host memory, as the CUDA backend uses them
        (torch.cuda, "Stream"): _SimStream,
        (torch.cuda, "Event"): _SimEvent,
        (torch.cuda, "current_stream"): lambda device=None: _CURRENT_STREAM,
        (torch.cuda, "stream"): lambda stream=None: contextlib.nullcontext(),
        (torch.cuda, "device"): lambda device=None: contextlib.nullcontext(),
        (Tensor, "record_stream"): lambda self, stream: None,
        (Tensor, "pin_memory"): lambda self, device=None: self,  # (host memory, nothing to pin)
        (Tensor, "is_pinned"): lambda self, device=None: False,
    }


@contextlib.contextmanager
def _torch_patched() -> Iterator[None]:
    patches = _entry_points()
    saved = {key: getattr(*key) for key in patches}
    for (owner, name), fn in patches.items():
        setattr(owner, name, fn)
    # nn.Module.cuda() / .to("cuda") must make new Parameters around the SimTensors: assigning
    # a subclass to `param.data` would keep the plain CPU parameter.
    overwrite = torch.__future__.get_overwrite_module_params_on_conversion()
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        yield
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(overwrite)
        for (owner, name), fn in saved.items():
            setattr(owner, name, fn)


@contextlib.contextmanager
def simulated_cuda(
    locate: Callable[[], tuple[str, str] | None] | None = None,
) -> Iterator[Simulation]:
    """A block in which ``device="cuda"`` is the simulated device; yields what it saw.

    ``locate`` names the program's call (kind, rule or constraint) active when an event happens.
    On a machine with a real GPU the simulation still works (it never touches the GPU).
    """
    if active() is not None:
        raise BackendUnavailable("simulated_cuda() blocks do not nest")
    sim = Simulation(locate=locate)
    _state.sim = sim
    try:
        with _torch_patched(), _SimMode():
            yield sim
    finally:
        _state.sim = None


class SimCudaBackend(CudaBackend):
    """The CUDA backend itself on the simulated device (``--backend simcuda``): the same dispatch,
    streams, events, pinned copies and ``results_to_host`` as on a GPU, where the streams and
    events are the simulation's (work runs at once: nothing to wait for). It needs a
    :func:`simulated_cuda` block around the run (one thread: the mode is per thread)."""

    name = "simcuda"

    def __init__(self, *, worker: str = "simcuda:0", results_to_host: bool = True) -> None:
        if active() is None:
            raise BackendUnavailable(
                "the simulated CUDA backend runs inside lmpm.workers.simcuda.simulated_cuda()",
                hint="`lmpm check PROGRAM --device cuda` runs a program on it",
            )
        super().__init__(device=SIM_DEVICE, worker=worker, results_to_host=results_to_host)


def make_backend(**opts: Any) -> SimCudaBackend:
    return SimCudaBackend(**opts)
