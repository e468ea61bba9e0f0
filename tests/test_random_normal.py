"""Tests of the scaled-normal op (condinit.ops.random.op NORMAL, ``mean + std * z`` rounded once to the
destination dtype): the fused C++ CPU kernel equals the torch composite (the definition) bit for
bit for every destination dtype, scale, shift, size, block-id pattern, thread count and ISA variant,
non-finite results included; and condinit.models.stream.own_normal_, which runs it, does not
depend on chunking or layout."""
from __future__ import annotations

import pytest
import torch

from condinit import _backends
from condinit.ops.random import op as R
from condinit.models.stream import OWN_INIT_BLOCK, own_init_stream, own_normal_

SEED = 0x0123456789ABCDEF
STREAM = 0x9E3779B9
CPU_NATIVE = _backends.available("cpp-cpu", "cpu", "philox_normal")
needs_cpp = pytest.mark.skipif(not CPU_NATIVE[0], reason=f"cpp-cpu backend unavailable: {CPU_NATIVE[1]}")
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
STDS = [1.0, 0.02, 1e-30, 3.7]
MEANS = [0.0, 0.5]
# (block shape, number of elements): one element, a partial tile, a block and one more, a few
# blocks whose size is no multiple of 4 (Philox quads straddle nothing) with a cut last block
SIZES = [((1, OWN_INIT_BLOCK), 1), ((1, 3), 3), ((1, OWN_INIT_BLOCK), OWN_INIT_BLOCK + 1), ((33, 65), 4 * 33 * 65 + 517)]
IDS = [0, 2 ** 33 + 7, 5, 2 ** 62 + 3, 4]   # not contiguous, not sorted, both id words used

pytestmark = pytest.mark.usefixtures("one_thread")


def int_bits(x: torch.Tensor) -> torch.Tensor:
    view = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[x.element_size()]
    return x.contiguous().view(view)


def assert_bitwise(got: torch.Tensor, want: torch.Tensor, what: str):
    assert got.shape == want.shape and got.dtype == want.dtype, what
    diff = int_bits(got) != int_bits(want)
    assert not bool(diff.any()), f"{what}: {int(diff.sum())} of {got.numel()} elements differ " \
                                 f"(first at {int(diff.nonzero()[0])})"


def poisoned(numel: int, dtype) -> torch.Tensor:
    return torch.full((numel,), float("nan"), dtype=dtype)


