"""JacobianOperator of the attention a Hugging Face layer really computes (RoPE, QK-norm, sliding
window, soft-capping, GQA, its own scale) against torch.func.jacrev of the module's own forward, in
float64, from its input hidden states to its attention output before o_proj (o_proj's input).

HF computes the softmax and its RMSNorms in float32 whatever the input dtype (an upcast meant for
half precision); for a float64 reference the test runs HF's own source of those functions with that
upcast dtype changed to float64 (``_float64_source``), nothing else.
"""
import inspect
import sys
import textwrap

import pytest
import torch

transformers = pytest.importorskip("transformers")

from condinit.probe import JacobianOperator, lanczos_svd  # noqa: E402
from condinit.probe.estimators import _Effective  # noqa: E402

F64 = torch.float64
pytestmark = pytest.mark.usefixtures("one_thread")

B, N = 1, 6


def _float64_source(fn):
    """``fn`` recompiled from its own source with its float32 upcasts made float64 upcasts."""
    src = textwrap.dedent(inspect.getsource(fn))
    src = src.replace("torch.float32", "torch.float64").replace(".float()", ".double()")
    ns = {}
    exec(compile(src, f"<float64 {fn.__qualname__}>", "exec"), fn.__globals__, ns)
    return ns[fn.__name__]


def _configs(kv_heads=4):
    from transformers import (Gemma2Config, Gemma3TextConfig, GPTNeoXConfig, LlamaConfig, MistralConfig, Olmo2Config,
                              Qwen3Config)

    common = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=kv_heads, max_position_embeddings=32)
    return {
        "llama": LlamaConfig(**common),
        "qwen3": Qwen3Config(**common, head_dim=4),
        "olmo2": Olmo2Config(**common),
        # layer 0 is a sliding layer (window 3 < N) with soft-capping 2 (active at these score sizes)
        "gemma2": Gemma2Config(**common, head_dim=4, sliding_window=3, attn_logit_softcapping=2.0,
                               query_pre_attn_scalar=8, layer_types=["sliding_attention", "full_attention"]),
        "gemma3": Gemma3TextConfig(**common, head_dim=4, sliding_window=3, query_pre_attn_scalar=8,
                                   layer_types=["sliding_attention", "full_attention"]),
        # the window from config.sliding_window (the module holds no sliding_window attribute)
        "mistral": MistralConfig(**common, sliding_window=3),
        # fused [H, 3, d] query_key_value with biases, partial rotary (half of the head)
        "neox": GPTNeoXConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                              num_attention_heads=4, max_position_embeddings=32, attention_bias=True,
                              rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                               "partial_rotary_factor": 0.5}),
    }


def _build(name, seed, monkeypatch, kv_heads=4):
    """(attention module, its input x, its call kwargs) of layer 0 of a tiny float64 model."""
    from transformers import AutoModelForCausalLM

    cfg = _configs(kv_heads)[name]
    cfg._attn_implementation = "eager"
    g = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=F64).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname or "layernorm" in pname:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g, dtype=F64))
            else:
                p.copy_(torch.randn(p.shape, generator=g, dtype=F64) * 0.25)
    layers = model.model.layers if hasattr(model, "model") else model.gpt_neox.layers
    attn = layers[0].self_attn if hasattr(layers[0], "self_attn") else layers[0].attention
    mod = sys.modules[type(attn).__module__]
    monkeypatch.setattr(mod, "eager_attention_forward", _float64_source(mod.eager_attention_forward))
    for cls in {type(sub) for sub in attn.modules() if "Norm" in type(sub).__name__}:
        monkeypatch.setattr(cls, "forward", _float64_source(cls.forward))
    seen = {}

    def grab(m, args, kwargs):
        seen.setdefault("call", (args, kwargs))

    h = attn.register_forward_pre_hook(grab, with_kwargs=True)
    ids = torch.randperm(32, generator=g)[:N].reshape(B, N)        # distinct tokens: X of full rank
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    h.remove()
    args, kwargs = seen["call"]
    x = args[0] if args else kwargs.pop("hidden_states")
    kwargs = {k: v for k, v in kwargs.items() if k != "hidden_states"}
    return attn, x.detach().clone(), kwargs


def _pre_o_proj(attn, x, kwargs, params=None):
    """The module's output before o_proj ([B, N, H d]), captured at o_proj's input."""
    box = []
    out_proj = attn.o_proj if hasattr(attn, "o_proj") else attn.dense
    h = out_proj.register_forward_pre_hook(lambda m, a: box.append(a[0]) and None)
    try:
        if params is None:
            attn(x, **kwargs)
        else:
            torch.func.functional_call(attn, params, (x,), kwargs)
    finally:
        h.remove()
    return box[0]


def _qkv_names(attn):
    if hasattr(attn, "q_proj"):
        return ["q_proj.weight", "k_proj.weight", "v_proj.weight"]
    return ["query_key_value.weight"]


