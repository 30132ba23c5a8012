"""Loading and saving the built-in models' weights: safetensors with the config in the metadata.

Weights live beside this module, in ``src/lmpm/models/weights/NAME.safetensors`` (committed;
produced by ``scripts/train_*.py``). They are loaded offline, on first use, and cached per process.
``LMPM_WEIGHTS`` overrides the directory (tests of the training scripts, experiments).
"""

from __future__ import annotations

import copy
import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from lmpm.errors import BindError
from lmpm.workers.simcuda import active

WEIGHTS = Path(__file__).parent  # the committed NAME.safetensors files

M = TypeVar("M", bound=nn.Module)

_CACHE: dict[tuple[str, str, str], nn.Module] = {}  # (weights dir, name, device)
_LOCK = threading.Lock()


def weights_dir() -> Path:
    return Path(os.environ.get("LMPM_WEIGHTS") or WEIGHTS)


def save(module: nn.Module, path: str | Path, config: dict[str, Any], **meta: Any) -> Path:
    from safetensors.torch import save_file

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in module.state_dict().items()}
    metadata = {"config": json.dumps(config, sort_keys=True)}
    metadata.update({k: json.dumps(v, sort_keys=True) for k, v in meta.items()})
    save_file(tensors, str(p), metadata=metadata)
    return p


def metadata(path: str | Path) -> dict[str, Any]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        raw = f.metadata() or {}
    return {k: json.loads(v) for k, v in raw.items()}


def _device_key(device: torch.device) -> str:
    """The cache's name of ``device``: a simulated CUDA device (lmpm.workers.simcuda) is not
    the real one, so a process that runs both keeps both copies apart."""
    return f"sim:{device}" if device.type == "cuda" and active() is not None else str(device)


def load(name: str, build: Callable[..., M], device: torch.device | str | None = None) -> M:
    """The model ``name`` (``weights/NAME.safetensors``), built by ``build(**config)``, eval mode,
    on ``device`` (default: the CPU), cached per process and device: the weights are read once
    per weights directory and moved to each device once, never per call."""
    d = weights_dir()
    dev = torch.device("cpu" if device is None else device)
    if dev.type != "cpu":
        key = (str(d), name, _device_key(dev))
        with _LOCK:
            hit = _CACHE.get(key)
        if hit is None:
            hit = copy.deepcopy(load(name, build)).to(dev)
            with _LOCK:
                hit = _CACHE.setdefault(key, hit)
        return hit  # type: ignore[return-value]
    key = (str(d), name, "cpu")
    with _LOCK:
        hit = _CACHE.get(key)
        if hit is not None:
            return hit  # type: ignore[return-value]
        path = d / f"{name}.safetensors"
        if not path.is_file():
            raise BindError(
                f"the weights of the built-in model `{name}` are missing: {path}",
                code="B070",
                hint=f"train them with scripts/train_{'text' if name == 'bytelm' else 'video'}.py",
            )
        from safetensors.torch import load_file

        config = metadata(path)["config"]
        module = build(**config)
        module.load_state_dict(load_file(str(path)))
        module.eval()
        for p in module.parameters():
            p.requires_grad_(False)
        _CACHE[key] = module
        return module


def clear_cache() -> None:
    with _LOCK:
        _CACHE.clear()


def deterministic(seed: int, threads: int = 2) -> torch.Generator:
    """Seed everything a training script uses; returns a generator for data sampling."""
    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    return torch.Generator().manual_seed(seed)


_TABLES: dict[tuple[str, str], Any] = {}


def table(name: str, make: Callable[[], Any], device: torch.device | str) -> Any:
    """A built-in model's constant table(s), ``make()`` on the CPU, moved to ``device`` once and
    cached per device (a tensor, or a tuple of tensors)."""
    dev = torch.device(device)
    key = (name, _device_key(dev))
    hit = _TABLES.get(key)
    if hit is None:
        made = make()
        hit = tuple(t.to(dev) for t in made) if isinstance(made, tuple) else made.to(dev)
        hit = _TABLES.setdefault(key, hit)
    return hit