def fill(backend: str, shape, numel, dtype, mean, std, ids=IDS, threads=1):
    m, n = shape
    blocks = ids[:-(-numel // (m * n))]
    out = poisoned(numel, dtype)
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        R.NORMAL(backend, SEED, STREAM, torch.tensor(blocks, dtype=torch.int64), m, n, mean, std, out)
    finally:
        torch.set_num_threads(prev)
    return out


def test_composite_is_the_definition():
    # independent of the op's code: the float32 normals, scaled and shifted by torch, then rounded
    shape, numel = (33, 65), 2 * 33 * 65 + 100
    z = R.block_randn(SEED, STREAM, IDS[:3], shape, backend="torch").reshape(-1)[:numel]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert_bitwise(fill("torch", shape, numel, dtype, 0.5, 0.02), (z * 0.02 + 0.5).to(dtype), str(dtype))
    assert_bitwise(fill("torch", shape, numel, torch.float64, 0.0, 3.7), (z * 3.7).double(), "float64")


@needs_cpp
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0][0]}x{s[0][1]}-{s[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_equals_composite(dtype, size, threads):
    shape, numel = size
    for std in STDS:
        for mean in MEANS:
            want = fill("torch", shape, numel, dtype, mean, std)
            got = fill("cpp-cpu", shape, numel, dtype, mean, std, threads=threads)
            assert_bitwise(got, want, f"std={std} mean={mean}")


@needs_cpp
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_equals_composite_non_finite_and_tiny(dtype):
    """Overflow to inf in float32 or in the destination, NaN from inf * 0 or a NaN mean, float32
    denormal products: the same bits as torch's ops and conversion."""
    shape, numel = (1, 4096), 3 * 4096 + 9
    for mean, std in [(0.0, float("inf")), (float("nan"), 1.0), (float("-inf"), float("inf")), (0.0, 1e39), (1.0, 3e38), (0.0, 1e5),
                      (0.0, 1e-40), (-0.0, 2.0 ** -140), (1e-3, 1e-9)]:
        want = fill("torch", shape, numel, dtype, mean, std)
        got = fill("cpp-cpu", shape, numel, dtype, mean, std, threads=2)
        assert_bitwise(got, want, f"std={std} mean={mean}")


def _isa_available(isa, monkeypatch):
    monkeypatch.setenv("CONDINIT_RANDN_ISA", isa)
    try:
        fill("cpp-cpu", (1, 8), 8, torch.float16, 0.0, 1.0)
        return True
    except RuntimeError:
        return False
    finally:
        monkeypatch.delenv("CONDINIT_RANDN_ISA")


@needs_cpp
@pytest.mark.parametrize("isa", ["default", "avx2", "avx512"])
def test_fused_isa_variants(isa, monkeypatch):
    if not _isa_available(isa, monkeypatch):
        pytest.skip(f"CPU lacks {isa}")
    shape, numel = (33, 65), 3 * 33 * 65 + 11
    wants = {(d, mean): fill("torch", shape, numel, d, mean, 0.02) for d in DTYPES for mean in MEANS}
    monkeypatch.setenv("CONDINIT_RANDN_ISA", isa)
    for (dtype, mean), want in wants.items():
        assert_bitwise(fill("cpp-cpu", shape, numel, dtype, mean, 0.02), want, f"{dtype} mean={mean}")


@needs_cpp
def test_fused_checks_its_output():
    ids = torch.arange(2, dtype=torch.int64)
    for numel in (2 * 12 + 1, 12):   # more than the blocks hold; a whole block unused
        with pytest.raises(RuntimeError, match="elements"):
            R.NORMAL("cpp-cpu", SEED, 1, ids, 3, 4, 0.0, 1.0, torch.empty(numel))
    with pytest.raises(RuntimeError, match="contiguous"):
        R.NORMAL("cpp-cpu", SEED, 1, ids, 3, 4, 0.0, 1.0, torch.empty(6, 4).t())
    with pytest.raises(RuntimeError, match="float32, float64, bfloat16 or float16"):
        R.NORMAL("cpp-cpu", SEED, 1, ids, 3, 4, 0.0, 1.0, torch.empty(24, dtype=torch.float8_e4m3fn))


def test_table_rows():
    assert R.NORMAL.choose("cpu", dtype=torch.float8_e4m3fn) == "torch"     # no fused kernel for it
    if CPU_NATIVE[0]:
        assert R.NORMAL.choose("cpu", dtype=torch.bfloat16) == "cpp-cpu"
    assert R.NORMAL.choose("cuda", dtype=torch.bfloat16) == "torch"


NAME = "model.layers.0.mlp.down_proj.weight"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_own_normal_chunking_and_layout(dtype, monkeypatch, forced_backend):
    rows, cols = 5, 30_000     # 150_000 elements: 3 blocks, the last one cut
    whole = own_normal_(torch.empty(rows, cols, dtype=dtype), 3, NAME, mean=0.5, std=0.02)
    stream, first = own_init_stream(NAME)
    z = R.block_randn(3, stream, range(first, first + 3), (1, OWN_INIT_BLOCK)).reshape(-1)[:rows * cols]
    assert_bitwise(whole.reshape(-1), (z * 0.02 + 0.5).to(dtype), "whole tensor")
    # a tensor of the first rows, under the same name: the first elements
    part = own_normal_(torch.empty(2, cols, dtype=dtype), 3, NAME, mean=0.5, std=0.02)
    assert_bitwise(part, whole[:2], "first rows")
    # a non-contiguous destination: the values in row-major order of its shape
    t = own_normal_(torch.empty(cols, rows, dtype=dtype).t(), 3, NAME, mean=0.5, std=0.02)
    assert not t.is_contiguous()
    assert_bitwise(t.contiguous(), whole, "transposed storage")
    # the composite, one Philox block per draw
    forced_backend("normal=torch")
    monkeypatch.setattr(R, "NORMAL_CHUNK", 1)
    chunked = own_normal_(torch.empty(rows, cols, dtype=dtype), 3, NAME, mean=0.5, std=0.02)
    assert_bitwise(chunked, whole, "composite in one-block draws")


def test_own_normal_other_float_dtypes():
    # dtypes without a fused kernel go through the composite on every device
    n = 70_000
    stream, first = own_init_stream(NAME)
    z = R.block_randn(3, stream, range(first, first + 2), (1, OWN_INIT_BLOCK)).reshape(-1)[:n]
    w = own_normal_(torch.empty(n, dtype=torch.float8_e4m3fn), 3, NAME, std=0.5)
    assert torch.equal(w.view(torch.uint8), (z * 0.5).to(torch.float8_e4m3fn).view(torch.uint8))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_own_normal_cuda_equals_cpu(dtype):
    # the composite on the GPU (its RANDN kernel, torch's ops and conversion) and the CPU kernel
    n = 3 * OWN_INIT_BLOCK + 77
    cpu = own_normal_(torch.empty(n, dtype=dtype), 5, NAME, mean=0.5, std=0.02)
    gpu = own_normal_(torch.empty(n, dtype=dtype, device="cuda"), 5, NAME, mean=0.5, std=0.02)
    assert_bitwise(gpu.cpu(), cpu, str(dtype))
