"""The Logits return record and the vocabulary mask: what the worker chooses from a model's logits."""

from __future__ import annotations

import pytest
import torch

from lmpm import Logits
from lmpm.errors import ModelError
from lmpm.workers import MaskSets, VocabMask, WorkItem, choose, get_backend


def _run(model, cells, vocab, mask=None, **keys):
    be = get_backend("cpu")
    item = WorkItem("gen", model, {}, cells, vocab=vocab, mask=mask, **keys)
    return be.collect(be.dispatch(item))[0]


def test_top_k_ties_go_to_the_lower_token_id():
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0, 1.0, 3.0]])
    res = _run(lambda inputs: Logits(logits, k=4, pick="top"), torch.tensor([0]), 6)
    assert res.proposal.tolist() == [[1, 3, 5, 2]]
    logp = torch.log_softmax(logits, dim=1)
    assert torch.allclose(res.score, logp[0, [1, 3, 5, 2]].unsqueeze(0))


def test_sample_k1_is_the_plain_logits_draw_and_partition_free():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    cells = torch.arange(10, 16)
    keys = {"seed": 7, "epoch": 3, "value": "Tok"}
    plain = _run(lambda inputs: {"logits": logits}, cells, 50, **keys).proposal
    one = _run(lambda inputs: Logits(logits, k=1), cells, 50, **keys).proposal
    assert one.squeeze(1).tolist() == plain.tolist()
    many = _run(lambda inputs: Logits(logits, k=5), cells, 50, **keys).proposal
    half = _run(lambda inputs: Logits(logits[3:], k=5), cells[3:], 50, **keys).proposal
    assert torch.equal(many[3:], half)
    assert many[:, 0].tolist() == plain.tolist()  # the first of k draws is the k=1 draw
    assert all(len(set(row)) == 5 for row in many.tolist())  # without replacement


def test_temperature_scales_scores_and_inf_logits_are_never_chosen():
    logits = torch.tensor([[2.0, -torch.inf, 0.0, -torch.inf]])
    res = _run(
        lambda inputs: Logits(logits, k=3, pick="top", temperature=2.0), torch.tensor([0]), 4
    )
    assert res.proposal.tolist() == [[0, 2, 0]]  # two tokens left: the first fills the third slot
    logp = torch.log_softmax(logits / 2.0, dim=1)
    assert torch.allclose(res.score[0], logp[0, [0, 2, 0]])


@pytest.mark.parametrize(
    ("kwargs", "what"),
    [
        ({"k": 0}, "k=0"),
        ({"k": 2.5}, "k=2.5"),
        ({"pick": "best"}, "pick='best'"),
        ({"temperature": 0.0}, "temperature=0.0"),
        ({"temperature": float("nan")}, "temperature=nan"),
        ({"temperature": float("inf")}, "temperature=inf"),
        ({"k": True}, "k=True"),
    ],
)
def test_bad_logits_record_is_r052(kwargs, what):
    model = lambda inputs: Logits(torch.zeros(1, 3), **kwargs)  # noqa: E731
    with pytest.raises(ModelError) as info:
        _run(model, torch.tensor([0]), 3)
    assert info.value.code == "R052" and what in str(info.value)


def test_mask_keeps_the_best_level_by_level_and_refreshes_keep():
    # level 0 (highest): tokens {0, 1, 2}; level 1: tokens {2, 3} (no overlap with level 0 but 2)
    ok = torch.zeros(2, 6, dtype=torch.bool)
    ok[0, :3] = True
    ok[1, 2:4] = True
    sets = MaskSets(ok, levels=((0,), (1,)))
    logits = torch.tensor([[5.0, 4.0, 1.0, 9.0, 0.0, 8.0]] * 3)
    applies = torch.tensor([[True, True], [True, False], [False, False]])
    mask = VocabMask(sets, applies, torch.tensor([-1, 4, 0]))
    res = _run(lambda inputs: Logits(logits, k=1, pick="top"), torch.arange(3), 6, mask=mask)
    # row 0: both levels -> {2}; row 1: level 0 only -> {0,1,2} best 0; row 2: no constraint -> 3
    assert res.proposal[:, 0].tolist() == [2, 0, 3]
    # the model alone's choice joins as a column where the mask kept it out (token 3, best of
    # all), so the trace sees the constraint beat it; elsewhere the first choice again
    assert res.proposal[:, 1].tolist() == [3, 3, 3]
    # the committed token joins as a column (row 0 is unset: its first choice again)
    assert res.proposal[:, 2].tolist() == [2, 4, 0]
    logp = torch.log_softmax(logits, dim=1)
    assert torch.allclose(res.score, logp.gather(1, res.proposal))


