"""Degenerate and non-finite data never crash the probes, the spectrum or the monitor.

One token, an all-zero input, NaN / Inf in inputs or weights, weights at extreme (finite) scales
and autocast regions each give a correct, documented result (exact values where the mathematics
gives one, a clear error for non-finite data, a NaN value with the reason for an overflow), and the
training-time monitor logs them as records instead of raising into the training loop.
"""
import json
import math

import pytest
import torch
from torch import nn

import condinit
from condinit.init import recondition_, spectrum
from condinit.probe import (JacobianMonitor, JacobianOperator, condition_number, condition_number_bound,
                            frobenius_hutchinson, lanczos_svd, power_sigma_max)
from condinit.probe.bound import softmax_jacobian_kappa
from condinit.probe import NonFiniteError

from conftest import F64, assert_close
from helpers import TinyTransformer

pytestmark = pytest.mark.usefixtures("one_thread")


def mha(rng, D=16, H=2, dtype=F64):
    m = nn.MultiheadAttention(D, H, batch_first=True, dtype=dtype)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=rng, dtype=F64) / math.sqrt(D))
    return m


# ------------------------------------------------------------------------------------------------
# one token, x = 0

def test_one_token_bound_is_vacuous_and_measured_kappa_exact(rng):
    """N = 1: softmax over one key is constant, so the bound's kappa(Lambda) is undefined (vacuous
    bound, with the reason); J only sees W_V, J^T u = u x^T, so on the complement every singular
    value is ||x|| (kappa 1)."""
    m = mha(rng)
    x = torch.randn(1, 1, 16, generator=rng, dtype=F64)
    for causal in (False, True):
        res = condition_number_bound(m, x, causal=causal, steps=50, seed=0)
        assert res.bound is None and res.kappa_Lambda is None
        assert "single key" in res.notes and "N = 1" in res.notes
        assert res.per_head == [[None, None]]
        norm = float(torch.linalg.vector_norm(x))
        assert res.measured.sigma_max == pytest.approx(norm, rel=1e-10)
        assert res.measured.sigma_min == pytest.approx(norm, rel=1e-10)
        assert res.measured_kappa == pytest.approx(1.0, rel=1e-10)
    assert torch.isinf(softmax_jacobian_kappa(torch.ones(3, 2, 1, 1, dtype=F64))).all()
    assert softmax_jacobian_kappa(torch.ones(3, 2, 1, 1, dtype=F64)).shape == (3, 2)


def _module_attention_weights(m, x, causal):
    """Per-head attention matrices [B, H, N, N] from nn.MultiheadAttention's own forward."""
    N = x.shape[1]
    mask = torch.ones(N, N, dtype=torch.bool).triu(1) if causal else None
    with torch.no_grad():
        return m(x, x, x, attn_mask=mask, need_weights=True, average_attn_weights=False)[1]


def test_vacuous_bound_says_how_singular_p_is(rng):
    """kappa(P) = inf is explained with the count of (sequence, head) pairs and the smallest
    sigma_min(P) / sigma_max(P), read from the module's own attention weights: a causal P at sharp
    logits (invertible, but its smallest singular value underflows float64's relative rounding), and
    a bidirectional P of repeated tokens (rank one)."""
    m = mha(rng, D=16, H=2)
    with torch.no_grad():
        m.in_proj_weight.mul_(4.0)                     # sharp logits
    x = torch.randn(1, 48, 16, generator=rng, dtype=F64)
    P = _module_attention_weights(m, x, causal=True)
    s = torch.linalg.svdvals(P)
    ratios = s[..., -1] / s[..., 0]
    assert bool((ratios <= 1e-13).all()), ratios      # the case this test needs
    res = condition_number_bound(m, x, causal=True, measure=False)
    assert res.bound is None and res.kappa_softmax is None
    assert "the causal attention matrix is singular to float64 for 2 of 2 (sequence, head) pairs" in res.notes
    shown = float(res.notes.split("down to ")[1].split(",")[0])
    assert shown == pytest.approx(float(ratios.min()), rel=0.06, abs=1e-18), (shown, ratios)
    assert "falls exponentially with N" in res.notes

    rep = x[:, :1].expand(1, 6, 16).contiguous()      # six copies of one token
    res = condition_number_bound(m, rep, causal=False, measure=False)
    assert "the attention matrix is singular to float64 for 2 of 2 (sequence, head) pairs" in res.notes
    assert "e.g. repeated tokens" in res.notes and "kappa(X_b) = inf" in res.notes


