"""`lmpm check / show / fmt`: exit codes, JSON lines, --strict, formats, and no torch on check."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from lmpm.cli import main

ROOT = Path(__file__).resolve().parents[2]
VIDEO = ROOT / "examples" / "video.lmpm"
GPT = ROOT / "examples" / "gpt.lmpm"
H = "param N = 8\nvalue A : Token[Byte] shape Seq(N)\n"


def run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main(list(argv))
    return rc, out.getvalue(), err.getvalue()


def write(tmp_path: Path, text: str, name: str = "p.lmpm") -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_check_clean_exits_0() -> None:
    rc, _, err = run("check", str(VIDEO))
    assert rc == 0 and err.strip().endswith(": ok")


def test_check_warnings_exit_0(tmp_path: Path) -> None:
    rc, _, err = run("check", write(tmp_path, H + "visible A[t] <- A[t-1]\n"))
    assert rc == 0 and "warning[W202]" in err and "(1 warning)" in err


def test_check_errors_exit_1_with_caret_and_hint(tmp_path: Path) -> None:
    path = write(tmp_path, H + "visible A[t] <- B[t]\n")
    rc, _, err = run("check", path)
    assert rc == 1
    assert f"{path}:3:17: error[E101]: unknown value `B`" in err
    assert "    3 | visible A[t] <- B[t]" in err and "^" in err and "hint:" in err


def test_parse_error_exits_1(tmp_path: Path) -> None:
    rc, _, err = run("check", write(tmp_path, "value A Token\n"))
    assert rc == 1 and "error[P002]" in err


def test_usage_errors_exit_2(tmp_path: Path) -> None:
    assert run("check")[0] == 2
    assert run("check", str(tmp_path / "missing.lmpm"))[0] == 2
    assert run("bogus")[0] == 2
    assert run("check", str(VIDEO), "--set", "W")[0] == 2
    assert run("check", str(VIDEO), "--set", "W=abc")[0] == 2
    assert run("show", str(VIDEO), "--format", "png")[0] == 2


def test_unknown_set_name_is_a_usage_error_listing_the_params() -> None:
    rc, _, err = run("check", str(VIDEO), "--set", "Q=3")
    assert rc == 2
    assert "unknown parameter(s) Q" in err and "BPE, H, N, T, VQ, W" in err
    assert run("show", str(VIDEO), "--set", "Q=3")[0] == 2


def test_set_binds_params_and_divisibility() -> None:
    assert run("check", str(VIDEO), "--set", "W=64")[0] == 0
    rc, _, err = run("check", str(VIDEO), "--set", "W=30")
    assert rc == 1 and "error[E203]" in err and "W = 30 is not divisible by 8" in err


def test_json_output_is_json_lines(tmp_path: Path) -> None:
    path = write(tmp_path, H + "visible A[t] <- A[t-1]\nvisible A[t] <- B[t]\n")
    rc, out, _ = run("check", path, "--json")
    assert rc == 1
    rows = [json.loads(line) for line in out.splitlines()]
    assert {r["code"] for r in rows} == {"E101"}  # build errors stop before the checker
    assert set(rows[0]) >= {"code", "severity", "message", "hint", "file", "line", "col"}
    rc, out, _ = run("check", write(tmp_path, "value A Token\n", "q.lmpm"), "--json")
    assert rc == 1 and json.loads(out.splitlines()[0])["code"] == "P002"
    rc, out, _ = run("check", write(tmp_path, H + "visible A[t] <- A[t-1]\n", "w.lmpm"), "--json")
    assert rc == 0 and json.loads(out)["code"] == "W202"


def test_strict_makes_unbound_names_errors(tmp_path: Path) -> None:
    # every name of the video program is a built-in (models/video.py, models/world.py)
    assert run("check", str(VIDEO), "--strict")[0] == 0
    mine = write(tmp_path, VIDEO.read_text().replace("Model(", "MyModel("), "mine.lmpm")
    rc, _, err = run("check", mine)
    assert rc == 0 and "W210" in err and "`MyModel`" in err
    rc, _, err = run("check", mine, "--strict")
    assert rc == 1 and "error[E207]: `MyModel` (model) is not bound to anything" in err
    binds = tmp_path / "binds.py"
    binds.write_text("import lmpm\n\nLMPM_BINDINGS = {'MyModel': lambda *a, **k: None}\n")
    assert run("check", mine, "--strict", "--bind", str(binds))[0] == 0
    rc, _, err = run("check", mine, "--bind", str(binds))  # without --strict: no warning either
    assert rc == 0 and "W210" not in err


def test_bind_module_faults(tmp_path: Path) -> None:
    empty = tmp_path / "empty.py"
    empty.write_text("x = 1\n")
    rc, _, err = run("check", str(VIDEO), "--strict", "--bind", str(empty))
    assert rc == 1 and "B012" in err
    for strict in (["--strict"], []):  # a --bind that cannot load is an error either way
        rc, _, err = run("check", str(VIDEO), *strict, "--bind", "no_such_module_xyz")
        assert rc == 2 and "module not found" in err and "hint" not in err


def test_bind_names_a_file_of_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "my_binds_xyz.py").write_text("LMPM_BINDINGS = {'MyModel': lambda *a, **k: None}\n")
    monkeypatch.chdir(tmp_path)
    # as the `lmpm` script sees it (`python -m pytest` puts the working directory on the path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    rc, _, err = run("check", str(VIDEO), "--strict", "--bind", "my_binds_xyz")  # not on the path
    assert rc == 2 and "hint: to load the file, pass its path: --bind ./my_binds_xyz.py" in err
    assert run("check", str(VIDEO), "--strict", "--bind", "./my_binds_xyz.py")[0] == 0


@pytest.mark.parametrize("fmt", ["text", "dot", "mermaid", "ir"])
def test_show_formats(fmt: str) -> None:
    rc, out, _ = run("show", str(VIDEO), "--format", fmt)
    assert rc == 0
    marker = {
        "text": "values:",
        "dot": "digraph lmpm {",
        "mermaid": "flowchart LR",
        "ir": "lamport-ir v1",
    }[fmt]
    assert marker in out and "LocalGen" in out


def test_show_svg_without_graphviz_renders_svg(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import shutil
    import xml.etree.ElementTree as ET

    monkeypatch.setattr(shutil, "which", lambda name: None)
    dest = tmp_path / "g.svg"
    rc, _out, err = run("show", str(VIDEO), "--format", "svg", "-o", str(dest))
    assert rc == 0, err
    root = ET.fromstring(dest.read_text())
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    ns = {"s": "http://www.w3.org/2000/svg"}
    texts = [t.text or "" for t in root.iterfind(".//s:text", ns)]
    assert "rule LocalGen" in texts and any(t.startswith("HardLock") for t in texts)
    boxes = [g.get("id") for g in root.iterfind("s:g", ns)]
    assert {"v_Vid", "r_LocalGen", "c_HardLock", "m_0"} <= set(boxes)
    assert len(root.findall("s:path", ns)) >= 10  # the edges


def test_show_output_file(tmp_path: Path) -> None:
    dest = tmp_path / "g.dot"
    assert run("show", str(GPT), "--format", "dot", "-o", str(dest))[0] == 0
    assert dest.read_text().startswith("digraph")


def test_show_errors_exit_1(tmp_path: Path) -> None:
    assert run("show", write(tmp_path, H + "visible A[t] <- B[t]\n"))[0] == 1


def test_emit_ir(tmp_path: Path) -> None:
    rc, out, _ = run("check", str(GPT), "--emit-ir", "json")
    assert rc == 0 and json.loads(out)["node"] == "Program"
    rc, out, _ = run("check", str(GPT), "--emit-ir", "text")
    assert rc == 0 and out.startswith("lamport-ir v1")
    assert run("check", str(GPT), "--emit-ir", "yaml")[0] == 2


def test_fmt_check_and_rewrite(tmp_path: Path) -> None:
    messy = "value  A:Token[Byte] shape Seq( 8 )   // keep me\nvisible A[t]<-A[0..t-1] when t>0\n"
    path = write(tmp_path, messy)
    rc, _, err = run("fmt", path, "--check")
    assert rc == 1 and "would be reformatted" in err
    assert Path(path).read_text() == messy  # --check never writes
    rc, out, _ = run("fmt", path, "--stdout")
    assert rc == 0 and "// keep me" in out
    assert run("fmt", path)[0] == 0
    tidy = Path(path).read_text()
    assert tidy == (
        "value A : Token[Byte] shape Seq(8) clock Lamport  // keep me\n"
        "visible A[t] <- A[0..t-1] when t > 0\n"
    )
    assert run("fmt", path, "--check")[0] == 0


def test_fmt_examples_idempotent_and_ir_preserving(tmp_path: Path) -> None:
    from lmpm.ir import compile_file
    from lmpm.ir.printer import print_ir

    for path in sorted((ROOT / "examples").glob("*.lmpm")):
        copy = tmp_path / path.name
        copy.write_text(path.read_text())
        assert run("fmt", str(copy))[0] == 0
        assert run("fmt", str(copy), "--check")[0] == 0
        before = print_ir(compile_file(path).ir).replace(str(path), "P")
        assert print_ir(compile_file(copy).ir).replace(str(copy), "P") == before


def test_fmt_aligns_trailing_comments(tmp_path: Path) -> None:
    path = write(tmp_path, "param T = 4 // a\nparam BPE = 256 // b\n\nparam Z = 1 // c\n")
    rc, out, _ = run("fmt", path, "--stdout")
    assert rc == 0
    assert out == "param T = 4      // a\nparam BPE = 256  // b\n\nparam Z = 1  // c\n"


def test_fmt_parse_error_exits_1(tmp_path: Path) -> None:
    assert run("fmt", write(tmp_path, "value A Token\n"))[0] == 1
    deep = H + "visible A[t] <- A[t" + "+1" * 5000 + "]\n"
    rc, _, err = run("fmt", write(tmp_path, deep, "deep.lmpm"))
    assert rc == 1 and "P004" in err


def test_check_never_imports_torch() -> None:
    code = (
        "import sys\nfrom lmpm.cli import main\n"
        f"rc = main(['check', {str(VIDEO)!r}])\n"
        "heavy = [m for m in ('torch', 'numpy', 'lark', 'rich') if m in sys.modules]\n"
        "print(rc, heavy)\n"
    )
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    assert res.stdout.strip() == "0 []", res.stdout + res.stderr


def test_real_process_exit_codes(tmp_path: Path) -> None:
    def proc(*args: str) -> int:
        return subprocess.run(
            [sys.executable, "-m", "lmpm.cli", *args], capture_output=True, check=False
        ).returncode

    assert proc("check", str(VIDEO)) == 0
    assert proc("check", write(tmp_path, H + "visible A[t] <- B[t]\n")) == 1
    assert proc("check", str(VIDEO), "--set", "Nope=1") == 2
