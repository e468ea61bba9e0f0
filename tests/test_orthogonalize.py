"""orthogonalize(): orthogonality of every method, agreement between methods, storage dtypes, the
Triton polar kernels (interpreter), the backend table, the caller's process state (thread count,
matmul precision) left alone, and Haar-distribution tests with a proof of their power (QR without
the sign fix must fail them)."""
import importlib
import math
import threading

import pytest
import torch

from condinit import _backends
from condinit.init import conditioned_blocks, conditioned_init_, orthogonalize
from helpers import assert_refused

scipy_stats = pytest.importorskip("scipy.stats")
scipy_special = pytest.importorskip("scipy.special")

orth_mod = importlib.import_module("condinit.ops.orthogonalize.op")  # the module, not the function

METHODS = ["householder", "cholqr2", "polar", "svd", "auto"]


def orth_error(Q: torch.Tensor) -> float:
    """max |Q Q^T - I| (rows, m <= n) or |Q^T Q - I| (columns), in float64."""
    Q = Q.double()
    m, n = Q.shape[-2:]
    G = Q @ Q.transpose(-1, -2) if m <= n else Q.transpose(-1, -2) @ Q
    return (G - torch.eye(min(m, n), dtype=torch.float64)).abs().max().item()


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("shape", [(1, 1), (1, 5), (5, 1), (3, 1, 7), (17, 123), (123, 17), (2, 33, 33),
                                   (3, 64, 256), (2, 2, 40, 17)])
def test_orthonormal(method, shape, rng):
    W = torch.randn(*shape, generator=rng)
    Q = orthogonalize(W, method)
    assert Q.shape == W.shape and Q.dtype == W.dtype
    assert orth_error(Q) <= 1e-5
    # the factor relating W and Q: lower triangular with diag > 0 (QR, CholeskyQR) or symmetric
    # positive definite (polar, SVD)
    W64, Q64 = W.double().reshape(-1, *shape[-2:]), Q.double().reshape(-1, *shape[-2:])
    if shape[-2] > shape[-1]:
        W64, Q64 = W64.transpose(1, 2), Q64.transpose(1, 2)
    F = W64 @ Q64.transpose(1, 2)          # W = F Q
    concrete = orth_mod.resolve_method(*W64.shape[1:], method)
    scale = F.abs().amax()
    if concrete in ("householder", "cholqr2"):
        assert (F.triu(1).abs().amax() <= 1e-5 * scale)
        assert bool((F.diagonal(dim1=1, dim2=2) > 0).all())
    else:
        assert (F - F.transpose(1, 2)).abs().amax() <= 1e-5 * scale
        assert bool((torch.linalg.eigvalsh((F + F.transpose(1, 2)) / 2) > 0).all())


@pytest.mark.parametrize("method,n", [("cholqr2", 16384), ("householder", 4096), ("polar", 4096)])
def test_big_wide_block(method, n, rng):
    W = torch.randn(2, 256, n, generator=rng)
    assert orth_error(orthogonalize(W, method)) <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("method,n", [("householder", 2048), ("svd", 512), ("polar", 256), ("cholqr2", 256)])
def test_square(method, n, rng):
    W = torch.randn(n, n, generator=rng)
    assert orth_error(orthogonalize(W, method)) <= 1e-5


def test_qr_and_cholqr_give_the_same_q(rng):
    W = torch.randn(6, 16, 300, generator=rng)
    a, b = orthogonalize(W, "householder"), orthogonalize(W, "cholqr2")
    torch.testing.assert_close(a, b, atol=2e-6, rtol=0)
    c, d = orthogonalize(W, "polar"), orthogonalize(W, "svd")
    torch.testing.assert_close(c, d, atol=2e-6, rtol=0)
    assert (a - d).norm() > 0.1 * a.norm()  # Q factor and polar factor are different matrices


