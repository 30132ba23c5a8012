"""One open cell's reads on the host (lmpm.runtime.data.inputs.host_slots): what the general
gather makes, looked up in NumPy."""

from __future__ import annotations

import pytest
import torch

from lmpm.runtime.data.inputs import host_slots


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
