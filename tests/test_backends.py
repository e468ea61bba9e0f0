"""condinit._backends: op tables, the automatic choice, forcing by argument and environment, the
determinism flag, availability reasons, the report and ``condinit info``.

The choice logic is tested on a throwaway op (removed from the registry afterwards) with every
backend declared available, so the result does not depend on what this machine has built; the
real availability checks have their own test.
"""
import functools
import json
import subprocess
import sys
import uuid
import warnings

import pytest
import torch

from condinit import _backends
from condinit._backends import ANY_DEVICE, BackendUnavailableError


def _fake_availability(monkeypatch, rule):
    """Replace the availability check (cached like the real one, which reset() clears)."""
    fake = functools.lru_cache(maxsize=None)(lambda backend, device_type, native_op=None, native_fn=None: rule(backend, device_type))
    monkeypatch.setattr(_backends, "available", fake)


@pytest.fixture
def toy(monkeypatch):
    """A throwaway op with a row per backend (each returns its name), all available."""
    op = _backends.Op(f"_toy_{uuid.uuid4().hex[:8]}")
    for backend, devices in (("torch", (ANY_DEVICE,)), ("cpp-cpu", ("cpu",)),
                             ("triton", ("cpu", "cuda")), ("cuda", ("cuda",))):
        op.register(backend, devices=devices, limits={"n": (1, 2, 3)} if backend != "torch" else None)(
            lambda *args, _b=backend: _b)
    _fake_availability(monkeypatch, lambda backend, device_type: (True, "available"))
    yield op
    _backends._OPS.pop(op.name)


def test_register_returns_the_function_and_records_the_row(toy):
    def fn(x):
        return x * 2
    assert toy.register("torch", devices=(ANY_DEVICE,), limits={"dtype": (torch.float32,)},
                        deterministic=False, native_op="some_op")(fn) is fn
    impl = toy.impls["torch"]
    assert (impl.backend, impl.fn, impl.devices, impl.deterministic, impl.native_op) == \
        ("torch", fn, (ANY_DEVICE,), False, "some_op")
    assert impl.limits == (("dtype", (torch.float32,)),)
    assert toy("torch", 21) == 42
    assert toy.name in _backends.ops() and _backends.get(toy.name) is toy


def test_bad_tables_are_refused(toy):
    with pytest.raises(ValueError, match="backend must be one of"):
        toy.register("cudnn", devices=("cuda",))
    with pytest.raises(ValueError, match="already defined"):
        _backends.Op(toy.name)


def test_automatic_choice_follows_the_device_preference(toy):
    assert toy.choose("cpu", None, n=1) == "cpp-cpu"           # Triton on CPU only when forced
    assert toy.choose(torch.device("cuda", 1), None, n=1) == "triton"
    assert toy.choose("meta", None, n=1) == "torch"              # no preference list: torch
    assert toy.choose("cpu", "auto", n=1) == "cpp-cpu"
    # a row whose limits reject the call is passed over; a key the row does not limit is ignored
    assert toy.choose("cpu", None, n=7) == "torch"
    assert toy.choose("cuda", None, n=2, dtype=torch.float64) == "triton"


def test_automatic_choice_skips_unavailable_rows_and_says_why_none_fits(toy, monkeypatch):
    _fake_availability(monkeypatch, lambda b, dt: (b == "torch", "available" if b == "torch" else f"{b} not built"))
    assert toy.choose("cpu", None, n=1) == "torch"
    del toy.impls["torch"]
    with pytest.raises(BackendUnavailableError) as raised:
        toy.choose("cpu", None, n=1)
    message = str(raised.value)
    assert message.startswith(f"{toy.name}: no backend can run this call on cpu")
    assert "cpp-cpu: cpp-cpu not built" in message and "torch: not implemented for this op" in message


def test_forced_backend(toy):
    assert toy.choose("cpu", "triton", n=1) == "triton"
    assert toy.choose("cpu", "torch", n=1) == "torch"
    cannot = f"{toy.name}: backend '(triton|cuda)' cannot run this call on cpu"
    with pytest.raises(BackendUnavailableError, match=cannot + r": n 9 not in \(1, 2, 3\)"):
        toy.choose("cpu", "triton", n=9)
    with pytest.raises(BackendUnavailableError, match=cannot + ": runs on cuda tensors only"):
        toy.choose("cpu", "cuda", n=1)
    with pytest.raises(ValueError, match="backend must be one of .* or 'auto', got 'fastest'"):
        toy.choose("cpu", "fastest", n=1)
    del toy.impls["cpp-cpu"]
    with pytest.raises(BackendUnavailableError, match="not implemented for this op"):
        toy.choose("cpu", "cpp-cpu", n=1)


