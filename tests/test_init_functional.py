"""semi_orthogonal_, rect_identity_, conditioned_init_, conditioned_init_layers_, conditioned_blocks:
per-head orthonormality, V identity, GQA, determinism under re-chunking / per-layer calls / sharding,
generator semantics, storage dtypes and strides, meta no-op, bad input leaving tensors untouched."""
import pytest
import torch

import condinit
from condinit.init import (conditioned_blocks, conditioned_init_, conditioned_init_layers_, rect_identity_,
                           semi_orthogonal_)
from condinit.init.functional import LAYER_STRIDE
from condinit.ops.random.op import stream_id
from helpers import assert_refused


def rows_err(W: torch.Tensor) -> float:
    W = W.double()
    return (W @ W.transpose(-1, -2) - torch.eye(W.shape[-2], dtype=torch.float64)).abs().max().item()


def cols_err(W: torch.Tensor) -> float:
    return rows_err(W.transpose(-1, -2))


def test_top_level_functions_do_what_their_documentation_says(rng):
    """Called as ``condinit.<name>``: semi-orthogonal heads, the rectangular identity, an
    orthonormalized stack, a conditioned layer (one by one and as a stack), singular values, and
    condition numbers clamped."""
    w = condinit.semi_orthogonal_(torch.empty(32, 50), head_dim=8, seed=11)
    assert rows_err(w.view(4, 8, 50)) <= 1e-5
    assert torch.equal(condinit.rect_identity_(torch.randn(6, 10, generator=rng)), torch.eye(6, 10))
    assert rows_err(condinit.orthogonalize(torch.randn(3, 8, 40, generator=rng))) <= 1e-5
    q, k, v = (torch.randn(rows, 24, generator=rng) for rows in (16, 8, 8))
    condinit.conditioned_init_(q, k, v, num_heads=4, num_kv_heads=2, seed=1)
    assert rows_err(q.view(4, 4, 24)) <= 1e-5 and rows_err(k.view(2, 4, 24)) <= 1e-5
    assert torch.equal(v, torch.eye(8, 24))
    layers = [{p: torch.randn(rows, 24, generator=rng) for p, rows in (("q", 16), ("k", 8), ("v", 8))}
              for _ in range(2)]
    condinit.conditioned_init_layers_(layers, num_heads=4, num_kv_heads=2, seed=1)
    assert all(torch.equal(layers[0][p], t) for p, t in (("q", q), ("k", k), ("v", v)))   # layer 0 alike
    assert rows_err(layers[1]["q"].view(4, 4, 24)) <= 1e-5 and not torch.equal(layers[1]["q"], q)
    W = torch.randn(3, 8, 40, generator=rng) * torch.logspace(0, -3, 8)[:, None]   # kappa ~ 1e3
    sv = torch.linalg.svdvals(W.double())
    torch.testing.assert_close(condinit.spectrum(W).cond, sv[:, 0] / sv[:, -1], rtol=1e-7, atol=0)
    assert condinit.recondition_(W, max_cond=10.0) is W
    assert bool((condinit.spectrum(W).cond <= 10.0 * (1 + 1e-5)).all())


@pytest.mark.parametrize("method", ["auto", "householder", "cholqr2", "polar", "svd"])
def test_semi_orthogonal_per_head(method):
    w = torch.empty(3 * 16, 77)
    assert semi_orthogonal_(w, head_dim=16, seed=3, method=method) is w
    assert rows_err(w.view(3, 16, 77)) <= 1e-5
    # whole matrix, and head_dim > cols: orthonormal columns per head
    w2 = torch.empty(40, 17)
    semi_orthogonal_(w2, head_dim=20, seed=3, method=method)
    assert cols_err(w2.view(2, 20, 17)) <= 1e-5
    w3 = torch.empty(17, 40)
    semi_orthogonal_(w3, seed=3, method=method)
    assert rows_err(w3) <= 1e-5


