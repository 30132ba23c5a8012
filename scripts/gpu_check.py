"""One prepared GPU check (docs/gpu.md): the test suite with the GPU-marked tests, every example on
the device against the CPU, ``lmpm check --device cuda`` on every example program, and the GPU
cases of the benchmarks, each step in its own process under a share of one time budget, written to
one report (``report.md`` + ``report.jsonl``) in ``--out DIR``.

Run it through ``scripts/gpu_check.sh`` (the same arguments). The driver imports only the standard
library: the steps import torch and lmpm in their own processes, so one that hangs or crashes is
killed and recorded while the others run. ``--dry-run`` runs the same steps on the CPU at small
sizes (on the simulated CUDA device where lmpm has one), for CI.

Example:
    >>> opts = parse_args(["--dry-run", "--out", "/tmp/gc"])
    >>> opts.dry_run, opts.budget, str(opts.out)
    (True, 300.0, '/tmp/gc')

This module is also the pytest plugin of the test step (``-p gpu_check``): it tags the GPU-marked
tests in the JUnit XML so the report can list them apart.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
import zipfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"

REAL_BUDGET_S = 450.0  # the whole check fits 8 minutes on one H100/H200, with room to start
DRY_BUDGET_S = 600.0  # a ceiling for CI (2 shared cores); the dry run itself takes ~3 min
GRACE_S = 10.0  # after SIGINT (pytest writes its JUnit XML), before SIGKILL of the whole group
TAIL_LINES = 40  # output lines kept in the report for a step that did not pass
TEST_TIMEOUT_S = 120  # pytest-timeout's limit per test, where that plugin is installed

# The wheels a GPU image with PyTorch lacks (lark is a dependency of lmpm; the jsonschema set lets
# tests/ir/test_ir_schema.py run there). Pinned to versions pyproject.toml accepts.
WHEELS = (
    "lark==1.3.1",
    "jsonschema==4.26.0",
    "jsonschema-specifications==2025.9.1",
    "referencing==0.37.0",
    "rpds-py==2026.9.1",
    "attrs==26.1.0",
    # the `hf` extra (tests/models/test_hf*.py and tests/runtime/test_tokenizer_io.py skip without
    # it, and with them the Hugging Face adapter's CUDA check): transformers, tokenizers and what
    # they import that a PyTorch image lacks (its numpy, packaging, filelock, fsspec, rich are used)
    "transformers==5.24.0",
    "tokenizers==0.23.3",
    "huggingface-hub==2.4.0",
    "hf-xet==1.8.0",
    "httpx2==2.16.2",
    "httpcore2==2.16.2",
    "h11==0.16.0",
    "anyio==4.16.0",
    "idna==3.20",
    "truststore==0.10.5",
    "pyyaml==6.0.4",
    "regex==2026.11.19",
    "tqdm==4.70.1",
    "typer==0.29.2",
    "click==8.5.1",
    "shellingham==1.5.4",
    "annotated-doc==0.0.7",
    "pydantic==2.14.4",
    "pydantic-core==2.50.5",
    "annotated-types==0.8.0",
    "typing-inspection==0.4.5",
)
WHEEL_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "any")
# The GPU image's Python is not known in advance (the first one had 3.12): rpds-py is compiled per
# version, so the wheels are downloaded for each of these and only the running one's installed.
WHEEL_PYTHONS = ("3.11", "3.12", "3.13", "3.14")  # rpds-py 2026.9.1 has no 3.10 wheel
REQUIRED_MODULES = ("lark", "numpy", "torch", "rich", "safetensors", "matplotlib", "pytest")

REPORT_MD = "report.md"
REPORT_JSONL = "report.jsonl"
TESTS_LOG = "tests.log"
JUNIT_XML = "junit.xml"
JUNIT_GPU_XML = "junit-gpu.xml"
STEPS_LOG = "steps.log"
OUT_FILES = (REPORT_MD, REPORT_JSONL, TESTS_LOG, JUNIT_XML, JUNIT_GPU_XML, STEPS_LOG)
# The GPU-marked and CUDA-named tests: on a GPU they run early (their outcome is the point of the
# check, reported even when the whole suite does not fit), and the suite runs the rest last.
GPU_TESTS = "cuda or gpu"

MSG_MISSING = (
    "gpu_check: cannot import {names} with {python}. On a machine with network, run\n"
    "  scripts/gpu_check.sh --download-wheels DIR\n"
    "carry DIR to this machine, and run scripts/gpu_check.sh --wheels DIR ..."
)
UNSUPPORTED = re.compile(r"error: (unrecognized arguments|argument \S+: invalid choice)")

# Results of a step, in the report's words.
OK, FAILED, TIMED_OUT, UNSUPPORTED_FLAG = "ok", "failed", "timed out", "unsupported flag"


# ---------------------------------------------------------------- options


@dataclass(frozen=True, slots=True)
class Options:
    out: Path  # the report folder (made if missing; only OUT_FILES in it are replaced)
    wheels: Path | None  # a folder of wheels to install offline before the steps
    download_wheels: Path | None  # download WHEELS there and stop (on a connected machine)
    dry_run: bool  # the same steps on the CPU at small sizes
    budget: float  # seconds for all steps together
    only: tuple[str, ...] = ()  # the steps to run (empty: all); env always runs


def parse_args(argv: Sequence[str]) -> Options:
    ap = argparse.ArgumentParser(prog="scripts/gpu_check.sh", description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "gpu-check", help="report folder")
    ap.add_argument("--wheels", type=Path, help="install these wheels offline first")
    ap.add_argument("--download-wheels", type=Path, metavar="DIR", help="download wheels, stop")
    ap.add_argument("--dry-run", action="store_true", help="CPU, small sizes (CI)")
    ap.add_argument(
        "--budget",
        type=float,
        help=f"seconds (default {REAL_BUDGET_S:.0f}; dry run {DRY_BUDGET_S:.0f})",
    )
    ap.add_argument(
        "--only",
        metavar="STEP,...",
        help="run only these steps (env always runs first), e.g. examples,check,tests",
    )
    a = ap.parse_args(list(argv))
    budget = a.budget if a.budget is not None else DRY_BUDGET_S if a.dry_run else REAL_BUDGET_S
    if budget <= 0:
        ap.error(f"--budget must be positive, got {budget}")
    if a.wheels is not None and not a.wheels.is_dir():
        ap.error(f"--wheels {a.wheels}: no such folder (make it with --download-wheels)")
    only = tuple(x.strip() for x in a.only.split(",") if x.strip()) if a.only else ()
    return Options(a.out, a.wheels, a.download_wheels, a.dry_run, budget, only)


# ---------------------------------------------------------------- steps as data


@dataclass(frozen=True, slots=True)
class Step:
    name: str  # tag of the step's JSON lines and row of the report
    what: str  # one line for the report
    argv: tuple[str, ...]
    weight: float  # share of the budget (shares of later steps are reserved for them)
    kind: str  # "env" | "tests" | "examples" | "check" | "bench": how its output is read
    log: str = STEPS_LOG
    echo: bool = True  # print its JSON lines as progress
    junit: str = JUNIT_XML  # a tests step's JUnit XML (in --out)


@dataclass(slots=True)
class Outcome:
    step: Step
    result: str  # OK, FAILED, TIMED_OUT or UNSUPPORTED_FLAG
    rc: int | None
    seconds: float
    limit: float
    records: list[dict[str, Any]]  # its JSON lines, tagged with the step
    tail: list[str]  # the last output lines (kept for a step that did not pass)
    numbers: str = ""  # the report's "numbers" cell
    details: list[str] = field(default_factory=list)  # markdown lines under the table


def python_steps(opts: Options, python: str, tests_python: str, plugins: Plugins) -> list[Step]:
    """The check, in the order it runs. The tests run last: they take what the others leave."""
    dry = opts.dry_run
    me = (python, str(SCRIPTS / "gpu_check.py"))
    device = "auto" if dry else "cuda"

    def bench(name: str, what: str, weight: float, *args: str) -> Step:
        return Step(f"bench:{name}", what, (python, *args), weight, "bench")

    return [
        Step(
            "env",
            "python, torch, CUDA device, commit, CPUs",
            (*me, "--child", "env", "--device", device),
            0.03,
            "env",
        ),
        Step(
            "examples",
            "every engine example on the device against the CPU (commits, clocks, payload)",
            (*me, "--child", "examples", "--device", device),
            0.12,
            "examples",
        ),
        Step(
            "check",
            "`lmpm check PROGRAM --device cuda` on every bundled example",
            (*me, "--child", "check"),
            0.09,
            "check",
        ),
        *(
            ()
            if dry
            else (
                Step(
                    "gpu-tests",
                    f"the GPU-marked and CUDA-named tests (`-k '{GPU_TESTS}'`)",
                    tests_argv(opts, tests_python, plugins, GPU_TESTS, JUNIT_GPU_XML),
                    0.12,
                    "tests",
                    TESTS_LOG,
                    echo=False,
                    junit=JUNIT_GPU_XML,
                ),
            )
        ),
        bench("masks-ops", "mask_mod aten op counts", 0.03, "benchmarks/masks.py", "--ops"),
        bench(
            "masks-gpu",
            "BlockMask build + FlexAttention vs hand-written",
            0.10,
            "benchmarks/masks.py",
            "--gpu",
            *(("--device", "cpu", "--small") if dry else ("--device", "cuda")),
        ),
        bench(
            "backends",
            "batched hypothesis update on the device",
            0.06,
            "benchmarks/backends.py",
            "--only",
            "cuda",
            *(("--device", "cpu", "--scale", "0.1") if dry else ("--device", "cuda")),
        ),
        bench(
            "vm",
            "token-stream VM step on the device: eager, one CUDA graph, per-stream loop",
            0.08,
            "benchmarks/vm.py",
            *(
                ("--device", "cpu", "--quick", "--k-sizes", "")
                if dry
                else (
                    *("--device", "cuda", "--sizes", "1024,16384", "--repeat", "2"),
                    *("--baseline-max", "1024", "--model-streams", "0", "--k-sizes", ""),
                )
            ),
        ),
        bench(
            "vm-k",
            "token-stream VM, K = 1..16 steps per CUDA-graph replay: per-step wall and host time",
            0.06,
            "benchmarks/vm.py",
            "--k-only",
            *(
                ("--device", "cpu", "--k-sizes", "64", "--repeat", "1", "--no-compile")
                if dry
                else (
                    *("--device", "cuda", "--k-sizes", "1024,16384", "--repeat", "2"),
                    *("--baseline-max", "1024"),
                )
            ),
        ),
        bench(
            "compile",
            "the examples' epochs on the device, eager and compiled (each step a CUDA graph)",
            0.14,  # inductor's Triton compiles of the steps, then 10,000 text epochs
            "benchmarks/compile.py",
            "--quick",
            # the dry run: the same path on the simulated device (its times are the simulation's)
            *(
                ("--device", "simcuda", "--long-epochs", "200")
                if dry
                else ("--device", "cuda", "--long-epochs", "10000")
            ),
        ),
        bench(
            "compile-k",
            "K = 1..16 epochs per CUDA-graph replay of a capturable workload: time per epoch",
            0.04,
            "benchmarks/compile.py",
            "--quick",
            "--epochs-per-replay",
            "1,2,4,8,16",
            *(("--device", "simcuda", "--k-width", "4") if dry else ("--device", "cuda")),
        ),
        Step(
            "tests",
            _tests_what(dry),
            tests_argv(opts, tests_python, plugins, GPU_TESTS if dry else f"not ({GPU_TESTS})"),
            0.35 if dry else 0.23,
            "tests",
            TESTS_LOG,
            echo=False,
        ),
    ]


def _tests_what(dry: bool) -> str:
    if dry:
        return f"the GPU-marked and CUDA-named tests (`-k '{GPU_TESTS}'`), slow ones skipped"
    return "the rest of the test suite (`gpu-tests` ran the GPU ones), slow ones skipped"


@dataclass(frozen=True, slots=True)
class Plugins:
    """The pytest plugins the test step loads by name (PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 keeps
    foreign ones out: pytest-benchmark warns under xdist, and `filterwarnings = error` then
    stops collection)."""

    xdist: bool  # pytest-xdist: -p xdist.plugin -n WORKERS
    hypothesis: str | None  # the module of hypothesis' plugin
    timeout: bool  # pytest-timeout: a hung test fails alone instead of eating the budget

    @staticmethod
    def find() -> Plugins:
        hyp = next(
            (m for m in ("_hypothesis_pytestplugin", "hypothesis.extra.pytestplugin") if _has(m)),
            None,
        )
        return Plugins(_has("xdist"), hyp, _has("pytest_timeout"))


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def tests_argv(
    opts: Options, python: str, plugins: Plugins, select: str | None, junit: str = JUNIT_XML
) -> tuple[str, ...]:
    """pytest on the tests ``select`` picks (a -k expression; None: all), each result named in
    the log as it happens (-v: a step stopped at its limit still says which tests failed)."""
    argv = [python, "-m", "pytest", "-p", "gpu_check", "-v", "-rfE", "--durations=25"]
    if plugins.xdist:
        argv += ["-p", "xdist.plugin", "-n", str(test_workers())]
    if plugins.hypothesis:
        argv += ["-p", plugins.hypothesis]
    if plugins.timeout:
        argv += ["-p", "pytest_timeout", f"--timeout={TEST_TIMEOUT_S}"]
    argv += ["--junitxml", str(opts.out / junit)]
    if select:
        argv += ["-k", select]
    return tuple(argv)


def test_workers() -> int:
    return min(16, os.cpu_count() or 1)


def tests_env(env: dict[str, str], xdist: bool) -> dict[str, str]:
    """The test step's environment. Foreign pytest plugins stay out (``Plugins``). With xdist,
    each worker's torch gets an equal share of the cores (OMP/MKL threads, inductor's compile
    workers: one each), where each would otherwise take every core: 16 workers x 16 threads on
    the first GPU machine's 16 cores. A value the caller set is kept."""
    out = {**env, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    out["PYTHONPATH"] = os.pathsep.join([str(SCRIPTS), env["PYTHONPATH"]])
    if xdist:
        share = str(max(1, (os.cpu_count() or 1) // test_workers()))
        for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            out.setdefault(name, share)
        out.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    return out


def limits(weights: Sequence[float], budget: float, spent: float, index: int) -> float:
    """Seconds step ``index`` may take: what is left of the budget after ``spent``, less the
    shares reserved for the steps after it (a step that finishes early gives its time on)."""
    total = sum(weights)
    reserved = budget * sum(weights[index + 1 :]) / total
    return max(budget - spent - reserved, 0.0)


# ---------------------------------------------------------------- running one command


@dataclass(frozen=True, slots=True)
class Finished:
    rc: int | None  # None: killed before it exited
    timed_out: bool
    seconds: float
    lines: list[str]


def run_command(
    argv: Sequence[str],
    *,
    timeout: float,
    env: dict[str, str] | None = None,
    cwd: Path = ROOT,
    log: IO[str] | None = None,
    on_line: Callable[[str], None] | None = None,
    grace: float = GRACE_S,
) -> Finished:
    """Run ``argv`` in its own process group, stdout and stderr as lines. Past ``timeout``: SIGINT
    (pytest still writes its report), then after ``grace`` SIGKILL to the whole group."""
    start = time.monotonic()
    proc = subprocess.Popen(
        list(argv),
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    lines: list[str] = []
    pump = threading.Thread(target=_pump, args=(proc.stdout, lines, log, on_line), daemon=True)
    pump.start()
    timed_out = False
    try:
        proc.wait(timeout=max(timeout, 0.01))
    except subprocess.TimeoutExpired:
        timed_out = True
        _stop(proc, grace)
    pump.join(timeout=5)
    if pump.is_alive():  # a grandchild still holds the pipe
        _kill_group(proc.pid)
        pump.join(timeout=5)
    if proc.stdout is not None:
        proc.stdout.close()
    rc = None if timed_out and proc.returncode in (-signal.SIGKILL, None) else proc.returncode
    return Finished(rc, timed_out, time.monotonic() - start, lines)


def _pump(
    stream: IO[str] | None,
    lines: list[str],
    log: IO[str] | None,
    on_line: Callable[[str], None] | None,
) -> None:
    assert stream is not None
    for line in stream:
        lines.append(line.rstrip("\n"))
        if log is not None:
            log.write(line)
            log.flush()
        if on_line is not None:
            on_line(line.rstrip("\n"))


def _stop(proc: subprocess.Popen[str], grace: float) -> None:
    try:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=grace)
    except (subprocess.TimeoutExpired, ProcessLookupError):
        pass
    _kill_group(proc.pid)
    proc.wait()


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def json_records(lines: Iterable[str], step: str) -> list[dict[str, Any]]:
    """Every line that is a JSON object, tagged with the step that printed it."""
    out = []
    for line in lines:
        s = line.strip()
        if not s.startswith("{"):
            continue
        try:
            obj = json.loads(s)
        except ValueError:
            continue
        if isinstance(obj, dict):
            out.append({"step": step, **{k: v for k, v in obj.items() if k != "step"}})
    return out


def classify(fin: Finished, records: Sequence[dict[str, Any]]) -> str:
    if fin.timed_out:
        return TIMED_OUT
    if fin.rc == 2 and any(UNSUPPORTED.search(line) for line in fin.lines[-20:]):
        return UNSUPPORTED_FLAG
    if fin.rc != 0 or any(r.get("ok") is False for r in records):
        return FAILED
    return OK


# ---------------------------------------------------------------- the test step's JUnit XML


@dataclass(frozen=True, slots=True)
class TestCase:
    id: str  # classname::name as JUnit spells it
    outcome: str  # "passed" | "failed" | "error" | "skipped"
    message: str  # first line of the failure, error or skip reason
    gpu: bool  # marked gpu (tagged by this module as a pytest plugin)


@dataclass(frozen=True, slots=True)
class JUnit:
    cases: tuple[TestCase, ...]

    def count(self, outcome: str) -> int:
        return sum(c.outcome == outcome for c in self.cases)

    def summary(self) -> str:
        n = {o: self.count(o) for o in ("passed", "failed", "error", "skipped")}
        return f"{n['passed']} passed, {n['failed']} failed, {n['error']} errors, {n['skipped']} skipped"


def parse_junit(path: Path) -> JUnit | None:
    """The cases of a pytest JUnit XML file; None if there is none or it is cut off."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    cases = []
    for tc in root.iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = tc.find(tag)
            if el is not None:
                outcome = "failed" if tag == "failure" else tag
                message = _first_line(el.get("message") or el.text or "")
                break
        props = {(p.get("name"), p.get("value")) for p in tc.iter("property")}
        name = f"{tc.get('classname', '')}::{tc.get('name', '')}"
        cases.append(TestCase(name, outcome, message, ("lmpm_marker", "gpu") in props))
    return JUnit(tuple(cases))


def _first_line(text: str) -> str:
    return next((s.strip() for s in text.splitlines() if s.strip()), "")[:300]


def pytest_collection_modifyitems(items: list[Any]) -> None:
    """pytest hook (``-p gpu_check``): tag GPU-marked tests for the JUnit XML."""
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.user_properties.append(("lmpm_marker", "gpu"))


# ---------------------------------------------------------------- reading each kind of step


def read_outcome(out: Outcome, junit_path: Path) -> None:
    """Fill the report's numbers and details of ``out`` from its records (and JUnit XML)."""
    {"env": _read_env, "examples": _read_examples, "check": _read_check, "bench": _read_bench}.get(
        out.step.kind, lambda o: None
    )(out)
    if out.step.kind == "tests":
        _read_tests(out, parse_junit(junit_path))


def _read_env(out: Outcome) -> None:
    r = out.records[0] if out.records else {}
    out.numbers = (
        f"python {r.get('python')}, torch {r.get('torch')}, CUDA {r.get('cuda_available')}, "
        f"{r.get('device_name')}, {r.get('cpus')} CPUs, commit {r.get('git_commit')}"
    )


def _read_tests(out: Outcome, junit: JUnit | None) -> None:
    if out.rc == 5:  # pytest: no tests collected (a dry run where nothing matches)
        out.result = OK if out.result == FAILED else out.result
        out.numbers = "no tests collected"
        return
    if junit is None:
        out.numbers = "no JUnit XML (pytest did not get to write it)"
        return
    out.numbers = junit.summary() + (" before it was stopped" if out.result == TIMED_OUT else "")
    bad = [c for c in junit.cases if c.outcome in ("failed", "error")]
    if bad:
        out.details += ["Failed tests:", ""] + [f"- `{c.id}`: {c.message}" for c in bad] + [""]
    gpu = [c for c in junit.cases if c.gpu]
    out.details += [f"GPU-marked tests ({len(gpu)}):", ""]
    out.details += ["| test | outcome | first line |", "|---|---|---|"]
    out.details += [f"| `{c.id}` | {c.outcome} | {_cell(c.message)} |" for c in gpu] + [""]
    for r in [
        {"step": "tests", "test": c.id, "outcome": c.outcome, "message": c.message, "gpu": c.gpu}
        for c in bad + gpu
    ]:
        out.records.append(r)


def _read_examples(out: Outcome) -> None:
    rows = [r for r in out.records if "example" in r]
    dev = next((r.get("device") for r in out.records if "device" in r), "?")
    ok = sum(bool(r.get("ok")) for r in rows)
    out.numbers = f"{ok}/{len(rows)} commit as on the CPU, device {dev}"
    out.details += [
        "| example | ok | max abs diff | cpu s | device s | error |",
        "|---|---|---|---|---|---|",
    ]
    out.details += [
        f"| {r['example']} | {r.get('ok')} | {r.get('max_abs_diff')} | {r.get('cpu_s')} | "
        f"{r.get('device_s')} | {_cell(r.get('error', ''))} |"
        for r in rows
    ] + [""]


def _read_check(out: Outcome) -> None:
    rows = [r for r in out.records if "program" in r]
    ok = sum(r.get("result") == OK for r in rows)
    unsupported = sum(r.get("result") == UNSUPPORTED_FLAG for r in rows)
    out.numbers = f"{ok}/{len(rows)} ready for cuda" + (
        f", {unsupported} without `--device` in `lmpm check` yet" if unsupported else ""
    )
    if rows and unsupported == len(rows) and out.result == FAILED:
        out.result = UNSUPPORTED_FLAG
    out.details += ["| program | result | exit | last line |", "|---|---|---|---|"]
    out.details += [
        f"| {r['program']} | {r.get('result')} | {r.get('rc')} | {_cell(r.get('last', ''))} |"
        for r in rows
    ] + [""]


def _read_bench(out: Outcome) -> None:
    out.numbers = f"{len(out.records)} JSON lines"
    out.details += [f"- `{_compact(r)}`" for r in out.records] + [""]


def _compact(r: dict[str, Any], width: int = 400) -> str:
    s = json.dumps({k: v for k, v in r.items() if k != "step"}, separators=(",", ":"))
    return s if len(s) <= width else s[: width - 3] + "..."


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")[:200]


# ---------------------------------------------------------------- the report


def write_report(out_dir: Path, header: dict[str, Any], outcomes: Sequence[Outcome]) -> None:
    """report.md (a table, then one section per step) and report.jsonl (every record, then one
    line per step with its result)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / REPORT_JSONL, "w") as f:
        f.write(json.dumps({"step": "header", **header}) + "\n")
        for o in outcomes:
            for r in o.records:
                f.write(json.dumps(r) + "\n")
            f.write(json.dumps(_step_record(o)) + "\n")
    (out_dir / REPORT_MD).write_text(render_markdown(header, outcomes))


def _step_record(o: Outcome) -> dict[str, Any]:
    return {
        "step": o.step.name,
        "kind": "result",
        "result": o.result,
        "rc": o.rc,
        "seconds": round(o.seconds, 1),
        "limit_s": round(o.limit, 1),
        "numbers": o.numbers,
        "argv": list(o.step.argv),
    }


def render_markdown(header: dict[str, Any], outcomes: Sequence[Outcome]) -> str:
    lines = ["# LMPM GPU check", ""]
    lines += [f"- {k}: {v}" for k, v in header.items()] + [""]
    lines += ["| step | what | result | numbers | time |", "|---|---|---|---|---|"]
    lines += [
        f"| {o.step.name} | {o.step.what} | {o.result} | {_cell(o.numbers)} | "
        f"{o.seconds:.1f} s of {o.limit:.0f} |"
        for o in outcomes
    ]
    lines.append("")
    for o in outcomes:
        lines += [
            f"## {o.step.name}: {o.result}",
            "",
            "`" + " ".join(_short(o.step.argv)) + "`",
            "",
        ]
        lines += o.details
        if o.result != OK:
            lines += [f"Exit {o.rc}; last lines:", "", "```", *o.tail, "```", ""]
    return "\n".join(lines)


def _short(argv: Sequence[str]) -> list[str]:
    return [_short_path(a) for a in argv]


def _short_path(arg: str) -> str:
    """An argument with the project's root left out (`Txt=/root/examples/x` -> `Txt=examples/x`)."""
    return arg.replace(str(ROOT) + os.sep, "")


# ---------------------------------------------------------------- the driver


def main(argv: Sequence[str]) -> int:
    if "--child" in argv:
        return child_main(argv)
    opts = parse_args(argv)
    if opts.download_wheels is not None:
        return download_wheels(opts.download_wheels)
    extra_path: list[str] = []
    if opts.wheels is not None:
        site = install_wheels(opts.wheels)
        if site is None:
            return 2
        extra_path.append(str(site))
        sys.path.insert(0, str(site))
    env = child_env(extra_path)
    missing = missing_modules(REQUIRED_MODULES, env)
    if missing:
        print(MSG_MISSING.format(names=", ".join(missing), python=sys.executable), flush=True)
        return 2
    python, note = tests_interpreter(env)
    steps = python_steps(opts, sys.executable, python, Plugins.find())
    if opts.only:
        known = {st.name for st in steps}
        unknown = [name for name in opts.only if name not in known]
        if unknown:
            sys.stderr.write(f"gpu_check: --only {','.join(unknown)}: steps are {sorted(known)}\n")
            return 2
        steps = [st for st in steps if st.name == "env" or st.name in opts.only]
    header = {
        "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "mode": "dry run (CPU, small sizes)" if opts.dry_run else "GPU",
        "budget_s": opts.budget,
        "wheels": str(opts.wheels) if opts.wheels else "none",
        "python": sys.executable,
        "tests_python": note,
    }
    outcomes = run_steps(opts, steps, env)
    header["seconds"] = round(sum(o.seconds for o in outcomes), 1)
    write_report(opts.out, header, outcomes)
    bad = [o for o in outcomes if o.result in (FAILED, TIMED_OUT)]
    skipped = [o.step.name for o in outcomes if o.result == UNSUPPORTED_FLAG]
    print(
        f"gpu_check: {len(outcomes) - len(bad)}/{len(outcomes)} steps passed"
        + (f"; not run (flag unsupported): {', '.join(skipped)}" if skipped else "")
        + (f"; failed: {', '.join(o.step.name for o in bad)}" if bad else "")
        + f"; report: {opts.out / REPORT_MD}",
        flush=True,
    )
    return 1 if bad else 0


def run_steps(opts: Options, steps: Sequence[Step], env: dict[str, str]) -> list[Outcome]:
    opts.out.mkdir(parents=True, exist_ok=True)
    for name in OUT_FILES:
        (opts.out / name).unlink(missing_ok=True)
    start = time.monotonic()
    weights = [s.weight for s in steps]
    outcomes = []
    with contextlib.ExitStack() as stack:
        logs = {
            name: stack.enter_context(open(opts.out / name, "w")) for name in {s.log for s in steps}
        }
        for i, step in enumerate(steps):
            limit = limits(weights, opts.budget, time.monotonic() - start, i)
            outcomes.append(run_step(step, limit, env, logs[step.log], opts))
    return outcomes


def run_step(step: Step, limit: float, env: dict[str, str], log: IO[str], opts: Options) -> Outcome:
    _progress(f"{step.name}: started (limit {limit:.0f} s)")
    log.write(f"===== {step.name}: {' '.join(_short(step.argv))}\n")
    log.flush()
    step_env = {**env, "LMPM_GPU_CHECK_LIMIT": f"{limit:.0f}"}
    if step.kind == "tests":
        step_env = tests_env(step_env, "xdist.plugin" in step.argv)
    echo = (lambda line: _echo(step.name, line)) if step.echo else None
    grace = min(GRACE_S, limit / 5)  # a short step keeps most of its time
    try:
        fin = run_command(
            step.argv,
            timeout=max(limit - grace, 1.0),
            env=step_env,
            log=log,
            on_line=echo,
            grace=grace,
        )
    except OSError as e:  # the command could not start
        fin = Finished(None, False, 0.0, [f"could not start: {e}"])
    records = json_records(fin.lines, step.name)
    out = Outcome(
        step, classify(fin, records), fin.rc, fin.seconds, limit, records, fin.lines[-TAIL_LINES:]
    )
    try:
        read_outcome(out, opts.out / step.junit)
    except Exception as e:  # a report that cannot read a step still reports the others
        out.result, out.numbers = FAILED, f"could not read its output: {e!r}"
    _progress(f"{step.name}: {out.result} in {fin.seconds:.1f} s: {out.numbers}")
    return out


_T0 = time.monotonic()


def _progress(msg: str) -> None:
    print(f"[{time.monotonic() - _T0:6.1f}s] {msg}", flush=True)


def _echo(step: str, line: str) -> None:
    if line.lstrip().startswith("{"):
        print(f"    {step}: {line.strip()[:160]}", flush=True)


# ---------------------------------------------------------------- environment and wheels


def child_env(extra_path: Sequence[str]) -> dict[str, str]:
    """The steps' environment: lmpm from src/ (not installed on the GPU machine), the installed
    wheels, unbuffered output."""
    env = dict(os.environ)
    parts = [str(ROOT / "src"), *extra_path]
    if env.get("PYTHONPATH"):
        parts.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(parts)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def missing_modules(names: Sequence[str], env: dict[str, str]) -> list[str]:
    code = "import importlib.util as u, sys; print(' '.join(n for n in sys.argv[1:] if u.find_spec(n) is None))"
    r = subprocess.run(
        [sys.executable, "-c", code, *names], env=env, capture_output=True, text=True, check=False
    )
    return r.stdout.split() if r.returncode == 0 else list(names)


def tests_interpreter(env: dict[str, str]) -> tuple[str, str]:
    """The interpreter of the test step. Some tests run the ``lmpm`` script next to
    ``sys.executable``, which a bare GPU image (lmpm not installed) lacks: there the tests run
    under a link to this interpreter in a folder that has an ``lmpm`` script beside it (and, for
    a virtual environment, its pyvenv.cfg and lib/ beside that, so the link finds the same
    packages). Where the link does not import what the tests need, the interpreter itself."""
    here = Path(sys.executable)
    if (here.parent / "lmpm").exists():
        return sys.executable, sys.executable
    prefix = Path(tempfile.mkdtemp(prefix="lmpm-gpu-check-python-"))
    link = prefix / "bin" / here.name
    try:
        link.parent.mkdir()
        link.symlink_to(here)
        venv = Path(sys.prefix)
        if sys.prefix != sys.base_prefix and (venv / "pyvenv.cfg").is_file():
            shutil.copy(venv / "pyvenv.cfg", prefix / "pyvenv.cfg")
            for lib in ("lib", "lib64"):
                if (venv / lib).is_dir():
                    (prefix / lib).symlink_to(venv / lib)
        script = link.parent / "lmpm"
        script.write_text(f'#!/bin/sh\nexec "{here}" -m lmpm "$@"\n')
        script.chmod(0o755)
        probe = [str(link), "-c", "import sys, torch, pytest, lmpm; print(sys.executable)"]
        r = subprocess.run(probe, env=env, capture_output=True, text=True, timeout=120, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return sys.executable, f"{sys.executable} (no lmpm script beside it: {e})"
    if r.returncode != 0 or r.stdout.strip() != str(link):
        why = _first_line(r.stderr.splitlines()[-1] if r.stderr.strip() else r.stdout)
        return (
            sys.executable,
            f"{sys.executable} (no lmpm script beside it; the link failed: {why})",
        )
    env["PATH"] = os.pathsep.join([str(link.parent), env.get("PATH", "")])
    return str(link), f"{link} -> {here}, with an lmpm script beside it"


def download_wheels(folder: Path) -> int:
    folder.mkdir(parents=True, exist_ok=True)
    rc = 0
    for version in WHEEL_PYTHONS:
        argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
        argv += ["--python-version", version, "--implementation", "cp"]
        for p in WHEEL_PLATFORMS:
            argv += ["--platform", p]
        argv += ["-d", str(folder), *WHEELS]
        print("gpu_check: " + " ".join(argv), flush=True)
        rc = rc or subprocess.run(argv, check=False).returncode
    if rc == 0:
        print(
            f"gpu_check: wheels in {folder}; carry it to the GPU machine and run\n"
            f"  scripts/gpu_check.sh --wheels {folder} --out gpu-check",
            flush=True,
        )
    return rc


def install_wheels(folder: Path) -> Path | None:
    """Install every wheel of ``folder`` into a fresh folder for PYTHONPATH (offline, no
    dependencies resolved): with pip where there is one, else by unpacking (a wheel is a zip)."""
    found = sorted(folder.glob("*.whl"))
    wheels = [w for w in found if wheel_fits(w.name)]
    if not wheels:
        why = f"none of the {len(found)} for this Python" if found else "none"
        print(
            f"gpu_check: no wheels in {folder} ({why}; make them with --download-wheels)",
            flush=True,
        )
        return None
    site = Path(tempfile.mkdtemp(prefix="lmpm-gpu-check-site-"))
    argv = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--quiet"]
    argv += ["--disable-pip-version-check", "--target", str(site), *map(str, wheels)]
    if _has("pip") and subprocess.run(argv, check=False).returncode == 0:
        how = "pip"
    else:
        shutil.rmtree(site)
        site.mkdir()
        unpack_wheels(wheels, site)
        how = "unpacked"
    print(f"gpu_check: {len(wheels)} wheels from {folder} {how} into {site}", flush=True)
    return site


def wheel_fits(name: str, version: tuple[int, int] | None = None) -> bool:
    """Whether the wheel file ``name`` installs on CPython ``version`` (this one by default):
    pure Python (``py3``), built for that version (``cp312``), or the stable ABI from an
    earlier one (``cp38-abi3``). Platforms are not checked: the downloads are Linux x86_64."""
    major, minor = version or sys.version_info[:2]
    parts = name.removesuffix(".whl").split("-")
    if len(parts) < 5:
        return False
    tags, abi = parts[-3].split("."), parts[-2]
    for tag in tags:
        if tag in ("py3", f"py{major}{minor}", f"cp{major}{minor}"):
            return True
        if abi == "abi3" and tag.startswith(f"cp{major}") and tag[2:].isdigit():
            if int(tag[3:] or 0) <= minor:
                return True
    return False


def unpack_wheels(wheels: Iterable[Path], site: Path) -> None:
    for w in wheels:
        with zipfile.ZipFile(w) as z:
            z.extractall(site)


# ---------------------------------------------------------------- the steps' own processes


def child_main(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(prog="gpu_check.py --child")
    ap.add_argument("--child", choices=("env", "examples", "check"), required=True)
    ap.add_argument(
        "--device", default="cuda", help="cuda, or auto: cuda, else simulated, else cpu"
    )
    a = ap.parse_args(list(argv))
    return {"env": child_env_step, "examples": child_examples, "check": child_check}[a.child](
        a.device
    )


_EMIT = threading.Lock()


def emit(**record: Any) -> None:
    with _EMIT:  # one whole line per record, whichever thread prints it
        print(json.dumps(record), flush=True)


def child_env_step(device: str) -> int:
    import platform

    import torch

    cuda = torch.cuda.is_available()
    ok = cuda or device != "cuda"  # a GPU run without a GPU fails here first
    emit(
        step="env",
        ok=ok,
        python=platform.python_version(),
        torch=torch.__version__,
        cuda_available=cuda,
        cuda_version=torch.version.cuda,
        device_name=torch.cuda.get_device_name(0) if cuda else None,
        device_count=torch.cuda.device_count() if cuda else 0,
        git_commit=git_commit(),
        cpus=os.cpu_count(),
        modules={
            m: _has(m)
            for m in ("lark", "jsonschema", "xdist", "hypothesis", "pytest_timeout", "ray")
        },
    )
    return 0 if ok else 1


def git_commit() -> str | None:
    """The checked-out commit (with ``+dirty`` if the tree differs); None where the tree came
    without its history or git is missing."""
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        return None

    def git(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)

    head = git("rev-parse", "--short=12", "HEAD")
    if head.returncode != 0:
        return None
    dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
    return head.stdout.strip() + ("+dirty" if dirty else "")


def child_examples(device: str) -> int:
    """Every engine example of the tests (tests/runtime/test_runtime_dataplane.py), run on the CPU
    and on the device, compared as tests/runtime/test_runtime_cuda.py compares them."""
    import torch

    sys.path.insert(0, str(ROOT / "tests" / "runtime"))
    from test_runtime_dataplane import ENGINE_EXAMPLES, _examples

    from lmpm.runtime.session import Run

    backend, label, block = _device_block(device)
    emit(step="examples", device=label, backend=backend)
    bad = 0
    with tempfile.TemporaryDirectory() as tmp:
        cases = _examples(Path(tmp))
        for name in ENGINE_EXAMPLES:
            prog, params, inputs, epochs = cases[name]
            rec: dict[str, Any] = {"step": "examples", "example": name, "ok": False}
            try:
                t0 = time.perf_counter()
                cpu = Run.from_file(prog, params=params, inputs=inputs, seed=3, backend="cpu")
                cpu.run(epochs)
                rec["cpu_s"] = round(time.perf_counter() - t0, 3)
                with block() if block else contextlib.nullcontext():
                    t0 = time.perf_counter()
                    dev = Run.from_file(prog, params=params, inputs=inputs, seed=3, backend=backend)
                    dev.run(epochs)
                    if backend == "cuda":
                        torch.cuda.synchronize()
                    rec["device_s"] = round(time.perf_counter() - t0, 3)
                    rec.update(
                        compare_runs(cpu, dev, device_type="cpu" if backend == "cpu" else "cuda")
                    )
            except Exception as e:  # one example's failure is recorded; the others still run
                rec["error"] = f"{type(e).__name__}: {_first_line(str(e))}"
            bad += not rec["ok"]
            emit(**rec)
    return 1 if bad else 0


def _device_block(device: str) -> tuple[str, str, Callable[[], Any] | None]:
    """(backend, label, context factory) of the device: ``cuda`` on a GPU; with ``auto`` and no
    GPU, lmpm's simulated CUDA device where there is one, else the CPU against itself."""
    import torch

    if device == "cuda" or torch.cuda.is_available():
        name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
        return "cuda", f"cuda ({name})", None
    if device == "auto" and _has("lmpm.workers.simcuda"):
        from lmpm.workers.simcuda import simulated_cuda

        return "simcuda", "cuda (simulated, lmpm.workers.simcuda)", simulated_cuda
    return "cpu", "cpu (no CUDA, no simulated device)", None


def compare_runs(cpu: Any, dev: Any, *, device_type: str) -> dict[str, Any]:
    """Committed masks equal; token values bit-identical, clock/rule/epoch included; float
    values within 1e-4; the device's payload resident on it."""
    import torch

    wrong: list[str] = []
    diff = 0.0
    for value, vp in cpu.plan.values.items():
        a, b = cpu.engine.state[value], dev.engine.state[value]
        if not torch.equal(a.committed, host(b.committed)):
            wrong.append(f"{value}.committed")
        pa, pb = cpu.payload(value), host(dev.payload(value))
        if vp.vocab is not None:
            fields = ("clock", "rule", "epoch")
            wrong += [
                f"{value}.{f}"
                for f in fields
                if not torch.equal(getattr(a, f), host(getattr(b, f)))
            ]
            if not torch.equal(pa, pb):
                wrong.append(f"{value}.payload")
        else:
            d = float((pa.double() - pb.double()).abs().max()) if pa.numel() else 0.0
            diff = max(diff, d)
            if not d <= 1e-4:
                wrong.append(f"{value}.payload (max abs diff {d:.3g})")
        if dev.dataplane.payload[value].device.type != device_type:
            wrong.append(f"{value} not resident on {device_type}")
    return {"ok": not wrong, "max_abs_diff": diff, **({"mismatch": wrong} if wrong else {})}


def host(t: Any) -> Any:
    """``t`` as a plain CPU tensor. The simulated device's ``.cpu()`` keeps a tensor on the
    simulated ``cuda:0`` today; its values, read out, make the CPU copy there."""
    import torch

    c = t.cpu()
    if c.device.type == "cpu":
        return c
    return torch.tensor(c.tolist(), dtype=c.dtype).reshape(c.shape)


def child_check(device: str) -> int:
    """``lmpm check PROGRAM --device cuda`` for every bundled example as
    tests/commands/test_check_device.py runs it (its inputs, parameters, --bind), a few at once:
    each is a process that mostly starts torch."""
    sys.path.insert(0, str(ROOT / "tests" / "commands"))
    from test_check_device import EX, EXAMPLES

    jobs = min(4, os.cpu_count() or 1)
    limit = float(os.environ.get("LMPM_GPU_CHECK_LIMIT", "120"))
    per = max(15.0, limit * jobs / max(len(EXAMPLES), 1) * 1.5)
    commands = [check_argv(EX / args[0], args[1:]) for args in EXAMPLES]
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        results = list(pool.map(lambda argv: check_program(argv, per), commands))
    return 1 if any(r != OK for r in results) else 0


def check_argv(prog: Path, args: Sequence[str]) -> list[str]:
    rel = prog.relative_to(ROOT) if prog.is_relative_to(ROOT) else prog
    return [sys.executable, "-m", "lmpm", "check", str(rel), *args, "--device", "cuda"]


def check_program(argv: Sequence[str], timeout: float) -> str:
    """Run one ``lmpm check``, print its JSON line, return its result. It stays in this step's
    process group, so the driver's kill of the step reaches it."""
    t0 = time.monotonic()
    try:
        r = subprocess.run(
            argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False
        )
        fin = Finished(
            r.returncode, False, time.monotonic() - t0, (r.stdout + r.stderr).splitlines()
        )
    except subprocess.TimeoutExpired as e:
        out = e.stdout if isinstance(e.stdout, str) else ""
        fin = Finished(None, True, time.monotonic() - t0, out.splitlines())
    result = classify(fin, [])
    lines = [s for s in fin.lines if s.strip()]
    emit(
        step="check",
        program=argv[4],
        argv=[_short_path(a) for a in argv[2:]],
        rc=fin.rc,
        result=result,
        seconds=round(fin.seconds, 2),
        last=" / ".join(lines[-3:])[:400],
    )
    return result


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
