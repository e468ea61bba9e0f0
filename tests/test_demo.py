"""condinit demo: the CLI end to end (--quick), reproducibility, bad input, and the pieces' math."""
import csv
import json
import math
import os

import pytest
import torch
from torch import nn

from condinit.cli import main
from condinit.demo import inits as demo_inits
from condinit.demo.models import TinyCausalLM, TinyViT
from condinit.demo.tasks import mqar_sequences
from condinit.demo.train import attention_jacobian_sigma

INITS = ("default", "mimetic", "conditioned", "spectral")


def _numbers(summary):
    """Every number of summary.json except timings and the meta block."""
    out = {}
    for task, t in summary["tasks"].items():
        for init, s in t["inits"].items():
            for k, v in s.items():
                if k != "seconds":
                    out[(task, init, k)] = v
        out[(task, "target")] = t["target_accuracy"]
    return out


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    pytest.importorskip("sklearn")
    pytest.importorskip("matplotlib")
    out = tmp_path_factory.mktemp("demo") / "out" / "nested"
    rc = main(["demo", "--quick", "--seeds", "1", "--steps", "12", "--out", str(out), "--jobs", "1",
               "--no-progress"])
    return rc, out


def test_quick_end_to_end_files_and_table(quick_run, capsys):
    rc, out = quick_run
    assert rc == 0
    names = sorted(os.listdir(out))
    assert names == sorted(["summary.json", "curves.csv", "table.md", "vision_curves.png", "vision_kappa.png",
                            "text_curves.png", "text_kappa.png"])      # and no temporary files left
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["tasks"]) == {"vision", "text"}
    assert summary["meta"]["command"].startswith("condinit demo")
    for task, t in summary["tasks"].items():
        assert set(t["inits"]) == set(INITS)
        assert 0.0 <= t["target_accuracy"] <= 1.0 and t["budget_steps"] == 12
        for init, s in t["inits"].items():
            fa = s["final_accuracy"]
            assert 0.0 <= fa["min"] <= fa["mean"] <= fa["max"] <= 1.0 and len(fa["per_seed"]) == 1
            assert math.isfinite(s["final_loss"]["mean"]) and s["final_loss"]["mean"] > 0
            assert s["steps_to_target"] is None or 0 <= s["steps_to_target"] <= 12
            assert (s["steps_ratio"] is None) == (s["steps_to_target"] is None)
            assert s["kappa_probe_steps"][0] == 0 and s["kappa_probe_steps"][-1] == 12
            assert len(s["kappa_per_layer"]) == 2                   # two attention layers
            for curve in s["kappa_per_layer"]:
                assert len(curve) == len(s["kappa_probe_steps"])
                assert all(isinstance(k, str) or k >= 1.0 for k in curve)   # kappa >= 1 (or "inf")
            assert (s["kappa_below_default_fraction"] is None) == (init == "default")

    with open(out / "curves.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["task", "init", "seed", "step", "series", "layer", "value"]
    series = {(r["task"], r["init"], r["series"]) for r in rows}
    for task in ("vision", "text"):
        for init in INITS:
            for s in ("train_loss", "train_acc", "eval_loss", "eval_acc", "kappa", "sigma_max", "sigma_min"):
                assert (task, init, s) in series
    n_train = sum(r["series"] == "train_loss" for r in rows)
    assert n_train == 2 * 4 * 12                                # tasks x inits x steps, one seed
    assert all(math.isfinite(float(r["value"])) for r in rows if r["series"] != "kappa")

    import matplotlib.image as mpimg
    for name in ("vision_curves.png", "vision_kappa.png", "text_curves.png", "text_kappa.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        img = mpimg.imread(out / name)
        assert img.ndim == 3 and img.shape[0] > 200 and img.shape[1] > 400

    table = (out / "table.md").read_text().splitlines()
    assert table[0].startswith("| task | init | final acc")
    assert len(table) == 2 + 2 * 4


def test_quick_prints_table(tmp_path, capsys):
    rc = main(["demo", "--quick", "--task", "text", "--seeds", "1", "--steps", "4", "--inits", "default,conditioned",
               "--out", str(tmp_path / "o"), "--jobs", "1", "--no-progress", "--no-plots"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "conditioned" in printed and "default" in printed and "steps to" in printed
    assert sorted(os.listdir(tmp_path / "o")) == ["curves.csv", "summary.json", "table.md"]


def test_same_seed_same_numbers(tmp_path):
    args = ["demo", "--quick", "--task", "text", "--seeds", "1", "--steps", "6", "--inits", "default,mimetic,conditioned,spectral",
            "--jobs", "1", "--no-progress", "--no-plots"]
    assert main(args + ["--out", str(tmp_path / "a")]) == 0
    assert main(args + ["--out", str(tmp_path / "b")]) == 0
    a = json.loads((tmp_path / "a" / "summary.json").read_text())
    b = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert _numbers(a) == _numbers(b)
    ca = (tmp_path / "a" / "curves.csv").read_text()
    assert ca == (tmp_path / "b" / "curves.csv").read_text()
    # one more step changes the numbers (the comparison above can fail)
    assert main([a if a != "6" else "7" for a in args] + ["--out", str(tmp_path / "c")]) == 0
    c = json.loads((tmp_path / "c" / "summary.json").read_text())
    assert _numbers(c) != _numbers(a)


@pytest.mark.parametrize("argv, needle", [
    (["--task", "audio"], "--task"),
    (["--seeds", "0"], "--seeds"),
    (["--seeds", "-2"], "--seeds"),
    (["--steps", "0"], "--steps"),
    (["--inits", "default,xavier"], "--inits"),
    (["--jobs", "0"], "--jobs"),
])
def test_bad_input_exits_2_and_writes_nothing(tmp_path, capsys, argv, needle):
    out = tmp_path / "out"
    rc = main(["demo", "--quick", "--out", str(out), "--no-progress"] + argv)
    assert rc == 2
    err = capsys.readouterr().err
    assert "condinit demo: error:" in err and needle in err
    assert not out.exists()


def test_out_under_a_regular_file(tmp_path, capsys):
    f = tmp_path / "file.txt"
    f.write_text("x")
    for out in (f, f / "sub" / "dir"):
        rc = main(["demo", "--quick", "--task", "text", "--out", str(out), "--no-progress"])
        assert rc == 2
        assert "not a directory" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["file.txt"] and f.read_text() == "x"


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_out_read_only_dir(tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        rc = main(["demo", "--quick", "--task", "text", "--out", str(ro / "x"), "--no-progress"])
        assert rc == 2 and "not writable" in capsys.readouterr().err
        assert os.listdir(ro) == []
    finally:
        ro.chmod(0o700)


# ------------------------------------------------------------------------------------------------
# the pieces

def test_mqar_targets_are_the_recalled_values():
    g = torch.Generator().manual_seed(3)
    x, y = mqar_sequences(17, num_pairs=5, num_keys=9, num_values=7, generator=g)
    assert x.shape == (17, 19) and y.shape == (17, 19)
    for seq, tgt in zip(x.tolist(), y.tolist()):
        ctx = dict(zip(seq[0:10:2], seq[1:10:2]))
        assert len(ctx) == 5 and all(k < 9 <= v < 16 for k, v in ctx.items())
        scored = [(i, t) for i, t in enumerate(tgt) if t != -100]
        assert [i for i, _ in scored] == [10, 12, 14, 16, 18]
        assert all(ctx[seq[i]] == t for i, t in scored)


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
        target = 0.7 * z + 0.7 * eye
        u, s, vh = torch.linalg.svd(target)
        best = (u[:, :d] * s[:d]) @ vh[:d]           # best rank-d approximation (Eckart-Young)
        rows = slice(head * d, (head + 1) * d)
        qk = w[:e][rows].T @ w[e:2 * e][rows]        # W_Q^h W_K^h^T in the row convention
        torch.testing.assert_close(qk, best, atol=1e-5, rtol=1e-5)
    z2 = torch.randn(e, e, dtype=torch.float64, generator=g) / math.sqrt(e)
    vo = w[2 * e:].T @ mha.out_proj.weight.detach().double().T  # W_V W_O, row convention
    torch.testing.assert_close(vo, 0.4 * z2 - 0.4 * eye, atol=1e-5, rtol=1e-5)
    assert float(mha.in_proj_bias.detach().abs().max()) == 0.0


def test_spectral_shift_is_fixed_and_w_trains():
    mha = nn.MultiheadAttention(12, 2, batch_first=True)
    torch.nn.init.normal_(mha.in_proj_weight, std=0.02)
    w0 = mha.in_proj_weight.detach().clone()
    demo_inits.spectral_condition_(mha, lam=10.0)
    eff = mha.in_proj_weight
    torch.testing.assert_close(eff, w0 + 10.0 * torch.eye(12).repeat(3, 1))
    trainable = [n for n, p in mha.named_parameters()]
    assert "in_proj_weight" not in trainable and "parametrizations.in_proj_weight.original" in trainable
    x = torch.randn(2, 5, 12)
    mha(x, x, x)[0].square().sum().backward()
    assert mha.parametrizations.in_proj_weight.original.grad.abs().sum() > 0


def test_all_inits_share_non_attention_weights_and_condinit_gives_unit_spectra():
    models = {}
    for init in INITS:
        m = TinyViT(dim=16, num_heads=2)
        demo_inits.initialize_(m, init, seed=11)
        models[init] = m
    ref = dict(models["default"].named_parameters())
    for init, m in models.items():
        for name, p in m.named_parameters():
            if "attn" not in name:
                assert torch.equal(p, ref[name]), (init, name)
    attn = models["conditioned"].blocks[1].attn
    w = attn.in_proj_weight.detach().double()
    for blk in (w[0:8], w[8:16], w[16:24], w[24:32]):    # Q and K head blocks: orthonormal rows
        torch.testing.assert_close(torch.linalg.svdvals(blk), torch.ones(8, dtype=torch.float64), atol=1e-5, rtol=0)
    torch.testing.assert_close(w[32:], torch.eye(16, dtype=torch.float64), atol=1e-6, rtol=0)


@pytest.mark.parametrize("causal", [False, True])
def test_jacobian_sigma_matches_full_mha_jacobian(causal):
    """Per-head probe == singular values of the dense Jacobian of nn.MultiheadAttention itself
    (W_O = I, so the module's output is the concatenated heads) wrt its whole in_proj_weight."""
    e, h, n = 8, 2, 6
    g = torch.Generator().manual_seed(2)
    mha = nn.MultiheadAttention(e, h, batch_first=True).double()
    with torch.no_grad():
        mha.in_proj_weight.copy_(torch.randn(3 * e, e, generator=g, dtype=torch.float64) * 0.4)
        mha.in_proj_bias.copy_(torch.randn(3 * e, generator=g, dtype=torch.float64) * 0.1)
        mha.out_proj.weight.copy_(torch.eye(e))
        mha.out_proj.bias.zero_()
    x = torch.randn(n, e, generator=g, dtype=torch.float64)
    mask = torch.ones(n, n, dtype=torch.bool).triu_(1) if causal else None
    w0 = mha.in_proj_weight.detach().clone()

    def f(w):
        out = torch.func.functional_call(mha, {"in_proj_weight": w}, (x[None], x[None], x[None]),
                                         {"attn_mask": mask, "need_weights": False})[0]
        return out.reshape(-1)

    jac = torch.func.jacrev(f)(w0).reshape(n * e, -1)
    s = torch.linalg.svdvals(jac.detach())
    smax, smin = attention_jacobian_sigma(mha, x, causal=causal)
    assert math.isclose(smax, float(s.max()), rel_tol=1e-9)
    assert math.isclose(smin, float(s.min()), rel_tol=1e-7)


def test_models_forward_shapes():
    vit = TinyViT(dim=16, num_heads=2)
    assert vit(torch.rand(3, 1, 8, 8)).shape == (3, 10)
    lm = TinyCausalLM(vocab_size=17, max_len=9, dim=16, num_heads=2)
    tok = torch.randint(0, 17, (2, 9))
    out = lm(tok)
    assert out.shape == (2, 9, 17)
    tok2 = tok.clone()
    tok2[:, -1] = (tok2[:, -1] + 1) % 17                      # causal: earlier positions unchanged
    torch.testing.assert_close(lm(tok2)[:, :-1], out[:, :-1])


def test_jacobian_sigma_agrees_with_condinit_probe():
    """The demo's per-head dense probe and condinit.probe's exact (dense) estimator give the same
    sigma_max and sigma_min on a LayerNorm'd input (wide J: no output-side nulls to project)."""
    probe = pytest.importorskip("condinit.probe")
    g = torch.Generator().manual_seed(4)
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    with torch.no_grad():
        mha.in_proj_weight.normal_(0, 0.3, generator=g)
        mha.in_proj_bias.normal_(0, 0.05, generator=g)
    x = torch.nn.functional.layer_norm(torch.randn(5, 8, generator=g), (8,))
    for causal in (False, True):
        est = probe.condition_number(probe.JacobianOperator(mha, x, causal=causal, dtype=torch.float64),
                                     method="dense")
        smax, smin = attention_jacobian_sigma(mha, x, causal=causal)
        assert math.isclose(smax, est.sigma_max, rel_tol=1e-8)
        assert math.isclose(smin, est.sigma_min, rel_tol=1e-6)
