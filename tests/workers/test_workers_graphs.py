"""lmpm.workers.graphs on the simulated CUDA device: a captured body replays on its static
buffers, and late flags never make the host wait until it is ``lag`` steps ahead."""

from __future__ import annotations

import torch

from lmpm.workers.graphs import LateFlags, capture
from lmpm.workers.simcuda import simulated_cuda


class _Pending:
    """An event the GPU has not reached yet."""

    def __init__(self) -> None:
        self.waited = False

    def query(self) -> bool:
        return False

    def synchronize(self) -> None:
        self.waited = True


def test_replay_writes_into_the_first_outputs() -> None:
    with simulated_cuda():
        x = torch.zeros(3, device="cuda")
        outs, replay = capture(lambda: [x + 1])
        first = outs[0]
        x.fill_(5)
        replay()
        assert outs[0] is first and first.tolist() == [6.0, 6.0, 6.0]


def test_late_flags_are_read_without_waiting_until_lag_steps_behind() -> None:
    with simulated_cuda():
        flags = torch.zeros(2, dtype=torch.int64, device="cuda")
        late = LateFlags(flags, lag=3)
        flags.fill_(1)
        for behind in (1, 2):
            late.mark()
            pending = late._event = _Pending()  # type: ignore[assignment]
            assert late.read() == [0, 0] and late.behind == behind and not pending.waited
        late.mark()
        pending = late._event = _Pending()  # type: ignore[assignment]
        assert late.read() == [1, 1] and pending.waited and late.waits == 1
        late.reset()
        assert late.read() == [0, 0]
