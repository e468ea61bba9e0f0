"""benchmarks/gpu_check.py, the one-shot check run on a GPU machine: where no GPU is visible it
must still start and say so, and its own logic (references, tolerances, timing, the table) runs
in a CPU dry run on the CPU backends at toy sizes."""
import os
import pathlib
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]


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


def test_gpu_check_script_logic_in_a_cpu_dry_run(tmp_path):
    """The GPU check runs once per GPU session on a small budget: its own logic (references,
    tolerances, timing, the table) is exercised here on the CPU backends at toy sizes."""
    log = tmp_path / "gpu_check.log"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--cpu-dry-run", "--log", str(log)],
                         capture_output=True, text=True, timeout=300, env=env, cwd=str(ROOT))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = log.read_text()
    assert " 0 failed" in text and "attention_jvp P=8 probes" in text
    assert "[ERROR]" not in text