def test_semi_orthogonal_gain_streams_and_determinism():
    a, b, c = torch.empty(32, 50), torch.empty(32, 50), torch.empty(32, 50)
    semi_orthogonal_(a, head_dim=8, seed=11)
    semi_orthogonal_(b, head_dim=8, seed=11, gain=2.5)
    semi_orthogonal_(c, head_dim=8, seed=11, stream="other")
    torch.testing.assert_close(b, 2.5 * a, atol=1e-6, rtol=0)
    assert not torch.allclose(a, c)
    # block index = head index: head h equals block h of the same stream
    ref = conditioned_blocks(11, "semi_orthogonal", range(4), (8, 50))
    assert torch.equal(a.view(4, 8, 50), ref)


def test_generator_semantics():
    w1, w2, w3 = torch.empty(16, 40), torch.empty(16, 40), torch.empty(16, 40)
    torch.manual_seed(123)
    semi_orthogonal_(w1, head_dim=4)
    torch.manual_seed(123)
    semi_orthogonal_(w2, head_dim=4)
    semi_orthogonal_(w3, head_dim=4)            # the default generator advanced: new draw
    assert torch.equal(w1, w2) and not torch.equal(w2, w3)
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    a, b = torch.empty(16, 40), torch.empty(16, 40)
    semi_orthogonal_(a, generator=g1)
    semi_orthogonal_(b, generator=g2)
    assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_storage_dtype_and_strides(dtype):
    ref = semi_orthogonal_(torch.empty(24, 60), head_dim=8, seed=1)
    w = semi_orthogonal_(torch.empty(24, 60, dtype=dtype), head_dim=8, seed=1)
    assert w.dtype == dtype
    assert torch.equal(w, ref.to(dtype))              # rounded once from the fp32 result
    t = torch.empty(60, 24, dtype=dtype).t()          # non-contiguous nn.Linear-shaped weight
    semi_orthogonal_(t, head_dim=8, seed=1)
    assert t.stride() == (1, 24) and torch.equal(t, ref.to(dtype))
    conv = torch.empty(8, 3, 5, 4)                    # trailing dims flattened like nn.init.orthogonal_
    semi_orthogonal_(conv, seed=2)
    assert rows_err(conv.view(8, -1)) <= 1e-5
    nv = torch.empty(3, 5, 4, 8).permute(3, 0, 1, 2)  # not viewable as [8, 60]: written back by copy
    semi_orthogonal_(nv, seed=2)
    assert torch.equal(nv, conv)


def test_rect_identity():
    w = torch.randn(48, 20)
    rect_identity_(w)
    assert torch.equal(w, torch.eye(48, 20))
    rect_identity_(w, head_dim=16, per_head=True)
    assert torch.equal(w, torch.eye(16, 20).repeat(3, 1))
    t = torch.randn(20, 48).t()
    rect_identity_(t)
    assert torch.equal(t, torch.eye(48, 20)) and t.stride() == (1, 48)
    b = torch.randn(6, 10, dtype=torch.bfloat16)
    assert torch.equal(rect_identity_(b), torch.eye(6, 10, dtype=torch.bfloat16))


def _layer(H, Hkv, d, D, dtype=torch.float32, bias=True):
    g = torch.Generator().manual_seed(H * 1000 + D)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=dtype)  # noqa: E731 (never zeros: must be overwritten)
    out = {"q": mk(H * d, D), "k": mk(Hkv * d, D), "v": mk(Hkv * d, D)}
    if bias:
        out.update(q_bias=mk(H * d), k_bias=mk(Hkv * d), v_bias=mk(Hkv * d))
    return out


