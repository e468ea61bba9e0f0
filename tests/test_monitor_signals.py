"""JacobianMonitor's signals beside kappa (max logit, attention entropy, ||W_Q,h^T W_K,h||_2, ||J||_F),
each against a direct float64 computation on a tiny layer, and its alerts."""
import csv
import dataclasses
import json
import math
import sys
import types
import warnings

import pytest
import torch
from torch import nn

from conftest import F64, assert_close
import condinit.probe.estimators as estimators_mod
import condinit.probe.signals as signals_mod
from condinit.models import AttentionSpec, register_adapter, unregister_adapter
from condinit.probe import JacobianMonitor, JacobianOperator
from condinit.probe.alerts import ALERT_KINDS, ConditioningWarning

pytestmark = pytest.mark.usefixtures("one_thread")

FAST = dict(steps=2, frobenius_samples=0, max_batch=None, dtype=F64, tensorboard=False)


class GQAAttention(nn.Module):
    """Separate projections, grouped-query, causal: read through a registered adapter."""

    is_causal = True

    def __init__(self, D, H, Hkv, d):
        super().__init__()
        self.H, self.Hkv, self.d = H, Hkv, d
        self.wq = nn.Linear(D, H * d)
        self.wk = nn.Linear(D, Hkv * d)
        self.wv = nn.Linear(D, Hkv * d)

    def forward(self, x):
        return self.wv(x)    # the monitor reads the weights, never this output


@pytest.fixture
def gqa_adapter():
    register_adapter(GQAAttention, lambda m: AttentionSpec.from_linears(m.wq, m.wk, m.wv, num_heads=m.H))
    yield
    unregister_adapter(GQAAttention)


