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
from helpers import LLAMA_GQA, llama_config, on_real_init  # noqa: E402


def tiny_config(tie: bool, **kw):
    return llama_config(LLAMA_GQA, tie_word_embeddings=tie, initializer_range=0.02, **kw)


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

    # every tensor: condinit.apply on the model built on meta (its own init drawn as the writer draws it)
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(cfg).to(dtype)
    condinit.apply(meta, seed=seed, report=False)
    meta_sd = meta.state_dict()
    assert sd.keys() == meta_sd.keys()
    for k, t in sd.items():
        assert torch.equal(t, meta_sd[k]), k
    norms = [k for k in sd if "norm" in k]     # the model's own rule: RMSNorm weights are ones
    assert norms and all(torch.equal(sd[k], torch.ones_like(sd[k])) for k in norms)
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
                                   num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                                   vocab_size=int(sys.argv[2]), tie_word_embeddings=False)
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


def _write_growth(tmp_path, vocab: int) -> dict:
    out = tmp_path / str(vocab)
    out.mkdir()
    res = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT, str(out), str(vocab)], capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_bounded_memory(tmp_path):
    # fp32, D = 1024: the embedding and the head are 33.5 MB each at vocabulary 8192, 134 MB at 32768
    small, big = _write_growth(tmp_path, 8192), _write_growth(tmp_path, 32768)
    print(small, big)
    assert small["size"] > 350e6 and small["files"] >= 8 and big["size"] > small["size"] + 190e6
    # the writer's queue, a piece being drawn, one attention layer (Q/K/V and their scratch), slack:
    # neither the largest tensor nor the model's size
    from condinit.ops.orthogonalize.op import DEFAULT_BUDGET
    from condinit.models.stream import Tuning

    sizes = Tuning()
    layer = (1024 * 1024 + 2 * 256 * 1024) * 4
    bound = sizes.max_queued_bytes + 2 * sizes.piece_bytes + layer + 3 * DEFAULT_BUDGET["cpu"] + 16e6
    assert small["growth"] < bound and big["growth"] < bound, (small, big, bound)
    assert abs(big["growth"] - small["growth"]) < 2 * sizes.piece_bytes, (small, big)


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


# ------------------------------------------------------------------------------------------------
# own init from the counter-based generator; layout independence; a single file

import hashlib  # noqa: E402
import signal  # noqa: E402
import time  # noqa: E402

from safetensors.torch import load_file  # noqa: E402

from condinit.ops.random import op as philox  # noqa: E402
from condinit.ops.random.op import block_randn  # noqa: E402
from condinit.models.stream import own_init_stream, own_normal_, tuned, write_checkpoint  # noqa: E402
from condinit.models.stream.writer import Progress  # noqa: E402


def tiny_gpt2(**kw):
    base = dict(n_embd=48, n_layer=3, n_head=4, vocab_size=301, n_positions=32, initializer_range=0.02,
                bos_token_id=0, eos_token_id=0)
    base.update(kw)
    return transformers.GPT2Config(**base)


def _files(d):
    return {name: open(os.path.join(d, name), "rb").read() for name in sorted(os.listdir(d))}