@pytest.mark.parametrize("H,Hkv,d,D", [(4, 4, 8, 40), (6, 2, 5, 33), (8, 1, 4, 32), (2, 1, 24, 16)])
def test_conditioned_init_layer(H, Hkv, d, D):
    L = _layer(H, Hkv, d, D)
    conditioned_init_(L["q"], L["k"], L["v"], num_heads=H, num_kv_heads=Hkv, q_bias=L["q_bias"],
                      k_bias=L["k_bias"], v_bias=L["v_bias"], seed=9, layer_index=3)
    check = rows_err if d <= D else cols_err
    assert check(L["q"].view(H, d, D)) <= 1e-5
    assert check(L["k"].view(Hkv, d, D)) <= 1e-5
    assert torch.equal(L["v"], torch.eye(Hkv * d, D))
    for key in ("q_bias", "k_bias", "v_bias"):
        assert torch.equal(L[key], torch.zeros_like(L[key]))
    # the documented block ids: Q head h of layer 3 is block 3 * 2**32 + h of stream "q"
    ref = conditioned_blocks(9, "q", range(3 * LAYER_STRIDE, 3 * LAYER_STRIDE + H), (d, D))
    assert torch.equal(L["q"].view(H, d, D), ref)
    refk = conditioned_blocks(9, stream_id("k"), range(3 * LAYER_STRIDE, 3 * LAYER_STRIDE + Hkv), (d, D))
    assert torch.equal(L["k"].view(Hkv, d, D), refk)
    L2 = _layer(H, Hkv, d, D, bias=False)
    conditioned_init_(L2["q"], L2["k"], L2["v"], num_heads=H, num_kv_heads=Hkv, seed=9, v_mode="identity_per_head")
    assert torch.equal(L2["v"], torch.eye(d, D).repeat(Hkv, 1))


@pytest.mark.parametrize("method", ["auto", "polar"])
def test_layers_one_by_one_all_at_once_chunked_sharded_identical(method):
    H, Hkv, d, D, n = 4, 2, 8, 64, 7
    all_at_once = [_layer(H, Hkv, d, D) for _ in range(n)]
    conditioned_init_layers_(all_at_once, num_heads=H, num_kv_heads=Hkv, seed=77, method=method)
    for i in range(n):  # one by one
        L = _layer(H, Hkv, d, D)
        conditioned_init_(L["q"], L["k"], L["v"], num_heads=H, num_kv_heads=Hkv, seed=77, layer_index=i,
                          method=method)
        assert torch.equal(L["q"], all_at_once[i]["q"]) and torch.equal(L["k"], all_at_once[i]["k"])
    for chunk in ([0, 1, 2], [3, 4], [5, 6]):  # chunks of layers, other order, tuples, small budgets
        layers = [_layer(H, Hkv, d, D) for _ in chunk]
        conditioned_init_layers_([(x["q"], x["k"], x["v"]) for x in reversed(layers)], num_heads=H,
                                 num_kv_heads=Hkv, seed=77, layer_indices=list(reversed(chunk)),
                                 memory_budget=3 * 4 * d * D, method=method)
        for i, x in zip(chunk, layers):
            assert torch.equal(x["q"], all_at_once[i]["q"]) and torch.equal(x["k"], all_at_once[i]["k"])
    # a shard owning rows 2..5 of Q heads 1..2 of layer 5
    blocks = conditioned_blocks(77, "q", [5 * LAYER_STRIDE + 1, 5 * LAYER_STRIDE + 2], (d, D), method, rows=slice(2, 6))
    assert torch.equal(blocks, all_at_once[5]["q"].view(H, d, D)[1:3, 2:6])


@pytest.mark.slow
def test_same_bits_across_runs():
    """A fresh interpreter produces the same bits for the same (seed, stream, blocks)."""
    import hashlib
    import subprocess
    import sys
    code = ("import hashlib, torch\n"
            "from condinit.init import conditioned_blocks\n"
            "for meth in ('householder', 'cholqr2', 'polar'):\n"
            "    x = conditioned_blocks(2026, 'q', [0, 5, 1], (8, 32), meth)\n"
            "    print(hashlib.sha256(x.numpy().tobytes()).hexdigest())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    here = [hashlib.sha256(conditioned_blocks(2026, "q", [0, 5, 1], (8, 32), m).numpy().tobytes()).hexdigest()
            for m in ("householder", "cholqr2", "polar")]
    assert out.stdout.split() == here
    a = conditioned_blocks(2026, "q", [0, 1], (8, 32), "householder")
    b = conditioned_blocks(2026, "q", [1, 0], (8, 32), "cholqr2")
    torch.testing.assert_close(a, b.flip(0), atol=2e-6, rtol=0)   # same Q from QR and CholeskyQR