def _redraw(module, rng, scale=0.7):
    """Fresh weights from the test's generator, large enough for peaked attention."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=rng) * scale)


def _qkv_weights(module):
    """(Wq, bq, Wk, bk, H, Hkv, causal) in float64, read by hand for the two test layers."""
    if isinstance(module, nn.MultiheadAttention):
        D, H = module.embed_dim, module.num_heads
        w, b = module.in_proj_weight.detach().to(F64), module.in_proj_bias.detach().to(F64)
        return w[:D], b[:D], w[D:2 * D], b[D:2 * D], H, H, False
    if isinstance(module, GQAAttention):
        f = lambda t: t.detach().to(F64)  # noqa: E731
        return f(module.wq.weight), f(module.wq.bias), f(module.wk.weight), f(module.wk.bias), module.H, \
            module.Hkv, True
    attn = module     # Hugging Face Llama attention (no RoPE in the operator's A(X))
    f = lambda lin: (lin.weight.detach().to(F64), None if lin.bias is None else lin.bias.detach().to(F64))  # noqa
    (wq, bq), (wk, bk) = f(attn.q_proj), f(attn.k_proj)
    H = wq.shape[0] // attn.head_dim
    return wq, bq, wk, bk, H, wk.shape[0] // attn.head_dim, True


def reference_signals(module, x):
    """The signals by their definitions, in float64, from whole score matrices."""
    wq, bq, wk, bk, H, Hkv, causal = _qkv_weights(module)
    x = x.to(F64)
    B, N, D = x.shape
    d = wq.shape[0] // H
    lin = lambda w, b: x @ w.t() + (0 if b is None else b)  # noqa: E731
    q = lin(wq, bq).reshape(B, N, H, d).transpose(1, 2)
    k = lin(wk, bk).reshape(B, N, Hkv, d).transpose(1, 2).repeat_interleave(H // Hkv, dim=1)
    s = (q @ k.transpose(-1, -2)) / math.sqrt(d)
    if causal:
        s = s.masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), -math.inf)
    p = torch.softmax(s, dim=-1)
    ent = -torch.where(p > 0, p * p.log(), torch.zeros_like(p)).sum(-1)          # [B, H, N]
    multi = ent[..., 1:] if causal else ent                                      # queries seeing > 1 key
    wq_h, wk_g = wq.reshape(H, d, D), wk.reshape(Hkv, d, D).repeat_interleave(H // Hkv, dim=0)
    qk = torch.stack([torch.linalg.matrix_norm(wq_h[h].t() @ wk_g[h], 2) for h in range(H)])
    return {"max_logit_heads": s.amax(dim=(0, 2, 3)), "entropy_mean_heads": ent.mean(dim=(0, 2)),
            "entropy_min_heads": multi.amin(dim=(0, 2)), "qk_norm_heads": qk}


def _check_record(rec, ref, factor=100):
    for key, expected in ref.items():
        got = torch.tensor(rec[key], dtype=F64)
        assert_close(got, expected, F64, key, factor=factor)
        layer_key = key[:-len("_heads")]
        agg = expected.mean() if key == "entropy_mean_heads" else (
            expected.min() if key == "entropy_min_heads" else expected.max())
        assert_close(torch.tensor(rec[layer_key], dtype=F64), agg, F64, layer_key, factor=factor)


def _layer(kind, rng):
    if kind == "mha":          # non-causal, D = 12 > d = 4
        module, B, N = nn.MultiheadAttention(12, 3, batch_first=True), 2, 7
    elif kind == "gqa":        # causal, 4 query heads on 2 key/value heads, D = 10 > d = 3
        module, B, N = GQAAttention(10, 4, 2, 3), 2, 6
    else:                      # D = 4 <= d = 4: the D x D form directly
        module, B, N = GQAAttention(4, 2, 1, 4), 1, 5
    _redraw(module, rng)
    return module, torch.randn(B, N, module.wq.in_features if kind != "mha" else 12, generator=rng)


def _forward(module, x):
    return module(x, x, x) if isinstance(module, nn.MultiheadAttention) else module(x)


@pytest.mark.parametrize("tile", ["whole", "one_row", "two_rows"])
@pytest.mark.parametrize("kind", ["mha", "gqa", "small_D"])
def test_signals_match_float64_definitions(kind, tile, rng, gqa_adapter, monkeypatch):
    module, x = _layer(kind, rng)
    B, N = x.shape[:2]
    H = module.num_heads if kind == "mha" else module.H
    if tile != "whole":     # score blocks of 1 or 2 query rows (the last one ragged for odd N)
        monkeypatch.setattr(signals_mod, "SIGNAL_TILE_ELEMENTS", B * H * N * (1 if tile == "one_row" else 2))
    mon = JacobianMonitor(module, every=1, **FAST)
    _forward(module, x)
    (rec,) = mon.step()
    mon.close()
    assert rec["skipped"] is None
    _check_record(rec, reference_signals(module, x))


def _hf_reference(module, x, kwargs, qk_from_source):
    """Signals of a Hugging Face attention call from the module's own pieces: its eager attention's
    probabilities (entropy) and its RoPE'd q, k with its mask (max logit, before soft-capping)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    x = x.to(F64)
    B, N, _ = x.shape
    d = module.head_dim
    with torch.no_grad():
        _, probs = module(x, **kwargs)
        q, k = qk_from_source(module, x)
        q, k = apply_rotary_pos_emb(q, k, *kwargs["position_embeddings"])
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        s = (q @ k.transpose(-1, -2)) * module.scaling
        mask = kwargs.get("attention_mask")         # additive: 0 where allowed, a large negative elsewhere
        s = s.masked_fill(mask < 0 if mask is not None else torch.ones(N, N, dtype=torch.bool).triu(1), -math.inf)
    probs = probs.to(F64)
    ent = -torch.where(probs > 0, probs * probs.log(), torch.zeros_like(probs)).sum(-1)
    several = (probs > 0).sum(-1) > 1
    ent_min = torch.where(several, ent, torch.full_like(ent, math.inf)).amin(dim=(0, 2))
    wq, wk = module.q_proj.weight.detach().to(F64), module.k_proj.weight.detach().to(F64)
    H, Hkv, D = wq.shape[0] // d, wk.shape[0] // d, wq.shape[1]
    wq_h, wk_g = wq.reshape(H, d, D), wk.reshape(Hkv, d, D).repeat_interleave(H // Hkv, dim=0)
    qk = torch.stack([torch.linalg.matrix_norm(wq_h[h].t() @ wk_g[h], 2) for h in range(H)])
    return {"max_logit_heads": s.amax(dim=(0, 2, 3)), "entropy_mean_heads": ent.mean(dim=(0, 2)),
            "entropy_min_heads": ent_min, "qk_norm_heads": qk}


def _float64_eager(monkeypatch, module):
    """HF's eager attention from its own source with its float32 softmax upcast made float64."""
    import inspect
    import textwrap

    mod = sys.modules[type(module).__module__]
    fn = mod.eager_attention_forward
    src = textwrap.dedent(inspect.getsource(fn)).replace("torch.float32", "torch.float64")
    ns = {}
    exec(compile(src, "<float64 eager_attention_forward>", "exec"), fn.__globals__, ns)
    monkeypatch.setattr(mod, "eager_attention_forward", ns["eager_attention_forward"])


def _hf_qk(module, x):
    B, N, _ = x.shape
    shape = (B, N, -1, module.head_dim)
    q, k = module.q_proj(x).view(shape), module.k_proj(x).view(shape)
    if hasattr(module, "q_norm"):
        q, k = module.q_norm(q), module.k_norm(k)
    return q.transpose(1, 2), k.transpose(1, 2)


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_signals_on_hf_layers(name, rng, monkeypatch):
    """Hugging Face Llama (causal, grouped-query, biases, RoPE) and Gemma-2 (sliding window,
    soft-capping, its own scale): signals from the layer the module computes, against the module's
    own attention probabilities and rotated scores."""
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, attention_bias=True)
    if name == "llama":
        cfg = transformers.LlamaConfig(**common)
        model = transformers.LlamaModel(cfg)
    else:
        cfg = transformers.Gemma2Config(**common, head_dim=4, sliding_window=3, attn_logit_softcapping=3.0,
                                        query_pre_attn_scalar=8, layer_types=["sliding_attention", "full_attention"])
        model = transformers.Gemma2Model(cfg)
    cfg._attn_implementation = "eager"
    model = model.to(F64)
    _redraw(model, rng, scale=0.5)
    attn = [model.layers[i].self_attn for i in range(2)]
    _float64_eager(monkeypatch, attn[0])
    calls = {}
    hooks = [a.register_forward_pre_hook(lambda m, args, kw, i=i: calls.setdefault(i, (args, dict(kw))) and None,
                                         with_kwargs=True) for i, a in enumerate(attn)]
    ids = torch.randint(0, 32, (2, 6), generator=rng)
    mon = JacobianMonitor(model, every=1, **FAST)
    with torch.no_grad():
        model(ids, use_cache=False)
    for h in hooks:
        h.remove()
    recs = mon.step()
    mon.close()
    assert [r["skipped"] for r in recs] == [None, None], [r["skipped"] for r in recs]
    for i, (rec, module) in enumerate(zip(recs, attn)):
        args, kw = calls[i]
        x = args[0] if args else kw.pop("hidden_states")
        kw.pop("hidden_states", None)
        _check_record(rec, _hf_reference(module, x, kw, _hf_qk))


