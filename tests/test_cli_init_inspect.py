"""``condinit init`` and ``condinit inspect`` end to end (through ``condinit.cli.main``): presets and
any config, the layouts in the metadata, ``--adapter`` and ``--strict``, directories, and bad input."""
from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

from condinit.cli import main
from condinit.models import AttentionSpec, Projection, UncoveredAttentionWarning
from helpers import assert_orthonormal_rows, run_cli, write_config

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402


def _listing(d):
    return sorted(os.listdir(d))


# the configs given to --config: tiny models, no download
GPT2_CONFIG = {"model_type": "gpt2", "n_embd": 48, "n_layer": 2, "n_head": 4, "vocab_size": 101, "n_positions": 32,
               "architectures": ["GPT2LMHeadModel"]}
NEOX_CONFIG = {"model_type": "gpt_neox", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
               "num_attention_heads": 4, "vocab_size": 99, "max_position_embeddings": 32}
T5_CONFIG = {"model_type": "t5", "d_model": 32, "d_kv": 8, "d_ff": 32, "num_layers": 1, "num_heads": 4,
             "vocab_size": 99}
# multi-head latent attention, which no built-in adapter conditions
DEEPSEEK_CONFIG = {"model_type": "deepseek_v3", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                   "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 16, "kv_lora_rank": 16,
                   "qk_rope_head_dim": 4, "qk_nope_head_dim": 8, "v_head_dim": 8, "n_routed_experts": 2,
                   "moe_intermediate_size": 16, "vocab_size": 99}
# global attention projections beside the covered local ones
LONGFORMER_CONFIG = {"model_type": "longformer", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                     "num_attention_heads": 4, "vocab_size": 99, "attention_window": 4, "max_position_embeddings": 40,
                     "pad_token_id": 1}


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    d = tmp_path_factory.mktemp("init")
    out = d / "tiny.safetensors"
    assert main(["init", "--preset", "tiny-llama", "--seed", "3", "--out", str(out), "--quiet"]) == 0
    return out


def test_init_tiny_llama_writes_conditioned_checkpoint(tiny_llama, tmp_path, capsys):
    assert _listing(tiny_llama.parent) == ["tiny.safetensors"]  # no temporary file left
    with safe_open(str(tiny_llama), "pt") as fh:
        meta = json.loads(fh.metadata()["condinit"])
    assert meta["family"] == "llama" and meta["num_heads"] == 8 and meta["num_kv_heads"] == 4
    assert meta["head_dim"] == 32 and meta["seed"] == 3 and len(meta["layers"]) == 4
    sd = load_file(str(tiny_llama))
    # tied embeddings written once
    assert ("lm_head.weight" in sd) != ("model.embed_tokens.weight" in sd)
    for L in range(4):
        q = sd[f"model.layers.{L}.self_attn.q_proj.weight"].reshape(8, 32, 256)
        k = sd[f"model.layers.{L}.self_attn.k_proj.weight"].reshape(4, 32, 256)
        for w in (q, k):
            assert (w @ w.transpose(1, 2) - torch.eye(32)).abs().max() <= 1e-5
        v = sd[f"model.layers.{L}.self_attn.v_proj.weight"]
        assert torch.equal(v, torch.eye(128, 256))
    # the file loads back into the model class and runs
    from condinit.models.presets import build_model
    from safetensors.torch import load_model

    model, _ = build_model("tiny-llama", device="cpu")
    load_model(model, str(tiny_llama), strict=True)
    ids = torch.randint(0, 4096, (1, 8))
    assert torch.isfinite(model(input_ids=ids, labels=ids).loss)
    # the table is printed without --quiet
    rc, out, _ = run_cli(capsys, "inspect", str(tiny_llama))
    assert rc == 0 and "model.layers.3.self_attn" in out


def test_init_same_seed_same_file_content(tmp_path, capsys):
    cfg = write_config(tmp_path, GPT2_CONFIG)
    files = []
    for name in ("a", "b"):
        out = tmp_path / f"{name}.safetensors"
        rc, text, err = run_cli(capsys, "init", "--config", str(cfg), "--seed", "5", "--out", str(out))
        assert rc == 0, err
        assert "transformer.h.1.attn" in text and "wrote" in text  # the per-layer table and summary
        files.append(out)
    # same seed, same tensors (--seed seeds torch's generator too, for the model's own init);
    # safetensors' header order is not reproducible across calls, its content is
    a, b = (load_file(str(f)) for f in files)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with safe_open(str(files[0]), "pt") as fa, safe_open(str(files[1]), "pt") as fb:
        assert fa.metadata() == fb.metadata()


