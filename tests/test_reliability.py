"""Bad input never writes, degenerate input never crashes: the init engine's public functions
(``conditioned_init_``, ``conditioned_init_layers_``, ``semi_orthogonal_``, ``rect_identity_``,
``orthogonalize``) refuse bad arguments, aliased destinations and unrunnable backends before the
first write, with an error naming the argument, and give correct results at extreme scales.
"""
import dataclasses
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import condinit
from condinit import _backends
from condinit.init.functional import conditioned_init_, conditioned_init_layers_, rect_identity_, semi_orthogonal_
from condinit.ops.orthogonalize.op import ORTHOGONALIZE, orthogonalize
from helpers import assert_refused

pytestmark = pytest.mark.usefixtures("one_thread")

F64 = torch.float64


def _orth_err(W: torch.Tensor) -> float:
    """max |W W^T - I| of every wide block (float64)."""
    W = W.double()
    if W.shape[-2] > W.shape[-1]:
        W = W.transpose(-1, -2)
    return (W @ W.transpose(-1, -2) - torch.eye(W.shape[-2], dtype=F64)).abs().max().item()


def _layer(rng, heads=4, kv=2, d=8, D=32):
    return {"q": torch.randn(heads * d, D, generator=rng), "k": torch.randn(kv * d, D, generator=rng),
            "v": torch.randn(kv * d, D, generator=rng), "q_bias": torch.randn(heads * d, generator=rng),
            "k_bias": torch.randn(kv * d, generator=rng), "v_bias": torch.randn(kv * d, generator=rng)}


def _init_one(layer, **kw):
    conditioned_init_(layer["q"], layer["k"], layer["v"], num_heads=4, num_kv_heads=2, q_bias=layer["q_bias"],
                      k_bias=layer["k_bias"], v_bias=layer["v_bias"], seed=0, **kw)


# ---------------------------------------------------------------------------------------------------
# 1. every argument and the backend choice resolved before the first write

@pytest.mark.parametrize("backend, exc", [("bogus", ValueError), (7, ValueError), ("cuda", condinit.BackendUnavailableError)])
def test_unrunnable_backend_writes_nothing(rng, backend, exc):
    layer = _layer(rng)
    assert_refused(lambda: _init_one(layer, backend=backend), list(layer.values()), exc, "backend")


def test_unavailable_triton_writes_nothing(rng, monkeypatch):
    real = _backends.available

    def no_triton(backend, device_type, native_op=None, native_fn=None):
        if backend == "triton":
            return False, "on CPU only under TRITON_INTERPRET=1 (set before triton is imported)"
        return real(backend, device_type, native_op, native_fn)

    monkeypatch.setattr(_backends, "available", no_triton)
    try:
        layer = _layer(rng)
        assert_refused(lambda: _init_one(layer, backend="triton", method="polar"), list(layer.values()),
                       condinit.BackendUnavailableError, "triton")
    finally:
        monkeypatch.undo()
        _backends.reset()


def test_backend_of_a_later_group_is_chosen_before_the_first_write(rng, monkeypatch):
    # two layer shapes (two groups of blocks); the backend cannot run the second group's method
    impl = ORTHOGONALIZE.impls["torch"]
    monkeypatch.setitem(ORTHOGONALIZE.impls, "torch", dataclasses.replace(impl, limits=(("method", ("householder",)),)))
    small = {"q": torch.randn(8, 8, generator=rng), "k": torch.randn(8, 8, generator=rng), "v": torch.randn(8, 8, generator=rng)}
    wide = {"q": torch.randn(8, 64, generator=rng), "k": torch.randn(8, 64, generator=rng), "v": torch.randn(8, 64, generator=rng)}
    # 4 x 8 blocks: householder; 4 x 64 blocks: cholqr2, which this torch row refuses
    assert_refused(lambda: conditioned_init_layers_([small, wide], num_heads=2, seed=0, backend="torch"),
                   list(small.values()) + list(wide.values()), condinit.BackendUnavailableError, "method cholqr2")


def test_layer_index_overflow_writes_nothing(rng):
    layers = [_layer(rng), _layer(rng)]
    tensors = [t for layer in layers for t in layer.values()]
    assert_refused(lambda: conditioned_init_layers_(layers, num_heads=4, num_kv_heads=2, seed=0, layer_indices=[0, 2 ** 31]),
                   tensors, ValueError, r"layer_indices\[1\]")