def test_frobenius_matches_the_dense_jacobian(rng):
    layer = nn.MultiheadAttention(8, 2, batch_first=True)
    _redraw(layer, rng, scale=0.5)
    x = torch.randn(1, 5, 8, generator=rng)
    mon = JacobianMonitor(layer, every=1, steps=2, frobenius_samples=64, dtype=F64, tensorboard=False,
                          seed=int(torch.randint(0, 2**62, (1,), generator=rng)))
    layer(x, x, x)
    (rec,) = mon.step()
    mon.close()
    exact = float(torch.linalg.matrix_norm(JacobianOperator(layer, x, dtype=F64).dense()))
    # 64 Rademacher probes: the relative standard error of ||J||_F is below sqrt(1/(2*64)) ~ 0.09
    assert abs(rec["frobenius"] - exact) <= 0.3 * exact, (rec["frobenius"], exact)
    assert rec["frobenius_ci_low"] <= rec["frobenius"] <= rec["frobenius_ci_high"]


def test_records_reach_jsonl_csv_and_tensorboard(tmp_path, rng, monkeypatch):
    scalars = []

    class FakeWriter:      # stands in for torch.utils.tensorboard.SummaryWriter
        def __init__(self, log_dir):
            pass

        def add_scalar(self, tag, value, step):
            scalars.append((tag, value, step))

        def close(self):
            pass

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=FakeWriter))
    layer = nn.TransformerEncoderLayer(12, 3, dim_feedforward=16, batch_first=True)
    mon = JacobianMonitor(layer, every=1, steps=2, frobenius_samples=2, log_dir=tmp_path)
    layer(torch.randn(1, 4, 12, generator=rng))
    (rec,) = mon.step()
    mon.close()
    (line,) = [json.loads(l) for l in open(tmp_path / "jacobian.jsonl")]
    assert line == json.loads(json.dumps(rec))
    (row,) = list(csv.DictReader(open(tmp_path / "jacobian.csv")))
    assert float(row["max_logit"]) == rec["max_logit"] and json.loads(row["qk_norm_heads"]) == rec["qk_norm_heads"]
    tags = {t: v for t, v, _ in scalars}
    for key in ("kappa", "frobenius", "max_logit", "entropy_mean", "entropy_min", "qk_norm"):
        assert tags[f"jacobian/000/{key}"] == rec[key], key
    for h in range(3):
        assert tags[f"jacobian/000/max_logit/head_{h:02d}"] == rec["max_logit_heads"][h]
        assert tags[f"jacobian/000/entropy_mean/head_{h:02d}"] == rec["entropy_mean_heads"][h]