@pytest.mark.slow
def test_inspect_reads_metadata_and_plots(tiny_llama, tmp_path, capsys):
    plot = tmp_path / "cond.png"
    rc, out, err = run_cli(capsys, "inspect", str(tiny_llama), "--plot", str(plot))
    assert rc == 0, err
    assert "model.layers.0.self_attn" in out and "8/4x32" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and _listing(tmp_path) == ["cond.png"]
    rc, out, _ = run_cli(capsys, "inspect", str(tiny_llama), "--json")
    data = json.loads(out)
    assert len(data["layers"]) == 4
    for layer in data["layers"]:
        for p in "qk":
            assert max(abs(c - 1) for c in layer[p]["cond_per_head"]) < 1e-4
        assert layer["v"]["cond_per_head"] == [1.0] * 4


def test_config_gpt2_bf16_and_inspect_without_metadata(tmp_path, capsys):
    cfg = write_config(tmp_path, GPT2_CONFIG)
    out = tmp_path / "gpt2.safetensors"
    rc, _, err = run_cli(capsys, "init", "--config", str(cfg), "--dtype", "bf16", "--out", str(out), "--quiet")
    assert rc == 0, err
    sd = load_file(str(out))
    w = sd["transformer.h.1.attn.c_attn.weight"]  # Conv1D: [in, 3E]
    assert w.dtype == torch.bfloat16 and w.shape == (48, 144)
    assert torch.equal(w[:, 96:].t().float(), torch.eye(48))
    assert torch.count_nonzero(sd["transformer.h.1.attn.c_attn.bias"]) == 0
    with safe_open(str(out), "pt") as fh:   # no --seed: the explicit default 0, never a drawn seed
        assert json.loads(fh.metadata()["condinit"])["seed"] == 0
    rc, text, _ = run_cli(capsys, "inspect", str(out), "--json")
    conds = json.loads(text)["layers"][0]["q"]["cond_per_head"]
    assert len(conds) == 4 and max(conds) < 1.05  # bf16 rounding moves kappa off 1 a little
    # without the condinit header: names are enough, head counts come from the options
    bare = tmp_path / "bare.safetensors"
    save_file(sd, str(bare))
    rc, _, err = run_cli(capsys, "inspect", str(bare))
    assert rc == 2 and "--num-heads" in err
    rc, text, err = run_cli(capsys, "inspect", str(bare), "--num-heads", "4", "--json")
    assert rc == 0, err
    layers = json.loads(text)["layers"]
    assert [l["name"] for l in layers] == ["transformer.h.0.attn", "transformer.h.1.attn"]
    assert layers[1]["head_dim"] == 12 and max(layers[1]["k"]["cond_per_head"]) < 1.05


def test_inspect_finds_separate_projections_by_name(tmp_path, capsys):
    g = torch.Generator().manual_seed(0)
    sd = {f"enc.{i}.attn.{p}.weight": torch.randn(rows, 20, generator=g)
          for i in range(2) for p, rows in (("query", 20), ("key", 10), ("value", 10))}
    f = tmp_path / "plain.safetensors"
    save_file(sd, str(f))
    rc, text, err = run_cli(capsys, "inspect", str(f), "--num-heads", "4", "--head-dim", "5", "--json")
    assert rc == 0, err
    layers = json.loads(text)["layers"]
    assert len(layers) == 2 and layers[0]["num_kv_heads"] == 2
    blocks = sd["enc.0.attn.query.weight"].double().reshape(4, 5, 20)
    s = torch.linalg.svdvals(blocks)
    assert layers[0]["q"]["cond_per_head"] == pytest.approx((s[:, 0] / s[:, -1]).tolist(), rel=1e-9)


