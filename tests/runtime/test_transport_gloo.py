"""The gloo halo transport between real processes: 2 and 3 ranks on loopback exchange the changed
halo cells of their DataPlanes; every rank's halo then holds the owners' latest payload, and the
bytes received are exactly the changed routed cells. Then they exchange metadata parts of
different sizes (the owners' exchange, ``exchange_objects``): every rank gets every part, as the
record it was sent as."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from lmpm.bindings import Bindings
from lmpm.ir import compile_file
from lmpm.resolve.plan import resolve
from lmpm.resolve.topology import partition

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_exchange_their_changed_halo_cells(world: int, tmp_path: Path) -> None:
    sys.path.insert(0, str(HERE))
    from gloo_halo_rank import token

    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(HERE / "gloo_halo_rank.py"),
                str(r),
                str(world),
                str(port),
                str(tmp_path / f"{r}.json"),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    front = compile_file(ROOT / "examples" / "gpt.lmpm", overrides={"N": 24})
    plan = resolve(front.ir, {"N": 24}, Bindings((), {}))
    topo = partition(plan, world, replicate_bytes=0)
    assert topo.routes  # gpt reads every earlier token: later ranks need earlier ranks' cells
    for r in range(world):
        got = json.loads((tmp_path / f"{r}.json").read_text())
        halo = got["halo"]
        assert halo == topo.halo_cells("Txt", r).tolist()
        want, committed, moved = [], [], [0, 0, 0]
        for c in halo:
            last = [e for e in range(3) if (c + e) % 2 == 0]
            want.append(token(last[-1], c) if last else 0)
            committed.append(bool(last))
        for e in range(3):
            moved[e] = 8 * sum(1 for c in halo if (c + e) % 2 == 0)
        assert got["payload"] == want
        assert got["committed"] == committed
        assert got["moved"] == moved
        # exchange_objects: every rank's part, in rank order, on every rank, as its record
        assert got["parts"] == [
            None
            if q == 1
            else {"type": "WouldCommit", "cells": list(range(q * 700)), "conf": [q] * 2}
            for q in range(world)
        ]
