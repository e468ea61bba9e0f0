"""The brackets of the kappa estimates contain the truth, over many seeded random attention layers.

The reference is the dense Jacobian of the layer's own forward by ``torch.func.jacrev`` (a naive
float64 attention, or a Hugging Face module's forward), its singular values by
``torch.linalg.svdvals``, and kappa over those above ``1e-10 sigma_max`` (the nonzero ones). Cases:
causal and bidirectional, grouped-query 1:1, 2:1 and 4:1, N below, equal to and above the head
dim, one or two sequences, left padding (the first tokens one repeated pad embedding, no padding
mask: the operator does not model one, so neither does the reference), and Hugging Face Llama
(RoPE), Qwen3 (RoPE and QK-norm), Gemma-2 (sliding window, soft-capping), GPT-NeoX (partial
rotary, biases) and BERT (``BertSelfAttention``, bidirectional, biases) layers. Each case checks,
at the defaults, that ``[lo, hi]`` of sigma_max, sigma_min and kappa holds the reference for
``condition_number`` (``method="auto"``) and ``lanczos_svd`` (Lanczos, 300 steps, tol 0.1), and that
Lanczos run to the end equals the reference to 1e-6. Where ``J`` is block diagonal over its
key/value groups, ``condition_number`` runs per block (its dense path), and Lanczos per block
(``blocks=True``) is checked too.

A reference with singular values in ``(1e-13, 1e-10] sigma_max`` (a near-degeneracy, not a null
direction: those sit near 1e-16) has no kappa; there an exact estimate must say rank-deficient.
"""
import math

import pytest
import torch

from condinit.probe import condition_number, lanczos_svd

from test_probe_operator import F64, _adapter, make, reference_jacobian  # noqa: F401 (fixtures)

pytestmark = pytest.mark.usefixtures("one_thread")

GQA = ((2, 2), (2, 1), (4, 1), (1, 1))


def _tiny_case(g: torch.Generator, i: int):
    """A random small layer: (description, operator, dense reference J)."""
    pick = lambda seq: seq[int(torch.randint(len(seq), (1,), generator=g))]  # noqa: E731
    wrt, causal, (H, Hkv) = pick(("weights", "input", "qkv")), pick((False, True)), pick(GQA)
    d = pick((2, 4))
    N = max(1, d + pick((-1, 0, 2)))           # below / equal / above the head dim
    B, D, pad = pick((1, 1, 2)), pick((6, 8)), pick((0, 0, 0, 1, 2))
    seed = int(torch.randint(2 ** 31, (1,), generator=g))
    x_fn = None
    if pad and pad < N:
        def x_fn(x, pad=pad):                    # left padding: the first tokens one pad embedding
            x = x.clone()
            x[:, :pad] = x[:1, :1]
            return x
    m, x, op = make(wrt, causal, B=B, N=N, D=D, H=H, Hkv=Hkv, d=d, seed=seed, x_fn=x_fn)
    what = f"case {i}: wrt={wrt} causal={causal} H={H} Hkv={Hkv} d={d} N={N} B={B} D={D} pad={pad} seed={seed}"
    return what, op, reference_jacobian(m, x, wrt, causal)


def _hf_case(g: torch.Generator, i: int, mp):
    """A random Hugging Face layer (its float64 patches active in ``mp`` while the case is used: the
    operator's QK-norm calls the norm class's forward)."""
    import test_operator_real_attention as real
    from condinit.probe import JacobianOperator

    pick = lambda seq: seq[int(torch.randint(len(seq), (1,), generator=g))]  # noqa: E731
    name, wrt, kv = pick(("llama", "qwen3", "gemma2", "neox")), pick(("weights", "input")), pick((4, 2))
    kv = 4 if name == "neox" else kv
    seed = int(torch.randint(2 ** 31, (1,), generator=g))
    attn, x, kwargs = real._build(name, seed, mp, kv)
    op = JacobianOperator(attn, x, wrt=wrt, causal=True, dtype=F64, position_embeddings=kwargs["position_embeddings"])
    J = real.reference_jacobian(attn, x, kwargs, wrt, op.H, op.d).detach()
    return f"case {i}: {name} wrt={wrt} kv_heads={kv} seed={seed}", op, J


