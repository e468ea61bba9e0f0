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