def test_own_normal_is_the_named_philox_stream(seed):
    # element e of tensor `name`: lane e % 2**16 of block (h31 << 32) + e // 2**16, from the
    # stream and block id that the BLAKE2b digest of the name gives, then std * z rounded once
    name = "model.layers.1.mlp.up_proj.weight"
    digest = hashlib.blake2b(b"condinit own init\0" + name.encode(), digest_size=8).digest()
    stream_id, high = int.from_bytes(digest[:4], "little"), int.from_bytes(digest[4:], "little") & 0x7FFFFFFF
    assert own_init_stream(name) == (stream_id, high << 32)
    n = 3 * 2 ** 16 + 123
    z = block_randn(seed, stream_id, range((high << 32), (high << 32) + 4), (1, 2 ** 16)).reshape(-1)[:n]
    for dtype in (torch.float32, torch.bfloat16):
        w = own_normal_(torch.empty(n, dtype=dtype), seed, name, mean=0.5, std=0.02)
        assert torch.equal(w, (z * 0.02 + 0.5).to(dtype)), dtype
    # any shape and layout: the elements in row-major order of the tensor's shape
    w2 = own_normal_(torch.empty(7, n // 7 + 1).t(), seed, name, std=0.02)
    assert not w2.is_contiguous() and torch.equal(w2.reshape(-1)[:n], z * 0.02)


def test_chunking_does_not_change_the_bytes(tmp_path, monkeypatch, forced_backend):
    cfg = tiny_config(False)
    a = write_pretrained(cfg, tmp_path / "a", seed=4, max_shard_size=40_000)
    forced_backend("normal=torch")                             # own-init normals by the torch composite,
    monkeypatch.setattr(philox, "NORMAL_CHUNK", 1)             # one Philox block per draw
    # the writer never runs ahead; writeback started (and cache dropped) often
    with tuned(max_queued_bytes=1, writeback_step=4096):
        b = write_pretrained(cfg, tmp_path / "b", seed=4, max_shard_size=40_000)
    assert [os.path.basename(f) for f in a.files] == [os.path.basename(f) for f in b.files]
    assert _files(a.out_dir) == _files(b.out_dir)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_three_shards_load_and_equal_the_single_file(tmp_path, seed, family):
    cfg = tiny_config(True) if family == "llama" else tiny_gpt2()
    out = tmp_path / "dir"
    rep = write_pretrained(cfg, out, seed=seed, dtype=torch.bfloat16,
                           max_shard_size=110_000 if family == "llama" else 80_000)
    assert len(rep.files) == 3, rep.files
    model = load(out)
    single = write_checkpoint(cfg, tmp_path / "one.safetensors", seed=seed, dtype=torch.bfloat16)
    flat = load_file(single.files[0])
    sd = model.state_dict()
    assert set(flat) == set(rep.weight_map)
    for k, t in flat.items():
        assert t.dtype == torch.bfloat16 and torch.equal(sd[k], t), k
    # tied as transformers ties them: the head is the embedding, saved once under the kept name
    head, emb = (("lm_head.weight", "model.embed_tokens.weight") if family == "llama"
                 else ("lm_head.weight", "transformer.wte.weight"))
    assert head not in flat and emb in flat
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    # other shard sizes: the same tensors
    for size in (25_000, "1GB"):
        other = write_pretrained(cfg, tmp_path / f"s{size}", seed=seed, dtype=torch.bfloat16, max_shard_size=size)
        sd2 = load(other.out_dir).state_dict()
        assert all(torch.equal(sd2[k], flat[k]) for k in flat), size


def test_gpt2_own_init_rule(tmp_path, seed):
    # transformers' GPT-2 _init_weights: Conv1D / Embedding normal(0, 0.02), c_proj rescaled to
    # 0.02 / sqrt(2 n_layer), LayerNorm ones / zeros, biases zero
    cfg = tiny_gpt2(n_embd=64, vocab_size=2000, initializer_range=0.05)
    sd = load_file(write_checkpoint(cfg, tmp_path / "g.safetensors", seed=seed).files[0])
    for k, t in sd.items():
        x = t.double()
        if ".ln_" in k or k.startswith("transformer.ln_f"):
            assert torch.equal(t, torch.ones_like(t) if k.endswith("weight") else torch.zeros_like(t)), k
        elif k.endswith("bias"):
            assert torch.count_nonzero(t) == 0, k
        elif "c_attn" not in k:
            std = 0.05 / (2 * cfg.n_layer) ** 0.5 if "c_proj" in k else 0.05
            assert abs(x.std().item() / std - 1) < 6 / (2 * x.numel()) ** 0.5 + 0.01, (k, x.std().item(), std)
    name = "transformer.h.0.mlp.c_proj.weight"
    ref = own_normal_(torch.empty(sd[name].shape), seed, name, std=0.05 / (2 * cfg.n_layer) ** 0.5)
    assert torch.equal(sd[name], ref)


# ------------------------------------------------------------------------------------------------
# refusals write nothing; resume

def _snapshot(d):
    return {name: (os.path.getsize(os.path.join(d, name)), os.stat(os.path.join(d, name)).st_mtime_ns,
                   open(os.path.join(d, name), "rb").read()) for name in sorted(os.listdir(d))}


def test_other_model_refused_unless_overwrite(tmp_path):
    out = tmp_path / "out"
    write_pretrained(tiny_config(True), out, seed=1, max_shard_size=40_000)
    before = _snapshot(out)
    for cfg, kw, why in [(tiny_config(True, hidden_size=96, head_dim=24), {}, "config.json differs"),
                         (tiny_config(True), dict(seed=2), "seed: 1 there, 2 here"),
                         (tiny_config(True), dict(dtype=torch.bfloat16), "config.json differs"),
                         (tiny_config(True), dict(seed=2, resume=True), "seed")]:
        with pytest.raises(ValueError, match=why):
            write_pretrained(cfg, out, max_shard_size=40_000, **kw)
        assert _snapshot(out) == before
    # weights condinit did not write
    (tmp_path / "hf").mkdir()
    transformers.AutoModelForCausalLM.from_config(tiny_config(True)).save_pretrained(tmp_path / "hf")
    with pytest.raises(ValueError, match="no condinit metadata|config.json differs"):
        write_pretrained(tiny_config(True), tmp_path / "hf", seed=1)
    # the same model again (another shard size) is a rewrite, not another model
    write_pretrained(tiny_config(True), out, seed=1, max_shard_size=60_000)
    rep = write_pretrained(tiny_config(True), out, seed=2, max_shard_size=40_000, overwrite=True)
    assert load(out) is not None and rep.seed == 2


def test_disk_space_checked_before_writing(tmp_path, monkeypatch):
    import shutil

    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    with pytest.raises(ValueError, match=r"not enough disk space .* needs 6\d\d.\d\d kB .* 1.00 kB free"):
        write_pretrained(tiny_config(True), tmp_path / "new", max_shard_size=40_000)
    assert not (tmp_path / "new").exists()
    with pytest.raises(ValueError, match="not enough disk space"):
        write_checkpoint(tiny_config(True), tmp_path / "one.safetensors")
    assert os.listdir(tmp_path) == []
    # a resume needs only what is missing
    monkeypatch.setattr(shutil, "disk_usage", real)
    rep = write_pretrained(tiny_config(True), tmp_path / "d", max_shard_size=40_000)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=10_000))
    again = write_pretrained(tiny_config(True), tmp_path / "d", max_shard_size=40_000, resume=True)
    assert len(again.kept) == len(rep.files)


