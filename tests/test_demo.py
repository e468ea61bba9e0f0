"""condinit demo: deterministic tasks, the shortcut baseline, the LR selection, the probe's math,
the ablation inits, and the CLI end to end on a tiny configuration."""
import collections
import csv
import json
import math
import os

import pytest
import torch
from torch import nn

from condinit.cli import main
from condinit.demo import inits as demo_inits
from condinit.demo.models import TinyLM, TinyViT
from condinit.demo.report import select_best_lr, spearman, summarize
from condinit.demo.tasks import (CHAR_VOCAB, DATA_SEED, bert_mask, encode_chars, make_task, mqar_sequences,
                                 mqar_shortcut_baseline, stdlib_corpus)
from condinit.demo.train import attention_jacobian_sigma, head_probe
from helpers import run_cli

INITS = demo_inits.INITS


# ------------------------------------------------------------------------------------------------
# tasks: deterministic, from fixed seeds only

def test_mqar_sequences_are_fixed_by_the_seed():
    """The generator stream alone fixes the data: pinned values (same on any machine), and the
    global RNG and the thread count play no part."""
    threads = torch.get_num_threads()
    try:
        out = []
        for n_threads in (1, 2):
            torch.set_num_threads(n_threads)
            torch.manual_seed(len(out))                      # global RNG state differs, must not matter
            g = torch.Generator().manual_seed(DATA_SEED)
            out.append(mqar_sequences(2, num_pairs=4, num_keys=16, num_values=16, generator=g))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])
    assert out[0][0].tolist() == [[2, 29, 1, 19, 4, 18, 11, 29, 2, 29, 11, 29, 1, 19, 4],
                                  [8, 24, 10, 23, 15, 29, 3, 28, 10, 23, 3, 28, 15, 29, 8]]


def _batches(task, seed, n=3, size=4):
    g = torch.Generator().manual_seed(seed)
    return [task.batch(size, g) for _ in range(n)]


@pytest.mark.parametrize("name", ["mqar-32", "lm-causal", "lm-masked"])
def test_tasks_same_seed_same_split_and_batches(name):
    kw = {"num_train": 256, "num_test": 64} if name.startswith("mqar") else {"num_valid": 16, "file_chars": 1024}
    a, b = make_task(name, **kw), make_task(name, **kw)
    torch.manual_seed(123)                                   # the global RNG is not the data's
    assert torch.equal(a.x_test, b.x_test) and torch.equal(a.y_test, b.y_test)
    assert a.info == b.info
    for (xa, ya), (xb, yb) in zip(_batches(a, 7), _batches(b, 7)):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    other = _batches(a, 8)
    assert any(not torch.equal(xa, xo) for (xa, _), (xo, _) in zip(_batches(a, 7), other))


def test_stdlib_corpus_split_cap_and_hash(tmp_path):
    root = tmp_path / "lib"
    names = [f"m{i:02d}.py" for i in range(12)] + ["pkg/a.py", "pkg/b.py", "site-packages/x.py", "pkg/c.txt"]
    for i, n in enumerate(names):
        p = root / n
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(f"# file {n}\n".encode() + b"x" * (50 + i))
    train, valid, info = stdlib_corpus(file_chars=30, root=str(root))
    order = sorted(n for n in names if n.endswith(".py") and not n.startswith("site-packages"))
    assert info["files"] == len(order) == 14
    heads = [(root / n).read_bytes()[:30] for n in order]
    assert valid == b"".join(h for i, h in enumerate(heads) if i % 10 == 9)       # every tenth file
    assert train == b"".join(h for i, h in enumerate(heads) if i % 10 != 9)
    assert info["train_chars"] == len(train) and info["valid_chars"] == len(valid)
    (root / "m03.py").write_bytes(b"changed")
    assert stdlib_corpus(file_chars=30, root=str(root))[2]["sha256"] != info["sha256"]


def test_char_encoding_and_bert_mask():
    tok = encode_chars("a\n\t\r\u00e9~ ".encode())
    assert tok.tolist() == [ord("a") - 31, 0, 96, 97, 97, 97, ord("~") - 31, 1]
    assert int(tok.max()) < CHAR_VOCAB
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, CHAR_VOCAB, (200, 40), generator=g)
    xm, y = bert_mask(x, 0.15, CHAR_VOCAB, torch.Generator().manual_seed(1))
    chosen = y != -100
    assert (chosen.sum(1) == 6).all()                                              # round(0.15 * 40)
    assert torch.equal(y[chosen], x[chosen]) and torch.equal(xm[~chosen], x[~chosen])
    frac_mask = float((xm[chosen] == CHAR_VOCAB).float().mean())
    assert 0.75 < frac_mask < 0.85