def test_cholqr2_falls_back_on_ill_conditioned_blocks(rng):
    W = torch.randn(4, 8, 64, generator=rng, dtype=torch.float64)
    W[1, 3] = W[1, 2] + 1e-7 * W[1, 3]             # kappa ~ 1e8: CholeskyQR cannot
    W[2] = torch.diag(torch.logspace(0, -6, 8, dtype=torch.float64)) @ W[2]
    W = W.float()
    Q = orthogonalize(W, "cholqr2")
    assert orth_error(Q) <= 1e-5
    torch.testing.assert_close(Q[0], orthogonalize(W[0], "householder"), atol=2e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_storage_dtype_rounded_once(dtype, rng):
    W = torch.randn(3, 24, 100, generator=rng)
    Q32 = orthogonalize(W, "cholqr2")
    Q = orthogonalize(W.to(dtype), "cholqr2") if dtype == torch.float64 else orthogonalize(W, "cholqr2", out=torch.empty(W.shape, dtype=dtype))
    assert Q.dtype == dtype
    if dtype != torch.float64:
        assert torch.equal(Q, Q32.to(dtype))      # fp32 compute, one rounding on write
    eps = torch.finfo(dtype).eps if dtype != torch.float64 else 2.0 ** -23
    assert orth_error(Q) <= max(1e-5, 4 * eps)


def test_out_non_contiguous_and_input_untouched(rng):
    W = torch.randn(5, 12, 40, generator=rng)
    W0 = W.clone()
    out = torch.empty(40, 12, 5).permute(2, 1, 0)
    res = orthogonalize(W, "householder", out=out)
    assert res is out and out.stride() == (1, 5, 60)
    assert torch.equal(W, W0)
    assert torch.equal(out, orthogonalize(W, "householder"))


@pytest.mark.parametrize("backend", [None, "torch"])
def test_chunking_does_not_change_bits(backend, rng):
    """Also for the torch backend, whose GEMMs run with the caller's (here 2 or more) threads."""
    W = torch.randn(37, 16, 200, generator=rng)
    for method in ("cholqr2", "polar", "householder"):
        ref = orthogonalize(W, method, backend=backend)
        for budget in (2 * 4 * 16 * 200, 5 * 4 * 16 * 200):
            assert torch.equal(orthogonalize(W, method, memory_budget=budget, backend=backend), ref), method
        assert torch.equal(orthogonalize(W[5:9], method, backend=backend), ref[5:9])
        assert torch.equal(orthogonalize(W[7], method, backend=backend), ref[7])


def test_meta_and_bad_input():
    m = torch.empty(3, 4, 8, device="meta")
    assert orthogonalize(m).device.type == "meta"
    with pytest.raises(TypeError, match="stack"):
        orthogonalize(torch.ones(3, 4, dtype=torch.int64))
    with pytest.raises(TypeError, match="stack"):
        orthogonalize(torch.ones(3, 4, dtype=torch.complex64))
    with pytest.raises(ValueError, match="stack"):
        orthogonalize(torch.ones(4))
    with pytest.raises(ValueError, match="zero-size"):
        orthogonalize(torch.ones(0, 4, 4))
    with pytest.raises(ValueError, match="method"):
        orthogonalize(torch.ones(4, 4), "gram-schmidt")
    bad = torch.randn(4, 4)
    bad[1, 1] = float("nan")
    with pytest.raises(ValueError, match="finite"):
        orthogonalize(bad)
    with pytest.raises(ValueError, match="out"):
        orthogonalize(torch.randn(4, 4), out=torch.empty(4, 5))
    with pytest.raises(TypeError, match="out"):
        orthogonalize(torch.randn(4, 4), out=[[0.0] * 4] * 4)
    with pytest.raises(ValueError, match="backend"):
        orthogonalize(torch.randn(4, 4), backend="lapack")
    for budget, exc in ((0, ValueError), (True, TypeError), (1.5, TypeError)):
        with pytest.raises(exc, match="memory_budget"):
            orthogonalize(torch.randn(4, 4), memory_budget=budget)
    with pytest.raises(_backends.BackendUnavailableError, match="cpp-cpu"):
        orthogonalize(m, backend="cpp-cpu")                       # meta tensors: torch only
    with pytest.raises(_backends.BackendUnavailableError, match="method"):
        orthogonalize(torch.randn(4, 4), "cholqr2", backend="triton")


# --------------------------------------------------------------------------------------------------
# the caller's process state: thread count and matmul precision are read, never changed



@pytest.fixture
def forbid_process_state_changes(monkeypatch):
    """Every setter of torch's thread count or fp32 matmul precision raises for the test's duration."""
    def forbidden(name):
        def setter(*args, **kwargs):
            raise AssertionError(f"{name} called inside a library call")
        return setter
    for owner, name in ((torch, "set_num_threads"), (torch._C, "set_num_threads"),
                        (torch, "set_num_interop_threads"), (torch, "set_float32_matmul_precision"),
                        (torch._C, "_set_float32_matmul_precision"), (torch._C, "_set_cublas_allow_tf32"),
                        (torch._C, "_set_fp32_precision_setter")):
        if hasattr(owner, name):
            monkeypatch.setattr(owner, name, forbidden(f"{owner.__name__}.{name}"))
    yield


@pytest.fixture
def restore_precision():
    """Tests that set the caller's matmul precision get the default back afterwards."""
    yield
    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.allow_tf32 = False


def test_process_state_untouched(forbid_process_state_changes, rng):
    threads, precision = torch.get_num_threads(), torch.get_float32_matmul_precision()
    W = torch.randn(9, 16, 96, generator=rng)
    for method in ("householder", "cholqr2", "polar", "svd"):
        assert orth_error(orthogonalize(W, method, memory_budget=2 * 4 * 16 * 96)) <= 1e-5
    q, k, v = torch.empty(4 * 16, 96), torch.empty(2 * 16, 96), torch.empty(2 * 16, 96)
    conditioned_init_(q, k, v, num_heads=4, num_kv_heads=2, seed=7)
    assert orth_error(q.view(4, 16, 96)) <= 1e-5
    assert torch.get_num_threads() == threads
    assert torch.get_float32_matmul_precision() == precision


@pytest.mark.slow
def test_other_threads_see_no_change(rng):
    """A caller's thread running torch ops meanwhile sees its own settings, start to end."""
    torch.set_float32_matmul_precision("highest")
    W = torch.randn(64, 32, 256, generator=rng)
    seen, stop = set(), threading.Event()

    def observer():
        while not stop.is_set():
            seen.add((torch.get_num_threads(), torch.get_float32_matmul_precision()))

    t = threading.Thread(target=observer)
    t.start()
    try:
        for _ in range(3):
            orthogonalize(W, "cholqr2", memory_budget=4 * 4 * 32 * 256)
    finally:
        stop.set()
        t.join()
    assert seen == {(torch.get_num_threads(), "highest")}


@pytest.mark.parametrize("precision", ["high", "medium"])
def test_reduced_matmul_precision_keeps_fp32_accuracy(precision, restore_precision, rng):
    """With TF32 / bf16 matmuls allowed by the caller, the GEMMs run in float64: still fp32-accurate,
    and the setting is still the caller's afterwards."""
    W = torch.randn(6, 64, 1024, generator=rng)
    ref = {method: orthogonalize(W, method) for method in ("cholqr2", "polar", "svd")}
    torch.set_float32_matmul_precision(precision)
    assert orth_mod.gemm_dtype("cpu") == torch.float64
    for method in ("cholqr2", "polar", "svd"):
        Q = orthogonalize(W, method)
        assert orth_error(Q) <= 1e-5, method
        torch.testing.assert_close(Q, ref[method], atol=2e-6, rtol=0)
        # float64 GEMMs: the blocks still do not depend on the chunking
        assert torch.equal(orthogonalize(W[2:4], method), Q[2:4]), method
    assert torch.get_float32_matmul_precision() == precision


def test_gemm_dtype_follows_the_callers_settings(restore_precision):
    assert orth_mod.gemm_dtype("cpu") == orth_mod.gemm_dtype("cuda") == torch.float32
    torch.backends.cuda.matmul.allow_tf32 = True
    assert orth_mod.gemm_dtype("cuda") == torch.float64
    assert orth_mod.gemm_dtype("cpu") == torch.float32       # TF32 for cuBLAS only
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_float32_matmul_precision("medium")
    assert orth_mod.gemm_dtype("cpu") == orth_mod.gemm_dtype("cuda") == torch.float64


def test_bits_do_not_depend_on_thread_count(rng):
    W = torch.randn(21, 16, 200, generator=rng)
    budget = 3 * 4 * 16 * 200                                 # 7 chunks of 3 blocks
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)                              # the test sets it, not the library
        one = {method: orthogonalize(W, method, memory_budget=budget) for method in ("cholqr2", "polar", "householder")}
        torch.set_num_threads(2)
        for method, ref in one.items():
            assert torch.equal(orthogonalize(W, method, memory_budget=budget), ref), method
    finally:
        torch.set_num_threads(threads)


