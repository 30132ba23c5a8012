"""Comparing BlockMasks by what FlexAttention reads, not by raw (padded) tensors."""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask

from lmpm.visibility.blockmask import SIDES, block_sets, with_dense_indices


def assert_same_blocks(ours: BlockMask, ref: BlockMask, context: object = None) -> None:
    """Same ``*_num_blocks`` and, per row, the same first ``num_blocks`` indices in the same
    order, on every side (kv, full kv, and the q sides the backward pass reads); and
    :func:`with_dense_indices` gives ``ref``'s tensors exactly."""
    assert block_sets(ours).keys() == block_sets(ref).keys() == set(SIDES), context
    for side in SIDES:
        num, idx = getattr(ours, f"{side}_num_blocks"), getattr(ours, f"{side}_indices")
        ref_num, ref_idx = getattr(ref, f"{side}_num_blocks"), getattr(ref, f"{side}_indices")
        assert torch.equal(num, ref_num), (side, context)
        assert idx.shape == ref_idx.shape and idx.dtype == ref_idx.dtype, (side, context)
        width = int(num.max())
        read = torch.arange(width) < num[0, 0].unsqueeze(1)  # (rows, width): what is read
        got, want = idx[0, 0, :, :width][read], ref_idx[0, 0, :, :width][read]
        assert torch.equal(got, want), (side, context)
    assert torch.equal(ours.to_dense(), ref.to_dense()), context
    dense = with_dense_indices(ours)
    for side in SIDES:
        for name in (f"{side}_num_blocks", f"{side}_indices"):
            assert torch.equal(getattr(dense, name), getattr(ref, name)), (name, context)