# ---------------------------------------------------------------------------------------------------
# 2. aliased destinations refused, naming the arguments

def test_expanded_weight_refused():
    w = torch.zeros(1, 8).expand(12, 8)
    assert_refused(lambda: rect_identity_(w), [w], ValueError, "weight .*share memory")
    assert_refused(lambda: semi_orthogonal_(w, seed=0), [w], ValueError, "weight .*share memory")
    layer = {"q": torch.zeros(1, 32).expand(16, 32), "k": torch.zeros(8, 32), "v": torch.zeros(8, 32)}
    assert_refused(lambda: conditioned_init_(layer["q"], layer["k"], layer["v"], num_heads=4, num_kv_heads=2, seed=0),
                   list(layer.values()), ValueError, "q_weight .*share memory")


def test_aliased_destinations_refused(rng):
    q, v = torch.randn(16, 32, generator=rng), torch.randn(16, 32, generator=rng)
    assert_refused(lambda: conditioned_init_(q, q, v, num_heads=2, seed=0), [q, v], ValueError, "q_weight and k_weight")
    k = torch.randn(16, 32, generator=rng)
    assert_refused(lambda: conditioned_init_(q, k, q, num_heads=2, seed=0), [q, k], ValueError, "q_weight and v_weight")
    w = torch.randn(16, 32, generator=rng)
    assert_refused(lambda: conditioned_init_(w[:8], w[4:12], torch.zeros(8, 32), num_heads=1, seed=0), [w],
                   ValueError, "q_weight and k_weight overlap")
    b = torch.randn(24, generator=rng)
    assert_refused(lambda: conditioned_init_(q, k, v, num_heads=2, q_bias=b[:16], k_bias=b[8:], seed=0), [q, k, v, b],
                   ValueError, "q_bias and k_bias")
    layers = [_layer(rng), _layer(rng)]
    layers[1]["v"] = layers[0]["k"]
    tensors = [t for layer in layers for t in layer.values()]
    assert_refused(lambda: conditioned_init_layers_(layers, num_heads=4, num_kv_heads=2, seed=0), tensors,
                   ValueError, r"layers\[0\].k and layers\[1\].v")


def test_disjoint_views_of_one_tensor_accepted(rng):
    # a fused [D, 3D] weight (Conv1D layout): Q, K, V are interleaved column blocks, disjoint
    D = 32
    fused = torch.randn(D, 3 * D, generator=rng, dtype=F64)
    q, k, v = (fused[:, i * D:(i + 1) * D].t() for i in range(3))
    conditioned_init_(q, k, v, num_heads=4, seed=5)
    ref = [torch.empty(D, D, dtype=F64) for _ in range(3)]
    conditioned_init_(*ref, num_heads=4, seed=5)
    for got, want in zip((q, k, v), ref):
        assert torch.equal(got, want)
    rows = torch.randn(3 * D, D, generator=rng)    # and row blocks of a fused nn.Linear weight
    conditioned_init_(rows[:D], rows[D:2 * D], rows[2 * D:], num_heads=4, seed=5)
    assert torch.equal(rows[:D].double(), ref[0].float().double())


# ---------------------------------------------------------------------------------------------------
# 3. extreme scales and non-finite values

def test_conditioned_init_overwrites_nan_weights(rng):
    layer = {key: torch.full_like(t, float("nan")) for key, t in _layer(rng).items()}
    _init_one(layer)
    assert all(bool(t.isfinite().all()) for t in layer.values())
    assert _orth_err(layer["q"].view(4, 8, 32)) < 1e-5
    assert torch.equal(layer["v"], torch.eye(16, 32))


# ---------------------------------------------------------------------------------------------------
# 4. reproducibility across thread counts (in a subprocess: a hang must not hang the suite)

_THREADS = textwrap.dedent("""
    import hashlib, torch
    from condinit.init.functional import conditioned_init_
    digests = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        q, k, v = (torch.empty(192, 192) for _ in range(3))
        conditioned_init_(q, k, v, num_heads=3, seed=2024)     # ViT-Ti: D = 192, head_dim 64
        digests.append(hashlib.sha256(q.numpy().tobytes() + k.numpy().tobytes()).hexdigest())
    print(digests[0] == digests[1])
""")


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="thread-count independence of LAPACK's "
                    "bits is controlled through MKL's per-thread setting")