def test_zero_input_is_exactly_zero_jacobian(rng):
    """x = 0 (wrt weights): every input direction is a known null (rows of dW in null(X) = R^D), so
    J = 0: sigma_max = sigma_min = 0, rank-deficient, no kappa, the reason in notes."""
    m = mha(rng)
    x = torch.zeros(2, 5, 16, dtype=F64)
    op = JacobianOperator(m, x, wrt="weights")
    assert torch.count_nonzero(op.dense()) == 0
    for est in (lanczos_svd(op, steps=10, seed=1), condition_number(op, seed=1),
                condition_number(op, method="dense")):
        assert (est.sigma_max, est.sigma_min, est.kappa) == (0.0, 0.0, None)
        assert est.rank_deficient and est.converged and "J = 0 exactly" in est.notes
        assert "r = min(m', n') = 0" in est.subspace
    assert power_sigma_max(op, seed=1).sigma_max == 0.0
    fro = frobenius_hutchinson(op, samples=4, seed=1)
    assert (fro.frobenius, fro.ci_low, fro.ci_high) == (0.0, 0.0, 0.0)
    res = condition_number_bound(m, x, steps=5)
    assert res.bound is None and res.kappa_X is None and "kappa(X_b) = inf for sequence(s) 0, 1" in res.notes
    assert res.measured.sigma_max == 0.0 and res.measured_kappa is None


@pytest.mark.parametrize("scale", [2.0 ** -600, 2.0 ** 500])
def test_known_nulls_do_not_depend_on_weight_scale(rng, scale):
    """The null directions depend on ranks only: the same layer at an extreme (finite) scale has the
    same ones (the gauge's Gram matrices would under/overflow float64 unscaled)."""
    m = mha(rng)
    x = torch.randn(2, 5, 16, generator=rng, dtype=F64)
    x[1] = x[1, :1]                                      # a rank-1 sequence, so that X w = 1 is solvable
    ref = JacobianOperator(m, x)
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(scale)
    op = JacobianOperator(m, x)
    assert op.null_dims == ref.null_dims and op.null_description == ref.null_description
    t = torch.randn(op.n, generator=rng, dtype=F64)
    assert_close(op.project_input(t), ref.project_input(t), F64, "projection at an extreme weight scale",
                 factor=100)


def test_float32_capture_in_a_float64_operator_keeps_its_small_directions(rng):
    """A float32 input whose two features are collinear to 3e-7, probed in float64: that direction of X
    is real in the float64 J (not a null to float32 rounding), so it is not deflated; the estimate agrees
    with the dense SVD of the module's own forward (rank-deficient at rank_rtol, sigma_min the reference)."""
    m = mha(rng, D=8, H=2, dtype=torch.float32)
    x = torch.randn(1, 24, 8, generator=rng)
    x[..., 1] = x[..., 0] * (1 + 3e-7) + 1e-7 * torch.randn(24, generator=rng)
    op = JacobianOperator(m, x, dtype=F64)
    names = ("q", "k", "v")
    w = {n: t.detach().double() for n, t in zip(names, m.in_proj_weight.chunk(3))}
    b = {n: t.detach().double() for n, t in zip(names, m.in_proj_bias.chunk(3))}
    xd = x.double()[0]

    def f(wq, wk, wv):                                   # the heads' outputs before W_o, heads first
        q, k, v = (xd @ wm.t() + b[n] for wm, n in zip((wq, wk, wv), names))
        q, k, v = (t.reshape(24, 2, 4).transpose(0, 1) for t in (q, k, v))
        return torch.softmax(q @ k.transpose(1, 2) / 2.0, -1) @ v
    js = torch.func.jacrev(f, argnums=(0, 1, 2))(*w.values())
    s = torch.linalg.svdvals(torch.cat([j.reshape(-1, 64) for j in js], dim=1))
    smin = float(s[s > 1e-13 * s[0]][-1])
    est = lanczos_svd(op, seed=int(torch.randint(1000, (1,), generator=rng)))
    assert est.sigma_min_lo <= smin <= est.sigma_min_hi, (est.sigma_min_lo, smin, est.sigma_min_hi, est.notes)
    assert est.rank_deficient and est.kappa is None


