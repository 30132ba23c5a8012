"""Comparing LMPM's BlockMasks with ``create_block_mask``'s, tensor by tensor."""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask

from lmpm.visibility.blockmask import SIDES, block_sets, with_dense_indices


def assert_dense_layout(bm: BlockMask, context: object = None) -> None:
    """Every index tensor of ``bm`` is laid out as ``create_block_mask`` lays it out: contiguous
    (1, 1, rows, cols), so no two rows share storage (the compiled CUDA kernel misread rows that
    overlapped), and holds only valid block numbers."""
    for side in SIDES:
        num, idx = getattr(bm, f"{side}_num_blocks"), getattr(bm, f"{side}_indices")
        assert idx.is_contiguous() and num.is_contiguous(), (side, context)
        rows, cols = idx.shape[-2:]
        assert idx.stride()[-2:] == (cols, 1), (side, idx.stride(), context)
        assert idx.untyped_storage().nbytes() == 4 * rows * cols, (side, context)
        assert num.shape[-1] == rows and idx.dtype == num.dtype == torch.int32, (side, context)
        assert bool(((idx >= 0) & (idx < cols)).all()), (side, context)


def assert_same_blocks(ours: BlockMask, ref: BlockMask, context: object = None) -> None:
    """``ours`` has ``ref``'s tensors exactly, on every side (kv, full kv, and the q sides the
    backward pass reads), in the dense contiguous layout; so have :func:`block_sets` and
    :func:`with_dense_indices`."""
    assert block_sets(ours).keys() == block_sets(ref).keys() == set(SIDES), context
    assert_dense_layout(ours, context)
    for side in SIDES:
        for name in (f"{side}_num_blocks", f"{side}_indices"):
            assert torch.equal(getattr(ours, name), getattr(ref, name)), (name, context)
    for side, flags in block_sets(ours).items():
        assert torch.equal(flags, block_sets(ref)[side]), (side, context)
    assert torch.equal(ours.to_dense(), ref.to_dense()), context
    dense = with_dense_indices(ours)
    for side in SIDES:
        for name in (f"{side}_num_blocks", f"{side}_indices"):
            assert torch.equal(getattr(dense, name), getattr(ref, name)), (name, context)