def reference_jacobian(attn, x, kwargs, wrt, H, d):
    """Dense [m, n] Jacobian by jacrev of the HF module, rows in the operator's [B, H, N, d] order."""
    def heads_first(y):
        return y.reshape(B, N, H, d).transpose(1, 2).reshape(-1)

    if wrt == "input":
        J = torch.func.jacrev(lambda xx: heads_first(_pre_o_proj(attn, xx, kwargs)))(x)
        return J.reshape(J.shape[0], -1)
    names = _qkv_names(attn)
    base = {k: v.detach() for k, v in attn.named_parameters()}
    if len(names) == 3:
        def f(wq, wk, wv):
            return heads_first(_pre_o_proj(attn, x, kwargs, {**base, names[0]: wq, names[1]: wk, names[2]: wv}))
        js = torch.func.jacrev(f, argnums=(0, 1, 2))(*(base[n] for n in names))
        return torch.cat([j.reshape(j.shape[0], -1) for j in js], dim=1)
    # fused [H, 3, d] rows: the operator's inputs are (dW_Q, dW_K, dW_V), each [H d, D]
    w = base[names[0]]
    D = w.shape[1]

    def f(wq, wk, wv):
        fused = torch.stack([wq.reshape(H, d, D), wk.reshape(H, d, D), wv.reshape(H, d, D)], 1).reshape(-1, D)
        return heads_first(_pre_o_proj(attn, x, kwargs, {**base, names[0]: fused}))
    parts = w.reshape(H, 3, d, D)
    js = torch.func.jacrev(f, argnums=(0, 1, 2))(*(parts[:, i].reshape(H * d, D) for i in range(3)))
    return torch.cat([j.reshape(j.shape[0], -1) for j in js], dim=1)


def _rel(a, b):
    a, b = a.detach(), b.detach()
    return float(torch.linalg.matrix_norm(a - b) / torch.linalg.matrix_norm(b))


CASES = [(name, wrt, 4) for name in ("llama", "qwen3", "olmo2", "gemma2", "gemma3", "neox")
         for wrt in ("input", "weights")] + [("llama", "weights", 2), ("gemma2", "input", 2), ("qwen3", "weights", 2),
                                             ("mistral", "input", 2)]


@pytest.mark.slow
@pytest.mark.parametrize("name,wrt,kv_heads", CASES)
def test_operator_matches_jacrev_of_the_module(name, wrt, kv_heads, seed, monkeypatch):
    """float64: op.dense() is the module's Jacobian; the stated nulls are nulls of it; Lanczos run to
    the end gives sigma_max, the smallest nonzero singular value and kappa of the dense SVD within
    1e-6, whatever null directions the mask adds beyond the stated ones."""
    attn, x, kwargs = _build(name, seed % 1000, monkeypatch, kv_heads)
    op = JacobianOperator(attn, x, wrt=wrt, causal=True, dtype=F64, position_embeddings=kwargs["position_embeddings"])
    H, d = op.H, op.d
    with torch.no_grad():
        out = _pre_o_proj(attn, x, kwargs)
        assert _rel(op._primal()[3].transpose(1, 2).reshape(B, N, -1)[0], out[0]) < 1e-12, "forward differs"
    J = reference_jacobian(attn, x, kwargs, wrt, H, d).detach()     # (the parameters require grad)
    assert J.shape == op.shape
    assert _rel(op.dense(), J) < 1e-10
    # the adjoint is the transpose
    u = torch.randn(op.m, dtype=F64, generator=torch.Generator().manual_seed(seed))
    torch.testing.assert_close(op.rmv(u), J.t() @ u, rtol=1e-10, atol=1e-12)
    # the stated null directions are nulls of the module's own Jacobian
    Jin = op.project_input(J)                         # J P_in (projection acts on the rows' input side)
    assert float(torch.linalg.matrix_norm(J - Jin)) <= 1e-10 * float(torch.linalg.matrix_norm(J))
    Jc = op.project_output(Jin.t()).t()
    assert float(torch.linalg.matrix_norm(Jin - Jc)) <= 1e-10 * float(torch.linalg.matrix_norm(J))
    # sigma_max and kappa over the nonzero spectrum: Lanczos to the end against the dense SVD (J's
    # values above 1e-12 sigma_max are nonzero; the float64 Jacobian's exact nulls sit near 1e-14)
    r = _Effective(op).r
    s = torch.linalg.svdvals(Jc)
    nonzero = s[s > 1e-12 * s[0]]
    smax, smin = float(s[0]), float(nonzero[-1])
    est = lanczos_svd(op, steps=r, seed=seed)
    assert abs(est.sigma_max - smax) <= 1e-6 * smax
    if est.rank_deficient:
        # a singular value at the rounding floor (below 1e-12 sigma_max, so not in `nonzero`) that the
        # certified ceiling finds: the dense J has one at most that large
        assert est.sigma_min_hi <= 1e-10 * smax and float(s[min(op.shape) - 1]) <= est.sigma_min_hi, \
            (est.sigma_min_hi, s[-3:])
    else:
        assert abs(est.sigma_min - smin) <= 1e-6 * smin + 1e-12 * smax
        assert abs(est.kappa - smax / smin) <= 1e-6 * smax / smin
    # what the operator models is named in the estimate
    assert "Operator" in est.subspace and "modelled" in est.subspace
    assert ("plain torch" in est.notes) == (op.softcap is not None)
    for feature, word in (("rope", "RoPE"), ("q_norm", "q_norm"), ("softcap", "soft-capping"),
                          ("window", "sliding window")):
        present = {"rope": op._rope_cs is not None, "q_norm": op.q_norm is not None,
                   "softcap": op.softcap is not None, "window": op.window is not None}[feature]
        modelled = est.subspace.split("Operator: ")[1].split("Not modelled")[0]
        assert (word in modelled) == present, (feature, est.subspace)
    # the rank decision agrees with the dense SVD: a genuinely tiny nonzero singular value, never a
    # null direction of the mask
    assert est.rank_deficient == (smin <= 1e-10 * smax) or abs(smin / smax - 1e-10) < 1e-11


