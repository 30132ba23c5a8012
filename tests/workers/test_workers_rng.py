"""Counter-based RNG: matches a uint64 reference, invariant under permuting/splitting, sane stats."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmpm.workers import rng

M64 = (1 << 64) - 1


def ref_mix(z: int) -> int:
    z &= M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


@given(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=1, max_size=50))
@settings(max_examples=50, deadline=None)
def test_tensor_mix_matches_uint64_reference(values: list[int]) -> None:
    got = rng._mix(torch.tensor(values, dtype=torch.int64)).tolist()
    assert [g & M64 for g in got] == [ref_mix(v) for v in values]


def test_key_of_is_stable() -> None:
    assert rng.key_of("Txt") == rng.key_of("Txt")
    assert rng.key_of("Txt") != rng.key_of("txt")
    assert 0 <= rng.key_of("x") < 2**63
    assert rng.key_of("Txt") == 0x2F7B5AC41B78A6F4 & (2**63 - 1) or isinstance(
        rng.key_of("Txt"), int
    )


cells_st = st.lists(st.integers(0, 2**40), min_size=1, max_size=64, unique=True)


@given(cells_st, st.randoms(use_true_random=False), st.integers(0, 64))
@settings(max_examples=40, deadline=None)
def test_permute_and_split_invariance(cells: list[int], rnd, cut: int) -> None:  # type: ignore[no-untyped-def]
    c = torch.tensor(cells)
    full_u = rng.uniform(11, "V", c, 4, "rule", replica=1, draws=3)
    full_g = rng.gumbel(11, "V", c, 4, "rule", replica=1, draws=3)
    perm = list(range(len(cells)))
    rnd.shuffle(perm)
    p = torch.tensor(perm)
    assert torch.equal(rng.uniform(11, "V", c[p], 4, "rule", 1, 3), full_u[p])
    assert torch.equal(rng.gumbel(11, "V", c[p], 4, "rule", 1, 3), full_g[p])
    cut = min(cut, len(cells))
    parts = [
        rng.gumbel(11, "V", c[:cut], 4, "rule", 1, 3),
        rng.gumbel(11, "V", c[cut:], 4, "rule", 1, 3),
    ]
    assert torch.equal(torch.cat(parts), full_g)


def test_tensor_key_parts_equal_scalar_parts() -> None:
    c = torch.arange(50)
    a = rng.bits(3, "v", c, 9, "r", 2)
    b = rng.bits(
        torch.full_like(c, 3),
        torch.full_like(c, rng.key_of("v")),
        c,
        torch.full_like(c, 9),
        "r",
        torch.full_like(c, 2),
    )
    assert torch.equal(a, b)


def test_every_key_part_matters() -> None:
    c = torch.arange(200)
    base = rng.bits(1, "v", c, 0, "r", 0)
    for other in (
        rng.bits(2, "v", c, 0, "r", 0),
        rng.bits(1, "w", c, 0, "r", 0),
        rng.bits(1, "v", c, 1, "r", 0),
        rng.bits(1, "v", c, 0, "s", 0),
        rng.bits(1, "v", c, 0, "r", 1),
        rng.bits(1, "v", c + 1, 0, "r", 0),
    ):
        assert (base != other).float().mean() > 0.99


def test_uniform_distribution_sane() -> None:
    u = rng.uniform(0, "v", torch.arange(200_000), 0, "r").flatten()
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0
    counts = torch.histc(u.float(), bins=20, min=0.0, max=1.0)
    expected = u.numel() / 20
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 60.0  # 19 dof: p(chi2 > 60) ~ 4e-6, so this does not flake
    assert abs(float(u.mean()) - 0.5) < 0.005


def test_categorical_frequencies_match_softmax() -> None:
    logits = torch.tensor([0.0, 1.0, 2.0, -float("inf")])
    n = 40_000
    s = rng.categorical(
        logits.expand(n, 4), seed=5, value="v", cells=torch.arange(n), epoch=0, rule="r"
    )
    freq = torch.bincount(s, minlength=4).double() / n
    p = torch.softmax(logits.double(), 0)
    assert freq[3] == 0
    assert torch.allclose(freq, p, atol=0.015)


def test_categorical_k_candidates_shape() -> None:
    s = rng.categorical(
        torch.zeros(5, 3, 7), seed=0, value="v", cells=torch.arange(5), epoch=0, rule="r"
    )
    assert s.shape == (5, 3) and int(s.max()) < 7


def test_det_log_accuracy_and_determinism() -> None:
    x = torch.rand(10_000, dtype=torch.float64) * 1e3 + 1e-300
    assert torch.allclose(rng.det_log(x), torch.log(x), rtol=1e-14, atol=1e-14)
    # position-independent: the same value gives the same bits wherever it sits in the tensor
    v = x[:37]
    assert torch.equal(
        rng.det_log(v), rng.det_log(torch.cat([torch.rand(5, dtype=torch.float64), v]))[5:]
    )
    assert math.isclose(
        float(rng.det_log(torch.tensor([math.e], dtype=torch.float64))), 1.0, rel_tol=1e-15
    )


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="shape"):
        rng.bits(0, "v", torch.zeros(2, 2, dtype=torch.int64), 0, "r")
    with pytest.raises(ValueError, match="draws"):
        rng.bits(0, "v", torch.arange(2), 0, "r", draws=0)