# ------------------------------------------------------------------------------------------------
# the shortcut baseline

def _brute_force_shortcut(x, y, num_pairs):
    scores = [0.0] * num_pairs
    for seq, tgt in zip(x.tolist(), y.tolist()):
        remaining = collections.Counter(seq[1:2 * num_pairs:2])
        answers = [tgt[p] for p in range(2 * num_pairs, 4 * num_pairs, 2)]
        for i, ans in enumerate(answers):
            best = max(remaining.values())
            top = [v for v, c in remaining.items() if c == best]
            scores[i] += (1.0 / len(top) if ans in top else 0.0) / x.shape[0]
            remaining[ans] -= 1
            if remaining[ans] == 0:
                del remaining[ans]
    return scores


@pytest.mark.parametrize("num_values", [3, 16])
def test_shortcut_baseline_matches_brute_force(rng, num_values):
    x, y = mqar_sequences(300, num_pairs=4, num_keys=8, num_values=num_values, generator=rng)
    got = mqar_shortcut_baseline(x, y, 4)
    want = _brute_force_shortcut(x, y, 4)
    assert got == pytest.approx(want, abs=1e-12)
    assert got[-1] == 1.0 and 0.25 <= got[0] < 1.0


def test_shortcut_baseline_follows_the_data():
    """Not a constant: distinct values give 1/4, 1/3, 1/2, 1; one repeated value gives 1 throughout;
    two draws of the data give different numbers."""
    x, y = mqar_sequences(1, num_pairs=4, num_keys=8, num_values=8, generator=torch.Generator().manual_seed(0))
    ctx_vals = torch.tensor([8, 9, 10, 11])
    for vals, want in ((ctx_vals, [0.25, 1 / 3, 0.5, 1.0]), (torch.full((4,), 9), [1.0, 1.0, 1.0, 1.0])):
        xs, ys = x.clone(), y.clone()
        keys = xs[0, 0:8:2].tolist()
        xs[0, 1:8:2] = vals
        value_of = dict(zip(keys, vals.tolist()))
        for p in range(8, 15, 2):
            ys[0, p] = value_of[xs[0, p].item()]
            if p + 1 < 15:
                xs[0, p + 1] = ys[0, p]
        assert mqar_shortcut_baseline(xs, ys, 4) == pytest.approx(want)
    a = mqar_shortcut_baseline(*mqar_sequences(64, num_pairs=4, num_keys=16, num_values=16,
                                                generator=torch.Generator().manual_seed(1)), 4)
    b = mqar_shortcut_baseline(*mqar_sequences(64, num_pairs=4, num_keys=16, num_values=16,
                                                generator=torch.Generator().manual_seed(2)), 4)
    assert a != b


# ------------------------------------------------------------------------------------------------
# LR selection and the summary

def test_select_best_lr():
    acc = {0.3: (0.55, 0.90), 1.0: (0.99, 0.05), 3.0: (0.99, 0.03)}
    assert select_best_lr(acc, higher_is_better=True) == 3.0          # tie on accuracy: lower loss
    assert select_best_lr({0.3: (0.5, 1.0), 1.0: (0.5, 1.0)}, higher_is_better=True) == 0.3   # then smaller LR
    loss = {0.3: (2.1, 2.1), 1.0: (1.9, 1.9), 3.0: (float("nan"), float("nan"))}
    assert select_best_lr(loss, higher_is_better=False) == 1.0        # lower loss wins, NaN never
    assert select_best_lr({1.0: (float("nan"), 1.0), 3.0: (0.1, 5.0)}, higher_is_better=True) == 3.0
    with pytest.raises(ValueError):
        select_best_lr({}, higher_is_better=True)


def test_spearman():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 3], [1, 1, 1]) is None and spearman([1, 2], [1, 2]) is None


def _fake_run(init, mult, seed, accs, kappa0):
    steps = list(range(0, 10 * len(accs), 10))
    probe = [[kappa0, kappa0], [2 * kappa0, 2 * kappa0]]
    return {"task": "t", "init": init, "seed": seed, "lr_mult": mult, "lr": mult * 1e-3, "seconds": 1.0,
            "train_step": [1], "train_loss": [1.0], "eval_step": steps, "eval_acc": accs,
            "eval_loss": [1.0 - a for a in accs], "eval_query_acc": [], "probe_step": [0, steps[-1]],
            "kappa": probe, "sigma_max": probe, "sigma_min": [[1.0, 1.0]] * 2, "sigma_min_px": [[0.5, 0.5]] * 2,
            "value_share": [[0.95, 0.99], [0.5, 0.5]]}


