"""The programs `--compile` coverage is measured on: the bundled examples that run offline on the
epoch engine (with their inputs), and the differential tests' random programs
(test_runtime_differential: `programs`, one rule per value, and `rich_programs`, several rules per
value, quorum replicas, every policy, the six schedules, in-set / change / user predicates, soft
or `hard`). Used by tests/runtime/test_compile_coverage.py and benchmarks/compile_coverage.py."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings

sys.path.insert(0, str(Path(__file__).parent))
from test_runtime_differential import BINDINGS, programs, rich_programs, used

ROOT = Path(__file__).resolve().parents[2]
EX = ROOT / "examples"

# Every examples/**/*.lmpm the epoch engine runs offline, with its inputs (relative to examples/)
# and a few epochs. Not here: hf/*.lmpm (a Hugging Face download), train_bytelm.lmpm (a training
# program: no epoch step), vm.lmpm (a workflow: the token-stream VM runs it).
EXAMPLES: list[tuple[str, dict[str, str], int]] = [
    ("text.lmpm", {"Txt": "text/prompt.txt"}, 6),
    ("gpt.lmpm", {"Txt": "text/prompt.txt"}, 6),
    ("text_free.lmpm", {"Txt": "text/prompt.txt"}, 6),
    ("video.lmpm", {"Txt": "video/caption.txt", "Vid": "video/patch.npy"}, 3),
    ("video_free.lmpm", {"Txt": "video/caption.txt"}, 3),
    ("latent.lmpm", {"Z": "latent/z0.npy"}, 3),
    ("sudoku.lmpm", {"Grid": "sudoku/puzzle.json"}, 6),
]
NOT_RUN_OFFLINE = {
    "hf/story.lmpm",
    "hf/story_free.lmpm",
    "hf/rows.lmpm",
    "train_bytelm.lmpm",
    "vm.lmpm",
}


def example_inputs(inputs: dict[str, str]) -> dict[str, str]:
    return {k: str(EX / v) for k, v in inputs.items()}


def bindings_for(front: Any) -> dict[str, Any]:
    """The test bindings a random program names (Echo, FEcho, big)."""
    return used(front, BINDINGS)


def random_programs(n: int, max_side: int = 4) -> list[tuple[str, dict[str, Any]]]:
    """``n`` random programs, the same ones every call (derandomized): (source, {target, seed,
    epochs}). A quarter from the differential tests' simple generator (one rule per value: they
    compile today), the rest from their rich one (several rules, quorum, every policy: eager
    today, compiled once issue 45's wider step lands)."""
    simple = n // 4
    return _drawn(programs(), simple) + _drawn(rich_programs(max_side=max_side), n - simple)


def _drawn(strategy: Any, n: int) -> list[tuple[str, dict[str, Any]]]:
    out: list[tuple[str, dict[str, Any]]] = []
    if n <= 0:
        return out

    @settings(
        max_examples=n,
        derandomize=True,
        database=None,
        phases=(Phase.generate,),
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def collect(case: tuple[str, dict[str, Any]]) -> None:
        out.append(case)

    collect()
    return out