def _bert_case(g: torch.Generator, i: int, mp):
    """A random ``BertSelfAttention`` (bidirectional, biases, float64) from a tiny ``BertConfig``; the
    reference is jacrev of the module's own forward (its context output, before ``BertSelfOutput``)."""
    import test_operator_real_attention as real
    from transformers import BertConfig
    from transformers.models.bert import modeling_bert
    from condinit.probe import JacobianOperator

    pick = lambda seq: seq[int(torch.randint(len(seq), (1,), generator=g))]  # noqa: E731
    H, d, N, wrt = pick((1, 2, 3)), pick((2, 4)), pick((3, 5, 6)), pick(("weights", "input"))
    seed = int(torch.randint(2 ** 31, (1,), generator=g))
    cfg = BertConfig(hidden_size=H * d, num_attention_heads=H, intermediate_size=8, attention_probs_dropout_prob=0.0)
    cfg._attn_implementation = "eager"
    mp.setattr(modeling_bert, "eager_attention_forward", real._float64_source(modeling_bert.eager_attention_forward))
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        attn = modeling_bert.BertSelfAttention(cfg).to(F64).eval()
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=F64) / math.sqrt(H * d))
    x = torch.randn(1, N, H * d, generator=gen, dtype=F64)

    def heads_first(y):
        return y.reshape(1, N, H, d).transpose(1, 2).reshape(-1)

    if wrt == "input":
        J = torch.func.jacrev(lambda xx: heads_first(attn(xx)[0]))(x).reshape(H * N * d, -1)
    else:
        names = ("query.weight", "key.weight", "value.weight")
        base = {k: v.detach() for k, v in attn.named_parameters()}

        def f(*ws):
            return heads_first(torch.func.functional_call(attn, {**base, **dict(zip(names, ws))}, (x,))[0])
        js = torch.func.jacrev(f, argnums=(0, 1, 2))(*(base[n] for n in names))
        J = torch.cat([j.reshape(j.shape[0], -1) for j in js], dim=1)
    op = JacobianOperator(attn, x, wrt=wrt, causal=False, dtype=F64)
    return f"case {i}: bert wrt={wrt} H={H} d={d} N={N} seed={seed}", op, J.detach()


def _check(est, s, what):
    """The estimate's brackets against the reference singular values ``s`` (descending)."""
    s1 = float(s[0])
    assert est.sigma_max_lo <= s1 <= est.sigma_max_hi, (what, est.method, est.sigma_max_lo, s1, est.sigma_max_hi)
    # the reported values lie inside the reported brackets
    assert est.sigma_max_lo <= est.sigma_max <= est.sigma_max_hi, (what, est.method)
    assert est.sigma_min_lo <= est.sigma_min <= est.sigma_min_hi, (what, est.method)
    if est.kappa is not None:
        assert est.kappa_lo <= est.kappa <= est.kappa_hi, (what, est.method, est.kappa_lo, est.kappa, est.kappa_hi)
    band = s[(s > 1e-13 * s1) & (s <= 1e-10 * s1)]
    if len(band):                                # near-degenerate: no reference kappa
        if est.exact:
            assert est.rank_deficient, (what, est.method, float(band[-1]) / s1)
        assert est.sigma_min_hi >= float(band[-1]) * (1 - 1e-9), (what, est.method)
        return "near-degenerate"
    smin = float(s[s > 1e-10 * s1][-1])
    assert not est.rank_deficient, (what, est.method, est.sigma_min, smin)
    assert est.sigma_min_lo <= smin <= est.sigma_min_hi, (what, est.method, est.sigma_min_lo, smin, est.sigma_min_hi)
    assert est.kappa_lo <= s1 / smin <= est.kappa_hi, (what, est.method, est.kappa_lo, s1 / smin, est.kappa_hi)
    return "kappa"


def _run(cases, seed):
    kinds = {"kappa": 0, "near-degenerate": 0}
    for what, op, J in cases:
        s = torch.linalg.svdvals(J)
        if float(s[0]) == 0.0:
            continue
        auto = condition_number(op, seed=seed % 1000)
        assert auto.converged, (what, auto.method, auto.notes)     # dense, or Lanczos where that is cheaper
        kinds[_check(auto, s, what)] += 1
        _check(lanczos_svd(op, seed=seed % 1000), s, what)
        _check(lanczos_svd(op, seed=seed % 1000, blocks=True), s, what)
        full = lanczos_svd(op, steps=10_000, tol=0.0, seed=seed % 1000)
        _check(full, s, what)
        nz = s[s > 1e-10 * float(s[0])]
        assert abs(full.sigma_max - float(s[0])) <= 1e-6 * float(s[0]), what
        assert full.exact, (what, full.notes)
        if not full.rank_deficient:
            for est in (full, auto) if auto.exact else (full,):
                assert abs(est.sigma_min - float(nz[-1])) <= 1e-6 * float(nz[-1]), (what, est.method)
                assert abs(est.kappa - float(s[0] / nz[-1])) <= 1e-6 * float(s[0] / nz[-1]), (what, est.method)
    return kinds


def test_brackets_contain_the_truth_fast(seed):
    g = torch.Generator().manual_seed(seed)
    kinds = _run((_tiny_case(g, i) for i in range(20)), seed)
    assert kinds["kappa"] >= 10, kinds           # most random cases have a kappa to bracket