def test_forced_by_environment(toy, forced_backend):
    forced_backend(f"{toy.name}=triton")
    assert toy.choose("cpu", None, n=1) == "triton"
    assert toy.choose("cpu", "torch", n=1) == "torch"            # the argument wins
    assert toy.choose("cpu", "auto", n=1) == "cpp-cpu"           # and "auto" means automatic
    forced_backend(f"some_other_op=torch, {toy.name} = cuda")
    with pytest.raises(BackendUnavailableError, match="backend 'cuda'"):
        toy.choose("cpu", None, n=1)
    forced_backend("triton")                                     # every op
    assert toy.choose("cpu", None, n=1) == "triton"
    forced_backend("some_other_op=torch")
    assert toy.choose("cpu", None, n=1) == "cpp-cpu"
    forced_backend("auto")
    assert toy.choose("cpu", None, n=1) == "cpp-cpu"
    forced_backend("fastest")
    with pytest.raises(ValueError, match="backend must be one of"):
        toy.choose("cpu", None, n=1)
    for malformed in (f"{toy.name}=", f"{toy.name}=torch,triton", "=torch"):
        forced_backend(malformed)
        with pytest.raises(ValueError, match=f"{_backends.ENV_VAR} must be a backend name or 'op=backend"):
            toy.choose("cpu", None, n=1)


def test_environment_is_read_once_until_reset(toy, monkeypatch):
    monkeypatch.setenv(_backends.ENV_VAR, f"{toy.name}=torch")
    _backends.reset()
    try:
        assert toy.choose("cpu", None, n=1) == "torch"
        monkeypatch.setenv(_backends.ENV_VAR, f"{toy.name}=triton")
        assert toy.choose("cpu", None, n=1) == "torch"
        _backends.reset()
        assert toy.choose("cpu", None, n=1) == "triton"
    finally:
        monkeypatch.delenv(_backends.ENV_VAR)
        _backends.reset()


def test_a_non_deterministic_row_runs_only_when_forced(toy):
    toy.register("cpp-cpu", devices=("cpu",), deterministic=False)(lambda: "cpp-cpu")
    assert toy.choose("cpu", None, n=1) == "torch"
    assert toy.choose("cpu", "cpp-cpu", n=1) == "cpp-cpu"
    del toy.impls["torch"]
    with pytest.raises(BackendUnavailableError, match="cpp-cpu: not deterministic"):
        toy.choose("cpu", None, n=1)
    row = next(r for r in _backends.report() if r["op"] == toy.name and r["backend"] == "cpp-cpu")
    assert row["deterministic"] is False and row["automatic"] is False
    assert "not deterministic" in row["supports"]


def test_a_kernel_error_is_not_caught(toy):
    """Op(name, ...) runs exactly the chosen row: its exception reaches the caller, no warning."""
    error = RuntimeError("kernel exploded")

    def boom(*_):
        raise error
    toy.register("cpp-cpu", devices=("cpu",))(boom)
    with warnings.catch_warnings(), pytest.raises(RuntimeError) as raised:
        warnings.simplefilter("error")
        toy(toy.choose("cpu", None), 1)
    assert raised.value is error


def test_report(toy, monkeypatch):
    """Per device: the automatic order first, then the rows that run only when forced."""
    _fake_availability(monkeypatch, lambda b, dt: (b != "cuda", "not built" if b == "cuda" else "available"))
    rows = [r for r in _backends.report() if r["op"] == toy.name]
    assert [(r["device"], r["backend"]) for r in rows] == [
        ("cpu", "cpp-cpu"), ("cpu", "torch"), ("cpu", "triton"),
        ("cuda", "triton"), ("cuda", "cuda"), ("cuda", "torch")]
    by = {(r["device"], r["backend"]): r for r in rows}
    assert by["cpu", "cpp-cpu"]["available"] and by["cpu", "cpp-cpu"]["reason"] == "available"
    assert by["cpu", "cpp-cpu"]["supports"] == "n: 1, 2, 3" and by["cpu", "torch"]["supports"] == "any"
    assert by["cpu", "cpp-cpu"]["automatic"] and not by["cpu", "triton"]["automatic"]
    assert by["cpu", "triton"]["supports"].endswith("only when forced")
    assert not by["cuda", "cuda"]["available"] and by["cuda", "cuda"]["reason"] == "not built"
    assert all(r["deterministic"] for r in rows)


def test_availability_reasons(monkeypatch):
    """The real checks (cached until reset): each no says why."""
    try:
        assert _backends.available("torch", "meta") == (True, "available")
        assert _backends.available("cuda", "cpu") == (False, "runs on cuda tensors only")
        assert _backends.available("cpp-cpu", "cuda") == (False, "runs on cpu tensors only")
        ok, why = _backends.available("triton", "meta")
        assert not ok and "no Triton support for device type 'meta'" in why
        ok, why = _backends.available("cpp-cpu", "cpu", "no_such_op")
        assert not ok and ("condinit_C::no_such_op has no CPU kernel" in why or "extension" in why)
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        _backends.reset()
        ok, why = _backends.available("triton", "cpu")
        assert not ok and "TRITON_INTERPRET=1" in why
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert _backends.available("triton", "cpu")[0] is False      # cached
        _backends.reset()
        ok, why = _backends.available("triton", "cpu")
        assert ok or "triton is not importable" in why
    finally:
        monkeypatch.undo()
        _backends.reset()


@pytest.mark.slow
def test_info_command_lists_every_backend():
    out = subprocess.run([sys.executable, "-m", "condinit", "info", "--json"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["import_errors"] == {}
    assert {r["backend"] for r in data["backends"]} == set(_backends.BACKENDS)
    assert {"attention_fwd", "attention_bwd", "attention_jvp"} <= {r["op"] for r in data["backends"]}
    for row in data["backends"]:
        assert row["reason"] and row["supports"], row  # every yes/no says why, every row what it takes
    assert not data["cuda_available"] or data["gpu"]