def test_hard_constraint_with_no_token_left_leaves_the_row():
    ok = torch.tensor([[False, False, True]])
    sets = MaskSets(ok, levels=(), hard=(0,))
    logits = torch.tensor([[1.0, 2.0, -torch.inf], [1.0, 2.0, 0.0]])
    mask = VocabMask(sets, torch.ones(2, 1, dtype=torch.bool))
    res = _run(lambda inputs: Logits(logits, pick="top"), torch.arange(2), 3, mask=mask)
    assert res.proposal[:, 0].tolist() == [1, 2]


def test_plain_logits_are_masked_too():
    ok = torch.tensor([[False, True, False, True]])
    mask = VocabMask(MaskSets(ok, levels=((0,),)), torch.ones(64, 1, dtype=torch.bool))
    res = _run(lambda inputs: {"logits": torch.zeros(64, 4)}, torch.arange(64), 4, mask=mask)
    assert set(res.proposal[:, 0].tolist()) == {1, 3}
    # the second column: the draw the model alone made (same noise), where the mask changed it
    alone = res.proposal[:, 1]
    assert set(alone.tolist()) == {0, 1, 2, 3}
    assert ((alone == res.proposal[:, 0]) | ((alone == 0) | (alone == 2))).all()


def _general(logits: torch.Tensor, mask: VocabMask) -> torch.Tensor:
    """The mask as ``allowed`` defines it, level by level (no shortcut)."""
    return torch.where(choose.allowed(logits, mask), logits, -torch.inf)


