"""Shared test fixtures and tolerances: per-dtype tolerances, one relative-error check, NaN-poisoned
allocations, and a fresh random seed per test, printed so that a failure can be reproduced. (Shared
plain helpers: helpers.py; attention references: attention_cases.py; model readings:
coverage_models.py.)

Every test draws its inputs from its own seed (derived from the test id; ``CONDINIT_TEST_SEED=random``
for fresh seeds per run). Reproduce a failure with ``CONDINIT_TEST_SEED=<seed printed in its output>``.
"""
import os

# Triton kernels run on the CPU through the interpreter; it must be set before triton is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

F64 = torch.float64

# Per-dtype (atol, rtol) used across the suite.
TOLERANCES = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


def _fresh_seed(nodeid: str) -> int:
    """Each test gets its own seed, derived from its id (so CI runs are reproducible);
    ``CONDINIT_TEST_SEED=random`` draws a fresh one per run, ``CONDINIT_TEST_SEED=<int>`` pins it."""
    env = os.environ.get("CONDINIT_TEST_SEED")
    if env == "random":
        return int.from_bytes(os.urandom(4), "little")
    if env:
        return int(env)
    import zlib
    return zlib.crc32(nodeid.encode())


@pytest.fixture
def seed(request) -> int:
    """A seed per test (see :func:`_fresh_seed`), printed in the test's output."""
    s = _fresh_seed(request.node.nodeid)
    print(f"\n[{request.node.nodeid}] CONDINIT_TEST_SEED={s}")
    return s


@pytest.fixture
def rng(seed) -> torch.Generator:
    """A fresh CPU generator per test, seeded from :func:`seed` (printed on failure)."""
    return torch.Generator().manual_seed(seed)


def rel_err(actual: torch.Tensor, expected: torch.Tensor, floor: float = 0.0) -> float:
    """max |actual - expected| / max(max |expected|, floor), in float64 (the absolute error when
    both are 0). Shapes must agree; a NaN where ``expected`` has none counts as infinite."""
    assert actual.shape == expected.shape, f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a, e = actual.detach().to(F64), expected.detach().to(F64)
    if (a.isnan() & ~e.isnan()).any():
        return float("inf")
    both_nan = a.isnan() & e.isnan()
    err = torch.where(both_nan, 0.0, (a - e).abs()).max().item() if a.numel() else 0.0
    scale = max(torch.where(e.isnan(), 0.0, e.abs()).max().item() if e.numel() else 0.0, floor)
    return err / scale if scale > 0 else err


def assert_close(actual, expected, dtype, what: str = "", floor: float = 0.0, factor: float = 1.0):
    """``rel_err(actual, expected, floor) <= factor * max(atol, rtol)`` of ``dtype``'s tolerances."""
    atol, rtol = TOLERANCES[dtype]
    tol = factor * max(atol, rtol)
    err = rel_err(actual, expected, floor)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e}"


def peak_extra_bytes(fn) -> int:
    """Peak bytes allocated by ``fn`` beyond what existed before, from the CPU allocator's
    events recorded by torch.profiler (every tensor allocation of the C++ kernels and of torch)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    now = peak = 0
    for _, nbytes in events:
        now += nbytes
        peak = max(peak, now)
    return peak


@pytest.fixture
def nan_poison(monkeypatch):
    """``torch.empty`` / ``empty_like`` / ``new_empty`` return NaN-filled floating tensors, so a
    kernel that forgets to write an element of a Python-side allocation fails loudly."""
    def poison(t):
        if t.is_floating_point() and t.device.type != "meta":
            t.fill_(float("nan"))
        return t
    empty, empty_like, new_empty = torch.empty, torch.empty_like, torch.Tensor.new_empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: poison(empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: poison(empty_like(*a, **kw)))
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda self, *a, **kw: poison(new_empty(self, *a, **kw)))


@pytest.fixture(scope="module")
def one_thread():
    """For modules of many tiny-shape tests (``pytestmark = pytest.mark.usefixtures("one_thread")``):
    one intra-op thread avoids OpenMP spin contention on a busy 2-core machine; restored afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def forced_backend(monkeypatch):
    """``forced_backend("attention_fwd=torch")`` sets CONDINIT_BACKEND for one test (re-read)."""
    from condinit import _backends

    def force(value: str):
        monkeypatch.setenv(_backends.ENV_VAR, value)
        _backends.reset()
    yield force
    monkeypatch.delenv(_backends.ENV_VAR, raising=False)
    _backends.reset()
