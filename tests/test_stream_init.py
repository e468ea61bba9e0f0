"""condinit.models.stream.write_pretrained: streamed, sharded, from_pretrained-ready directories."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

transformers = pytest.importorskip("transformers")

import condinit  # noqa: E402
from condinit.models.checkpoint import open_checkpoint, read_metadata  # noqa: E402
from condinit.models.stream import WEIGHTS_INDEX_NAME, parse_shard_size, plan_shards, write_pretrained  # noqa: E402


def tiny_config(tie: bool, **kw):
    base = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=300, tie_word_embeddings=tie, initializer_range=0.02)
    base.update(kw)
    return transformers.LlamaConfig(**base)


def load(out):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set(), info
    assert info["mismatched_keys"] == set() and not info["error_msgs"], info
    return model


def index_of(out):
    with open(os.path.join(out, WEIGHTS_INDEX_NAME)) as fh:
        return json.load(fh)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tie", [True, False])
def test_loads_and_matches_apply(tmp_path, seed, dtype, tie):
    cfg = tiny_config(tie)
    out = tmp_path / "out"
    rep = write_pretrained(cfg, out, seed=seed, dtype=dtype, max_shard_size=40_000)
    assert len(rep.files) >= 3
    model = load(out)
    assert model.dtype == dtype
    sd = model.state_dict()

    # the reference: the whole model materialized, then condinit.apply with the same seed
    ref = transformers.AutoModelForCausalLM.from_config(cfg).to(dtype)
    condinit.apply(ref, seed=seed, report=False)
    ref_sd = ref.state_dict()
    attn = [k for k in sd if any(f".{p}_proj." in k for p in "qkv")]
    assert len(attn) == 3 * cfg.num_hidden_layers
    for k in attn:
        assert torch.equal(sd[k], ref_sd[k]), k

    # everything else: the model's own init rule (norms ones, Linear / Embedding normal(0, 0.02))
    std = cfg.initializer_range
    for k, t in sd.items():
        if k in attn or (tie and k == "lm_head.weight"):
            continue
        if "norm" in k:
            assert torch.equal(t, torch.ones_like(t)), k
        else:
            x = t.double()
            n = x.numel()
            # std of the sample std of n normals ~ std / sqrt(2n); 6 sigma, and a mean near 0
            assert abs(x.std().item() / std - 1) < 6 / (2 * n) ** 0.5 + 0.01, (k, x.std().item())
            assert abs(x.mean().item()) < 6 * std / n ** 0.5, k
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr() if tie else \
        not torch.equal(sd["lm_head.weight"], sd["model.embed_tokens.weight"])
    assert ("lm_head.weight" in index_of(out)["weight_map"]) is not tie


def test_index_covers_every_key_once(tmp_path):
    cfg = tiny_config(True)
    out = tmp_path / "out"
    rep = write_pretrained(cfg, out, seed=3, max_shard_size="40KB")
    index = index_of(out)
    wm = index["weight_map"]
    seen = []
    for path in rep.files:
        with open_checkpoint(path) as fh:
            keys = list(fh.keys())
            assert all(wm[k] == os.path.basename(path) for k in keys)
            seen += keys
            meta = read_metadata(fh)   # each shard's condinit entry is readable on its own
            assert meta["seed"] == 3 and meta["shard"][1] == len(rep.files)
            for ent in meta["layers"]:
                assert all(ent[p]["tensor"] in keys for p in "qkv")
    assert sorted(seen) == sorted(wm) and len(seen) == len(set(seen))
    assert index["metadata"]["total_size"] == rep.total_size == sum(
        t.numel() * t.element_size() for k, t in load(out).state_dict().items() if k in wm)
    assert [l["index"] for l in index["metadata"]["condinit"]["layers"]] == list(range(cfg.num_hidden_layers))

    # the same files and keys as save_pretrained
    ref = transformers.AutoModelForCausalLM.from_config(cfg)
    ref.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    assert index_of(tmp_path / "hf")["weight_map"] == wm
    with torch.device("meta"):
        meta_model = transformers.AutoModelForCausalLM.from_config(cfg)
    assert {k: f for f, ks in plan_shards(meta_model, "40KB").items() for k in ks} == wm


def test_reproducible_bytes_and_independent_of_sharding(tmp_path):
    cfg = tiny_config(False)
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    ra = write_pretrained(cfg, a, seed=11, max_shard_size=50_000)
    rb = write_pretrained(cfg, b, seed=11, max_shard_size=50_000)
    assert [os.path.basename(f) for f in ra.files] == [os.path.basename(f) for f in rb.files]
    for fa, fb in zip(ra.files, rb.files):
        with open(fa, "rb") as x, open(fb, "rb") as y:
            assert x.read() == y.read(), fa
    write_pretrained(cfg, c, seed=11, max_shard_size="1GB")   # one file, no index
    assert sorted(os.listdir(c)) == ["config.json", "generation_config.json", "model.safetensors"]
    sa, sc = load(a).state_dict(), load(c).state_dict()
    assert all(torch.equal(sa[k], sc[k]) for k in sa)
    other = load(write_pretrained(cfg, tmp_path / "d", seed=12, max_shard_size=50_000).out_dir).state_dict()
    assert not torch.equal(other["model.layers.0.self_attn.q_proj.weight"], sa["model.layers.0.self_attn.q_proj.weight"])
    assert not torch.equal(other["model.layers.0.mlp.up_proj.weight"], sa["model.layers.0.mlp.up_proj.weight"])


def test_rewrite_removes_stale_files(tmp_path):
    cfg = tiny_config(True)
    out = tmp_path / "out"
    write_pretrained(cfg, out, seed=0, max_shard_size=20_000)
    many = len([f for f in os.listdir(out) if f.endswith(".safetensors")])
    rep = write_pretrained(cfg, out, seed=0, max_shard_size=60_000)
    names = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    assert names == sorted(os.path.basename(f) for f in rep.files) and len(names) < many
    load(out)


def test_arguments_checked_before_writing(tmp_path):
    cfg = tiny_config(True)
    for kw, err in [(dict(seed=-1), ValueError), (dict(seed=True), TypeError), (dict(method="qr"), ValueError),
                    (dict(max_shard_size="5 parsecs"), ValueError), (dict(max_shard_size=0), ValueError),
                    (dict(dtype=torch.int8), TypeError), (dict(v_mode="x"), ValueError)]:
        with pytest.raises(err):
            write_pretrained(cfg, tmp_path / "x", **kw)
    assert not (tmp_path / "x").exists()
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="not a directory"):
        write_pretrained(cfg, tmp_path / "file")
    with pytest.raises(ValueError, match="meta device"):
        write_pretrained(transformers.AutoModelForCausalLM.from_config(cfg), tmp_path / "y")
    assert parse_shard_size("500MB") == 500_000_000 and parse_shard_size("2GiB") == 2 ** 31


_MEMORY_SCRIPT = textwrap.dedent("""
    import json, resource, sys, time
    import torch, transformers
    from condinit.models.stream import write_pretrained
    cfg = transformers.LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                                   num_attention_heads=16, num_key_value_heads=4, head_dim=64, vocab_size=8192,
                                   tie_word_embeddings=False)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    write_pretrained(transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                     num_attention_heads=2, vocab_size=64), sys.argv[1] + "/warm")   # first-call imports
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    rep = write_pretrained(model, sys.argv[1] + "/big", seed=0, max_shard_size="50MB")
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"growth": after - before, "size": rep.total_size, "files": len(rep.files),
                      "seconds": time.perf_counter() - t0}))
""")


def test_bounded_memory(tmp_path):
    res = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout.strip().splitlines()[-1])
    print(got)
    assert got["size"] > 350e6 and got["files"] >= 8
    assert got["growth"] < 0.35 * got["size"], got


def test_cli_directory_out(tmp_path, capsys):
    from condinit.cli import main

    out = str(tmp_path / "tiny") + os.sep
    assert main(["init", "--preset", "tiny-llama", "--out", out, "--max-shard-size", "4MB", "--seed", "5",
                 "--quiet"]) == 0
    assert capsys.readouterr().out.strip() == out.rstrip(os.sep)
    files = index_of(out)["weight_map"].values()
    assert len(set(files)) >= 3
    model = load(out)
    ref = transformers.AutoModelForCausalLM.from_config(model.config)
    condinit.apply(ref, seed=5, report=False)
    k = "model.layers.3.self_attn.k_proj.weight"
    assert torch.equal(model.state_dict()[k], ref.state_dict()[k])
    assert main(["init", "--preset", "tiny-llama", "--out", out, "--max-shard-size", "lots"]) != 0
    assert "--max-shard-size" in capsys.readouterr().err