def test_resume_rewrites_only_what_is_not_complete(tmp_path):
    cfg = tiny_config(False)
    ref = write_pretrained(cfg, tmp_path / "ref", seed=9, max_shard_size=40_000)
    out = tmp_path / "out"
    write_pretrained(cfg, out, seed=9, max_shard_size=40_000)
    names = [os.path.basename(f) for f in ref.files]
    with open(out / names[1], "r+b") as fh:      # truncated: the size says it
        fh.truncate(1000)
    os.unlink(out / names[2])                     # missing
    os.unlink(out / WEIGHTS_INDEX_NAME)
    rep = write_pretrained(cfg, out, seed=9, max_shard_size=40_000, resume=True)
    assert sorted(os.path.basename(f) for f in rep.kept) == sorted(set(names) - {names[1], names[2]})
    assert _files(out) == _files(ref.out_dir)


# Writes a tiny model, pausing in the model's init of the attention projections that `sys.argv[2]`
# numbers, so that the parent can send SIGTERM while a shard is half written.
_INTERRUPTED = textwrap.dedent("""
    import sys, time
    from transformers.models.llama.modeling_llama import LlamaPreTrainedModel
    from condinit.models.stream import write_pretrained
    from helpers import LLAMA_GQA, llama_config, on_real_init

    def pause():
        print("paused", flush=True)
        time.sleep(120)

    LlamaPreTrainedModel._init_weights = on_real_init(int(sys.argv[2]), pause)
    write_pretrained(llama_config(LLAMA_GQA, tie_word_embeddings=False), sys.argv[1], seed=21, max_shard_size=40_000)
""")