# -- alerts ------------------------------------------------------------------------------------------

def _two_layer_model(rng):
    model = nn.Sequential(*(nn.TransformerEncoderLayer(12, 3, dim_feedforward=16, dropout=0.0, batch_first=True)
                            for _ in range(2)))
    for layer in model:
        _redraw(layer.self_attn, rng)
    return model


def test_threshold_alerts_name_layer_head_and_value_once(tmp_path, rng):
    model = _two_layer_model(rng)
    x = torch.randn(1, 6, 12, generator=rng)
    base = JacobianMonitor(model, every=1, **FAST)
    model(x)
    ref = base.step()
    base.close()
    # bounds just inside each layer's worst head, for the layer-0 value (layer 1 may or may not cross)
    r0 = ref[0]
    alerts = {"max_logit": r0["max_logit"] - 1e-6, "entropy": min(r0["entropy_mean_heads"]) + 1e-6,
              "qk_norm": r0["qk_norm"] * (1 - 1e-9)}
    mon = JacobianMonitor(model, every=1, log_dir=tmp_path, alerts=alerts, **FAST)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(x)
        mon.step()
        model(x)            # the same data again: the same values, no second warning
        mon.step()
    mon.close()
    warned = [str(w.message) for w in caught if issubclass(w.category, ConditioningWarning)]
    assert all(w.filename == __file__ for w in caught if issubclass(w.category, ConditioningWarning))
    expected = {}
    for r in ref:
        for kind, key, worst in (("max_logit", "max_logit_heads", max), ("entropy", "entropy_mean_heads", min),
                                 ("qk_norm", "qk_norm_heads", max)):
            head = worst(range(3), key=lambda h: r[key][h])
            value = r[key][head]
            if (value < alerts[kind]) if kind == "entropy" else (value > alerts[kind]):
                expected[(r["layer"], kind)] = (head, value)
    assert {(0, "max_logit"), (0, "entropy"), (0, "qk_norm")} <= set(expected)
    got = {(a["layer"], a["alert"]): (a["head"], a["value"]) for a in mon.alerts}
    assert got.keys() == expected.keys() and len(mon.alerts) == len(expected) == len(warned)
    for key, (head, value) in expected.items():
        assert got[key][0] == head
        assert got[key][1] == pytest.approx(value, rel=1e-9)
    assert all(a["step"] == 0 and a["threshold"] == alerts[a["alert"]] for a in mon.alerts)
    assert any(f"layer 0 (0.self_attn) head {expected[(0, 'max_logit')][0]}: max_logit" in w for w in warned)
    lines = [json.loads(l) for l in open(tmp_path / "jacobian.jsonl")]
    assert [l for l in lines if "alert" in l] == json.loads(json.dumps(mon.alerts))
    assert len(list(csv.DictReader(open(tmp_path / "jacobian.csv")))) == len(mon.history) == 4


def test_kappa_growth_is_relative_to_the_first_record(monkeypatch, rng):
    real = estimators_mod.lanczos_svd
    kappa_first = 7.0
    factors = iter([1.0, 3.0, 20.0, 40.0])      # kappa of sampled steps 0..3 over step 0's

    def scaled(op, **kw):
        return dataclasses.replace(real(op, **kw), kappa=kappa_first * next(factors))

    monkeypatch.setattr(estimators_mod, "lanczos_svd", scaled)
    layer = nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(1, 5, 8, generator=rng)
    mon = JacobianMonitor(layer, every=1, alerts={"kappa_growth": 10.0}, **FAST)
    with pytest.warns(ConditioningWarning, match="step 2: layer 0 .*kappa_growth = 20") as caught:
        for _ in range(4):
            layer(x, x, x)
            mon.step()
    mon.close()
    assert len([w for w in caught if issubclass(w.category, ConditioningWarning)]) == 1
    (alert,) = mon.alerts
    assert alert["step"] == 2 and alert["head"] is None and alert["alert"] == "kappa_growth"
    assert alert["value"] == pytest.approx(20.0) and alert["kappa_first"] == kappa_first
    assert alert["kappa"] == pytest.approx(140.0)


