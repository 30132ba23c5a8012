"""`lmpm mask` end to end, by subprocess, for each format and the dense size limit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
SEED_VIDEO = ROOT / "docs" / "img" / "seed_video.lmpm"  # the seed's four clauses, fixed
LMPM = str(Path(sys.executable).parent / "lmpm")


def lmpm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([LMPM, "mask", *args], capture_output=True, text=True, timeout=120)


def test_npy_is_canonical_whatever_the_layout(tmp_path: Path) -> None:
    outs = []
    for layout in ("raster", "morton"):
        out = tmp_path / f"{layout}.npy"
        r = lmpm(
            str(SEED_VIDEO),
            "--set",
            "T=2",
            "--set",
            "W=8",
            "--set",
            "H=8",
            "--set",
            "N=3",
            "--layout",
            layout,
            "-o",
            str(out),
        )
        assert r.returncode == 0, r.stderr
        outs.append(np.load(out))
    assert outs[0].dtype == np.bool_ and outs[0].shape == (3 + 128 + 2, 3 + 128 + 2)
    assert (outs[0] == outs[1]).all()
    # Vid[0,0,0] (row 3) sees Txt[*] (columns 0..2) and its N8 neighbours (0,0,1), (0,1,0), (0,1,1).
    assert np.flatnonzero(outs[0][3]).tolist() == [0, 1, 2, 4, 11, 12, 131]
    assert "can see nothing" in r.stderr  # Txt and Coarse have no visible clause


def test_json_summary(tmp_path: Path) -> None:
    r = lmpm(str(EXAMPLES / "gpt.lmpm"), "--set", "N=1024", "--block", "128")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["cells"] == 1024 and s["layout"] == "raster" and s["block_size"] == 128
    assert s["blocks"] == {"partial": 8, "full": 28, "empty": 28}
    assert set(s["sparsity"]) == {"raster", "tiled", "morton"}
    assert s["degenerate"][0]["pattern"] == "Txt[0]"
    assert "warning: 1 cell of Txt can see nothing (Txt[0]" in r.stderr


def test_png_small_and_large(tmp_path: Path) -> None:
    for n in ("64", "40000"):  # the second is drawn from the block structure, never N×N
        out = tmp_path / f"gpt{n}.png"
        r = lmpm(str(EXAMPLES / "gpt.lmpm"), "--set", f"N={n}", "--block", "16", "-o", str(out))
        assert r.returncode == 0, r.stderr
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_npy_size_limit_is_a_usage_error(tmp_path: Path) -> None:
    r = lmpm(str(EXAMPLES / "gpt.lmpm"), "--set", "N=20000", "-o", str(tmp_path / "big.npy"))
    assert r.returncode == 2
    assert "20000 × 20000" in r.stderr and "--format json" in r.stderr
    assert not (tmp_path / "big.npy").exists()