def test_features_are_read_from_the_module(monkeypatch):
    """Each model's transforms are detected (a missing one would still pass a weaker jacrev check
    only by accident); RoPE is reported excluded when no cos/sin are given."""
    expect = {"llama": dict(norm=None, softcap=None, window=None),
              "qwen3": dict(norm=False, softcap=None, window=None),
              "olmo2": dict(norm=True, softcap=None, window=None),
              "gemma2": dict(norm=None, softcap=2.0, window=(2, -1)),
              "gemma3": dict(norm=False, softcap=None, window=(2, -1))}
    for name, e in expect.items():
        attn, x, kwargs = _build(name, 0, monkeypatch)
        op = JacobianOperator(attn, x, causal=True, dtype=F64, position_embeddings=kwargs["position_embeddings"])
        assert (op.q_norm is None) == (e["norm"] is None), name
        if e["norm"] is not None:
            assert op.q_norm.whole == e["norm"] and op.k_norm.whole == e["norm"], name
        assert op.softcap == e["softcap"] and op.window == e["window"], name
        assert op.scale == attn.scaling and op._rope_cs is not None
        bare = JacobianOperator(attn, x, causal=True, dtype=F64)
        assert "RoPE (the module takes position_embeddings; none were given)" in bare.description
        with pytest.raises(ValueError, match="transforms"):
            JacobianOperator(attn, x, dtype=F64, transforms="none", position_embeddings=kwargs["position_embeddings"])
        none = JacobianOperator(attn, x, causal=True, dtype=F64, transforms="none")
        assert none.q_norm is None and none.softcap is None and none.window is None
        assert "transforms='none'" in none.description


def test_neox_fused_biases_are_read_per_head(monkeypatch):
    """GPT-NeoX's [H, 3, d] query_key_value: each projection's bias is read through its layout."""
    attn, x, kwargs = _build("neox", 3, monkeypatch)
    op = JacobianOperator(attn, x, causal=True, dtype=F64)
    H, d = op.H, op.d
    b = attn.query_key_value.bias.detach().reshape(H, 3, d)
    for i, got in enumerate((op.bq, op.bk, op.bv)):
        assert torch.equal(got, b[:, i].reshape(-1))
    w = attn.query_key_value.weight.detach().reshape(H, 3, d, -1)
    assert torch.equal(op.Wk, w[:, 1].reshape(H * d, -1))


def test_rope_gauge_dimension(monkeypatch):
    """Under RoPE the Q/K gauge keeps only the maps commuting with the rotations: 2 per frequency
    plane and key/value head (d per head), no more (the jacrev test shows they are nulls)."""
    attn, x, kwargs = _build("llama", 1, monkeypatch, kv_heads=2)
    op = JacobianOperator(attn, x, causal=True, dtype=F64, position_embeddings=kwargs["position_embeddings"])
    assert "Q/K gauge" in op.null_description
    full = JacobianOperator(attn, x, causal=True, dtype=F64)         # RoPE left out: the d^2 gauge
    H, Hkv, d, D = op.H, op.Hkv, op.d, op.D
    rows = (H + 2 * Hkv) * d * (D - int(torch.linalg.matrix_rank(x[0])))      # rows of dW in null(X)
    assert op.null_dims[0] - rows == Hkv * d
    # without RoPE: the full d x d gauge, and the key shifts dW_K = c w^T (X w = 1 solves: N < D)
    assert full.null_dims[0] - rows == Hkv * d * d + Hkv * d
