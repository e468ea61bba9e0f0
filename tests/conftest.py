import os

# Triton kernels run on the CPU through the interpreter; it must be set before triton is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# Per-dtype (atol, rtol) used across the suite.
TOLERANCES = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


@pytest.fixture
def rng():
    """A fresh, seeded generator per test (fresh random inputs, reproducible failures)."""
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little") if os.environ.get("CONDINIT_RANDOM_TESTS") else 1234)
    return g


@pytest.fixture(scope="module")
def one_thread():
    """For modules of many tiny-shape tests (``pytestmark = pytest.mark.usefixtures("one_thread")``):
    one intra-op thread avoids OpenMP spin contention on a busy 2-core machine (tiny ops ran 70x
    slower with 2 threads under load); restored afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