# ------------------------------------------------------------------------------------------------
# argument checks

@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_data_is_refused_at_construction(rng, bad):
    m = mha(rng)
    x = torch.randn(1, 6, 16, generator=rng, dtype=F64)
    x_bad = x.clone()
    x_bad[0, 3, 5] = bad
    with pytest.raises(ValueError, match=r"x must be finite, got NaN or Inf"):
        JacobianOperator(m, x_bad)
    with pytest.raises(NonFiniteError, match="x must be finite"):
        condition_number_bound(m, x_bad)
    q, k, v = (torch.randn(1, 2, 6, 8, generator=rng, dtype=F64) for _ in range(3))
    k[0, 1, 2, 3] = bad
    with pytest.raises(NonFiniteError, match="k must be finite"):
        JacobianOperator((q, k, v), wrt="qkv")
    with torch.no_grad():
        m.in_proj_weight[20, 1] = bad             # a K row of the packed projection
    with pytest.raises(NonFiniteError, match="the k projection's weight must be finite"):
        JacobianOperator(m, x)
    with torch.no_grad():
        m.in_proj_weight[20, 1] = 0.0
        m.out_proj.weight[0, 0] = bad
    JacobianOperator(m, x)                          # W_O unused without include_output_proj
    with pytest.raises(NonFiniteError, match="output projection's weight must be finite"):
        JacobianOperator(m, x, include_output_proj=True)
    # finite in float64, Inf in the requested compute dtype
    with pytest.raises(NonFiniteError, match=r"x must be finite.*float32"):
        JacobianOperator(mha(rng), x * 1e300, dtype=torch.float32)


def test_real_vectors_and_tol_are_checked(rng):
    op = JacobianOperator(mha(rng), torch.randn(1, 6, 16, generator=rng, dtype=F64))
    for call, name, size in ((op.mv, "t", op.n), (op.rmv, "u", op.m)):
        with pytest.raises(TypeError, match=rf"{name} must be a real .*complex128"):
            call(torch.randn(size, dtype=torch.complex128))
    with pytest.raises(TypeError, match=r"T must be a real .*complex64"):
        op.matmat(torch.randn(op.n, 2, dtype=torch.complex64))
    with pytest.raises(TypeError, match=r"U must be a real .*complex64"):
        op.rmatmat(torch.randn(op.m, 2, dtype=torch.complex64))
    with pytest.raises(TypeError, match=r"T must be a real"):
        op.project_input(torch.randn(op.n, dtype=torch.complex128))
    for bad, err in ((-1, "must be in"), (math.nan, "must be finite"), (math.inf, "must be finite")):
        with pytest.raises(ValueError, match=f"tol {err}"):
            lanczos_svd(op, tol=bad)
        with pytest.raises(ValueError, match=f"tol {err}"):
            power_sigma_max(op, tol=bad)


# ------------------------------------------------------------------------------------------------
# overflow of the compute dtype

def test_overflow_gives_nan_with_reason_not_an_error(rng):
    """Finite float32 weights whose scores overflow float32: NaN values and the reason, in float32
    and (cancellation, not overflow) in float64."""
    m = mha(rng, dtype=torch.float32)
    with torch.no_grad():
        m.in_proj_weight[:32] *= 1e20               # Q and K rows: scores ~ 1e40 * |x|^2, past float32 in any product order
    x = torch.randn(1, 6, 16, generator=rng)
    op = JacobianOperator(m, x)
    for est in (lanczos_svd(op, steps=4), condition_number(op, method="dense"), power_sigma_max(op)):
        assert math.isnan(est.sigma_max) and not est.converged and est.kappa is None
        assert "not finite in torch.float32" in est.notes and "try dtype=torch.float64" in est.notes
    fro = frobenius_hutchinson(op, samples=2)
    assert math.isnan(fro.frobenius) and "not finite" in fro.notes
    # in float64 nothing overflows, but scores ~1e40 make the JVP's S' V terms swamp P V' (rounding
    # cancels every product): NaN values and that reason, never "J = 0"
    est64 = lanczos_svd(JacobianOperator(m, x, dtype=F64), steps=4)
    assert math.isnan(est64.sigma_max) and not est64.converged and "not reliable" in est64.notes