@pytest.mark.slow
def test_sigterm_then_resume_gives_the_uninterrupted_directory(tmp_path):
    cfg = tiny_config(False)
    ref = write_pretrained(cfg, tmp_path / "ref", seed=21, max_shard_size=40_000)
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-c", _INTERRUPTED, str(out), "4"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=os.path.dirname(__file__))
    try:
        assert proc.stdout.readline().strip() == "paused", proc.stderr.read()
        # "paused" comes while earlier shards may still be on their way to disk: wait until the writer
        # has drained them and sits in the paused shard (a temporary file, complete shards before it,
        # and nothing changing for half a second)
        deadline, last, since = time.monotonic() + 30, None, time.monotonic()
        while True:
            names = sorted(os.listdir(out))
            if names != last:
                last, since = names, time.monotonic()
            elif (any(n.endswith(".tmp") for n in names) and any(n.endswith(".safetensors") for n in names)
                  and time.monotonic() - since > 0.5):
                break
            assert time.monotonic() < deadline, names
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == -signal.SIGTERM
    finally:
        proc.kill()
        proc.wait()
    left = sorted(os.listdir(out))
    shards = [n for n in left if n.endswith(".safetensors")]
    assert not any(n.startswith(".") for n in left), left          # no partial file
    assert WEIGHTS_INDEX_NAME not in left and 0 < len(shards) < len(ref.files), left
    expected = _files(ref.out_dir)
    assert all(open(out / n, "rb").read() == expected[n] for n in shards)   # complete shards only
    with pytest.raises(Exception):
        transformers.AutoModelForCausalLM.from_pretrained(out)     # never a directory that loads
    rep = write_pretrained(cfg, out, seed=21, max_shard_size=40_000, resume=True)
    assert sorted(os.path.basename(f) for f in rep.kept) == shards
    assert _files(out) == expected


def test_writer_and_generator_errors_leave_no_partial_file(tmp_path, monkeypatch):
    from transformers.models.llama.modeling_llama import LlamaPreTrainedModel

    cfg = tiny_config(False)

    def fail():
        raise RuntimeError("generation failed (simulated)")

    with monkeypatch.context() as m:
        m.setattr(LlamaPreTrainedModel, "_init_weights", on_real_init(4, fail))
        with pytest.raises(RuntimeError, match="simulated"):
            write_pretrained(cfg, tmp_path / "a", max_shard_size=40_000)
    written = os.listdir(tmp_path / "a")
    assert any(n.endswith(".safetensors") for n in written)           # it failed while writing
    assert not any(n.startswith(".") or n == WEIGHTS_INDEX_NAME for n in written)

    def full(fd):
        raise OSError(28, "No space left on device (simulated)")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="simulated"):
        write_pretrained(cfg, tmp_path / "b", max_shard_size=40_000)
    assert [n for n in os.listdir(tmp_path / "b") if n.endswith(".safetensors") or n.startswith(".")] == []


def test_progress_lines_without_tqdm(monkeypatch, capsys):
    import builtins

    real_import = builtins.__import__

    def no_tqdm(name, *args, **kwargs):
        if name.startswith("tqdm"):
            raise ImportError("no tqdm")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tqdm)
    bar = Progress(4_000_000, "condinit write", every_s=0.0)
    bar.update(1_000_000)
    bar.update(1_000_000)
    bar.close()
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and "2.00 MB of 4.00 MB (50%)" in lines[1] and "MB/s, ETA" in lines[1]


def test_init_that_condinit_cannot_follow_is_rerun_and_checked(tmp_path, monkeypatch):
    from transformers.models.llama.modeling_llama import LlamaPreTrainedModel, LlamaRMSNorm

    real = LlamaPreTrainedModel._init_weights
    cfg = tiny_config(False)
    ref = load_file(write_checkpoint(cfg, tmp_path / "ref.safetensors", seed=2).files[0])

    def tensor_method(self, module):     # norms filled by a tensor method, which condinit does not see
        if isinstance(module, LlamaRMSNorm):
            module.weight.data.fill_(1.0)
        else:
            real(self, module)

    monkeypatch.setattr(LlamaPreTrainedModel, "_init_weights", tensor_method)
    got = load_file(write_checkpoint(cfg, tmp_path / "a.safetensors", seed=2).files[0])
    assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)

    def forgets_norms(self, module):
        if not isinstance(module, LlamaRMSNorm):
            real(self, module)

    monkeypatch.setattr(LlamaPreTrainedModel, "_init_weights", forgets_norms)
    # from a config, the norms keep what their constructor wrote (ones), as from_config gives them
    got = load_file(write_checkpoint(cfg, tmp_path / "b.safetensors", seed=2).files[0])
    assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)
    # a model built elsewhere on meta: its constructors' values are unknown, and nothing is written
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(ValueError, match=r"model.layers.0.input_layernorm.weight: the model's own init .* leaves"):
        write_checkpoint(model, tmp_path / "c.safetensors", seed=2)
    assert sorted(os.listdir(tmp_path)) == ["a.safetensors", "b.safetensors", "ref.safetensors"]
