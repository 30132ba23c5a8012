"""One open cell's reads on the host (lmpm.runtime.data.inputs.host_slots,
lmpm.runtime.data.reads.dense_host): what the general gather and dense layout make, looked up in
NumPy."""

from __future__ import annotations

import pytest
import torch

from lmpm.runtime.data.inputs import HostViews, host_slots
from lmpm.runtime.data.reads import dense_host, dense_read


@pytest.mark.parametrize("seed", range(12))
def test_the_host_slots_are_the_general_gathers(seed: int) -> None:
    """Payload, mask and index of one cell's slots equal the tensor ops of the general path
    (``take`` of a 1-D value, ``index_select`` of cells with a shape), for several dtypes; the
    index is the plan table's row itself (a view), the payload the cell's own copy."""
    g = torch.Generator().manual_seed(seed)
    ncells, k = 20, 6
    index = torch.randint(0, ncells, (ncells, k), generator=g)
    valid = torch.rand(ncells, k, generator=g) < 0.7
    committed = torch.rand(ncells, generator=g) < 0.6
    dtype = (torch.int64, torch.float32, torch.bool, torch.float16)[seed % 4]
    shape = (ncells,) if seed % 3 else (ncells, 2, 3)
    payload = (torch.randn(shape, generator=g) * 10).to(dtype)
    before = payload.clone()
    cell = int(torch.randint(0, ncells, (1,), generator=g))
    data, mask, idx = host_slots(index, valid, cell, payload, committed)
    want_idx = index.narrow(0, cell, 1)
    want_mask = valid.narrow(0, cell, 1) & committed.take(want_idx)
    if payload.dim() == 1:
        want_data = payload.take(want_idx)
    else:
        want_data = payload.index_select(0, want_idx.reshape(-1)).reshape(1, k, 2, 3)
    assert torch.equal(idx, want_idx) and torch.equal(mask, want_mask)
    assert data.dtype == payload.dtype and torch.equal(data, want_data)
    assert idx.data_ptr() == want_idx.data_ptr()  # a view of the table's row
    data.view(-1).fill_(1)  # the payload's rows are the call's own: the value is untouched
    assert torch.equal(payload, before)


@pytest.mark.parametrize("seed", range(16))
def test_the_host_dense_row_is_the_general_dense_layout(seed: int) -> None:
    """One row on the host: a causal prefix (its visible slots leading, of any length, 0 and K
    included) gets the general dense layout, as views of the slot arrays (memory shared); any
    other row is left to the general path (None)."""
    g = torch.Generator().manual_seed(seed)
    k = 9
    cell = () if seed % 3 else (2,)
    data = torch.randint(1, 50, (1, k, *cell), generator=g)
    index = torch.randint(1, 50, (1, k), generator=g)
    clock = torch.randint(1, 50, (1, k), generator=g)
    if seed % 2:  # a causal prefix
        width = (0, k, *torch.randint(1, k, (6,), generator=g).tolist())[seed // 2]
        mask = torch.arange(k).unsqueeze(0) < width
    else:  # visible slots anywhere (leading ones now and then)
        mask = torch.rand(1, k, generator=g) < 0.5
    leads = bool(mask[0, : int(mask.sum())].all())
    with_clock = seed % 4 != 1
    got = dense_host(
        "x", data.numpy(), mask.numpy(), index.numpy(), clock.numpy() if with_clock else None
    )
    if not leads:
        assert got is None
        return
    assert got is not None
    want = dense_read("x", data, mask, index, clock if with_clock else None)
    assert got.keys() == want.keys()
    for key in want:
        assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key])
    if int(got["x_length"]):  # views of the slots (an empty tensor has no memory)
        assert got["x_dense"].data_ptr() == data.data_ptr()
        assert got["x_dense_index"].data_ptr() == index.data_ptr()


def test_the_host_views_follow_writes_and_replaced_tensors() -> None:
    """A worker's NumPy view of a host tensor is made once and shows in-place writes; a tensor
    replaced (a restore: a new object, or new storage) gets its own view, never a stale one."""
    views = HostViews()
    committed = torch.zeros(5, dtype=torch.bool)
    first = views(committed)
    assert views(committed) is first  # made once
    committed[2] = True  # a commit writes in place: the view shows it
    assert first.tolist() == [False, False, True, False, False]
    restored = torch.ones(5, dtype=torch.bool)  # a restore hands in another tensor
    assert views(restored).tolist() == [True] * 5
    committed.set_(torch.ones(3, dtype=torch.bool))  # the same tensor on new storage
    assert views(committed).tolist() == [True] * 3
