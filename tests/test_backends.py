"""The backend registry: automatic fallback, forcing by argument and environment, and `info`."""
import json
import subprocess
import sys
import warnings

import pytest
import torch

from condinit import _backends
from condinit._backends import BackendUnavailableError


@pytest.fixture
def toy_op():
    """A throwaway op with a torch and a failing cpp-cpu implementation."""
    name = "_toy_op_for_tests"
    calls = []

    @_backends.register(name, "torch")
    def _torch(x):
        calls.append("torch")
        return x + 1

    @_backends.register(name, "triton", supports=lambda n: None if n < 10 else f"n={n} too large")
    def _triton(x):
        calls.append("triton")
        return x + 1

    yield name, calls
    _backends._REGISTRY.pop(name, None)
    for key in [k for k in _backends._FALLBACKS if k[0] == name]:
        _backends._FALLBACKS.pop(key)


def test_auto_picks_torch_on_cpu(toy_op):
    name, calls = toy_op
    out = _backends.dispatch(name, "cpu", (torch.ones(2),), call_info={"n": 1})
    assert torch.equal(out, torch.full((2,), 2.0)) and calls == ["torch"]


def test_forced_backend_by_argument_and_env(toy_op, monkeypatch):
    name, calls = toy_op
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _backends.dispatch(name, "cpu", (torch.ones(1),), backend="triton", call_info={"n": 1})
    assert calls == ["triton"]
    monkeypatch.setenv(_backends.ENV_VAR, f"{name}=triton")
    _backends.dispatch(name, "cpu", (torch.ones(1),), call_info={"n": 1})
    assert calls == ["triton", "triton"]
    # a forced backend that does not support the call raises, naming why
    with pytest.raises(BackendUnavailableError, match="too large"):
        _backends.dispatch(name, "cpu", (torch.ones(1),), call_info={"n": 50})


def test_forced_unavailable_backend_raises(toy_op, monkeypatch):
    name, _ = toy_op
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(BackendUnavailableError, match="TRITON_INTERPRET"):
        _backends.select(name, "cpu", backend="triton", n=1)
    with pytest.raises(BackendUnavailableError, match="not implemented"):
        _backends.select(name, "cpu", backend="cpp-cpu", n=1)
    with pytest.raises(ValueError, match="backend must be one of"):
        _backends.select(name, "cpu", backend="fastest", n=1)


def test_automatic_failure_falls_back_and_is_reported(toy_op):
    name, calls = toy_op

    @_backends.register(name, "cuda")
    def _broken(x):
        raise RuntimeError("kernel exploded")

    impls = [_backends._REGISTRY[name]["cuda"], _backends._REGISTRY[name]["torch"]]
    # simulate an automatic choice on a device where cuda comes first
    orig = _backends.select
    try:
        _backends.select = lambda *a, **k: impls
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            out = _backends.dispatch(name, "cpu", (torch.zeros(1),))
    finally:
        _backends.select = orig
    assert out.item() == 1.0 and calls == ["torch"]
    assert any("kernel exploded" in str(x.message) for x in w)
    rows = [r for r in _backends.report() if r["op"] == name and r["backend"] == "cuda"]
    assert rows and "kernel exploded" in rows[0]["reason"]


def test_info_command_lists_every_backend():
    out = subprocess.run([sys.executable, "-m", "condinit", "info", "--json"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["import_errors"] == {}
    backends = {r["backend"] for r in data["backends"]}
    assert backends == {"cuda", "triton", "cpp-cpu", "torch"}
    for row in data["backends"]:
        assert row["reason"], row  # every yes/no says why
    assert not data["cuda_available"] or data["gpu"]


def test_gpu_check_script_runs_and_says_when_there_is_no_gpu(tmp_path):
    """benchmarks/gpu_check.py is only useful on a GPU, but it must at least parse, start, and
    exit non-zero with a clear line where no GPU is visible (as here)."""
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: run the script itself")
    log = tmp_path / "gpu_check.log"
    out = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--skip-build", "--log", str(log)],
                         capture_output=True, text=True, timeout=120,
                         cwd=str(__import__("pathlib").Path(__file__).resolve().parents[1]))
    assert out.returncode == 1, out.stderr
    assert "no CUDA GPU visible" in out.stdout and "no CUDA GPU visible" in log.read_text()


def test_gpu_check_script_logic_in_a_cpu_dry_run(tmp_path):
    """The GPU check runs once per GPU session on a small budget: its own logic (references,
    tolerances, timing, the table) is exercised here on the CPU backends at toy sizes."""
    log = tmp_path / "gpu_check.log"
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--cpu-dry-run", "--log", str(log)],
                         capture_output=True, text=True, timeout=300, env=env,
                         cwd=str(__import__("pathlib").Path(__file__).resolve().parents[1]))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = log.read_text()
    assert " 0 failed" in text and "attention_jvp P=8 probes" in text
    assert "[ERROR]" not in text