def test_overflowing_layer_logs_null_values_and_alerts(tmp_path, rng):
    """Finite float32 weights whose scores overflow: the signals are NaN / inf, logged as null (valid
    JSON), the record is skipped with the reason, the max-logit alert fires, nothing raises."""
    layer = nn.MultiheadAttention(8, 2, batch_first=True)
    _redraw(layer, rng, scale=1e21)
    mon = JacobianMonitor(layer, every=1, steps=2, frobenius_samples=0, log_dir=tmp_path,
                          alerts={"max_logit": 50.0, "entropy": 0.01})
    x = torch.randn(1, 4, 8, generator=rng)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layer(x, x, x)
        (rec,) = mon.step()
    mon.close()
    assert rec["skipped"] and rec["max_logit"] is None
    # inf logits; the entropy of a softmax over inf scores is NaN, which counts as crossing its bound
    assert {a["alert"] for a in mon.alerts} == {"max_logit", "entropy"}
    assert sorted(str(w.message).split(": ")[-1].split(" = ")[0] for w in caught) == ["entropy", "max_logit"]
    assert rec["qk_norm"] is not None and math.isfinite(rec["qk_norm"]) and rec["qk_norm"] > 1e30
    for line in open(tmp_path / "jacobian.jsonl"):
        json.loads(line)


def test_capturing_off_and_signals_off(rng):
    layer = nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(1, 4, 8, generator=rng)
    mon = JacobianMonitor(layer, every=1, signals=False, **FAST)
    mon.capturing = False
    layer(x, x, x)
    assert mon.step() == []
    mon.capturing = True
    layer(x, x, x)
    (rec,) = mon.step()
    mon.close()
    assert rec["skipped"] is None and "max_logit" not in rec and "qk_norm_heads" not in rec


def test_bad_alerts_are_refused_before_any_file_is_written(tmp_path):
    layer = nn.MultiheadAttention(8, 2, batch_first=True)
    out = tmp_path / "run"
    with pytest.raises(ValueError, match="unknown kind 'kappa'.*kappa_growth"):
        JacobianMonitor(layer, log_dir=out, alerts={"kappa": 2.0})
    with pytest.raises(TypeError, match="alerts must be a dict"):
        JacobianMonitor(layer, log_dir=out, alerts=[("max_logit", 1.0)])
    with pytest.raises(ValueError, match="alerts\\['entropy'\\]"):
        JacobianMonitor(layer, log_dir=out, alerts={"entropy": -1.0})
    with pytest.raises((TypeError, ValueError), match="alerts\\['max_logit'\\]"):
        JacobianMonitor(layer, log_dir=out, alerts={"max_logit": float("nan")})
    with pytest.raises(TypeError, match="signals"):
        JacobianMonitor(layer, log_dir=out, signals=1)
    assert not out.exists()
    assert set(ALERT_KINDS) == {"kappa_growth", "max_logit", "entropy", "qk_norm"}


# -- condinit plot -----------------------------------------------------------------------------------

@pytest.mark.slow
def test_plot_command_writes_pngs_of_a_run(tmp_path, rng, capsys):
    from condinit.cli import main

    model = _two_layer_model(rng)
    run = tmp_path / "run"
    with JacobianMonitor(model, every=1, steps=2, frobenius_samples=0, log_dir=run, tensorboard=False,
                         alerts={"max_logit": -1e9}) as mon, pytest.warns(ConditioningWarning):
        for _ in range(3):
            model(torch.randn(1, 5, 12, generator=rng))
            mon.step()
    out = tmp_path / "plots"
    assert main(["plot", str(run), "--out", str(out)]) == 0
    for name in ("kappa.png", "max_logit.png", "entropy.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 2000, name
    assert main(["plot", str(run / "jacobian.jsonl")]) == 0          # a JSONL path; PNGs beside it
    assert (run / "kappa.png").is_file()
    assert main(["plot", str(tmp_path / "missing")]) == 2
    assert "no such directory or file" in capsys.readouterr().err


def test_plot_command_without_matplotlib_names_the_extra(tmp_path, rng, capsys, monkeypatch):
    from condinit.cli import main

    layer = nn.MultiheadAttention(8, 2, batch_first=True)
    with JacobianMonitor(layer, every=1, steps=2, frobenius_samples=0, log_dir=tmp_path, tensorboard=False) as mon:
        x = torch.randn(1, 4, 8, generator=rng)
        layer(x, x, x)
        mon.step()
    monkeypatch.setitem(sys.modules, "matplotlib", None)     # import matplotlib -> ImportError
    assert main(["plot", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "pip install 'condinit[plot]'" in err
    (tmp_path / "jacobian.jsonl").write_text('{"step": 0}\n')
    assert main(["plot", str(tmp_path)]) == 2
    assert "jacobian.jsonl:1: not a JacobianMonitor record" in capsys.readouterr().err
