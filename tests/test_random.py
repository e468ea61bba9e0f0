"""Tests of the counter-based Gaussian generator (condinit.ops.random.op): Philox4x32-10 known answers,
the element -> (seed, stream, block, index) contract, block / chunk independence, bitwise agreement of
the backends (and of the C++ kernel's AVX-512 / AVX2 / baseline variants), accuracy against a float64
Box-Muller, statistics, seeds and stream ids, and input validation."""
from __future__ import annotations

import math
import os

import pytest
import torch

from condinit import _backends
from condinit.ops.random import op as R

SEED = 0x0123456789ABCDEF
CPU_NATIVE = _backends.available("cpp-cpu", "cpu", "philox_randn")
needs_cpp = pytest.mark.skipif(not CPU_NATIVE[0], reason=f"cpp-cpu backend unavailable: {CPU_NATIVE[1]}")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


def assert_bitwise(a: torch.Tensor, b: torch.Tensor):
    assert a.shape == b.shape
    diff = bits(a.cpu()) != bits(b.cpu())
    assert not bool(diff.any()), f"{int(diff.sum())} of {a.numel()} elements differ; max |a - b| = " \
                                 f"{(a.cpu() - b.cpu()).abs().max().item()}"


@pytest.fixture(autouse=True)
def one_thread():
    """Run on one thread: the reference's many small elementwise ops crawl when the test machine's
    2 cores are shared and OpenMP threads wait on each other. Tests of the C++ kernel's thread split
    ask for threads themselves (with_threads)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield n
    torch.set_num_threads(n)


def with_threads(k, fn, *args, **kwargs):
    n = torch.get_num_threads()
    torch.set_num_threads(k)
    try:
        return fn(*args, **kwargs)
    finally:
        torch.set_num_threads(n)


def torch_ref(*args, **kwargs):
    return R.block_randn(*args, backend="torch", **kwargs)


def nan_out(k, m, n, device="cpu"):
    return torch.full((k, m, n), float("nan"), dtype=torch.float32, device=device)


# --------------------------------------------------------------------------------------------------
# Philox4x32-10 known answers (Random123 kat_vectors: counter, key -> output)

KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter,key,expected", KAT)
def test_philox_known_answers(counter, key, expected):
    out = R.philox4x32_10([torch.tensor([c], dtype=torch.int64) for c in counter], key)
    assert tuple(int(w) for w in out) == expected


def test_element_contract():
    """Element e of block g is lane e % 4 of Philox((e // 4, stream, lo32 g, hi32 g), (lo32 s, hi32 s))."""
    g, stream, (m, n) = 2**40 + 7, 12345, (3, 7)
    z = R.block_randn(SEED, stream, [g], (m, n), backend="torch")[0].reshape(-1)
    e = torch.arange(m * n)
    q = e // 4
    words = R.philox4x32_10((q, torch.full_like(q, stream), torch.full_like(q, g & 0xFFFFFFFF),
                             torch.full_like(q, g >> 32)), (SEED & 0xFFFFFFFF, SEED >> 32))
    normals = R.philox_normals(words)                 # [elements, 4]: the quad of each element
    expected = normals[e, e % 4]
    assert_bitwise(z, expected)


def test_box_muller_accuracy_vs_float64():
    """The float32 log / sin / cos polynomials: within 2 ulp of the radius of a float64 Box-Muller."""
    g = torch.Generator().manual_seed(7)
    x = torch.randint(0, 2**32, (4, 50_000), dtype=torch.int64, generator=g)
    x[0, :500] = torch.arange(500)                      # u at its smallest (the tail)
    x[0, 500:1000] = 2**32 - 1 - torch.arange(500)      # u -> 1, r -> 0
    x[1, :1024] = torch.arange(1024) * 2**22 + 2**21 - 256 * (torch.arange(1024) % 3)  # octant edges
    z = R.philox_normals(list(x)).double()
    u = (x[0].double() + 0.5).float().double() * 2.0**-32   # RN(x + 1/2) in float32, exactly scaled
    r = torch.sqrt(-2 * torch.log(u))
    t = 2 * math.pi * torch.div(x[1], 256, rounding_mode="floor").double() / 2**24
    ulp_r = torch.clamp(r, min=2.0**-20) * 2.0**-23
    for got, ref in ((z[:, 0], r * torch.cos(t)), (z[:, 1], r * torch.sin(t))):
        assert float(((got - ref).abs() / ulp_r).max()) <= 2.0
    assert float(r.max()) < 6.77 and float(z.abs().max()) <= float(r.max())


# --------------------------------------------------------------------------------------------------
# independence of the blocks drawn together, of chunking and of backends

BACKENDS = ["torch", pytest.param("cpp-cpu", marks=needs_cpp)]
SHAPES = [(1, 1), (5, 3), (17, 33), (64, 32), (123, 7)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", SHAPES)
def test_block_independence(backend, shape):
    allb = R.block_randn(SEED, 3, range(10), shape, backend=backend)
    assert_bitwise(R.block_randn(SEED, 3, [3, 7], shape, backend=backend), allb[[3, 7]])
    assert_bitwise(R.block_randn(SEED, 3, torch.tensor([7, 3]), shape, backend=backend), allb[[7, 3]])
    chunks = [R.block_randn(SEED, 3, range(a, b), shape, backend=backend) for a, b in ((0, 4), (4, 5), (5, 10))]
    assert_bitwise(torch.cat(chunks), allb)
    one = nan_out(1, *shape)
    assert R.block_randn(SEED, 3, [9], shape, out=one, backend=backend) is one
    assert_bitwise(one, allb[9:])
    # a repeated id gives the same block twice
    twice = R.block_randn(SEED, 3, [4, 4], shape, backend=backend)
    assert_bitwise(twice[0], twice[1])
    assert not torch.equal(allb[0], allb[1])


def test_torch_backend_chunking(monkeypatch):
    """The reference's internal chunk size (several blocks per chunk, blocks across chunks) changes nothing."""
    ref = R.block_randn(SEED, 11, range(4), (7, 9), backend="torch")
    ref4 = R.block_randn(SEED, 11, range(4), (8, 10), backend="torch")
    for chunk in (5, 64):
        monkeypatch.setattr(R, "_TORCH_CHUNK_QUADS", chunk)
        assert_bitwise(R.block_randn(SEED, 11, range(4), (7, 9), backend="torch"), ref)
        assert_bitwise(R.block_randn(SEED, 11, range(4), (8, 10), backend="torch"), ref4)


@needs_cpp
@pytest.mark.parametrize("seed,stream,ids,shape", [
    (SEED, 99, [0, 1, 2**40 + 5, 2**63 - 1], (17, 33)),
    (0, 0, range(3), (1, 1)),
    (2**64 - 1, 2**32 - 1, [5, 2**32, 2**32 - 1], (5, 3)),
    (1234, 7, range(2), (100, 701)),   # 17,525 quads per block: split over threads inside a block
    (98765, 2, range(17), (64, 129)),  # several blocks per thread, partial tiles at each block's end
])
def test_cpp_matches_torch_bitwise(seed, stream, ids, shape):
    ref = torch_ref(seed, stream, ids, shape)
    out = nan_out(len(ids), *shape)
    got = with_threads(2, R.block_randn, seed, stream, ids, shape, out=out, backend="cpp-cpu")
    assert got is out
    assert_bitwise(got, ref)


def _isa_available(isa):
    os.environ["CONDINIT_RANDN_ISA"] = isa
    try:
        R.block_randn(1, 1, [0], (1, 1), backend="cpp-cpu")
        return True
    except RuntimeError:
        return False
    finally:
        del os.environ["CONDINIT_RANDN_ISA"]


@needs_cpp
@pytest.mark.parametrize("isa", ["default", "avx2", "avx512"])
def test_cpp_isa_variants_bitwise(isa, monkeypatch):
    """The baseline, AVX2+FMA and AVX-512 builds of the hot loop agree bit for bit (no FMA contraction)."""
    if not _isa_available(isa):
        pytest.skip(f"CPU lacks {isa}")
    ref = torch_ref(SEED, 5, range(7), (33, 65))
    monkeypatch.setenv("CONDINIT_RANDN_ISA", isa)
    assert_bitwise(R.block_randn(SEED, 5, range(7), (33, 65), backend="cpp-cpu"), ref)


@needs_cpp
def test_cpp_bad_isa_env(monkeypatch):
    monkeypatch.setenv("CONDINIT_RANDN_ISA", "sse9")
    with pytest.raises(RuntimeError, match="CONDINIT_RANDN_ISA"):
        R.block_randn(SEED, 5, [0], (3, 3), backend="cpp-cpu")


@needs_cuda
@pytest.mark.parametrize("shape", [(1, 1), (17, 33), (64, 2048)])
def test_cuda_matches_cpu_bitwise(shape):
    ids = [0, 3, 2**40 + 1]
    cpu = R.block_randn(SEED, 8, ids, shape, backend="torch")
    gpu_torch = R.block_randn(SEED, 8, ids, shape, device="cuda", backend="torch")
    assert_bitwise(gpu_torch, cpu)
    if _backends.available("cuda", "cuda", "philox_randn")[0]:
        out = nan_out(len(ids), *shape, device="cuda")
        assert_bitwise(R.block_randn(SEED, 8, torch.tensor(ids, device="cuda"), shape, out=out, backend="cuda"), cpu)


def test_default_backend_and_devices():
    a = R.block_randn(SEED, 1, range(2), (4, 6))
    assert a.dtype == torch.float32 and a.shape == (2, 4, 6) and a.device.type == "cpu"
    assert_bitwise(a, R.block_randn(SEED, 1, range(2), (4, 6), backend="torch"))
    empty = R.block_randn(SEED, 1, [], (4, 6))
    assert empty.shape == (0, 4, 6)


def test_forced_unavailable_backend():
    with pytest.raises(_backends.BackendUnavailableError):
        R.block_randn(SEED, 1, [0], (2, 2), backend="cuda")      # CPU tensors
    with pytest.raises(_backends.BackendUnavailableError):
        R.block_randn(SEED, 1, [0], (2, 2), backend="triton")    # not implemented for randn
    if not CPU_NATIVE[0]:
        with pytest.raises(_backends.BackendUnavailableError):
            R.block_randn(SEED, 1, [0], (2, 2), backend="cpp-cpu")


# --------------------------------------------------------------------------------------------------
# statistics

def _sample(backend, n_blocks=16, shape=(125, 500), seed=SEED, stream=0):
    return R.block_randn(seed, stream, range(n_blocks), shape, backend=backend)


def test_moments_and_ks():
    # the automatic backend (the backends agree bit for bit, tested above)
    scipy_stats = pytest.importorskip("scipy.stats")
    z = _sample(None).double().reshape(-1)             # 10^6 samples
    N = z.numel()
    mean, var = z.mean().item(), z.var().item()
    c = z - mean
    skew = (c**3).mean().item() / var**1.5
    kurt = (c**4).mean().item() / var**2
    assert abs(mean) < 5 / math.sqrt(N)
    assert abs(var - 1) < 5 * math.sqrt(2 / N)
    assert abs(skew) < 5 * math.sqrt(6 / N)
    assert abs(kurt - 3) < 5 * math.sqrt(24 / N)
    assert scipy_stats.kstest(z.numpy(), "norm").pvalue > 1e-3
    # the tails: P(|z| > 3) = 0.0026998, P(|z| > 4) = 6.33e-5
    for k, p in ((3, 2.6998e-3), (4, 6.334e-5)):
        frac = (z.abs() > k).double().mean().item()
        assert abs(frac - p) < 5 * math.sqrt(p / N)
    # each lane of a quad (cos / sin of two Box-Muller pairs) is standard normal on its own
    lanes = z.reshape(-1, 4)
    assert (lanes.mean(0).abs() < 5 / math.sqrt(N / 4)).all()
    assert ((lanes.var(0) - 1).abs() < 5 * math.sqrt(2 / (N / 4))).all()


def _corr(a, b):
    a, b = a.double().reshape(-1), b.double().reshape(-1)
    a, b = a - a.mean(), b - b.mean()
    return (a @ b / (a.norm() * b.norm())).item()


def test_no_correlation_between_blocks_streams_seeds_lanes():
    shape = (250, 400)   # 10^5 per block
    N = shape[0] * shape[1]
    lim = 5 / math.sqrt(N)
    blocks = R.block_randn(SEED, 0, range(3), shape, backend=None)
    assert abs(_corr(blocks[0], blocks[1])) < lim and abs(_corr(blocks[1], blocks[2])) < lim
    s1 = R.block_randn(SEED, 1, [0], shape, backend=None)
    assert abs(_corr(blocks[0], s1)) < lim
    seed1 = R.block_randn(SEED + 1, 0, [0], shape, backend=None)
    assert abs(_corr(blocks[0], seed1)) < lim
    seed_hi = R.block_randn(SEED + 2**32, 0, [0], shape, backend=None)
    assert abs(_corr(blocks[0], seed_hi)) < lim
    q = blocks[0].reshape(-1, 4)
    lim4 = 5 / math.sqrt(N / 4)
    for i, j in ((0, 1), (0, 2), (1, 3), (2, 3)):
        assert abs(_corr(q[:, i], q[:, j])) < lim4
    assert abs(_corr(q[:-1, 3], q[1:, 0])) < lim4     # adjacent quads
    # squares: the two normals of a Box-Muller pair share a radius, yet are independent
    assert abs(_corr(q[:, 0] ** 2, q[:, 1] ** 2)) < lim4


# --------------------------------------------------------------------------------------------------
# seeds and stream ids

def test_seed_from_manual_seed():
    torch.manual_seed(123)
    a = R.seed_from()
    torch.manual_seed(123)
    assert R.seed_from() == a
    assert R.seed_from() != a                          # the default generator advanced
    assert 0 <= a < 2**64


def test_seed_from_generator():
    g = torch.Generator().manual_seed(5)
    state = g.get_state().clone()
    a = R.seed_from(g)
    assert not torch.equal(g.get_state(), state)       # advanced like after any draw
    g.set_state(state)
    assert R.seed_from(g) == a
    expected = torch.randint(0, 2**32, (2,), generator=torch.Generator().manual_seed(5), dtype=torch.int64)
    assert a == int(expected[0]) | (int(expected[1]) << 32)
    assert R.seed_from(seed=2**64 - 1) == 2**64 - 1
    assert R.seed_from(seed=0) == 0


@pytest.mark.parametrize("bad,exc", [(-1, ValueError), (2**64, ValueError), (1.0, TypeError), (True, TypeError),
                                     ("7", TypeError)])
def test_seed_from_validation(bad, exc):
    with pytest.raises(exc, match="seed"):
        R.seed_from(seed=bad)


def test_seed_from_both_or_bad_generator():
    with pytest.raises(ValueError):
        R.seed_from(torch.Generator(), seed=1)
    with pytest.raises(TypeError):
        R.seed_from(generator=3)


def test_stream_id():
    # pinned: the ids must never change between versions, machines or Python runs
    assert R.stream_id("layer3.q") == 0x2FBB3665
    assert R.stream_id("") == 0x25CF7112
    ids = {R.stream_id(f"layers.{i}.self_attn.q_proj.weight") for i in range(200)}
    assert len(ids) == 200 and all(0 <= s < 2**32 for s in ids)
    with pytest.raises(TypeError):
        R.stream_id(3)


# --------------------------------------------------------------------------------------------------
# validation: errors before anything is written

@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(seed=-1), ValueError, "seed"),
    (dict(seed=2**64), ValueError, "seed"),
    (dict(seed=1.5), TypeError, "seed"),
    (dict(stream=2**32), ValueError, "stream"),
    (dict(stream=-3), ValueError, "stream"),
    (dict(block_ids=torch.tensor([0, 1], dtype=torch.int32)), TypeError, "block_ids"),
    (dict(block_ids=torch.tensor([0.0, 1.0])), TypeError, "block_ids"),
    (dict(block_ids=torch.tensor([[0, 1]])), ValueError, "block_ids"),
    (dict(block_ids=torch.tensor([0, -1])), ValueError, "block_ids"),
    (dict(block_ids=[0, -1]), ValueError, "block_ids"),
    (dict(block_ids=[0, 2**63]), ValueError, "block_ids"),
    (dict(block_ids=range(-1, 1)), ValueError, "block_ids"),
    (dict(block_ids=[0, 1.0]), TypeError, "block_ids"),
    (dict(block_ids="01"), TypeError, "block_ids"),
    (dict(block_shape=(0, 3)), ValueError, "block_shape"),
    (dict(block_shape=(3,)), ValueError, "block_shape"),
    (dict(block_shape=(3, 2.0)), TypeError, "block_shape"),
    (dict(block_shape=(2**20, 2**20)), ValueError, "block_shape"),
    (dict(stream=True), TypeError, "stream"),
    (dict(seed=torch.tensor(3)), TypeError, "seed"),
    (dict(block_ids=[0, True]), TypeError, "block_ids"),
    (dict(block_shape=(True, 4)), TypeError, "block_shape"),
    (dict(backend="cuda-graph"), ValueError, "backend"),
])
def test_validation_errors_before_writing(kwargs, exc, match):
    args = dict(seed=SEED, stream=1, block_ids=[0, 1], block_shape=(3, 4), backend=None)
    args.update(kwargs)
    out = nan_out(2, 3, 4)
    with pytest.raises(exc, match=match):
        R.block_randn(args["seed"], args["stream"], args["block_ids"], args["block_shape"], out=out,
                      backend=args["backend"])
    assert bool(out.isnan().all())


@pytest.mark.parametrize("out,exc", [
    (torch.full((2, 3, 4), float("nan"), dtype=torch.float64), TypeError),
    (torch.full((2, 4, 3), float("nan")), ValueError),
    (torch.full((3, 3, 4), float("nan")), ValueError),
    (torch.full((2, 4, 3), float("nan")).transpose(1, 2), ValueError),
])
def test_bad_out(out, exc):
    with pytest.raises(exc, match="out"):
        R.block_randn(SEED, 1, [0, 1], (3, 4), out=out)
    assert bool(out.isnan().all())


def test_out_on_other_device_than_requested():
    with pytest.raises(ValueError, match="device"):
        R.block_randn(SEED, 1, [0], (3, 4), out=nan_out(1, 3, 4), device="meta")