def test_init_bad_inputs_leave_nothing_behind(tmp_path, capsys):
    before = _listing(tmp_path)
    rc, _, err = run_cli(capsys, "init", "--preset", "llama-7t", "--out", str(tmp_path / "x.safetensors"))
    assert rc == 2 and "unknown preset 'llama-7t'" in err and "tiny-llama" in err
    rc, _, err = run_cli(capsys, "init", "--out", str(tmp_path / "missing" / "x.safetensors"))
    assert rc == 2 and "does not exist" in err
    afile = tmp_path / "afile"
    afile.write_text("x")
    rc, _, err = run_cli(capsys, "init", "--out", str(afile / "x.safetensors"))
    assert rc == 2 and "not a directory" in err
    rc, _, err = run_cli(capsys, "init", "--out", str(tmp_path / "d") + "/", "--max-shard-size", "0")
    assert rc == 2 and "max-shard-size" in err and not (tmp_path / "d").exists()   # a directory --out
    rc, _, err = run_cli(capsys, "init", "--seed", str(2 ** 64), "--out", str(tmp_path / "x.safetensors"))
    assert rc == 2 and "--seed must be an int in [0, 2**64)" in err
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    rc, _, err = run_cli(capsys, "init", "--config", str(bad), "--out", str(tmp_path / "x.safetensors"))
    assert rc == 2 and "not readable JSON" in err
    write_config(tmp_path, {"model_type": "no-such-model"}, "bad.json")
    rc, _, err = run_cli(capsys, "init", "--config", str(bad), "--out", str(tmp_path / "x.safetensors"))
    assert rc == 2 and "no-such-model" in err
    assert _listing(tmp_path) == sorted(before + ["afile", "bad.json"])


def test_init_failure_while_writing_leaves_nothing(tmp_path, capsys, monkeypatch):
    from condinit.models.stream.materialize import Materializer

    real, calls = Materializer.unit, [0]

    def broken(self, unit):
        calls[0] += 1
        if calls[0] == 6:      # the file is half written by now
            raise ValueError("disk full (simulated)")
        return real(self, unit)

    monkeypatch.setattr(Materializer, "unit", broken)
    cfg = write_config(tmp_path, GPT2_CONFIG)
    rc, _, err = run_cli(capsys, "init", "--config", str(cfg), "--out", str(tmp_path / "x.safetensors"))
    assert rc == 2 and "disk full" in err and calls[0] == 6
    assert _listing(tmp_path) == ["config.json"]