# ------------------------------------------------------------------------------------------------
# spectrum / recondition_ / apply's report

@pytest.mark.parametrize("method", ["svd", "gram"])
def test_spectrum_non_finite_and_extreme_scales(rng, method):
    W = torch.randn(3, 8, 24, generator=rng, dtype=F64)
    s_ref = torch.linalg.svdvals(W)
    ref_max, ref_min = s_ref[:, 0], s_ref[:, -1]
    for scale in (1e30, 1e-30, 2.0 ** 600, 1e-200, 1e-300):
        sp = spectrum(W * scale, method=method)
        torch.testing.assert_close(sp.sigma_max, ref_max * scale, rtol=1e-12, atol=0)
        torch.testing.assert_close(sp.sigma_min, ref_min * scale, rtol=1e-12, atol=0)
        torch.testing.assert_close(sp.cond, ref_max / ref_min, rtol=1e-12, atol=0)
    stack = torch.cat([W, torch.zeros(1, 8, 24, dtype=F64), W[:2]])
    stack[0, 1, 2] = math.nan                         # blocks: W0 (NaN), W1, W2, 0, W0, W1 (-Inf)
    stack[5, 0, 0] = -math.inf
    sp = spectrum(stack, method=method)
    for field in sp:
        assert field.shape == (6,)
        assert torch.isnan(field[[0, 5]]).all() and not torch.isnan(field[[1, 2, 3, 4]]).any()
    assert (sp.sigma_max[3], sp.sigma_min[3], sp.cond[3]) == (0.0, 0.0, math.inf)
    torch.testing.assert_close(sp.sigma_max[[1, 2, 4]], ref_max[[1, 2, 0]], rtol=1e-12, atol=0)
    torch.testing.assert_close(sp.cond[[1, 2, 4]], (ref_max / ref_min)[[1, 2, 0]], rtol=1e-12, atol=0)
    one = spectrum(torch.full((4, 4), math.nan, dtype=torch.float32), method=method)
    assert all(f.dim() == 0 and torch.isnan(f) for f in one)


@pytest.mark.parametrize("method", ["svd", "gram"])
def test_recondition_extreme_scales(rng, method):
    W = torch.randn(2, 8, 24, generator=rng, dtype=F64)
    W[:, :, 0] *= 50                                     # cond well above 2
    ref = recondition_(W.clone(), max_cond=2.0, method=method)
    for scale in (1e-200, 2.0 ** 600):
        out = recondition_(W * scale, max_cond=2.0, method=method)
        assert_close(out / scale, ref, F64, f"recondition_ at scale {scale:g}")
        assert float(spectrum(out).cond.max()) <= 2.0 * (1 + 1e-12)


