"""Counter-based randomness: noise is a pure function of its key, never of a generator's state.

Every sample LMPM draws is keyed by ``(seed, value, rule, replica, epoch, cell, draw)`` and computed with
integer tensor ops (a SplitMix64 finalizer applied as a hash combine). Nothing depends on the batch a
cell happens to sit in, its position in that batch, the worker that runs it, or the device:

- the 64-bit hash and :func:`uniform` are bit-identical on every device and under any permutation or
  split of the batch (integer ops, an exact int→float conversion and an exact power-of-two scale);
- :func:`gumbel` and :func:`categorical` use :func:`det_log`, a logarithm built from ``frexp``, ``+``,
  ``*`` and ``/`` only (each correctly rounded by IEEE 754, one torch op at a time, so no FMA
  contraction), because library ``log`` differs by an ulp between CPU and CUDA and even between the
  vectorized body and the scalar tail of one CPU kernel.

torch's int64 arithmetic wraps modulo 2**64 (two's complement) on CPU and CUDA, which is exactly the
uint64 arithmetic SplitMix64 needs, *except* for right shifts, which are arithmetic on signed tensors:
:func:`_shr` masks the sign-extended bits away. ``tests/workers/test_workers_rng.py`` checks the tensor
hash against a pure-Python uint64 reference.

Example:
    >>> import torch
    >>> from lmpm.workers import rng
    >>> cells = torch.arange(4)
    >>> u = rng.uniform(7, "Txt", cells, epoch=3, rule="sample", draws=2)
    >>> u.shape, bool(((u > 0) & (u < 1)).all())
    (torch.Size([4, 2]), True)
    >>> torch.equal(u[2:], rng.uniform(7, "Txt", cells[2:], epoch=3, rule="sample", draws=2))
    True
"""

from __future__ import annotations

import hashlib

import torch
from torch import Tensor

__all__ = [
    "KeyPart",
    "bits",
    "categorical",
    "det_log",
    "gumbel",
    "key_of",
    "signed64",
    "uniform",
]

_M64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15  # SplitMix64 increment (golden ratio)
_C1 = 0xBF58476D1CE4E5B9
_C2 = 0x94D049BB133111EB
_LN2 = 0.6931471805599453

# A key part is an int (same for every row), a name (hashed with key_of) or an int64 tensor (n,).
KeyPart = int | str | Tensor


def key_of(name: str) -> int:
    """A stable 63-bit key for a rule or value name (blake2b; Python's ``hash`` is salted per process).

    >>> key_of("Txt") == key_of("Txt") and key_of("Txt") != key_of("Img")
    True
    """
    digest = hashlib.blake2b(name.encode("utf-8"), digest_size=8, person=b"lmpm-rng").digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def signed64(x: int) -> int:
    """The int64 whose bits are ``x mod 2**64``."""
    x &= _M64
    return x - (1 << 64) if x >> 63 else x


def _mix_int(z: int) -> int:
    """SplitMix64 finalizer on a Python int, modulo 2**64 (the reference the tensor path matches)."""
    z &= _M64
    z = ((z ^ (z >> 30)) * _C1) & _M64
    z = ((z ^ (z >> 27)) * _C2) & _M64
    return z ^ (z >> 31)


