"""scripts/gpu_check.py, the prepared GPU check: its options, budget shares, JUnit reading, report
and the kill of a step past its time. The steps themselves run in CI as
``scripts/gpu_check.sh --dry-run`` (.ci/run)."""

from __future__ import annotations

import json
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import gpu_check as gc


def test_budget_defaults_to_the_gpu_run_or_the_dry_run_and_must_be_positive(
    tmp_path: Path,
) -> None:
    assert gc.parse_args([]).budget == gc.REAL_BUDGET_S
    dry = gc.parse_args(["--dry-run", "--out", str(tmp_path)])
    assert (dry.dry_run, dry.budget, dry.out) == (True, gc.DRY_BUDGET_S, tmp_path)
    assert gc.parse_args(["--budget", "60"]).budget == 60.0
    with pytest.raises(SystemExit):
        gc.parse_args(["--budget", "0"])
    with pytest.raises(SystemExit):
        gc.parse_args(["--wheels", str(tmp_path / "missing")])


def test_a_step_gets_what_earlier_steps_left_and_later_shares_stay_reserved() -> None:
    weights = [1.0, 1.0, 2.0]
    assert gc.limits(weights, 100, 0.0, 0) == 25.0
    assert gc.limits(weights, 100, 10.0, 1) == 40.0  # step 0 took 10 of its 25
    assert gc.limits(weights, 100, 50.0, 2) == 50.0  # the last step takes all that is left
    assert gc.limits(weights, 100, 120.0, 2) == 0.0


def test_the_dry_run_selects_the_cuda_and_gpu_tests_and_loads_plugins_by_name(
    tmp_path: Path,
) -> None:
    opts = gc.parse_args(["--dry-run", "--out", str(tmp_path)])
    plugins = gc.Plugins(xdist=True, hypothesis="hyp", timeout=False)
    steps = {s.name: s for s in gc.python_steps(opts, "py", "py", plugins)}
    assert "gpu-tests" not in steps  # (a dry run's test step is that selection)
    argv = steps["tests"].argv
    joined = " ".join(argv)
    assert "-p xdist.plugin -n" in joined and "-p hyp" in joined and "-p gpu_check" in joined
    assert argv[-2:] == ("-k", "cuda or gpu")
    assert "pytest_timeout" not in joined


def test_a_gpu_run_takes_the_gpu_tests_early_and_the_rest_of_the_suite_last() -> None:
    opts = gc.parse_args([])
    steps = gc.python_steps(opts, "py", "py", gc.Plugins(False, None, True))
    names = [s.name for s in steps]
    assert names.index("gpu-tests") < names.index("bench:masks-ops") and names[-1] == "tests"
    gpu, rest = steps[names.index("gpu-tests")], steps[-1]
    assert gpu.argv[-2:] == ("-k", "cuda or gpu") and gpu.junit != rest.junit
    assert rest.argv[-2:] == ("-k", "not (cuda or gpu)")
    assert "-n" not in rest.argv and f"--timeout={gc.TEST_TIMEOUT_S}" in rest.argv