def test_summary_judges_each_init_at_its_best_lr():
    curves = {("default", 1.0): [0.1, 0.5, 0.8, 0.9], ("default", 3.0): [0.1, 0.3, 0.4, 0.5],
              ("conditioned", 1.0): [0.1, 0.2, 0.3, 0.4], ("conditioned", 3.0): [0.1, 0.9, 0.95, 0.97]}
    runs = [_fake_run(i, m, s, [min(1.0, a + 0.01 * s) for a in c], 10.0 if i == "default" else 1e3)
            for (i, m), c in curves.items() for s in (0, 1)]
    results = {"tasks": {"t": {"config": {"steps": 30, "lr": 1e-3, "batch_size": 4, "model": {"dim": 8, "num_heads": 2}},
                               "info": {}, "metric": "accuracy", "runs": runs}}}
    t = summarize(results)["tasks"]["t"]
    d, c = t["inits"]["default"], t["inits"]["conditioned"]
    assert d["best_lr_mult"] == 1.0 and c["best_lr_mult"] == 3.0
    assert t["target"] == pytest.approx(0.905)                       # default's final, seed mean, at 1x
    assert c["steps_to_target"] == 10 and d["steps_to_target"] == 30
    assert c["final_metric"]["mean"] == pytest.approx(0.975)
    assert d["kappa_init"]["kappa"] == pytest.approx(10.0) and c["kappa_final"]["kappa"] == pytest.approx(2e3)
    assert d["kappa_init"]["value_path"] and not d["kappa_final"]["value_path"]


# ------------------------------------------------------------------------------------------------
# the probe

def _dense_jacobian(mha, x, causal):
    n = x.shape[0]
    mask = torch.ones(n, n, dtype=torch.bool).triu_(1) if causal else None
    w0 = mha.in_proj_weight.detach().clone()

    def f(w):
        out = torch.func.functional_call(mha, {"in_proj_weight": w}, (x[None], x[None], x[None]),
                                         {"attn_mask": mask, "need_weights": True})[0]
        return out.reshape(-1)

    return torch.func.jacrev(f)(w0).reshape(n * mha.embed_dim, -1).detach()


def _mha(e, h, rng, scale=0.4):
    mha = nn.MultiheadAttention(e, h, batch_first=True).double()
    with torch.no_grad():
        mha.in_proj_weight.copy_(torch.randn(3 * e, e, generator=rng, dtype=torch.float64) * scale)
        mha.in_proj_bias.copy_(torch.randn(3 * e, generator=rng, dtype=torch.float64) * 0.1)
        mha.out_proj.weight.copy_(torch.eye(e))
        mha.out_proj.bias.zero_()
    return mha


@pytest.mark.slow
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [5, 8])        # N < D (row-space projection) and N = D
def test_probe_matches_dense_jacobian_and_bounds_by_px(rng, causal, n):
    """Singular values == the dense Jacobian of nn.MultiheadAttention itself (W_O = I) wrt its
    in_proj_weight; sigma_min(J) >= sigma_min(P X) per head; value share in [0, 1]."""
    e, h = 8, 2
    mha = _mha(e, h, rng)
    x = torch.randn(n, e, generator=rng, dtype=torch.float64)
    s = torch.linalg.svdvals(_dense_jacobian(mha, x, causal))
    smax, smin = attention_jacobian_sigma(mha, x, causal=causal)
    assert math.isclose(smax, float(s.max()), rel_tol=1e-9)
    assert math.isclose(smin, float(s.min()), rel_tol=1e-7)
    for head in head_probe(mha, x, causal=causal):
        assert head["sigma_min"] >= head["sigma_min_px"] * (1 - 1e-9)
        assert 0.0 <= head["value_share"] <= 1.0


def test_probe_pure_value_path():
    """W_Q = W_K = 0 (uniform attention): J is the value path alone, sigma_min(J) = sigma_min(P X)
    (P X has identical rows: about 0 for N > 1) and the value share is 1."""
    rng = torch.Generator().manual_seed(0)
    mha = _mha(8, 2, rng)
    with torch.no_grad():
        mha.in_proj_weight[:16].zero_()
        mha.in_proj_bias.zero_()
    x = torch.randn(4, 8, generator=rng, dtype=torch.float64)
    for head in head_probe(mha, x, causal=True):
        assert head["sigma_min"] == pytest.approx(head["sigma_min_px"], rel=1e-8)
        assert head["value_share"] == pytest.approx(1.0, abs=1e-8)


