"""One rank of the gloo halo test (run by test_transport_gloo.py as a real subprocess).

    python gloo_halo_rank.py RANK WORLD PORT OUT_JSON

Every rank holds a DataPlane of examples/gpt.lmpm (N=24) with the cells the topology gives it; each
epoch it writes a known token into some of its owned cells, then exchanges the changed halo cells
with the other ranks over torch.distributed (gloo, loopback). It writes what its halo holds.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from lmpm.bindings import Bindings
from lmpm.ir import compile_file
from lmpm.resolve.plan import resolve
from lmpm.resolve.topology import partition
from lmpm.runtime.data.dataplane import DataPlane
from lmpm.runtime.data.shard import WouldCommit
from lmpm.runtime.data.transport import GlooTransport, exchange_objects

ROOT = Path(__file__).resolve().parents[2]


def token(epoch: int, cell: int) -> int:
    return (7 * epoch + 3 * cell) % 50


def main() -> None:
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    front = compile_file(ROOT / "examples" / "gpt.lmpm", overrides={"N": 24})
    plan = resolve(front.ir, {"N": 24}, Bindings((), {}))
    topo = partition(plan, world, replicate_bytes=0)
    dp = DataPlane(plan, worker=f"w{rank}")
    transport = GlooTransport(dp, topo, rank)
    owned = topo.owned("Txt", rank)
    moved = []
    for epoch in range(3):
        write = owned[(owned + epoch) % 2 == 0]
        dp.payload["Txt"][write] = torch.tensor([token(epoch, int(c)) for c in write.tolist()])
        dp.committed["Txt"][write] = True
        changed = torch.zeros(plan.values["Txt"].ncells, dtype=torch.bool)
        changed[write] = True
        moved.append(transport.exchange({"Txt": changed}))
    halo = topo.halo_cells("Txt", rank)
    # the owners' metadata exchange: every rank's part, a typed record of its own size (rank 1
    # has none) (rank 2's is larger than what travels with its size: a second round)
    mine = None if rank == 1 else WouldCommit(torch.arange(rank * 700), torch.full((2,), rank))
    parts = exchange_objects(mine)
    Path(out).write_text(
        json.dumps(
            {
                "halo": halo.tolist(),
                "payload": dp.payload["Txt"][halo].tolist(),
                "committed": dp.committed["Txt"][halo].tolist(),
                "moved": moved,
                "parts": [
                    None
                    if p is None
                    else {
                        "type": type(p).__name__,
                        "cells": p.cells.tolist(),
                        "conf": p.conf.tolist(),
                    }
                    for p in parts
                ],
            }
        )
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