def test_bf16_layers_rounded_once():
    L32 = _layer(4, 2, 8, 48)
    L16 = {k: v.to(torch.bfloat16) for k, v in _layer(4, 2, 8, 48).items()}
    conditioned_init_layers_([L32], num_heads=4, num_kv_heads=2, seed=1)
    conditioned_init_layers_([L16], num_heads=4, num_kv_heads=2, seed=1)
    for key in ("q", "k", "v"):
        assert L16[key].dtype == torch.bfloat16 and torch.equal(L16[key], L32[key].to(torch.bfloat16))


def test_meta_is_noop():
    w = torch.empty(16, 32, device="meta")
    assert semi_orthogonal_(w, head_dim=4) is w
    assert rect_identity_(w) is w
    conditioned_init_(w, torch.empty(8, 32, device="meta"), torch.empty(8, 32, device="meta"),
                      num_heads=4, num_kv_heads=2, seed=0)
    with pytest.raises(ValueError, match="head_dim"):   # still validated
        semi_orthogonal_(w, head_dim=5)


def test_bad_input_leaves_tensors_untouched():
    w = torch.randn(12, 20)
    assert_refused(lambda: semi_orthogonal_(torch.ones(4, 4, dtype=torch.int32)), [w], exc=TypeError, match="weight")
    assert_refused(lambda: semi_orthogonal_(torch.ones(4, 4, dtype=torch.complex64)), [w], exc=TypeError, match="weight")
    assert_refused(lambda: semi_orthogonal_(torch.ones(4)), [w], match="weight")
    assert_refused(lambda: semi_orthogonal_(torch.ones(0, 4)), [w], match="zero-size")
    assert_refused(lambda: semi_orthogonal_(w, head_dim=5), [w], match="head_dim")
    assert_refused(lambda: semi_orthogonal_(w, head_dim=0), [w], match="head_dim")
    assert_refused(lambda: semi_orthogonal_(w, gain=0.0), [w], match="gain")
    assert_refused(lambda: semi_orthogonal_(w, gain=-1.0), [w], match="gain")
    assert_refused(lambda: semi_orthogonal_(w, method="qr"), [w], match="method")
    assert_refused(lambda: rect_identity_(w, head_dim=7), [w], match="head_dim")
    assert_refused(lambda: rect_identity_(w, per_head=True), [w], match="head_dim")
    good, bad = _layer(4, 2, 8, 32), _layer(4, 2, 8, 32)
    tensors = list(good.values()) + list(bad.values())
    bad_q = dict(bad, q=torch.randn(30, 32))
    assert_refused(lambda: conditioned_init_layers_([good, bad_q], num_heads=4, num_kv_heads=2, seed=0),
                   tensors, match="num_heads")
    assert_refused(lambda: conditioned_init_layers_([good, dict(bad, k_bias=torch.randn(3))], num_heads=4,
                                                    num_kv_heads=2, seed=0), tensors, match="k_bias")
    assert_refused(lambda: conditioned_init_layers_([good, dict(bad, v=torch.ones(16, 32, dtype=torch.int64))],
                                                    num_heads=4, num_kv_heads=2, seed=0), tensors, exc=TypeError,
                   match="v")
    assert_refused(lambda: conditioned_init_layers_([good], num_heads=4, num_kv_heads=3, seed=0), tensors,
                   match="num_kv_heads")
    assert_refused(lambda: conditioned_init_layers_([good], num_heads=4, num_kv_heads=2, v_mode="eye", seed=0),
                   tensors, match="v_mode")
    assert_refused(lambda: conditioned_init_layers_([good], num_heads=4, num_kv_heads=2, method="lu", seed=0),
                   tensors, match="method")
    assert_refused(lambda: conditioned_init_layers_([good, bad], num_heads=4, num_kv_heads=2, layer_indices=[0],
                                                    seed=0), tensors, match="layer_indices")
    assert_refused(lambda: conditioned_init_(good["q"], good["k"], good["v"], num_heads=4, num_kv_heads=2,
                                             layer_index=-1, seed=0), tensors, match="layer_index")