# ------------------------------------------------------------------------------------------------
# the inits

def test_ablation_inits():
    models = {}
    for init in INITS:
        m = TinyLM(vocab_size=11, max_len=6, dim=16, num_heads=2)
        demo_inits.initialize_(m, init, seed=11)
        models[init] = m
    ref = dict(models["default"].named_parameters())
    for init, m in models.items():            # the same base init everywhere outside attention
        for name, p in m.named_parameters():
            if "attn" not in name:
                assert torch.equal(p, ref[name]), (init, name)
    for init in ("conditioned", "conditioned-qk", "conditioned-v0.1"):
        w = models[init].blocks[1].attn.in_proj_weight.detach().double()
        for blk in (w[0:8], w[8:16], w[16:24], w[24:32]):                 # Q, K head blocks
            torch.testing.assert_close(torch.linalg.svdvals(blk), torch.ones(8, dtype=torch.float64),
                                       atol=1e-6, rtol=0)
        wv = w[32:]
        if init == "conditioned-qk":
            assert torch.equal(models[init].blocks[1].attn.in_proj_weight[32:], ref["blocks.1.attn.in_proj_weight"][32:])
        else:
            g = 0.1 if init == "conditioned-v0.1" else 1.0
            torch.testing.assert_close(wv, g * torch.eye(16, dtype=torch.float64), atol=1e-7, rtol=0)
    # the Q/K draws are the same with or without the V ablation
    qk = [models[i].blocks[0].attn.in_proj_weight[:32] for i in ("conditioned", "conditioned-qk", "conditioned-v0.1")]
    assert torch.equal(qk[0], qk[1]) and torch.equal(qk[0], qk[2])


def test_mimetic_products_match_targets():
    e, h = 24, 3
    d = e // h
    mha = nn.MultiheadAttention(e, h, batch_first=True)
    demo_inits.mimetic_init_(mha, generator=torch.Generator().manual_seed(5))
    g = torch.Generator().manual_seed(5)            # replay the draws
    w = mha.in_proj_weight.detach().double()
    eye = torch.eye(e, dtype=torch.float64)
    for head in range(h):
        z = torch.randn(e, e, dtype=torch.float64, generator=g) / math.sqrt(e)
        u, s, vh = torch.linalg.svd(0.7 * z + 0.7 * eye)
        best = (u[:, :d] * s[:d]) @ vh[:d]           # best rank-d approximation (Eckart-Young)
        rows = slice(head * d, (head + 1) * d)
        torch.testing.assert_close(w[:e][rows].T @ w[e:2 * e][rows], best, atol=1e-5, rtol=1e-5)
    z2 = torch.randn(e, e, dtype=torch.float64, generator=g) / math.sqrt(e)
    vo = w[2 * e:].T @ mha.out_proj.weight.detach().double().T
    torch.testing.assert_close(vo, 0.4 * z2 - 0.4 * eye, atol=1e-5, rtol=1e-5)


def test_spectral_shift_is_fixed_and_w_trains():
    mha = nn.MultiheadAttention(12, 2, batch_first=True)
    torch.nn.init.normal_(mha.in_proj_weight, std=0.02)
    w0 = mha.in_proj_weight.detach().clone()
    demo_inits.spectral_condition_(mha, lam=10.0)
    torch.testing.assert_close(mha.in_proj_weight, w0 + 10.0 * torch.eye(12).repeat(3, 1))
    assert "parametrizations.in_proj_weight.original" in dict(mha.named_parameters())
    x = torch.randn(2, 5, 12)
    mha(x, x, x)[0].square().sum().backward()
    assert mha.parametrizations.in_proj_weight.original.grad.abs().sum() > 0


def test_models_forward_shapes_and_masking():
    assert TinyViT(dim=16, num_heads=2)(torch.rand(3, 1, 8, 8)).shape == (3, 10)
    tok = torch.randint(0, 17, (2, 9))
    for causal in (True, False):
        lm = TinyLM(vocab_size=17, max_len=9, dim=16, num_heads=2, causal=causal)
        out = lm(tok)
        assert out.shape == (2, 9, 17)
        tok2 = tok.clone()
        tok2[:, -1] = (tok2[:, -1] + 1) % 17
        same = torch.allclose(lm(tok2)[:, :-1], out[:, :-1])
        assert same == causal                                  # bidirectional: earlier positions see it