def test_the_test_step_shares_the_cores_among_its_workers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """16 xdist workers on 16 cores: one torch thread and one inductor compile worker each (not
    16 each); a value the caller set stays; without xdist nothing is capped."""
    monkeypatch.setattr(gc.os, "cpu_count", lambda: 16)
    env = {"PYTHONPATH": "src", "MKL_NUM_THREADS": "3"}
    got = gc.tests_env(env, xdist=True)
    assert got["OMP_NUM_THREADS"] == "1" and got["TORCHINDUCTOR_COMPILE_THREADS"] == "1"
    assert got["MKL_NUM_THREADS"] == "3" and got["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] == "1"
    assert got["PYTHONPATH"].endswith("src") and got["PYTHONPATH"] != "src"
    monkeypatch.setattr(gc.os, "cpu_count", lambda: 64)
    assert gc.tests_env(env, xdist=True)["OMP_NUM_THREADS"] == "4"  # 16 workers, 4 cores each
    assert "OMP_NUM_THREADS" not in gc.tests_env({"PYTHONPATH": "src"}, xdist=False)


def test_only_names_steps_and_a_zero_budget_is_refused() -> None:
    with pytest.raises(SystemExit):
        gc.parse_args(["--budget", "0"])
    assert gc.parse_args(["--only", "examples, check"]).only == ("examples", "check")


JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest">
<testcase classname="tests.a" name="test_ok"/>
<testcase classname="tests.a" name="test_gpu[x]">
  <properties><property name="lmpm_marker" value="gpu"/></properties>
  <failure message="AssertionError: cpu and cuda differ&#10;second line">tb</failure>
</testcase>
<testcase classname="tests.b" name="test_err"><error message="fixture failed">tb</error></testcase>
<testcase classname="tests.b" name="test_skip"><skipped message="needs a CUDA device"/></testcase>
</testsuite></testsuites>
"""


def test_junit_counts_outcomes_and_keeps_the_first_line_and_the_gpu_tag(tmp_path: Path) -> None:
    path = tmp_path / "junit.xml"
    path.write_text(JUNIT)
    junit = gc.parse_junit(path)
    assert junit is not None
    assert junit.summary() == "1 passed, 1 failed, 1 errors, 1 skipped"
    failed = next(c for c in junit.cases if c.outcome == "failed")
    assert (failed.id, failed.message, failed.gpu) == (
        "tests.a::test_gpu[x]",
        "AssertionError: cpu and cuda differ",
        True,
    )
    path.write_text(JUNIT[:200])  # pytest killed while writing
    assert gc.parse_junit(path) is None
    assert gc.parse_junit(tmp_path / "absent.xml") is None


def test_the_plugin_tags_gpu_marked_tests_only() -> None:
    def item(marked: bool) -> SimpleNamespace:
        return SimpleNamespace(
            get_closest_marker=lambda name: object() if marked and name == "gpu" else None,
            user_properties=[],
        )

    items = [item(True), item(False)]
    gc.pytest_collection_modifyitems(items)
    assert [i.user_properties for i in items] == [[("lmpm_marker", "gpu")], []]


def test_a_step_past_its_time_is_killed_with_its_output_so_far() -> None:
    code = "import time; print('{\"n\": 1}', flush=True); time.sleep(60)"
    fin = gc.run_command([sys.executable, "-c", code], timeout=1.0, grace=1.0)
    assert fin.timed_out and fin.seconds < 20
    records = gc.json_records(fin.lines, "bench:x")
    assert records == [{"step": "bench:x", "n": 1}]
    assert gc.classify(fin, records) == gc.TIMED_OUT


def test_sigint_first_lets_the_step_finish_its_report() -> None:
    code = (
        "import time\ntry:\n    time.sleep(60)\nexcept KeyboardInterrupt:\n"
        "    print('wrote the report', flush=True)\n    raise SystemExit(3)\n"
    )
    fin = gc.run_command([sys.executable, "-c", code], timeout=1.0, grace=10.0)
    assert fin.timed_out and fin.lines[-1] == "wrote the report" and fin.rc == 3


def test_results_unsupported_flag_failed_and_ok() -> None:
    usage = ["usage: vm.py [-h]", "vm.py: error: unrecognized arguments: --device cuda"]
    assert gc.classify(gc.Finished(2, False, 1.0, usage), []) == gc.UNSUPPORTED_FLAG
    choice = ["x: error: argument --only: invalid choice: 'cuda'"]
    assert gc.classify(gc.Finished(2, False, 1.0, choice), []) == gc.UNSUPPORTED_FLAG
    assert gc.classify(gc.Finished(0, False, 1.0, []), [{"ok": False}]) == gc.FAILED
    assert gc.classify(gc.Finished(1, False, 1.0, []), []) == gc.FAILED
    assert gc.classify(gc.Finished(0, False, 1.0, ["{}"]), [{"ok": True}]) == gc.OK


def _outcome(
    kind: str, result: str, rc: int | None, records: list[dict[str, object]]
) -> gc.Outcome:
    step = gc.Step(kind, f"the {kind} step", ("python", "-c", "x"), 1.0, kind)
    return gc.Outcome(step, result, rc, 2.5, 10.0, records, ["last line of output"])


def test_no_tests_collected_is_not_a_failure(tmp_path: Path) -> None:
    out = _outcome("tests", gc.FAILED, 5, [])
    gc.read_outcome(out, tmp_path / "junit.xml")
    assert (out.result, out.numbers) == (gc.OK, "no tests collected")


def test_the_report_has_a_row_per_step_every_record_and_the_tail_of_failures(
    tmp_path: Path,
) -> None:
    ex = _outcome(
        "examples",
        gc.FAILED,
        1,
        [
            {"step": "examples", "example": "gpt", "ok": True, "max_abs_diff": 0.0},
            {"step": "examples", "example": "video", "ok": False, "error": "R050 | bad"},
        ],
    )
    bench = _outcome("bench", gc.OK, 0, [{"step": "bench", "ratio": 2.0}])
    for o in (ex, bench):
        gc.read_outcome(o, tmp_path / "junit.xml")
    gc.write_report(tmp_path, {"mode": "dry run"}, [ex, bench])
    lines = [json.loads(s) for s in (tmp_path / gc.REPORT_JSONL).read_text().splitlines()]
    assert [r["step"] for r in lines] == [
        "header",
        "examples",
        "examples",
        "examples",
        "bench",
        "bench",
    ]
    assert [r["result"] for r in lines if r.get("kind") == "result"] == ["failed", "ok"]
    md = (tmp_path / gc.REPORT_MD).read_text()
    assert "| examples | the examples step | failed | 1/2 commit as on the CPU" in md
    assert "R050 \\| bad" in md  # a table cell keeps its pipes escaped
    assert md.count("last line of output") == 1  # the tail of the failed step only


def test_wheels_unpack_into_an_importable_folder(tmp_path: Path) -> None:
    whl = tmp_path / "tiny-1.0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("tiny_gpu_check_mod/__init__.py", "VALUE = 7\n")
    site = tmp_path / "site"
    gc.unpack_wheels([whl], site)
    assert (site / "tiny_gpu_check_mod" / "__init__.py").read_text() == "VALUE = 7\n"


def test_only_the_wheels_of_this_python_are_installed() -> None:
    """--download-wheels fetches rpds-py for several Pythons; --wheels installs the one that fits
    (pip refuses a set with another version's wheel in it)."""
    fits = gc.wheel_fits
    assert fits("lark-1.3.1-py3-none-any.whl", (3, 11))
    assert fits(
        "rpds_py-2026.9.1-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl", (3, 12)
    )
    assert not fits("rpds_py-2026.9.1-cp312-cp312-manylinux_2_17_x86_64.whl", (3, 11))
    assert fits("thing-1.0-cp38-abi3-manylinux_2_17_x86_64.whl", (3, 12))
    assert not fits("thing-1.0-cp313-abi3-manylinux_2_17_x86_64.whl", (3, 12))
    assert fits("attrs-26.1.0-py2.py3-none-any.whl", (3, 13))
    assert not fits("not-a-wheel.whl", (3, 12))