def test_seed_generator_and_stream_arguments():
    """Every in-place function takes seed in [0, 2**64) or a generator (not both), like torch.nn.init
    takes a generator; nothing is written when they are refused."""
    w = torch.randn(8, 16)
    before = w.clone()
    calls = {
        "semi_orthogonal_": lambda **kw: semi_orthogonal_(w, head_dim=4, **kw),
        "conditioned_init_": lambda **kw: conditioned_init_(w, w[:4], w[:4], num_heads=2, num_kv_heads=1, **kw),
        "conditioned_init_layers_": lambda **kw: conditioned_init_layers_([(w, None, None)], num_heads=2, **kw),
    }
    for name, fn in calls.items():
        for bad in (-1, 2 ** 64):
            with pytest.raises(ValueError, match=r"seed must be an int in \[0, 2\*\*64\)"):
                fn(seed=bad)
        for bad in (1.0, True, "0"):
            with pytest.raises(TypeError, match="seed"):
                fn(seed=bad)
        with pytest.raises(ValueError, match="either seed or generator"):
            fn(seed=1, generator=torch.Generator())
        with pytest.raises(TypeError, match="generator"):
            fn(generator=7)
        assert torch.equal(w, before), name
    with pytest.raises(TypeError, match="num_heads"):
        conditioned_init_layers_([(w, None, None)], num_heads=True, seed=0)
    with pytest.raises(ValueError, match="memory_budget"):
        conditioned_init_layers_([(w, None, None)], num_heads=2, seed=0, memory_budget=0)
    for bad in (-1, 2 ** 32):
        with pytest.raises(ValueError, match="stream"):
            semi_orthogonal_(w, seed=0, stream=bad)
    with pytest.raises(TypeError, match="seed"):
        conditioned_blocks(None, "q", [0], (4, 8))
    with pytest.raises(ValueError, match="block_shape"):
        conditioned_blocks(0, "q", [0], (0, 8))
    with pytest.raises(ValueError, match="layer_indices"):
        conditioned_init_layers_([(w, None, None)], num_heads=2, seed=0, layer_indices=[2 ** 31])
    assert torch.equal(w, before)
    # the ends of the range are valid seeds; seed=None draws from the generator
    a, b = torch.empty(8, 16), torch.empty(8, 16)
    semi_orthogonal_(a, seed=2 ** 64 - 1)
    semi_orthogonal_(b, seed=0)
    assert not torch.equal(a, b)
    L1, L2 = _layer(4, 2, 8, 32), _layer(4, 2, 8, 32)
    torch.manual_seed(8)
    conditioned_init_(L1["q"], L1["k"], L1["v"], num_heads=4, num_kv_heads=2)
    conditioned_init_layers_([L2], num_heads=4, num_kv_heads=2, generator=torch.Generator().manual_seed(8))
    assert torch.equal(L1["q"], L2["q"]) and torch.equal(L1["k"], L2["k"])