@pytest.mark.parametrize("seed", range(40))
def test_the_mask_shortcuts_choose_what_the_level_by_level_mask_does(seed: int) -> None:
    """``masked``'s one-addition path and ``greedy``'s unmasked favourite agree with the general
    mask on random logits (with -inf, +inf and NaN entries), sets, levels and rows a constraint
    does not speak about; the favourite returned is the unmasked argmax."""
    g = torch.Generator().manual_seed(seed)
    # (more rows than greedy reads as numbers: its check as tensor ops)
    n, vocab, sets = 5 if seed % 8 else 70, 12, 3
    logits = torch.randn(n, vocab, generator=g)
    odd = torch.rand(n, vocab, generator=g)
    logits[odd < 0.15] = -torch.inf
    if seed % 4 == 0:
        logits[0] = -torch.inf  # a row the model allows nothing in
    if seed % 5 == 0:
        logits[1, 3] = torch.nan
    if seed % 7 == 0:
        logits[2, 5] = torch.inf
    ok = torch.rand(sets, vocab, generator=g) < (0.2 if seed % 3 == 0 else 0.8)
    levels = ((0,), (1, 2)) if seed % 2 else ((0, 1), (2,))
    hard = (2,) if seed % 6 == 0 else ()
    levels = tuple(tuple(s for s in lv if s not in hard) for lv in levels)
    levels = tuple(lv for lv in levels if lv)
    applies = (
        torch.ones(n, sets, dtype=torch.bool)
        if seed % 2
        else torch.rand(n, sets, generator=g) < 0.7
    )
    mask = VocabMask(MaskSets(ok, levels, hard), applies)
    want = _general(logits, mask)
    got = choose.masked(logits, mask)
    finite = ~torch.isnan(want)
    assert torch.equal(got[finite] == -torch.inf, want[finite] == -torch.inf)
    rows = ~torch.isnan(logits).any(dim=1)  # a NaN row is a fault the worker reports
    top, alone = choose.greedy(logits, mask)
    ref = want.argmax(dim=1, keepdim=True)
    assert torch.equal(top[rows], ref[rows])
    assert torch.equal(alone, logits.argmax(dim=1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_the_row_argmax_is_torchs_first_of_maxima(dtype: torch.dtype) -> None:
    """argmax_rows (NumPy's argmax on the host) picks what torch.argmax picks: the first of equal
    maxima, the first NaN, a row of only -inf at 0."""
    g = torch.Generator().manual_seed(3)
    t = torch.randint(0, 4, (6, 9), generator=g).to(dtype)  # many ties
    t[1, 4] = torch.nan
    t[1, 6] = torch.nan
    t[2] = -torch.inf
    t[3, 2] = torch.inf
    got = choose.argmax_rows(t)
    assert got.dtype == torch.int64
    assert torch.equal(got, t.argmax(dim=1))
    assert got[1] == 4 and got[2] == 0 and got[3] == 2


@pytest.mark.parametrize("seed", range(24))
def test_the_host_greedy_step_chooses_and_checks_what_the_general_path_does(seed: int) -> None:
    """``greedy_rows`` (a decode step's greedy choice in NumPy) proposes what ``greedy`` then
    ``alone_column`` (or, unmasked, ``choose``) do, says "every row's max is finite" exactly when
    ``logits.amax`` does, and leaves to the general path the rows whose favourite is refused or
    NaN; through a backend, the choice, its scores and its faults are those of the general path."""
    g = torch.Generator().manual_seed(seed)
    n, vocab = 1 + seed % 3, 16
    logits = torch.randn(n, vocab, generator=g, dtype=torch.float64 if seed % 5 == 0 else None)
    if seed % 4 == 1:
        logits[0, 3] = torch.inf
    if seed % 6 == 2:
        logits[n - 1] = -torch.inf  # every token refused by the model
    if seed % 7 == 3:
        logits[0, 5] = torch.nan
    ok = torch.rand(1, vocab, generator=g) < (0.95 if seed % 2 else 0.4)
    mask = VocabMask(MaskSets(ok, ((0,),)), torch.ones(n, 1, dtype=torch.bool))
    finite = bool(torch.isfinite(logits.amax(dim=-1)).all())
    for m in (None, mask):
        got = choose.greedy_rows(logits, m)
        if m is None:
            want = choose.choose(logits, 1, "top", 1.0, lambda v: torch.zeros(n, v), None)
        else:
            top, alone = choose.greedy(logits, m)
            want = choose.alone_column(top, alone)
            if got is None:  # only where a favourite is refused or NaN
                assert any(
                    not (b > -torch.inf) or not ok[0, i]
                    for b, i in zip(logits.amax(1).tolist(), alone.tolist())
                )
                continue
        assert got is not None
        assert torch.equal(got.proposal, want)
        assert got.finite == finite
    # through the worker: a fault where the general path has one, the same choice otherwise
    model = lambda inputs: Logits(logits.clone(), k=1, pick="top")  # noqa: E731
    if finite:
        res = _run(model, torch.arange(n), vocab, mask=mask)
        logp = torch.log_softmax(logits.float(), dim=-1)
        assert torch.equal(res.score, logp.gather(1, res.proposal).double())
    else:
        with pytest.raises(ModelError) as err:
            _run(model, torch.arange(n), vocab, mask=mask)
        assert err.value.code == "R056"


def test_a_call_without_a_fault_shares_one_clean_bitmask_and_a_fault_gets_its_own() -> None:
    """``execute`` hands every call of n rows without a fault the same all-zero bitmask (made
    once, never written: ``raise_if_bad`` passes it at sight); a fault makes a new one, which
    names the faulty rows, and leaves the shared one zero."""
    from lmpm.workers.batch import _build_call, execute, raise_if_bad

    def call_of(logits: torch.Tensor):
        item = WorkItem("gen", lambda inputs: Logits(logits, k=1, pick="top"), {}, torch.arange(2))
        return _build_call([item], [0], None, None)

    fine = torch.randn(2, 8)
    first, clean = execute(call_of(fine), backend="cpu", worker="w")
    _, again = execute(call_of(fine * 2), backend="cpu", worker="w")
    assert again is clean and clean.tolist() == [0, 0]
    raise_if_bad(first, clean, backend="cpu", worker="w")
    broken = fine.clone()
    broken[1, 3] = torch.nan
    res, bad = execute(call_of(broken), backend="cpu", worker="w")
    assert bad is not clean and bad.tolist() == [0, 8] and clean.tolist() == [0, 0]
    with pytest.raises(ModelError) as err:
        raise_if_bad(res, bad, backend="cpu", worker="w")
    assert err.value.code == "R056"