def test_backend_chosen_once_per_call(monkeypatch, rng):
    calls = []
    choose = orth_mod.ORTHOGONALIZE.choose

    def counting(*args, **kwargs):
        calls.append(kwargs.get("method"))
        return choose(*args, **kwargs)

    monkeypatch.setattr(orth_mod.ORTHOGONALIZE, "choose", counting)
    W = torch.randn(12, 8, 64, generator=rng)
    orthogonalize(W, "cholqr2", memory_budget=2 * 4 * 8 * 64)   # 6 chunks
    assert calls == ["cholqr2"]


@pytest.mark.parametrize("backend", ["torch"])
def test_chunk_errors_and_grad_mode_reach_the_caller(backend):
    """A callback's exception surfaces unchanged; the callbacks run under the caller's grad mode."""
    grad_modes = []

    def fill(start, stop, A):
        grad_modes.append(torch.is_grad_enabled())
        if start >= 6:
            raise KeyError(f"chunk at {start}")
        A.copy_(torch.randn(A.shape))

    with pytest.raises(KeyError, match="chunk at"):
        orth_mod.run_chunks(10, (4, 16), "cholqr2", "cpu", fill, lambda *a: None, backend=backend,
                            memory_budget=2 * 4 * 4 * 16)
    with torch.no_grad():
        orth_mod.run_chunks(4, (4, 16), "cholqr2", "cpu", fill, lambda *a: None, backend=backend,
                            memory_budget=2 * 4 * 4 * 16)
    with torch.enable_grad():
        orth_mod.run_chunks(4, (4, 16), "cholqr2", "cpu", fill, lambda *a: None, backend=backend,
                            memory_budget=2 * 4 * 4 * 16)
    assert grad_modes[-4:] == [False, False, True, True]