@pytest.mark.slow
def test_brackets_contain_the_truth_many(seed):
    g = torch.Generator().manual_seed(seed)
    kinds = _run((_tiny_case(g, i) for i in range(300)), seed)
    assert kinds["kappa"] >= 150, kinds


@pytest.mark.slow
def test_brackets_contain_the_truth_hf_modules(seed, monkeypatch):
    pytest.importorskip("transformers")
    g = torch.Generator().manual_seed(seed)
    kinds = {"kappa": 0, "near-degenerate": 0}
    for i in range(24):
        with monkeypatch.context() as mp:        # HF's float64 patches, undone after each case
            for k, v in _run([_hf_case(g, i, mp)], seed).items():
                kinds[k] += v
    assert kinds["kappa"] >= 12, kinds


@pytest.mark.slow
def test_brackets_contain_the_truth_bert(seed, monkeypatch):
    """Hugging Face BERT self-attention (bidirectional): the brackets at the defaults hold the reference,
    Lanczos run to the end equals it to 1e-6."""
    pytest.importorskip("transformers")
    g = torch.Generator().manual_seed(seed)
    kinds = {"kappa": 0, "near-degenerate": 0}
    for i in range(12):
        with monkeypatch.context() as mp:
            for k, v in _run([_bert_case(g, i, mp)], seed).items():
                kinds[k] += v
    assert kinds["kappa"] >= 6, kinds


def test_brackets_contain_the_truth_bert_fast(seed, monkeypatch):
    pytest.importorskip("transformers")
    g = torch.Generator().manual_seed(seed)
    with monkeypatch.context() as mp:
        _run([_bert_case(g, 0, mp)], seed)


def test_dense_auto_is_declared(seed):
    """The automatic dense path says so; Lanczos alone (dense=False) is still Lanczos."""
    m, x, op = make("weights", True, N=6, D=8, H=2, Hkv=1, d=4, seed=seed)
    auto = condition_number(op)
    assert auto.method == "dense-svd" and auto.exact and "dense SVD chosen (dense='auto')" in auto.notes
    assert lanczos_svd(op, dense="auto").method == "dense-svd"
    assert lanczos_svd(op).method == "golub-kahan-lanczos"
    assert condition_number(op, method="lanczos").method == "golub-kahan-lanczos"
    with pytest.raises(ValueError, match="dense must be False, True or 'auto'"):
        lanczos_svd(op, dense="yes")
    assert not math.isnan(auto.sigma_max)


def test_qk_norm_in_float32_widens_the_brackets(seed):
    """Qwen3 as shipped: its q_norm / k_norm compute in float32 whatever their input, so a float64
    operator (and the float64 jacrev reference) is exact only to float32 rounding. The estimate says
    so, its brackets allow for it and hold the reference, and they do not depend on the seed."""
    pytest.importorskip("transformers")
    from transformers import Qwen3Config
    from transformers.models.qwen3 import modeling_qwen3 as mq
    from condinit.probe import JacobianOperator

    g = torch.Generator().manual_seed(seed)
    cfg = Qwen3Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      intermediate_size=32, num_hidden_layers=1)
    cfg._attn_implementation = "eager"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        attn = mq.Qwen3Attention(cfg, 0).to(F64).eval()
    with torch.no_grad():
        for name, p in attn.named_parameters():
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g, dtype=F64) if "norm" in name
                    else torch.randn(p.shape, generator=g, dtype=F64) / math.sqrt(32))
    N = 10
    x = torch.randn(1, N, 32, generator=g, dtype=F64)
    pe = tuple(t.to(F64) for t in mq.Qwen3RotaryEmbedding(cfg)(x, torch.arange(N)[None]))
    op = JacobianOperator(attn, x, dtype=F64, position_embeddings=pe, causal=False)   # no mask: bidirectional
    assert op.rounding_dtype == torch.float32
    names = ("q_proj.weight", "k_proj.weight", "v_proj.weight")
    base = {k: v.detach() for k, v in attn.named_parameters()}
    base["o_proj.weight"] = torch.eye(32, dtype=F64)

    def f(*ws):
        return torch.func.functional_call(attn, {**base, **dict(zip(names, ws))}, (x, pe, None))[0]
    js = torch.func.jacrev(f, argnums=(0, 1, 2))(*(base[n] for n in names))
    s = torch.linalg.svdvals(torch.cat([j.reshape(N * 32, -1) for j in js], 1))
    kappa = float(s[0] / s[s > 1e-5 * s[0]][-1])
    ests = [condition_number(op, seed=sd) for sd in (seed % 1000, seed % 1000 + 1)]
    for est in ests:
        assert "computes in torch.float32" in est.notes, est.notes
        assert est.kappa_lo <= kappa <= est.kappa_hi, (est.kappa_lo, kappa, est.kappa_hi)
    assert (ests[0].kappa_lo, ests[0].kappa_hi) == (ests[1].kappa_lo, ests[1].kappa_hi)