def _shr(z: Tensor, s: int) -> Tensor:
    """Logical right shift of int64 bits: torch's ``>>`` is arithmetic, so mask the copied sign bits."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _mix(z: Tensor) -> Tensor:
    """SplitMix64 finalizer on int64 tensors; multiplication wraps modulo 2**64 like uint64."""
    z = z ^ _shr(z, 30)
    z = z * signed64(_C1)
    z = z ^ _shr(z, 27)
    z = z * signed64(_C2)
    return z ^ _shr(z, 31)


def _part_int(part: int | str) -> int:
    return key_of(part) if isinstance(part, str) else int(part)


def _combine_int(h: int, part: int, slot: int) -> int:
    # h' = mix(h ^ mix(part + (slot+1)*gamma)); the slot constant keeps (a, b) and (b, a) apart.
    return _mix_int(h ^ _mix_int(part + (slot + 1) * _GAMMA))


def _combine(h: Tensor | int, part: Tensor, slot: int) -> Tensor:
    mixed = _mix(part.to(torch.int64) + signed64((slot + 1) * _GAMMA))
    return _mix(mixed ^ (signed64(h) if isinstance(h, int) else h))


def bits(
    seed: KeyPart,
    value: KeyPart,
    cells: Tensor,
    epoch: KeyPart,
    rule: KeyPart,
    replica: KeyPart = 0,
    draws: int = 1,
) -> Tensor:
    """64 random bits per (cell, draw) as int64, shape ``(n, draws)``, on ``cells.device``.

    Scalar key parts are folded in Python ints (exact, free); tensor parts must have shape ``(n,)``.
    """
    if cells.dim() != 1:
        raise ValueError(f"cells must have shape (n,), got {tuple(cells.shape)}")
    if draws < 1:
        raise ValueError(f"draws must be >= 1, got {draws}")
    # Fixed slot order: seed, value, rule, replica, epoch, cell, draw.
    parts: list[KeyPart] = [seed, value, rule, replica, epoch]
    h: Tensor | int = _mix_int(_GAMMA)
    for slot, part in enumerate(parts):
        if isinstance(part, Tensor):
            if part.shape != cells.shape:
                raise ValueError(
                    f"key part {slot} has shape {tuple(part.shape)}, expected {tuple(cells.shape)}"
                )
            h = _combine(h, part.to(cells.device), slot)
        elif isinstance(h, int):
            h = _combine_int(h, _part_int(part), slot)
        else:
            h = _combine(h, torch.full_like(cells, signed64(_part_int(part))), slot)
    h_cell = _combine(h, cells.to(torch.int64), len(parts))  # (n,)
    draw_ids = torch.arange(draws, dtype=torch.int64, device=cells.device)
    mixed_draws = _mix(draw_ids + signed64((len(parts) + 2) * _GAMMA))  # (draws,)
    return _mix(h_cell[:, None] ^ mixed_draws[None, :])  # (n, draws)


def uniform(
    seed: KeyPart,
    value: KeyPart,
    cells: Tensor,
    epoch: KeyPart,
    rule: KeyPart,
    replica: KeyPart = 0,
    draws: int = 1,
) -> Tensor:
    """Uniform float64 samples strictly inside (0, 1), shape ``(n, draws)``.

    The top 53 bits of :func:`bits` become ``(k + 0.5) / 2**53``: exact, so bit-identical everywhere.

    >>> import torch
    >>> u = uniform(0, "v", torch.arange(1000), epoch=0, rule="r")
    >>> 0.45 < float(u.mean()) < 0.55
    True
    """
    h = bits(seed, value, cells, epoch, rule, replica, draws)
    return (_shr(h, 11).to(torch.float64) + 0.5) * (2.0**-53)


# log(m) = 2 atanh(s) = 2 s (1 + s^2/3 + s^4/5 + ...), s = (m-1)/(m+1), |s| <= 0.1716 for
# m in [sqrt(1/2), sqrt(2)); 13 terms put the truncation error below 1e-17.
_ATANH_COEFFS = tuple(1.0 / (2 * k + 1) for k in range(13))


def det_log(x: Tensor) -> Tensor:
    """Natural log of positive finite float64 values, bit-identical on every device and position.

    Uses only ``frexp`` (exact) and single ``+ - * /`` ops (correctly rounded), so results do not
    depend on which libm, vector width or device computed them. Accurate to a few ulp.

    >>> import math, torch
    >>> abs(float(det_log(torch.tensor([10.0], dtype=torch.float64))) - math.log(10.0)) < 1e-15
    True
    """
    x = x.to(torch.float64)
    mantissa, exponent = torch.frexp(x)  # x = m * 2**e, m in [0.5, 1)
    small = mantissa < 0.7071067811865476
    mantissa = torch.where(small, mantissa * 2.0, mantissa)  # exact
    exp = (exponent - small.to(exponent.dtype)).to(torch.float64)
    s = (mantissa - 1.0) / (mantissa + 1.0)
    t = s * s
    poly = torch.full_like(t, _ATANH_COEFFS[-1])
    for c in reversed(_ATANH_COEFFS[:-1]):
        poly = poly * t
        poly = poly + c
    log_m = (s * 2.0) * poly
    return exp * _LN2 + log_m


def gumbel(
    seed: KeyPart,
    value: KeyPart,
    cells: Tensor,
    epoch: KeyPart,
    rule: KeyPart,
    replica: KeyPart = 0,
    draws: int = 1,
) -> Tensor:
    """Standard Gumbel float64 noise ``-log(-log(u))``, shape ``(n, draws)``, bit-identical everywhere."""
    u = uniform(seed, value, cells, epoch, rule, replica, draws)
    return -det_log(-det_log(u))


def categorical(
    logits: Tensor,
    *,
    seed: KeyPart,
    value: KeyPart,
    cells: Tensor,
    epoch: KeyPart,
    rule: KeyPart,
    replica: KeyPart = 0,
) -> Tensor:
    """Gumbel-max samples from unnormalized ``logits`` of shape ``(n, V)`` or ``(n, k, V)``.

    Returns int64 indices of shape ``(n,)`` or ``(n, k)``; the k candidates of a cell use draws
    ``j*V .. j*V+V-1``, so a cell's samples do not depend on anything but its key. ``-inf`` logits are
    never drawn; ties resolve to the lowest index (``torch.argmax``).

    >>> import torch
    >>> logits = torch.tensor([[0.0, -float("inf"), 0.0], [-float("inf"), 5.0, -float("inf")]])
    >>> s = categorical(logits, seed=1, value="Tok", cells=torch.tensor([10, 11]), epoch=0, rule="gen")
    >>> int(s[1]), int(s[0]) in (0, 2)
    (1, True)
    """
    if logits.dim() not in (2, 3):
        raise ValueError(f"logits must have shape (n, V) or (n, k, V), got {tuple(logits.shape)}")
    vocab = logits.shape[-1]
    k = logits.shape[1] if logits.dim() == 3 else 1
    noise = gumbel(seed, value, cells, epoch, rule, replica, draws=k * vocab)  # (n, k*V)
    noisy = logits.to(torch.float64) + noise.view(logits.shape)
    return noisy.argmax(dim=-1)
