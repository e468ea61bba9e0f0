"""benchmarks/gpu_check.py, the one-shot check run on a GPU machine: where no GPU is visible it
must still start and say so; its own logic (sections in their own processes with timeouts, every
check recorded as it finishes, a crashed or hung section recorded without losing the others, the
references, tolerances and the timing table of the ``condinit bench`` library) runs in a CPU dry
run on the CPU backends at toy sizes."""
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check  # noqa: E402

pytestmark = pytest.mark.slow  # offline GPU compiles / whole-script runs: CI, not the edit loop


def test_gpu_check_script_runs_and_says_when_there_is_no_gpu(tmp_path):
    """benchmarks/gpu_check.py is only useful on a GPU, but it must at least parse, start, and
    exit non-zero with a clear line where no GPU is visible (as here)."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: run the script itself")
    log = tmp_path / "gpu_check.log"
    out = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--skip-build", "--log", str(log)],
                         capture_output=True, text=True, timeout=120, cwd=str(ROOT))
    assert out.returncode == 1, out.stderr
    assert "no CUDA GPU visible" in out.stdout and "no CUDA GPU visible" in log.read_text()


def test_cpu_dry_run_records_everything_and_survives_a_crash_and_a_hang(tmp_path):
    """One dry run of every section, with one section made to crash (abort) after its checks and
    one to hang after them: both keep the checks they finished and get one ERROR entry each; every
    other check passes; every timing row names its backend."""
    log, records = tmp_path / "gpu_check.log", tmp_path / "gpu_check.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env[gpu_check.FAULT_ENV] = "init:hang,attention-cuda:crash"
    out = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--cpu-dry-run", "--log", str(log),
                          "--json", str(records), "--section-timeout", "init=45"],
                         capture_output=True, text=True, timeout=400, env=env, cwd=str(ROOT))
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    data = json.loads(records.read_text())["records"]
    checks = [r for r in data if r.get("kind") != "row"]
    failed = [r for r in checks if r["status"] not in ("PASS", "SKIP")]
    assert sorted((r["section"], r["name"]) for r in failed) == [("attention-cuda", "section"), ("init", "section")], \
        [(r["section"], r["name"], r["detail"]) for r in failed]
    by_section = {}
    for r in checks:
        by_section.setdefault(r["section"], []).append(r)
    hung = next(r for r in by_section["init"] if r["name"] == "section")
    assert "timed out" in hung["detail"], hung
    crashed = next(r for r in by_section["attention-cuda"] if r["name"] == "section")
    assert "exit status" in crashed["detail"]
    # the checks those two sections finished before failing are kept
    assert sum(r["status"] == "PASS" for r in by_section["init"]) >= 1, by_section["init"]
    assert sum(r["status"] == "PASS" for r in by_section["attention-cuda"]) == 6   # 2 cases x 3 dtypes
    assert any(r["name"].startswith("randn") for r in by_section["tiny"])
    # timing: the bench library's rows, each once, with the backend that ran
    rows = [r for r in data if r.get("kind") == "row"]
    keys = {(r["section"], r["row"]["key"]) for r in rows}
    assert len(keys) == len(rows)
    assert {"init.batched", "init.per_tensor", "init.floor", "ceilings.matmul_fp32"} <= \
        {k for s, k in keys if s == "timing-init"}
    for section, backend in (("timing-attention-triton", "cpp-cpu"), ("timing-attention-cuda", "torch")):
        mine = {r["row"]["key"]: r["row"] for r in rows if r["section"] == section}
        assert mine["attention.jvp"]["backend"] == backend and mine["attention.fwd"]["backend"] == backend
        assert all(r["backend"] not in ("", "?") and r["error"] is None for r in mine.values())
    text = log.read_text()
    assert "=== condinit gpu_check summary" in text and "time / other row's" in text


def test_section_timeouts_fit_the_budget():
    """The caps and reserves fit the 8-minute budget with the build's timeout; the timeout option
    parses both forms."""
    assert sum(cap for _, cap, _ in gpu_check.SECTIONS) + 0 <= 600
    assert sum(res for _, _, res in gpu_check.SECTIONS) + 240 <= 470
    assert gpu_check._section_timeouts("12") == {"*": 12.0}
    assert gpu_check._section_timeouts("init=3,timing-init=4.5") == {"init": 3.0, "timing-init": 4.5}


def test_run_limited_kills_the_whole_process_group():
    rc, out = gpu_check.run_limited([sys.executable, "-c", "import subprocess, sys, time; "
                                     "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
                                     "print('started', flush=True); time.sleep(60)"], timeout=3)
    assert rc is None and "started" in out
