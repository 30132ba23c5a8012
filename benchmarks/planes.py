"""Control-plane bytes per epoch: payload never crosses from the workers to the control plane.

The seed's video program (examples/video.lmpm, Vid 4×32×32) twice, identical but for the payload
type of ``Vid``: ``Token[16]`` and ``Tensor[256]`` (256 float32 per cell, 1 KiB). The palette
constraint (``in Palette``, a token set) is dropped from both, the rest is live (HardLock, the
read_future proof, red-black schedule). The null model proposes the same random token per
candidate in both runs (as a token, or as a vector filled with it), scores 0, so both runs take the
same decisions; only the payload's width differs.

Every message between the planes (:mod:`lmpm.runtime.protocol`) is measured with
``protocol.nbytes`` (tensor bytes in the message). Prints one JSON line: control-plane bytes per
epoch for each type and their ratio (goal: 1.0, equal), next to the payload bytes a plane that
shipped candidates would have moved for the Tensor[256] run.

    python benchmarks/planes.py [--epochs 6]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from lmpm.ir import compile_source  # noqa: E402
from lmpm.models.null import random_tokens, zero_score  # noqa: E402
from lmpm.runtime.protocol import nbytes  # noqa: E402
from lmpm.runtime.session import Run  # noqa: E402
from runtime import BINDINGS, caption, params  # noqa: E402

PALETTE = (
    'constraint TextPaint:\n  require Vid[t, region("sky")] in Palette("blue-ish") priority 50\n'
)


def vectors(inputs: dict[str, torch.Tensor], **kw: Any) -> dict[str, torch.Tensor]:
    """RandomTokens' tokens, each as a 256-vector filled with it (equal iff the tokens are)."""
    out = random_tokens(inputs, vocab=16, **{k: v for k, v in kw.items() if k != "vocab"})
    tok = out["proposal"]
    return {
        "proposal": tok.unsqueeze(-1).float().expand(*tok.shape, 256).clone(),
        "score": out["score"],
    }


def measure(typ: str, epochs: int) -> dict[str, float]:
    src = (ROOT / "examples" / "video.lmpm").read_text().replace(PALETTE, "")
    if typ != "Token":
        src = src.replace("value Vid : Token[VQ]", "value Vid : Tensor[256]")
    p = params(4, 32, 32)
    # the benchmark's own Model and ModelScore override the built-ins (and their signatures)
    front = compile_source(src, "video.lmpm", overrides=p, bound_names=("Model", "ModelScore"))
    model = random_tokens if typ == "Token" else vectors
    run = Run(
        front,
        params=p,
        # the dropped constraint's `Palette` and `region` are not used any more
        bindings={
            **{k: v for k, v in BINDINGS.items() if k not in ("Palette", "region")},
            "Model": model,
            "ModelScore": zero_score,
        },
        seed=0,
    )
    caption(run)
    dp = run.dataplane
    sent = {"control": 0, "payload": 0}
    propose, apply = dp.propose, dp.apply

    def p_(req: Any) -> Any:
        out = propose(req)
        sent["control"] += nbytes(req) + nbytes(out)
        # what a plane that shipped the candidate table would move on top
        for st in dp.staging.staged.values():
            sent["payload"] += st.table.numel() * st.table.element_size()
        return out

    def a_(req: Any) -> Any:
        out = apply(req)
        sent["control"] += nbytes(req) + nbytes(out)
        return out

    dp.propose, dp.apply = p_, a_  # type: ignore[method-assign]
    res = run.run(epochs)
    return {
        "control": sent["control"] / res.epochs,
        "payload": sent["payload"] / res.epochs,
        "commits": res.commits,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--quick", action="store_true", help="3 epochs")
    args = ap.parse_args()
    epochs = 3 if args.quick else args.epochs
    tok, ten = measure("Token", epochs), measure("Tensor", epochs)
    assert tok["commits"] == ten["commits"], "both runs take the same decisions"
    print(
        json.dumps(
            {
                "benchmark": "planes",
                "case": "control_plane_bytes",
                "epochs": epochs,
                "token16_bytes_per_epoch": round(tok["control"]),
                "tensor256_bytes_per_epoch": round(ten["control"]),
                "ratio": round(ten["control"] / tok["control"], 4),
                "goal": 1.0,
                "tensor256_candidate_payload_bytes_per_epoch": round(ten["payload"]),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