def _packed_q_blocks(m):
    D = m.embed_dim
    return m.in_proj_weight.detach()[:D].reshape(m.num_heads, D // m.num_heads, D).to(F64)


@pytest.mark.parametrize("dtype,poison", [(torch.float32, "nan"), (torch.float16, 1e30), (F64, 1e200)])
def test_apply_reinitializes_diverged_or_extreme_weights(rng, dtype, poison):
    """condinit.apply (default report) on a diverged layer (NaN, or 1e30 overflowing float16 to Inf)
    re-initializes it and reports the old spectrum as NaN; a finite extreme scale is reported
    exactly."""
    m = mha(rng, dtype=dtype)
    with torch.no_grad():
        if poison == "nan":
            m.in_proj_weight[3, 3] = math.nan
        else:
            m.in_proj_weight[:16] *= poison
    finite_before = bool(torch.isfinite(m.in_proj_weight).all())
    ref = torch.linalg.svdvals(_packed_q_blocks(m)) if finite_before else None
    report = condinit.apply(m, seed=5)
    assert torch.isfinite(m.in_proj_weight).all()
    before, after = report.layers[0].before["q"], report.layers[0].after["q"]
    if finite_before:
        assert before.sigma_max == pytest.approx(float(ref[:, 0].max()), rel=1e-12)
        assert before.sigma_min == pytest.approx(float(ref[:, -1].min()), rel=1e-12)
    else:
        assert math.isnan(before.sigma_max) and math.isnan(before.cond)
    assert after.cond == pytest.approx(1.0, abs=1e-2)
    assert "nan" in str(report) or finite_before


# ------------------------------------------------------------------------------------------------
# condinit probe

class ToyLM(nn.Module):
    """Three encoder layers behind an embedding, shaped like a preset model for the probe command."""

    def __init__(self, vocab=11, D=16):
        super().__init__()
        self.config = type("Config", (), {"vocab_size": vocab, "max_position_embeddings": None})()
        self.emb = nn.Embedding(vocab, D)
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(D, 2, dim_feedforward=24, dropout=0.0,
                                                               batch_first=True) for _ in range(3))

    def forward(self, input_ids):
        h = self.emb(input_ids)
        for layer in self.layers:
            h = layer(h)
        return h