def test_inspect_bad_inputs(tmp_path, tiny_llama, capsys):
    pt = tmp_path / "model.pt"
    torch.save({"w": torch.ones(2)}, pt)
    rc, _, err = run_cli(capsys, "inspect", str(pt))
    assert rc == 2 and "never unpickles" in err
    pkl = tmp_path / "model.safetensors"  # a pickle with a safetensors name: caught by content
    import pickle
    pkl.write_bytes(pickle.dumps({"w": 1}))
    rc, _, err = run_cli(capsys, "inspect", str(pkl))
    assert rc == 2 and "pickle" in err
    zipped = tmp_path / "zip.safetensors"
    zipped.write_bytes(pt.read_bytes())
    rc, _, err = run_cli(capsys, "inspect", str(zipped))
    assert rc == 2 and "zip" in err
    data = tiny_llama.read_bytes()
    trunc = tmp_path / "trunc.safetensors"
    trunc.write_bytes(data[: len(data) // 2])
    rc, _, err = run_cli(capsys, "inspect", str(trunc))
    assert rc == 2 and "truncated" in err
    trunc.write_bytes(data[:5])
    rc, _, err = run_cli(capsys, "inspect", str(trunc))
    assert rc == 2 and "too short" in err
    rc, _, err = run_cli(capsys, "inspect", str(tmp_path / "nope.safetensors"))
    assert rc == 2 and "does not exist" in err
    empty = tmp_path / "empty.safetensors"
    save_file({"mlp.weight": torch.ones(3, 3)}, str(empty))
    rc, _, err = run_cli(capsys, "inspect", str(empty), "--num-heads", "1")
    assert rc == 2 and "no attention weights" in err
    listing = _listing(tmp_path)
    rc, _, err = run_cli(capsys, "inspect", str(tiny_llama), "--plot", str(tmp_path / "no" / "p.png"))
    assert rc == 2 and "does not exist" in err
    rc, _, err = run_cli(capsys, "inspect", str(tiny_llama), "--num-heads", "0")
    assert rc == 2 and "--num-heads" in err
    rc, _, err = run_cli(capsys, "inspect", str(tiny_llama), "--num-heads", "3")
    assert rc == 2 and "3 heads" in err
    assert _listing(tmp_path) == listing


# ------------------------------------------------------------------------------------------------
# any config: layouts in the metadata, --adapter, --strict

def test_init_config_neox_metadata_layout_and_inspect(tmp_path, capsys):
    cfg = write_config(tmp_path, NEOX_CONFIG, "neox.json")
    out = tmp_path / "neox.safetensors"
    rc, text, err = run_cli(capsys, "init", "--config", str(cfg), "--strict", "--out", str(out))
    assert rc == 0, err
    assert "per_head" in text
    with safe_open(str(out), "pt") as fh:
        meta = json.loads(fh.metadata()["condinit"])
    ent = meta["layers"][0]
    assert ent["layout"] == "per_head" and meta["uncovered"] == []
    assert ent["q"] == {"tensor": "gpt_neox.layers.0.attention.query_key_value.weight", "start": 0, "stop": 8,
                        "transposed": False, "groups": 4, "stride": 24}
    # the file's rows, read per head as GPT-NeoX reads them
    w = load_file(str(out))["gpt_neox.layers.1.attention.query_key_value.weight"].unflatten(0, (4, 3, 8))
    for h in range(4):
        assert_orthonormal_rows(w[h, 0], f"file Q head {h}")
    rc, text, err = run_cli(capsys, "inspect", str(out), "--json")
    assert rc == 0, err
    for layer in json.loads(text)["layers"]:
        assert layer["layout"] == "per_head"
        for p in "qk":
            assert max(abs(c - 1) for c in layer[p]["cond_per_head"]) < 1e-4
        assert layer["v"]["cond_per_head"] == [1.0] * 4
    # every head block of a conditioned file has kappa 1 whichever rows are read: give the heads
    # known, different kappas (Q head h: h + 2, K head h: h + 10) so that only the right rows match
    with safe_open(str(out), "pt") as fh:
        header = fh.metadata()
    sd = load_file(str(out))
    for L in range(2):
        w = sd[f"gpt_neox.layers.{L}.attention.query_key_value.weight"].unflatten(0, (4, 3, 8))
        for h in range(4):
            for part, kappa in ((0, h + 2.0), (1, h + 10.0)):
                w[h, part] = torch.linspace(1.0, kappa, 8)[:, None] * w[h, part]
    marked = tmp_path / "marked.safetensors"
    save_file(sd, str(marked), metadata=header)
    expect = {"q": [2.0, 3.0, 4.0, 5.0], "k": [10.0, 11.0, 12.0, 13.0], "v": [1.0] * 4}

    def kappas(*argv):
        rc, text, err = run_cli(capsys, "inspect", *argv, "--json")
        assert rc == 0, err
        return [{p: layer[p]["cond_per_head"] for p in "qkv"} for layer in json.loads(text)["layers"]]

    for got in kappas(str(marked)):
        for p in "qkv":
            assert got[p] == pytest.approx(expect[p], rel=1e-5), p
    # without the metadata the layout must be given; the contiguous reading mixes the heads
    bare = tmp_path / "bare.safetensors"
    save_file(sd, str(bare))
    rc, _, err = run_cli(capsys, "inspect", str(bare), "--num-heads", "4")
    assert rc == 2 and "--layout per_head" in err
    for got in kappas(str(bare), "--num-heads", "4", "--layout", "per_head"):
        assert got["q"] == pytest.approx(expect["q"], rel=1e-5) and got["k"] == pytest.approx(expect["k"], rel=1e-5)
    wrong = kappas(str(bare), "--num-heads", "4", "--layout", "contiguous")[0]
    assert wrong["q"] == pytest.approx([2.0, 10.0, 1.0, 3.0], rel=1e-5)     # q0, k0, v0, q1
    rc, _, err = run_cli(capsys, "inspect", str(out), "--layout", "contiguous")
    assert rc == 2 and "metadata" in err


def test_init_config_model_classes(tmp_path, capsys):
    """Decoder LMs are built as AutoModelForCausalLM, encoders and encoder-decoders as AutoModel."""
    from condinit.models.presets import build_model, model_class_for

    assert model_class_for("llama", transformers.LlamaConfig()) == "AutoModelForCausalLM"
    for mt in ("bert", "roberta", "t5", "bart", "whisper", "vit"):
        assert model_class_for(mt, transformers.AutoConfig.for_model(mt)) == "AutoModel", mt
    model, family = build_model(config=dict(T5_CONFIG))
    assert type(model).__name__ == "T5Model" and family == "t5"
    cfg = write_config(tmp_path, T5_CONFIG, "t5.json")
    rc, text, err = run_cli(capsys, "init", "--config", str(cfg), "--out", str(tmp_path / "t5.safetensors"))
    assert rc == 0, err
    assert "EncDecAttention" in text and "(cross)" in text


def test_init_unsupported_config_lists_modules_and_strict_writes_nothing(tmp_path, capsys):
    cfg = write_config(tmp_path, dict(DEEPSEEK_CONFIG, qk_nope_head_dim=4, num_hidden_layers=4), "ds.json")
    out = tmp_path / "ds.safetensors"
    rc, _, err = run_cli(capsys, "init", "--config", str(cfg), "--out", str(out))
    assert rc == 2 and ("4 x DeepseekV3Attention (model.layers.0.self_attn, model.layers.1.self_attn, "
                        "model.layers.2.self_attn, ...): multi-head latent attention") in err, err
    assert err.count("multi-head latent attention") == 1            # one line per reason, not per layer
    assert "--adapter" in err and not out.exists()
    # a model with an uncovered module: --strict refuses before writing, the default lists it
    mixed = write_config(tmp_path, LONGFORMER_CONFIG, "mixed.json")
    rc, _, err = run_cli(capsys, "init", "--config", str(mixed), "--strict", "--out", str(out))
    assert rc == 2 and "query_global/key_global/value_global" in err and not out.exists()
    with pytest.warns(UncoveredAttentionWarning):
        rc, text, err = run_cli(capsys, "init", "--config", str(mixed), "--out", str(out))
    assert rc == 0, err
    assert "not conditioned" in text and "query_global" in text
    rc, text, _ = run_cli(capsys, "inspect", str(out))
    assert "not conditioned when the file was written" in text and "LongformerSelfAttention" in text


def mla_adapter(module):
    """An ``--adapter`` for the tests: conditions only DeepSeek's q_b_proj / kv_b_proj factors."""
    if type(module).__name__ != "DeepseekV3Attention":
        return None
    kv = module.kv_b_proj.weight          # [H * (nope + v), rank]: per head its K-nope rows, then its V rows
    H, nope, vd = module.config.num_attention_heads, module.qk_nope_head_dim, module.v_head_dim
    return AttentionSpec(Projection(module.q_b_proj.weight, 0, nope, groups=H, stride=nope + module.qk_rope_head_dim),
                         Projection(kv, 0, nope, groups=H, stride=nope + vd),
                         Projection(kv, nope, nope + vd, groups=H, stride=nope + vd), H, H, nope)


def test_init_adapter_from_the_command_line(tmp_path, capsys):
    cfg = write_config(tmp_path, DEEPSEEK_CONFIG, "ds.json")
    out = tmp_path / "ds.safetensors"
    rc, text, err = run_cli(capsys, "init", "--config", str(cfg), "--adapter", "test_cli_init_inspect:mla_adapter",
                            "--strict", "--out", str(out))
    assert rc == 0, err
    assert "--adapter test_cli_init_inspect:mla_adapter" in text
    from condinit.models import registered_adapters

    assert nn.Module not in registered_adapters()       # registered for the command only
    for bad, msg in (("nocolon", "expected MODULE:FUNCTION"), ("no_such_module_xyz:f", "cannot import"),
                     ("test_cli_init_inspect:missing", "has no attribute"),
                     ("test_cli_init_inspect:NEOX_CONFIG", "expected a function")):
        rc, _, err = run_cli(capsys, "init", "--config", str(cfg), "--adapter", bad, "--out", str(out))
        assert rc == 2 and msg in err, (bad, err)


# ------------------------------------------------------------------------------------------------
# directories, the single file, dry runs, refusals, bad arguments

def test_an_existing_file_is_replaced_only_with_overwrite(tmp_path, capsys):
    """A single-file --out that exists is refused (its bytes untouched) unless --overwrite, as a
    directory holding a model is; with it, the file is the new seed's."""
    out = tmp_path / "m.safetensors"
    assert main(["init", "--preset", "tiny-llama", "--seed", "1", "--out", str(out), "--quiet"]) == 0
    first = out.read_bytes()
    rc, _, err = run_cli(capsys, "init", "--preset", "tiny-llama", "--seed", "2", "--out", str(out))
    assert rc == 2 and "exists: pass --overwrite" in err and out.read_bytes() == first, err
    rc, _, err = run_cli(capsys, "init", "--preset", "tiny-llama", "--seed", "2", "--out", str(out), "--overwrite")
    assert rc == 0 and out.read_bytes() != first, err
    assert sorted(os.listdir(tmp_path)) == ["m.safetensors"]


def test_file_and_directory_hold_the_same_tensors_and_inspect_alike(tmp_path, capsys):
    cfg = write_config(tmp_path, GPT2_CONFIG)
    one, d = tmp_path / "one.safetensors", tmp_path / "dir"
    assert main(["init", "--config", str(cfg), "--seed", "4", "--out", str(one), "--quiet"]) == 0
    rc, out, err = run_cli(capsys, "init", "--config", str(cfg), "--seed", "4", "--out", str(d) + os.sep,
                           "--max-shard-size", "30kB")
    assert rc == 0, err
    assert "wrote" in out and "transformer.h.1.attn" in out
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3
    flat = load_file(str(one))
    merged = {}
    for name in shards:
        merged.update(load_file(str(d / name)))
    assert merged.keys() == flat.keys() and all(torch.equal(merged[k], flat[k]) for k in flat)
    rc, a, err = run_cli(capsys, "inspect", str(one), "--json")
    assert rc == 0, err
    rc, b, err = run_cli(capsys, "inspect", str(d), "--json")
    assert rc == 0, err
    la, lb = json.loads(a)["layers"], json.loads(b)["layers"]
    assert len(la) == 2 and la == lb          # per layer and head, read through the index
    # a directory that does not hold a complete model: one-line errors naming what is missing
    os.unlink(d / shards[-1])
    rc, _, err = run_cli(capsys, "inspect", str(d))
    assert rc == 2 and shards[-1] in err and "missing" in err and len(err.strip().splitlines()) == 1
    os.unlink(d / "model.safetensors.index.json")
    rc, _, err = run_cli(capsys, "inspect", str(d))
    assert rc == 2 and "model.safetensors.index.json" in err


def test_dry_run_prints_the_plan_and_writes_nothing(tmp_path, capsys):
    rc, out, err = run_cli(capsys, "init", "--preset", "tiny-llama", "--out", str(tmp_path / "d") + os.sep,
                           "--max-shard-size", "2MB", "--dtype", "bf16", "--dry-run")
    assert rc == 0, err
    assert "dry run, nothing written" in out and "model-00001-of-" in out
    assert "peak memory about" in out and "expected time on this machine" in out and "elements/s" in out
    assert _listing(tmp_path) == []
    rc, out, err = run_cli(capsys, "init", "--preset", "tiny-llama", "--out", str(tmp_path / "x.safetensors"),
                           "--dry-run", "--quiet")
    assert rc == 0 and "x.safetensors" in out and _listing(tmp_path) == []


@pytest.mark.slow
def test_directory_with_another_model_refused_unless_overwrite(tmp_path, capsys):
    d = str(tmp_path / "d") + os.sep
    assert main(["init", "--preset", "tiny-llama", "--out", d, "--quiet", "--seed", "1"]) == 0
    capsys.readouterr()
    before = {n: (tmp_path / "d" / n).read_bytes() for n in _listing(tmp_path / "d")}
    rc, _, err = run_cli(capsys, "init", "--preset", "tiny-llama", "--out", d, "--seed", "2")
    assert rc == 2 and "another model" in err and "--overwrite" in err and "seed" in err
    rc, _, err = run_cli(capsys, "init", "--config", str(write_config(tmp_path, GPT2_CONFIG, "gpt2.json")), "--out", d)
    assert rc == 2 and "config.json differs" in err
    assert {n: (tmp_path / "d" / n).read_bytes() for n in _listing(tmp_path / "d")} == before
    rc, _, err = run_cli(capsys, "init", "--preset", "tiny-llama", "--out", d, "--seed", "2", "--overwrite", "--quiet",
                         "--max-shard-size", "2MB")
    assert rc == 0, err
    # --resume: an interrupted write (a shard and the index missing) is finished, the rest kept
    full = {n: (tmp_path / "d" / n).read_bytes() for n in _listing(tmp_path / "d")}
    shards = sorted(n for n in full if n.startswith("model-"))
    assert len(shards) >= 3
    os.unlink(tmp_path / "d" / shards[1])
    os.unlink(tmp_path / "d" / "model.safetensors.index.json")
    rc, out, err = run_cli(capsys, "init", "--preset", "tiny-llama", "--out", d, "--seed", "2", "--resume",
                           "--max-shard-size", "2MB")
    assert rc == 0 and f"{len(shards) - 1} complete shard(s) kept" in out, err
    assert {n: (tmp_path / "d" / n).read_bytes() for n in _listing(tmp_path / "d")} == full


@pytest.mark.parametrize("change, needle", [
    ({"n_head": 5}, "n_head (5) must divide n_embd (48)"),
    ({"n_embd": -48}, "n_embd must be an int in [1, inf], got -48"),
    ({"n_embd": "48"}, "n_embd must be an int, got the string '48'"),
    ({"n_layer": 1.5}, "n_layer must be an int, got float 1.5"),
    ({"n_layer": True}, "n_layer must be an int, got bool True"),
])
def test_bad_config_values_are_one_line_errors(tmp_path, capsys, change, needle):
    cfg = write_config(tmp_path, dict(GPT2_CONFIG, **change))
    rc, _, err = run_cli(capsys, "init", "--config", str(cfg), "--out", str(tmp_path / "x.safetensors"))
    assert rc == 2 and needle in err and f"--config {cfg}" in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert _listing(tmp_path) == ["config.json"]


def test_bad_arguments_are_one_line_errors(tmp_path, capsys):
    llama = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 1,
             "num_attention_heads": 4, "num_key_value_heads": 3, "vocab_size": 50}
    cfg = write_config(tmp_path, llama, "llama.json")
    d = str(tmp_path / "d") + os.sep
    f = str(tmp_path / "x.safetensors")
    cases = [
        (["--config", str(cfg), "--out", f], "num_key_value_heads (3) must divide num_attention_heads (4)"),
        (["--out", d, "--max-shard-size", "-5"], "--max-shard-size must be a size such as 5GB"),
        (["--out", d, "--max-shard-size", "lots"], "--max-shard-size must be a size such as 5GB"),
        (["--out", d, "--max-shard-size", "0"], "--max-shard-size must be at least 1 byte"),
        (["--out", f, "--max-shard-size", "5GB"], "--max-shard-size: only with a directory --out"),
        (["--out", f, "--resume"], "--resume: only with a directory --out"),
        (["--out", f, "--qk-gain", "-1"], "--qk-gain must be in (0.0"),
        (["--out", f, "--max-rows", "-1"], "--max-rows must be an int in [0"),
    ]
    for argv, needle in cases:
        rc, _, err = run_cli(capsys, "init", *argv)
        assert rc == 2 and needle in err, (argv, err)
        assert len(err.strip().splitlines()) == 1 and "invalid literal" not in err, (argv, err)
    assert _listing(tmp_path) == ["llama.json"]


_CONSOLE = """
import atexit, sys, threading, time
atexit.register(lambda: print("exit handler ran", flush=True))
from condinit.cli import run
def late():
    time.sleep(1.0)
    print("non-daemon thread done")
threading.Thread(target=late).start()
run(sys.argv[1:])
"""


@pytest.mark.slow
def test_console_script_ends_like_a_normal_exit(tmp_path):
    """``condinit`` / ``python -m condinit`` end without the interpreter's teardown, but with what a
    normal exit does: other threads joined, exit handlers run, buffered output flushed, the status kept."""
    import subprocess
    import sys

    ok = subprocess.run([sys.executable, "-c", _CONSOLE, "info", "--json"], capture_output=True, text=True,
                        timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.endswith("exit handler ran\n") and ok.stdout.count("non-daemon thread done\n") == 1
    body = ok.stdout.replace("non-daemon thread done\n", "")[:-len("exit handler ran\n")]
    assert "torch" in json.loads(body)              # all of stdout's buffer was flushed
    bad = subprocess.run([sys.executable, "-c", _CONSOLE, "init", "--preset", "no-such-preset", "--out",
                          str(tmp_path / "x.safetensors")], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "condinit init: error: unknown preset 'no-such-preset'" in bad.stderr
    assert bad.stdout == "non-daemon thread done\nexit handler ran\n"     # the thread outlived main
    assert not os.listdir(tmp_path)
    mod = subprocess.run([sys.executable, "-m", "condinit", "init", "--preset", "tiny-llama", "--out",
                          str(tmp_path / "t.safetensors"), "--quiet"], capture_output=True, text=True, timeout=300)
    assert mod.returncode == 0, mod.stderr
    assert len(load_file(str(tmp_path / "t.safetensors"))) > 10