@pytest.mark.parametrize("d,D", [(8, 32), (16, 8)])   # wide and tall blocks
def test_plan_regions_equal_whole_matrix(d, D):
    """The executor writes any rectangular region of a projection (rows cutting heads, a column
    range: what one rank of a sharded model holds) with the bits of the whole-matrix init."""
    from condinit.init.plan import InitPlan, run_plan

    H, first = 4, 7 * LAYER_STRIDE
    whole = torch.empty(H * d, D)
    plan = InitPlan()
    plan.add_heads(stream_id("q"), first, whole, d, D)
    run_plan(plan, 3, "auto")
    row_cuts, col_cuts = [0, d // 2 + 1, 2 * d + 3, H * d], [0, D // 3, D]
    pieces = [(r0, r1, c0, c1) for r0, r1 in zip(row_cuts, row_cuts[1:]) for c0, c1 in zip(col_cuts, col_cuts[1:])]
    for dtype in (torch.float32, torch.bfloat16):
        got = torch.full((H * d, D), float("nan"), dtype=dtype)
        plan = InitPlan()
        for r0, r1, c0, c1 in pieces:
            plan.add_heads(stream_id("q"), first, got[r0:r1, c0:c1], d, D, row_lo=r0, col_lo=c0)
        launches, _ = run_plan(plan, 3, "auto")
        assert launches >= 1 and torch.equal(got, whole.to(dtype))
    for head_dim in (None, d):   # V: the rectangular identity, whole or per head, piece by piece
        ref = rect_identity_(torch.empty(H * d, D), head_dim=d, per_head=head_dim is not None)
        got = torch.full((H * d, D), float("nan"))
        plan = InitPlan()
        for r0, r1, c0, c1 in pieces:
            plan.add_identity(got[r0:r1, c0:c1], row_lo=r0, col_lo=c0, head_dim=head_dim)
        run_plan(plan, 0, "auto")
        assert torch.equal(got, ref)


def test_in_place_functions_work_on_parameters_that_require_grad():
    """Like torch.nn.init: the in-place initializers write into nn.Parameters (requires_grad=True,
    also from the CPU worker threads, where grad mode is thread-local) and leave them leaves."""
    import torch.nn as nn
    from condinit.init import conditioned_init_, recondition_, rect_identity_, semi_orthogonal_

    q, k, v = nn.Linear(256, 256), nn.Linear(256, 64), nn.Linear(256, 64)
    conditioned_init_(q.weight, k.weight, v.weight, num_heads=8, num_kv_heads=2, q_bias=q.bias,
                      k_bias=k.bias, v_bias=v.bias, seed=3)
    semi_orthogonal_(q.weight, head_dim=32, seed=4)
    rect_identity_(v.weight)
    recondition_(k.weight, max_cond=2.0, head_dim=32)
    for p in (q.weight, k.weight, v.weight, q.bias):
        assert p.requires_grad and p.is_leaf and p.grad_fn is None
    blocks = q.weight.detach().view(8, 32, 256)
    eye = torch.eye(32)
    assert (blocks @ blocks.mT - eye).abs().max() <= 1e-5
    assert torch.count_nonzero(q.bias) == 0
    (q(torch.randn(2, 256)).sum()).backward()  # still trainable
    assert q.weight.grad is not None


@pytest.mark.parametrize("method", ["auto", "householder", "svd"])
def test_batched_init_draws_inside_the_factorization_with_randns_bits(method, monkeypatch):
    """On the CPU the native factorizations draw each block's Gaussians themselves (one team per
    chunk); the weights equal those of the same call with the generator forced to the PyTorch
    reference (which fills every chunk before factoring it), bit for bit, also with chunks of one
    block padded to two and layers of different head counts in one group."""
    from condinit import _backends
    import random as _random
    seed = _random.getrandbits(63)

    def run():
        layers = [{"q": torch.empty(6 * 16, 80), "k": torch.empty(2 * 16, 80), "v": torch.empty(2 * 16, 80)}
                  for _ in range(3)]
        conditioned_init_layers_(layers, num_heads=6, num_kv_heads=2, seed=seed, method=method,
                                 memory_budget=3 * 4 * 16 * 80)
        return layers

    fused = run()
    monkeypatch.setenv("CONDINIT_BACKEND", "randn=torch")
    _backends.reset()
    try:
        filled = run()
    finally:
        monkeypatch.delenv("CONDINIT_BACKEND")
        _backends.reset()
    for a, b in zip(fused, filled):
        for name in ("q", "k", "v"):
            assert torch.equal(a[name], b[name]), name