# --------------------------------------------------------------------------------------------------
# Triton kernels (interpreter on CPU) and the registry

def test_registered_in_backend_registry():
    assert "orthogonalize" in _backends.ops()
    rows = [r for r in _backends.report(("cpu",)) if r["op"] == "orthogonalize"]
    assert {r["backend"] for r in rows} >= {"torch"}
    assert set(orth_mod.ORTHOGONALIZE.impls) == {"torch", "triton"}


@pytest.fixture
def triton_interp():
    pytest.importorskip("triton")
    import os
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 before triton is imported")


def test_triton_polar_kernels(triton_interp, rng):
    from condinit.kernels.orthogonalize import polar as kp
    X = torch.randn(3, 17, 45, generator=rng)
    G = kp.gram(X)
    torch.testing.assert_close(G.double(), X.double() @ X.double().transpose(1, 2), atol=1e-5, rtol=1e-5)
    a, b = torch.tensor([1.0, 0.5, 2.0]), torch.tensor([0.0, -0.3, 0.1])
    Y = kp.step(X, G, a, b, torch.empty_like(X))
    ref = a.double()[:, None, None] * X.double() + b.double()[:, None, None] * (G.double() @ X.double())
    torch.testing.assert_close(Y.double(), ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(Y[0], X[0])   # alpha = 1, beta = 0 is the exact identity step


@pytest.mark.parametrize("shape", [(2, 5, 23), (3, 17, 45), (2, 19, 19), (2, 40, 21)])
def test_triton_polar_matches_svd(triton_interp, shape, rng):
    W = torch.randn(*shape, generator=rng)
    m, n = shape[-2:]
    Q = orthogonalize(W, "polar", backend="triton", memory_budget=8 * m * n)   # chunks of 2 blocks
    assert orth_error(Q) <= 1e-5
    torch.testing.assert_close(Q, orthogonalize(W, "svd"), atol=5e-6, rtol=0)


# --------------------------------------------------------------------------------------------------
# Haar distribution

def _first_coordinate_cdf(x, n):
    """CDF of one coordinate of a uniform unit vector in R^n: x^2 ~ Beta(1/2, (n-1)/2), symmetric."""
    import numpy as np
    x = np.asarray(x, dtype=np.float64)
    return 0.5 + 0.5 * np.sign(x) * scipy_special.betainc(0.5, (n - 1) / 2.0, np.clip(x * x, 0.0, 1.0))


def _haar_checks(Q: torch.Tensor):
    """Raise AssertionError unless the semi-orthogonal [N, d, n] samples Q look Haar distributed.

    * KS test of entries (0,0) and (d-1, n-1) against the exact marginal of a Haar row entry;
    * moments of all entries: E w^2 = 1/n, E w^4 = 3/(n(n+2));
    * square blocks (Haar O(n)): E tr = 0, E tr^2 = 1, P(det = -1) = 1/2.
    """
    N, d, n = Q.shape
    Q = Q.double()
    for i, j in ((0, 0), (d - 1, n - 1), (d // 2, 0)):
        p = scipy_stats.kstest(Q[:, i, j].numpy(), lambda x: _first_coordinate_cdf(x, n)).pvalue
        assert p > 1e-3, f"entry ({i},{j}) is not distributed like a Haar row entry (KS p={p:.2e})"
    # (a row's squares sum to 1 exactly: use single entries, not per-draw averages of all entries)
    for k, want in ((2, 1.0 / n), (4, 3.0 / (n * (n + 2)))):
        for i, j in ((0, 0), (d - 1, n - 1)):
            samples = Q[:, i, j].pow(k)
            se = samples.std().item() / math.sqrt(N)
            assert abs(samples.mean().item() - want) <= 5 * se + 1e-9, \
                f"E w[{i},{j}]^{k} = {samples.mean().item()} != {want}"
    if d == n:
        tr = Q.diagonal(dim1=1, dim2=2).sum(-1)
        assert abs(tr.mean().item()) <= 5 / math.sqrt(N), "E tr(W) != 0"
        assert abs(tr.pow(2).mean().item() - 1.0) <= 5 * tr.pow(2).std().item() / math.sqrt(N), "E tr^2 != 1"
        neg = (torch.linalg.det(Q) < 0).double().mean().item()
        assert abs(neg - 0.5) <= 5 * 0.5 / math.sqrt(N), f"P(det < 0) = {neg} != 1/2"
        # two-sample KS of the trace against sign-fixed QR of independent torch Gaussians
        g = torch.Generator().manual_seed(99)
        Qr, R = torch.linalg.qr(torch.randn(N, n, n, generator=g, dtype=torch.float64))
        Qr = Qr * torch.sign(R.diagonal(dim1=1, dim2=2)).unsqueeze(1)
        p = scipy_stats.ks_2samp(tr.numpy(), Qr.diagonal(dim1=1, dim2=2).sum(-1).numpy()).pvalue
        assert p > 1e-3, f"trace distribution differs from Haar QR's (KS p={p:.2e})"


N_DRAWS = 3000


@pytest.mark.parametrize("method", ["householder", "cholqr2", "polar", "svd"])
@pytest.mark.parametrize("shape", [(3, 7), (4, 4), (9, 2)])
def test_haar_distribution(method, shape):
    Q = conditioned_blocks(20260101, "haar-test", range(N_DRAWS), shape, method)
    if shape[0] > shape[1]:
        Q = Q.transpose(1, 2)          # orthonormal columns: test the transposed (row) form
    _haar_checks(Q)


def _qr_without_sign_fix(W):
    Q, _ = torch.linalg.qr(W.transpose(1, 2))
    return Q.transpose(1, 2)


@pytest.mark.parametrize("shape", [(3, 7), (4, 4)])
def test_haar_test_has_power(shape):
    """The same checks reject QR without the sign fix (Mezzadri 2007) on the same Gaussians."""
    from condinit.ops.random.op import block_randn, stream_id
    W = block_randn(20260101, stream_id("haar-test"), range(N_DRAWS), shape)
    with pytest.raises(AssertionError):
        _haar_checks(_qr_without_sign_fix(W))
    _haar_checks(orthogonalize(W, "householder"))  # ... and accept it with the fix


@pytest.mark.slow
def test_no_deadlock_after_the_caller_changes_thread_counts():
    """torch.set_num_threads turns MKL's dynamic threading off; MKL LAPACK inside the chunk
    scheduler's parallel region then opened its own team and deadlocked. Run in a subprocess with a
    timeout, so a regression fails instead of hanging the suite."""
    import subprocess
    import sys
    code = ("import torch\n"
            "from condinit.init import orthogonalize\n"
            "torch.set_num_threads(1); torch.set_num_threads(2)\n"
            "for method in ('householder', 'svd', 'cholqr2', 'polar'):\n"
            "    for shape in ((3, 64, 256), (4, 40, 100)):\n"
            "        orthogonalize(torch.randn(*shape), method)\n"
            "print('ok')\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-2000:]


# --------------------------------------------------------------------------------------------------
# LAPACK factorizations: bits independent of the thread count; the CPU workspace

_LAPACK_THREADS = """
import hashlib, sys, torch
from condinit.init import orthogonalize
g = torch.Generator().manual_seed(5)
blocks = [torch.randn(6, 64, 192, generator=g), torch.randn(1, 256, 256, generator=g),
          torch.randn(5, 300, 40, generator=g)]
for threads in [int(t) for t in sys.argv[1:]]:
    torch.set_num_threads(threads)      # the script sets it, not the library
    digest = hashlib.sha256()
    for W in blocks:
        for method in ("householder", "svd"):
            digest.update(orthogonalize(W, method).numpy().tobytes())
    print(threads, digest.hexdigest())
"""


@pytest.mark.slow
@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="the per-thread LAPACK setting is MKL's")
def test_lapack_bits_do_not_depend_on_thread_count():
    """A fresh process each time, its first factorization under 2 threads (the OpenMP team is then
    created inside the call, which drops MKL's per-thread setting unless it is re-established)."""
    import subprocess
    import sys
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "2"}
    lines = []
    for order in (["2", "1"], ["1", "2"]):
        res = subprocess.run([sys.executable, "-c", _LAPACK_THREADS, *order], capture_output=True, text=True,
                             timeout=120, env=env)
        assert res.returncode == 0, res.stderr[-2000:]
        lines += res.stdout.split("\n")
    digests = {line.split()[1] for line in lines if line.strip()}
    assert len(digests) == 1, lines


def test_lapack_split_over_threads_matches_one_batch(rng):
    """The batch split over worker threads gives each block the bits of a one-thread batch call."""
    W = torch.randn(7, 48, 100, generator=rng)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = {m: orthogonalize(W, m) for m in ("householder", "svd")}
        torch.set_num_threads(3)                           # 3 workers: uneven parts 2, 2, 3
        for m, ref in one.items():
            assert torch.equal(orthogonalize(W, m), ref), m
            assert torch.equal(orthogonalize(W[3:4], m)[0], ref[3]), m
    finally:
        torch.set_num_threads(threads)


def test_workspace_contents_never_reach_the_result(rng):
    """Chunk buffers are reused between calls without clearing: poisoned with NaN, they change
    nothing (every element a chunk reads is written first, padding columns included)."""
    for shape in ((5, 16, 200), (4, 24, 96), (3, 40, 40)):   # 200: padded columns; 40 x 40: Householder
        W = torch.randn(*shape, generator=rng)
        ref = {m: orthogonalize(W, m) for m in ("cholqr2", "polar", "householder")}
        with orth_mod._WORKSPACE._lock:
            for t in orth_mod._WORKSPACE._free:
                t.fill_(float("nan"))
        for m, r in ref.items():
            assert torch.equal(orthogonalize(W, m), r), (shape, m)


def test_workspace_reused_and_bounded(rng):
    W = torch.randn(8, 32, 512, generator=rng)
    orthogonalize(W, "cholqr2")
    kept = {t.data_ptr() for t in orth_mod._WORKSPACE._free}
    assert kept and len(orth_mod._WORKSPACE._free) <= orth_mod._Workspace.KEEP
    taken = []
    original = orth_mod._WORKSPACE.take

    def spy(numel, device):
        t = original(numel, device)
        taken.append(t.data_ptr())
        return t
    orth_mod._WORKSPACE.take = spy
    try:
        orthogonalize(W, "cholqr2")
    finally:
        orth_mod._WORKSPACE.take = original
    assert taken and set(taken) <= kept                   # the second call allocated nothing
    big = orth_mod._Workspace.MAX_KEPT_BYTES
    orthogonalize(torch.randn(2, 64, big // (4 * 64) // 2 + 16, generator=rng), "cholqr2", memory_budget=4 * big)
    assert all(4 * t.numel() <= big for t in orth_mod._WORKSPACE._free)


def test_orthogonalize_out_aliasing(rng):
    A = torch.randn(4, 8, 32, generator=rng)
    out = torch.zeros(1, 8, 32).expand(4, 8, 32)
    assert_refused(lambda: orthogonalize(A, out=out), [A, out], ValueError, "out .*share memory")
    buf = torch.randn(5 * 8 * 32, generator=rng)
    stack, shifted = buf[:4 * 256].view(4, 8, 32), buf[256:].view(4, 8, 32)
    assert_refused(lambda: orthogonalize(stack, out=shifted), [buf], ValueError, "out overlaps stack")
    expected = orthogonalize(A.clone())
    assert torch.equal(orthogonalize(A, out=A), expected)            # in place: allowed


@pytest.mark.parametrize("method", ["polar", "householder", "cholqr2", "svd", "auto"])
@pytest.mark.parametrize("scale", [1e-30, 1e19, 1e30])
def test_orthogonalize_is_scale_invariant(rng, method, scale):
    A = torch.randn(3, 8, 40, generator=rng, dtype=torch.float64)
    ref = orthogonalize(A.float(), method)
    got = orthogonalize((A * scale).float(), method)
    assert orth_error(got) < 1e-5
    assert (got - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("method", ["polar", "householder", "cholqr2", "svd"])
def test_orthogonalize_degenerate_blocks(rng, method):
    A = torch.cat([torch.zeros(1, 4, 16), torch.randn(1, 4, 16, generator=rng) * 1e-42,     # zero, subnormal
                   torch.randn(1, 4, 16, generator=rng) * torch.tensor([1e20, 1, 1, 1e-20])[:, None]])
    Q = orthogonalize(A, method)
    assert orth_error(Q) < 1e-5
    wide = torch.randn(2, 4, 16, generator=rng, dtype=torch.float64)
    for s in (1e300, 1e-300):                     # float64 beyond the fp32 range
        assert (orthogonalize(wide * s, method) - orthogonalize(wide, method)).abs().max().item() < 1e-5


def test_orthogonalize_non_finite_refused(rng):
    for bad in (float("nan"), float("inf")):
        A = torch.randn(2, 4, 16, generator=rng)
        A[1, 2, 3] = bad
        out = torch.zeros_like(A)
        assert_refused(lambda: orthogonalize(A, out=out), [A, out], ValueError, "stack must be finite")


# --------------------------------------------------------------------------------------------------
# the per-block native kernels (one OpenMP team per chunk, single-threaded MKL per block)

reference_mod = importlib.import_module("condinit.ops.orthogonalize.reference")
native = pytest.mark.skipif(not reference_mod._per_block_lapack(torch.empty(1)),
                            reason="the per-block kernels of condinit._C are not built here")

_NATIVE_THREADS = """
import hashlib, sys, warnings
import torch
warnings.simplefilter("error")          # a warning about MKL's setting fails the script
from condinit.init import orthogonalize
g = torch.Generator().manual_seed(11)
ill = torch.randn(4, 16, 128, generator=g)
ill[1] *= torch.logspace(0, 4, 16)[:, None]  # kappa ~ 1e4: CholeskyQR2 redoes this block by Householder
blocks = [torch.randn(9, 64, 2048, generator=g), torch.randn(5, 48, 100, generator=g), ill,
          torch.randn(3, 96, 96, generator=g)]
for threads in [int(t) for t in sys.argv[1:]]:
    torch.set_num_threads(threads)      # the script sets it, not the library
    digest = hashlib.sha256()
    for W in blocks:
        for method in ("cholqr2", "householder", "svd"):
            digest.update(orthogonalize(W, method).numpy().tobytes())
            for i in range(W.shape[0]):   # each block alone: the bits of the whole batch
                assert torch.equal(orthogonalize(W[i:i + 1], method), orthogonalize(W, method)[i:i + 1])
    print(threads, digest.hexdigest())
"""


@pytest.mark.slow
@native
def test_native_bits_do_not_depend_on_thread_count_or_split():
    """Fresh processes whose first factorization runs on 2 or 3 threads (new team threads, where MKL
    drops its per-thread setting at their first call): every thread count gives the same bits, each
    block alone gives its bits in the batch, and nothing warns."""
    import subprocess
    import sys
    lines = []
    for order in (["2", "3", "1"], ["3", "1", "2"]):
        res = subprocess.run([sys.executable, "-c", _NATIVE_THREADS, *order], capture_output=True, text=True,
                             timeout=300, env={**__import__("os").environ, "OMP_NUM_THREADS": order[0]})
        assert res.returncode == 0, res.stderr[-2000:]
        lines += [line for line in res.stdout.split("\n") if line.strip()]
    assert len(lines) == 6 and len({line.split()[1] for line in lines}) == 1, lines


@native
def test_native_cholqr2_matches_the_batched_reference(rng, monkeypatch):
    """The per-block CholeskyQR2 kernel and the batched PyTorch one (the path without the extension)
    compute the same factorization: equal up to fp32 rounding, the same blocks sent to Householder."""
    W = torch.randn(6, 32, 256, generator=rng)
    W[2] *= torch.logspace(0, 4, 32)[:, None]              # one ill-conditioned block: the fallback
    got = orthogonalize(W, "cholqr2")
    monkeypatch.setattr(reference_mod, "_NATIVE_BLOCKS", False)
    want = orthogonalize(W, "cholqr2")
    assert orth_error(got) <= 1e-5
    torch.testing.assert_close(got, want, atol=2e-6, rtol=0)
    # the fallback block is the sign-fixed Householder factor of that block, computed in float64
    Q64, R64 = torch.linalg.qr(W[2].double().T)
    want2 = (Q64 * torch.sign(R64.diagonal())).T
    torch.testing.assert_close(got[2].double(), want2, atol=1e-5, rtol=0)


@native
@pytest.mark.parametrize("method", ["cholqr2", "householder", "svd"])
def test_native_kernels_draw_their_inputs_as_philox_randn_does(method):
    """With ``draws``, each block is drawn by the thread that factors it: the result equals
    philox_randn into A followed by the kernel without draws, bit for bit (blocks of different
    streams and ids in one batch, a repeated block, a seed with both 32-bit words set), and A then
    holds those Gaussians."""
    import random as _random
    r = _random.Random()
    seed = r.getrandbits(64)
    C, m, n = 5, 16, 96
    rows = torch.tensor([[r.getrandbits(32), r.getrandbits(40)] for _ in range(C - 1)], dtype=torch.int64)
    rows = torch.cat([rows, rows[-1:]])                    # the padding of a short chunk repeats a block
    want_A = torch.empty(C, m, n)
    for b in range(C):
        torch.ops.condinit_C.philox_randn(seed & 0xFFFFFFFF, seed >> 32, int(rows[b, 0]), rows[b, 1:], m, n,
                                          want_A[b:b + 1])
    want = torch.empty(C, m, n)
    got_A, got = torch.full((C, m, n), float("nan")), torch.empty(C, m, n)
    args = (torch.float32,) if method != "cholqr2" else (torch.float32,) + _cholqr2_thresholds(m)
    if method == "cholqr2":
        torch.ops.condinit_C.cholqr2_blocks_(want_A.clone(), want, *args)
        torch.ops.condinit_C.cholqr2_blocks_(got_A, got, *args, rows, seed & 0xFFFFFFFF, seed >> 32)
    else:
        torch.ops.condinit_C.orthonormal_blocks_(want_A.clone(), want, method, *args)
        torch.ops.condinit_C.orthonormal_blocks_(got_A, got, method, *args, rows, seed & 0xFFFFFFFF, seed >> 32)
    assert torch.equal(got_A, want_A) and torch.equal(got, want)
    assert torch.equal(got[-1], got[-2])
    inplace = torch.empty(C, m, n)                         # out aliasing A, as the chunks run
    if method == "cholqr2":
        torch.ops.condinit_C.cholqr2_blocks_(inplace, inplace, *args, rows, seed & 0xFFFFFFFF, seed >> 32)
    else:
        torch.ops.condinit_C.orthonormal_blocks_(inplace, inplace, method, *args, rows, seed & 0xFFFFFFFF,
                                                 seed >> 32)
    assert torch.equal(inplace, want)


def _cholqr2_thresholds(m):
    return (reference_mod.CHOLQR_MAX_DIAG_RATIO, reference_mod.CHOLQR_MAX_GRAM2_DEVIATION,
            reference_mod._first_order_max(m))


@native
@pytest.mark.parametrize("rows, words, match", [
    (torch.zeros(3, 2, dtype=torch.int64), (0, 0), "draws must be"),            # C rows expected
    (torch.zeros(4, 3, dtype=torch.int64), (0, 0), "draws must be"),
    (torch.zeros(4, 2, dtype=torch.int32), (0, 0), "draws must be"),
    (torch.tensor([[0, 0], [0, -1], [0, 0], [0, 0]]), (0, 0), r"draws\[1\]"),
    (torch.tensor([[1 << 32, 0]] * 4), (0, 0), r"draws\[0\]"),
    (torch.zeros(4, 2, dtype=torch.int64), (1 << 32, 0), "seed_lo and seed_hi"),
])
def test_native_draws_are_checked_before_anything_is_written(rows, words, match):
    A = torch.full((4, 8, 40), 3.0)
    out = torch.full((4, 8, 40), 5.0)
    with pytest.raises(RuntimeError, match=match):
        torch.ops.condinit_C.cholqr2_blocks_(A, out, torch.float32, *_cholqr2_thresholds(8), rows, *words)
    with pytest.raises(RuntimeError, match=match):
        torch.ops.condinit_C.orthonormal_blocks_(A, out, "householder", torch.float32, rows, *words)
    assert bool((A == 3).all()) and bool((out == 5).all())


@native
def test_native_kernels_one_team_no_pool(rng):
    """No Python worker threads: the factorizations of a call run in the caller's OpenMP team."""
    before = {t.name for t in threading.enumerate()}
    for method in ("householder", "svd", "cholqr2"):
        orthogonalize(torch.randn(5, 24, 120, generator=rng), method)
    assert {t.name for t in threading.enumerate()} == before


def test_bench_contention_stops_its_processes():
    """benchmarks/bench_contention.py: the busy processes it starts are gone after an error inside."""
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    try:
        bench_contention = importlib.import_module("bench_contention")
    finally:
        sys.path.pop(0)
    c = bench_contention.Contenders(2, "spin")
    with pytest.raises(KeyError):
        with c:
            procs = list(c.procs)
            assert len(procs) == 2 and all(p.poll() is None for p in procs)
            raise KeyError("inside")
    assert all(p.poll() is not None for p in procs)


def test_bench_contention_ratio_is_the_median_of_the_rounds():
    """benchmarks/bench_contention.py: each round's ratio is its contended / quiet median, the row's
    ratio the median of those; the ms columns pool every call of every round."""
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    try:
        bench_contention = importlib.import_module("bench_contention")
    finally:
        sys.path.pop(0)

    def timing(times):
        return {"median_s": sorted(times)[len(times) // 2], "all_s": times, "load_1min": [0.5] * len(times)}

    rounds = [({"w": timing([1.0, 2.0, 3.0])}, {"w": timing([4.0, 5.0, 6.0])}),     # 2.5
              ({"w": timing([1.0, 1.0, 1.0])}, {"w": timing([3.0, 3.0, 9.0])}),     # 3.0
              ({"w": timing([4.0, 4.0, 4.0])}, {"w": timing([8.0, 8.0, 8.0])})]     # 2.0
    row = bench_contention._row("w", "label", rounds)
    assert row["round_ratios"] == [2.5, 3.0, 2.0] and row["ratio"] == 2.5
    assert row["quiet"]["median_s"] == 2.0 and row["contended"]["median_s"] == 6.0
    assert len(row["quiet"]["all_s"]) == 9 and row["quiet"]["best_s"] == 1.0
    assert "2.50 3.00 2.00" in bench_contention.format_rows([row])