@pytest.mark.slow
def test_householder_bits_independent_of_thread_count():
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    try:
        run = subprocess.run([sys.executable, "-c", _THREADS], capture_output=True, text=True, timeout=40, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail("conditioned_init_ with 2 threads did not finish in 40 s")
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == "True", "1 and 2 threads gave different bits"


# ---------------------------------------------------------------------------------------------------
# 5. smaller argument checks

@pytest.mark.parametrize("budget, exc", [(0, ValueError), (-5, ValueError), ("a", TypeError), (True, TypeError)])
def test_memory_budget_checked(rng, budget, exc):
    A = torch.randn(4, 8, generator=rng)
    with pytest.raises(exc, match="memory_budget"):
        orthogonalize(A, memory_budget=budget)
    layer = _layer(rng)
    assert_refused(lambda: _init_one(layer, memory_budget=budget), list(layer.values()), exc, "memory_budget")


def test_gain_keeps_results_finite(rng):
    for dtype, bad in ((torch.float32, 1e39), (torch.float32, 3e38), (torch.float16, 7e4), (torch.bfloat16, 2e38)):
        w = torch.randn(4, 8, generator=rng).to(dtype)
        assert_refused(lambda: semi_orthogonal_(w, gain=bad, seed=0), [w], ValueError, "gain")
    for dtype in (torch.float32, torch.float16, torch.float64):
        limit = min(torch.finfo(dtype).max, torch.finfo(torch.float32).max) / 2
        w = torch.empty(16, 64, dtype=dtype)
        semi_orthogonal_(w, gain=limit, head_dim=4, seed=0)
        assert bool(w.isfinite().all())
        assert _orth_err((w.double() / limit).view(4, 4, 64)) < TOL_BY_DTYPE[dtype]


TOL_BY_DTYPE = {torch.float32: 1e-5, torch.float16: 4e-3, torch.float64: 1e-5}


def test_duplicate_layer_indices_refused(rng):
    layers = [_layer(rng) for _ in range(3)]
    tensors = [t for layer in layers for t in layer.values()]
    assert_refused(lambda: conditioned_init_layers_(layers, num_heads=4, num_kv_heads=2, seed=0, layer_indices=[3, 1, 3]),
                   tensors, ValueError, r"layer_indices must be distinct, got \[3\]")


def test_mixed_meta_destinations_refused(rng):
    q, v = torch.randn(16, 32, generator=rng), torch.randn(16, 32, generator=rng)
    k = torch.empty(16, 32, device="meta")
    assert_refused(lambda: conditioned_init_(q, k, v, num_heads=2, seed=0), [q, v], ValueError, "k_weight is on the meta")
    layers = [_layer(rng), {key: t.to("meta") for key, t in _layer(rng).items()}]
    assert_refused(lambda: conditioned_init_layers_(layers, num_heads=4, num_kv_heads=2, seed=0), list(layers[0].values()),
                   ValueError, "meta")
    meta = {key: torch.empty(16, 32, device="meta") for key in "qkv"}
    conditioned_init_(meta["q"], meta["k"], meta["v"], num_heads=2, seed=0)    # all meta: a no-op


def test_projection_shared_between_layers_is_written_once_and_reported():
    """Two layers holding one q_proj (the same nn.Linear): it is conditioned once, as the first layer's
    (bit for bit what an unshared model gets there); the second layer's own k and v are its own draws,
    and the report names the sharing."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=32, num_hidden_layers=2, vocab_size=50)
    shared, plain = transformers.LlamaForCausalLM(cfg), transformers.LlamaForCausalLM(cfg)
    a, b = (l.self_attn for l in shared.model.layers)
    b.q_proj = a.q_proj
    rep = condinit.apply(shared, seed=3)
    condinit.apply(plain, seed=3)
    pa, pb = (l.self_attn for l in plain.model.layers)
    assert torch.equal(a.q_proj.weight, pa.q_proj.weight) and b.q_proj is a.q_proj
    assert torch.equal(b.k_proj.weight, pb.k_proj.weight) and torch.equal(b.v_proj.weight, pb.v_proj.weight)
    assert rep.layers[1].shared == {"q": "model.layers.0.self_attn.q"} and not rep.layers[0].shared
    assert rep.layers[1].after["q"] is rep.layers[0].after["q"]
    assert "model.layers.1.self_attn.q is model.layers.0.self_attn.q (one weight)" in str(rep)