@pytest.mark.slow
def test_train_run_is_reproducible():
    """Same task, init, LR and seed: the same curves and probes, bit for bit (and another seed differs)."""
    from condinit.demo.train import deterministic, task_config, train_run
    task = make_task("mqar-32", num_train=128, num_test=32)
    cfg = task_config("mqar-32", quick=True, steps=3)
    with deterministic(1):
        a, b, c = (train_run(task, cfg, "conditioned-v0.1", s, lr_mult=3.0) for s in (5, 5, 6))
    for r in (a, b, c):
        r.pop("seconds")
    assert a == b and a != c
    assert a["lr"] == 3.0 * cfg.lr and len(a["eval_query_acc"][0]) == 4


# ------------------------------------------------------------------------------------------------
# the CLI end to end (tiny)

TINY = ["demo", "--quick", "--task", "mqar-32,lm-masked", "--seeds", "1", "--steps", "4",
        "--inits", "default,conditioned-v0.1", "--lr-mults", "1,3", "--jobs", "1", "--no-progress"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    pytest.importorskip("matplotlib")
    out = tmp_path_factory.mktemp("demo") / "out"          # created by the demo, in an existing parent
    rc = main(TINY + ["--out", str(out)])
    return rc, out


@pytest.mark.slow
def test_tiny_end_to_end(tiny_run):
    rc, out = tiny_run
    assert rc == 0
    assert sorted(os.listdir(out)) == sorted(["summary.json", "curves.csv", "table.md", "mqar-32.png",
                                              "lm-masked.png"])       # and no temporary files left
    summary = json.loads((out / "summary.json").read_text())
    assert summary["meta"]["command"].startswith("condinit demo --task mqar-32,lm-masked")
    mq, lm = summary["tasks"]["mqar-32"], summary["tasks"]["lm-masked"]
    assert mq["metric"] == "accuracy" and lm["metric"] == "loss"
    assert lm["info"]["python"] and len(lm["info"]["sha256"]) == 64
    assert mq["info"]["shortcut_per_query"][-1] == 1.0
    for t in (mq, lm):
        assert set(t["inits"]) == {"default", "conditioned-v0.1"} and t["lr_multipliers"] == [1.0, 3.0]
        for s in t["inits"].values():
            assert s["best_lr_mult"] in (1.0, 3.0) and set(s["sweep"]) == {"1.0", "3.0"}
            assert len(s["kappa_init"]["per_layer"]) == 2
            for lay in s["kappa_init"]["per_layer"]:
                assert lay["sigma_min"] >= lay["sigma_min_px"] * (1 - 1e-9)
    assert len(mq["inits"]["default"]["final_query_accuracy"]) == 4
    with open(out / "curves.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["task", "init", "lr_mult", "seed", "step", "series", "index", "value"]
    assert sum(r["series"] == "train_loss" for r in rows) == 2 * 2 * 2 * 4     # tasks x inits x LRs x steps
    assert {r["series"] for r in rows} >= {"eval_query_acc", "sigma_min_px", "value_share", "kappa"}
    table = (out / "table.md").read_text()
    assert "**mqar-32**" in table and "**lm-masked**" in table and "shortcut" in table
    assert (out / "mqar-32.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv, needle", [
    (["--task", "audio"], "--task"),
    (["--seeds", "0"], "--seeds"),
    (["--steps", "0"], "--steps"),
    (["--inits", "default,xavier"], "--inits"),
    (["--inits", "default,default"], "--inits"),
    (["--lr-mults", "1,-3"], "--lr-mults"),
    (["--lr-mults", "1,x"], "--lr-mults"),
    (["--jobs", "0"], "--jobs"),
])
def test_bad_input_exits_2_and_writes_nothing(tmp_path, capsys, argv, needle):
    out = tmp_path / "out"
    rc, _, err = run_cli(capsys, "demo", "--quick", "--out", str(out), "--no-progress", *argv)
    assert rc == 2
    assert "condinit demo: error:" in err and needle in err
    assert not out.exists()


def test_out_under_a_regular_file(tmp_path, capsys):
    f = tmp_path / "file.txt"
    f.write_text("x")
    for out in (f, f / "sub" / "dir"):
        rc, _, err = run_cli(capsys, "demo", "--quick", "--task", "mqar-32", "--out", str(out), "--no-progress")
        assert rc == 2 and "not a directory" in err
    assert sorted(os.listdir(tmp_path)) == ["file.txt"] and f.read_text() == "x"