def test_cli_probe_one_token_and_nan_weight(tmp_path, capsys, monkeypatch):
    """--seq-len 1 prints a vacuous bound; a NaN weight gives that layer (and the next, whose input
    it poisons) a 'not probed' row with the reason; the other layers are probed; exit status 0."""
    from safetensors.torch import save_file

    from condinit.cli import main
    from condinit.commands import probe

    torch.manual_seed(0)
    model = ToyLM().eval()
    with torch.no_grad():
        model.layers[1].self_attn.in_proj_weight[0, 0] = math.nan
    monkeypatch.setattr(probe, "_load", lambda path, preset: (model, "toy"))
    ckpt = tmp_path / "toy.safetensors"
    save_file({"w": torch.zeros(1)}, str(ckpt))
    out_json = tmp_path / "p.json"
    args = ["probe", str(ckpt), "--preset", "tiny-llama", "--batch", "1", "--steps", "3", "--samples", "2"]
    assert main(args + ["--seq-len", "1", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "not probed: layer: the q projection's weight must be finite" in out
    assert "not probed: x must be finite" in out
    rows = json.loads(out_json.read_text())["layers"]
    assert [r["skipped"] is None for r in rows] == [True, False, False]
    assert rows[0]["bound"] is None and "N = 1" in rows[0]["bound_notes"]
    assert rows[0]["kappa"] == pytest.approx(1.0, rel=1e-4) and rows[1]["sigma_max"] is None
    with torch.no_grad():
        model.layers[1].self_attn.in_proj_weight[0, 0] = 0.0
    assert main(args + ["--seq-len", "5"]) == 0
    out = capsys.readouterr().out
    assert "not probed" not in out and "bound '-'" not in out


def _mha_kappa(mha, x):
    """kappa over the nonzero spectrum of the float64 Jacobian (jacrev) of ``mha``'s own forward w.r.t.
    its Q/K/V weights, with its output projection replaced by the identity, at ``x`` ``[1, N, D]``."""
    D = x.shape[-1]
    params = {k: v.detach().to(F64) for k, v in mha.named_parameters()}
    params["out_proj.weight"] = torch.eye(D, dtype=F64)
    params["out_proj.bias"] = torch.zeros(D, dtype=F64)
    x = x.to(F64)

    def f(w):
        out = torch.func.functional_call(mha, {**params, "in_proj_weight": w}, (x, x, x), {"need_weights": False})[0]
        return out.reshape(-1)
    J = torch.func.jacrev(f)(params["in_proj_weight"]).reshape(x.numel(), -1)
    s = torch.linalg.svdvals(J)
    return float(s[0] / s[s > 1e-10 * s[0]][-1])


def test_monitor_is_exact_in_float64_where_exactness_is_cheap(seed):
    """A float32 layer whose estimate is exact (the dense SVD or Lanczos to the end of range(J)) is
    estimated on a float64 copy of the captured step: the record says float64, is converged, and its
    kappa is the jacrev reference's, whether the input repeats tokens or not."""
    g = torch.Generator().manual_seed(seed)
    m = mha(g, D=16, H=2, dtype=torch.float32)
    for repeat in (False, True):
        x = torch.randn(1, 6, 16, generator=g)
        if repeat:
            x[0, 4:] = x[0, :2]
        mon = JacobianMonitor(m, every=1, frobenius_samples=0, tensorboard=False, signals=False)
        with torch.no_grad():
            m(x, x, x)
        (rec,) = mon.step()
        mon.close()
        kappa = _mha_kappa(m, x)
        assert (rec["dtype"], rec["converged"], rec["skipped"]) == ("float64", True, None), rec
        assert rec["kappa_lo"] <= kappa <= rec["kappa_hi"] and rec["kappa"] == pytest.approx(kappa, rel=1e-6), \
            (repeat, rec["kappa"], kappa)


def test_monitor_leaves_out_sequences_its_operator_does_not_model(seed):
    """A padded sequence (key_padding_mask) or a mask other than the layer's own pattern (attn_mask) is
    not what the operator models: the record is measured on the other sequences, says how many were
    left out, and its kappa is the jacrev reference's on those alone; with none left, the layer is
    skipped with the reason."""
    g = torch.Generator().manual_seed(seed)
    m = mha(g, D=16, H=2)
    x = torch.randn(3, 6, 16, generator=g, dtype=F64)
    pad = torch.zeros(3, 6, dtype=torch.bool)
    pad[1, 4:] = True
    mon = JacobianMonitor(m, every=1, max_batch=None, frobenius_samples=0, tensorboard=False, signals=False)
    with torch.no_grad():
        m(x, x, x, key_padding_mask=pad)
    (padded,) = mon.step()
    assert padded["skipped"] is None and padded["batch"] == 2 and "1 of 3 sequences left out" in padded["notes"], \
        padded
    causal = torch.ones(6, 6, dtype=torch.bool).triu(1)         # True: not attended
    with torch.no_grad():
        m(x, x, x, key_padding_mask=torch.zeros(3, 6, dtype=torch.bool))   # no padding: nothing left out
        (rec,) = mon.step()
        assert rec["batch"] == 3 and "left out" not in rec["notes"], rec
        m(x, x, x, attn_mask=causal)                         # the layer is bidirectional
        (rec,) = mon.step()
    mon.close()
    assert rec.get("kappa") is None and "every sequence of this batch (3)" in rec["skipped"], rec
    kappa = _mha_kappa(m, x[[0, 2]])       # the hooks are gone: jacrev's forward is not captured
    assert padded["kappa_lo"] <= kappa <= padded["kappa_hi"] and padded["kappa"] == pytest.approx(kappa, rel=1e-6)


def test_monitor_reads_hugging_face_padding(seed):
    """A Hugging Face Llama with a left-padded sequence (eager and sdpa attention masks): that sequence
    is left out of every layer's record, the others are measured."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=16, num_attention_heads=2, num_key_value_heads=1, intermediate_size=32,
                      num_hidden_layers=1, vocab_size=50)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 50, (3, 7), generator=g)
    am = torch.ones(3, 7, dtype=torch.long)
    am[2, :2] = 0
    for impl in ("eager", "sdpa"):
        cfg._attn_implementation = impl
        model = LlamaForCausalLM(cfg).to(F64)
        mon = JacobianMonitor(model, every=1, max_batch=None, steps=8, frobenius_samples=0, tensorboard=False,
                              signals=False)
        with torch.no_grad():
            model(ids, attention_mask=am)
            (rec,) = mon.step()
            assert rec["batch"] == 2 and "1 of 3 sequences left out" in rec["notes"], (impl, rec)
            model(ids, attention_mask=torch.ones_like(am))
            (rec,) = mon.step()
            assert rec["batch"] == 3 and "left out" not in rec["notes"], (impl, rec)
        mon.close()


def test_probe_is_exact_in_float64_where_exactness_is_cheap(seed):
    """A layer small enough for an exact estimate (the dense SVD, or Lanczos to the end of range(J)) is
    probed in float64: exact, converged,
    and kappa that of the reference, the dense float64 Jacobian (jacrev) of the layer's own forward
    with its output projection replaced by the identity, on the input the layer received (captured by
    a hook of this test). The batch repeats tokens, so X has null directions: their rounding must not
    surface as small singular values of J."""
    from condinit.commands.probe import probe_model

    torch.manual_seed(seed)
    model = ToyLM().eval()
    ids = torch.randint(0, 11, (1, 7))
    ids[0, 5:] = ids[0, :2]          # repeated tokens: X (no positions in this model) is rank-deficient
    got = {}

    def keep(i):
        def hook(mod, args):
            got.setdefault(i, args[0].detach().to(F64))
        return hook
    hooks = [layer.self_attn.register_forward_pre_hook(keep(i)) for i, layer in enumerate(model.layers)]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    rows = probe_model(model, {"input_ids": ids}, samples=2, seed=seed)
    for i, layer in enumerate(model.layers):
        mha, x = layer.self_attn, got[i]
        kappa = _mha_kappa(mha, x)
        r = rows[i]
        assert (r["dtype"], r["exact"], r["converged"], r["skipped"]) == ("float64", True, True, None), r
        assert r["kappa_lo"] <= kappa <= r["kappa_hi"], (i, r["kappa_lo"], kappa, r["kappa_hi"])
        assert r["kappa"] == pytest.approx(kappa, rel=1e-6), i
        # the dense path too (its matrix in projection-output coordinates, K^(1/2) G, K = X X^T singular)
        dense = condition_number(JacobianOperator(mha, x, wrt="weights", dtype=F64), method="dense")
        assert dense.kappa_lo <= kappa <= dense.kappa_hi and dense.kappa == pytest.approx(kappa, rel=1e-6), i


def test_cli_probe_time_budget_default_and_no_limit(tmp_path, capsys, monkeypatch):
    """Each layer's Lanczos work is capped at 10 s by default; --time-budget 0 lifts the cap;
    a negative budget is refused before any work."""
    from safetensors.torch import save_file

    from condinit.cli import main
    from condinit.commands import probe

    torch.manual_seed(1)
    model = ToyLM().eval()
    monkeypatch.setattr(probe, "_load", lambda path, preset: (model, "toy"))
    seen = []
    real = probe.probe_model
    monkeypatch.setattr(probe, "probe_model", lambda *a, **kw: seen.append(kw["time_budget"]) or real(*a, **kw))
    ckpt = tmp_path / "toy.safetensors"
    save_file({"w": torch.zeros(1)}, str(ckpt))
    args = ["probe", str(ckpt), "--preset", "tiny-llama", "--batch", "1", "--steps", "3", "--samples", "2"]
    out_json = tmp_path / "p.json"
    assert main(args + ["--json", str(out_json)]) == 0
    assert json.loads(out_json.read_text())["time_budget"] == 10.0
    assert main(args + ["--time-budget", "0", "--json", str(out_json)]) == 0
    assert json.loads(out_json.read_text())["time_budget"] is None
    assert seen == [10.0, None]
    capsys.readouterr()
    assert main(args + ["--time-budget", "-1"]) == 2
    assert "--time-budget" in capsys.readouterr().err and seen == [10.0, None]


# ------------------------------------------------------------------------------------------------
# the monitor inside a training loop

def _train(scenario, monitor_kwargs=None, steps=3):
    """A seeded loop that skips the optimizer step on a non-finite loss (as AMP's GradScaler does).
    Scenario: 'autocast' (bf16 autocast around forward, backward and monitor.step), 'nan' (step 1's
    batch holds the NaN token), 'zero' (step 1's batch is all padding)."""
    torch.manual_seed(0)
    model = TinyTransformer(padding_idx=0, nan_token=scenario == "nan")   # token 0: a zero embedding
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    mon = JacobianMonitor(model, **monitor_kwargs) if monitor_kwargs is not None else None
    losses = []
    for step in range(steps):
        tok = torch.randint(1, 10, (2, 6))
        if step == 1 and scenario == "nan":
            tok[0, 2] = 10
        if step == 1 and scenario == "zero":
            tok.zero_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=scenario == "autocast"):
            loss = nn.functional.cross_entropy(model(tok).float().reshape(-1, 11), tok.roll(1, 1).reshape(-1))
            opt.zero_grad()
            loss.backward()
            if torch.isfinite(loss):
                opt.step()
            losses.append(loss.item())
            if mon is not None:
                mon.step()
    return model, losses, mon


@pytest.mark.parametrize("scenario", ["autocast", "nan", "zero"])
def test_monitor_never_raises_and_never_changes_training(scenario, tmp_path):
    kw = dict(every=1, steps=4, frobenius_samples=2, seed=1, log_dir=tmp_path, tensorboard=False)
    model0, losses0, _ = _train(scenario)
    model1, losses1, mon = _train(scenario, kw)
    mon.close()
    # bit-identical, NaN losses included
    assert [repr(v) for v in losses0] == [repr(v) for v in losses1]
    for (n0, p0), (n1, p1) in zip(model0.state_dict().items(), model1.state_dict().items()):
        torch.testing.assert_close(p1, p0, rtol=0, atol=0, equal_nan=True, msg=n0)
    recs = {(r["step"], r["layer"]): r for r in mon.history}
    assert sorted(recs) == [(s, l) for s in range(3) for l in range(2)]
    logged = {(r["step"], r["layer"]): r for r in map(json.loads, open(tmp_path / "jacobian.jsonl"))}
    assert logged.keys() == recs.keys()
    for key in ((0, 0), (0, 1), (2, 0), (2, 1)):
        assert recs[key]["skipped"] is None and recs[key]["sigma_max"] > 0
    if scenario == "autocast":
        assert all(r["skipped"] is None for r in recs.values())
    elif scenario == "nan":
        for layer in (0, 1):
            assert recs[(1, layer)]["skipped"] == "error: x must be finite, got NaN or Inf (in torch.float32)"
            assert logged[(1, layer)]["skipped"] == recs[(1, layer)]["skipped"]
    else:
        r = recs[(1, 0)]
        assert r["skipped"] is None and (r["sigma_max"], r["sigma_min"], r["kappa"]) == (0.0, 0.0, None)
        assert r["rank_deficient"] and "J = 0 exactly" in r["notes"] and r["frobenius"] == 0.0
        assert "J = 0 exactly" in logged[(1, 0)]["notes"]


def test_monitor_under_autocast_estimates_in_float32():
    """The first layer's input is the float32 embedding with or without autocast, and its weights
    are the same at step 0: the estimate under bf16 autocast is the float32 one, bit for bit."""
    kw = dict(every=10, steps=4, frobenius_samples=2, seed=7, tensorboard=False)
    plain = _train("none", kw, steps=1)[2].history
    under = _train("autocast", kw, steps=1)[2].history
    fields = ("sigma_max", "sigma_min", "kappa", "frobenius", "frobenius_ci_low", "lanczos_steps")
    assert [plain[0][f] for f in fields] == [under[0][f] for f in fields]
    assert under[1]["skipped"] is None and under[1]["sigma_max"] > 0


def test_monitor_logs_overflow_and_bad_step():
    torch.manual_seed(0)
    m = nn.MultiheadAttention(16, 2, batch_first=True)
    with torch.no_grad():
        m.in_proj_weight[:32] *= 1e19
    mon = JacobianMonitor(m, every=1, steps=4, frobenius_samples=2, tensorboard=False)
    x = torch.randn(1, 6, 16)
    m(x, x, x)
    (rec,) = mon.step()
    assert "in torch.float32" in rec["skipped"] and "not reliable" in rec["skipped"] and "sigma_max" not in rec
    # a wrong call raises at the call (steps count from 0); the data never do
    with pytest.raises(ValueError, match=r"step must be an int in \[0, inf\], got -5"):
        mon.step(step=-5)
    with pytest.raises(TypeError, match="step must be an int"):
        mon.step(step=1.0)
    assert mon.step_count == 1
    mon.close()
