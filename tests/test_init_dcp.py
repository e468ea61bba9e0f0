"""``condinit init --format dcp --torchtitan MODEL:FLAVOR``: a torchtitan seed checkpoint written by
every rank. Checked against torchtitan's own model (built afresh, the DCP directory loaded into it
with ``dcp.load``), its own init (the statistics of a single-process ``init_states()``), the DCP
metadata (what each rank wrote), and torch.chunk's row split (FSDP2's)."""
import os
import re
import subprocess
import sys

import pytest
import torch

from condinit.cli import main

FLAVOR = "llama3:debugmodel"
SEED = 20240917
_README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def _tt():
    return pytest.importorskip("torchtitan.models.llama3")


def _fresh(dtype=torch.float32):
    """torchtitan's debugmodel as torchtitan builds it (plain tensors, on the CPU), its parameters
    in ``dtype``."""
    model = _tt().model_registry("debugmodel").model.build()
    for p in model.parameters():
        p.data = p.data.to(dtype)
    return model


def _load(out_dir, dtype=torch.float32) -> dict:
    import torch.distributed.checkpoint as dcp

    model = _fresh(dtype)
    sd = model.state_dict()
    dcp.load(sd, checkpoint_id=str(out_dir), no_dist=True)
    model.load_state_dict(sd)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _cli(*argv):
    return main(["init", "--format", "dcp", *argv])


def _nproc(out, *extra, nproc=2):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "condinit", "init", "--format", "dcp", "--torchtitan", FLAVOR,
                           "--seed", str(SEED), "--out", str(out), "--nproc", str(nproc), *extra],
                          capture_output=True, text=True, timeout=600, env=env)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    _tt()
    out = tmp_path_factory.mktemp("dcp") / "one"
    assert _cli("--torchtitan", FLAVOR, "--seed", str(SEED), "--out", str(out), "--quiet") == 0
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    _tt()
    out = tmp_path_factory.mktemp("dcp") / "two"
    proc = _nproc(out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


# --- refusals: one line, nothing written ----------------------------------------------------------

@pytest.mark.parametrize("argv, flag", [
    (["--config", "x.json"], "--config"),
    (["--preset", "tiny-llama"], "--preset"),
    ([], "--torchtitan MODEL:FLAVOR"),
    (["--torchtitan", FLAVOR, "--resume"], "--resume"),
    (["--torchtitan", FLAVOR, "--overwrite"], "--overwrite"),
    (["--torchtitan", FLAVOR, "--max-shard-size", "1GB"], "--max-shard-size"),
    (["--torchtitan", FLAVOR, "--device", "cuda"], "--device cuda"),
    (["--torchtitan", FLAVOR, "--mla", "factors"], "--mla factors"),
    (["--torchtitan", "llama3"], "MODEL:FLAVOR"),
])
def test_refused_before_anything_is_written(tmp_path, capsys, argv, flag):
    out = tmp_path / "seed"
    assert _cli(*argv, "--out", str(out)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and flag in err, err
    assert os.listdir(tmp_path) == []


def test_torchtitan_flag_needs_dcp(tmp_path, capsys):
    assert main(["init", "--torchtitan", FLAVOR, "--out", str(tmp_path / "m.safetensors")]) == 2
    assert "--format dcp" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("spec, listed", [("llama3:no-such-flavor", "debugmodel"), ("no_such_model:8B", "llama3")])
def test_unknown_model_or_flavor(tmp_path, capsys, spec, listed):
    _tt()
    assert _cli("--torchtitan", spec, "--out", str(tmp_path / "seed")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and spec in err and listed in err, err
    assert os.listdir(tmp_path) == []


def test_non_empty_out_dir_left_as_it_was(tmp_path, capsys):
    _tt()
    (tmp_path / "notes.txt").write_bytes(b"keep me")
    assert _cli("--torchtitan", FLAVOR, "--out", str(tmp_path)) == 2
    assert "not empty" in capsys.readouterr().err
    assert os.listdir(tmp_path) == ["notes.txt"] and (tmp_path / "notes.txt").read_bytes() == b"keep me"


def test_torchtitan_missing_names_the_install_line(tmp_path, capsys, monkeypatch):
    from condinit.models.engines.dcp import write_torchtitan_seed

    line = re.search(r"`(pip install --no-deps torchtitan[^`]*)`", open(_README).read()).group(1)
    for name in [m for m in sys.modules if m == "torchtitan" or m.startswith("torchtitan.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torchtitan", None)     # `import torchtitan` fails
    with pytest.raises(ImportError, match=re.escape(line)):
        write_torchtitan_seed(FLAVOR, tmp_path / "seed", seed=0)
    assert _cli("--torchtitan", FLAVOR, "--out", str(tmp_path / "seed")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and line in err, err
    assert os.listdir(tmp_path) == []


# --- dry run: bytes per rank ------------------------------------------------------------------------

@pytest.mark.parametrize("world", [1, 3])
def test_dry_run_bytes_per_rank(tmp_path, capsys, world):
    """Each rank's bytes as torch.chunk splits the rows of every parameter of torchtitan's model
    (FSDP2's split); together the bytes of its state dict."""
    from condinit.models.engines.dcp import plan_torchtitan_seed

    with torch.device("meta"):
        meta = _tt().model_registry("debugmodel").model.build().to(torch.bfloat16)
    want = [0] * world
    for _, p in meta.named_parameters():
        for r, part in enumerate(torch.chunk(p, world, dim=0)):
            want[r] += part.numel() * part.element_size()
    plan = plan_torchtitan_seed(FLAVOR, world, dtype=torch.bfloat16)
    assert [s.bytes for s in plan.ranks] == want
    assert plan.total_bytes == sum(want) == sum(t.numel() * t.element_size() for t in meta.state_dict().values())
    assert plan.num_parameters == sum(p.numel() for p in meta.parameters())
    out = tmp_path / "seed"
    assert _cli("--torchtitan", FLAVOR, "--dtype", "bf16", "--out", str(out), "--dry-run", "--nproc", str(world)) == 0
    text = capsys.readouterr().out
    assert "dry run, nothing written" in text and f"{world} rank(s)" in text
    assert not out.exists()


# --- the checkpoint -------------------------------------------------------------------------------

def _layout():
    a = _fresh().layers["0"].attention
    return a.n_heads, a.n_kv_heads, a.head_dim


@pytest.mark.slow
def test_one_and_two_ranks_write_the_same_tensors(one_rank, two_ranks):
    one, two = _load(one_rank), _load(two_ranks)
    assert one.keys() == two.keys()
    for k in one:
        assert torch.equal(one[k], two[k]), k
    assert sorted(os.listdir(two_ranks)) == [".metadata", "__0_0.distcp", "__1_0.distcp"]


@pytest.mark.slow
def test_each_rank_wrote_its_rows(two_ranks):
    """The DCP metadata: rank r's file holds the rows torch.chunk gives rank r of every parameter
    torchtitan's model has (the fused wqkv's rows as pieces of wq / wk / wv), nothing more."""
    import torch.distributed.checkpoint as dcp

    with torch.device("meta"):
        meta_model = _tt().model_registry("debugmodel").model.build()
    want = [0, 0]
    for _, p in meta_model.named_parameters():
        for r, part in enumerate(torch.chunk(p, 2, dim=0)):
            want[r] += part.numel() * part.element_size()
    meta = dcp.FileSystemReader(str(two_ranks)).read_metadata()
    per_file, items = {}, {}
    for info in meta.storage_data.values():
        per_file[info.relative_path] = per_file.get(info.relative_path, 0) + info.length
        items[info.relative_path] = items.get(info.relative_path, 0) + 1
    for r in range(2):
        name = f"__{r}_0.distcp"      # the tensors' bytes, plus a small header per item
        assert want[r] <= per_file[name] < want[r] + 4096 * items[name], (r, want[r], per_file[name])
    for key, tmeta in meta.state_dict_metadata.items():
        assert sum(c.sizes.numel() for c in tmeta.chunks) == tmeta.size.numel(), key
        if ".qkv_linear." not in key:
            rows = tmeta.size[0]
            assert [c.offsets[0] for c in tmeta.chunks] == [0, -(-rows // 2)], key


DIM, HEADS, KV_HEADS = 48, 6, 2          # head_dim 8, 3 query heads per group: wqkv has 80 rows


def _gqa_config():
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
    from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers
    init = {"weight": torch.nn.init.normal_}
    return Llama3Model.Config(
        dim=DIM, vocab_size=64,
        tok_embeddings=Embedding.Config(num_embeddings=64, embedding_dim=DIM, param_init=init),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init={"weight": torch.nn.init.ones_}),
        lm_head=Linear.Config(in_features=DIM, out_features=64, param_init=init),
        layers=_build_llama3_layers(n_layers=2, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS, fuse_qkv=True,
                                    hidden_dim=compute_ffn_hidden_dim(DIM, multiple_of=16),
                                    rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=32, theta=500000.0),
                                    attn_backend="flex"))


def _gqa_worker(rank, world, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from condinit.models.engines.dcp import save_torchtitan_state
        with torch.device("meta"):
            model = _gqa_config().build()
        mesh = init_device_mesh("cpu", (world,))
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        with torch.no_grad():
            model.init_states()
        save_torchtitan_state(model, os.path.join(out, "dcp"))
        full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
        if rank == 0:        # torchtitan's own split of the fused wqkv (its state_dict hook)
            torch.save(full, os.path.join(out, "reference.pt"))
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_fused_qkv_rows_cut_across_groups(tmp_path):
    """3 ranks cut the 80 rows of a grouped-query wqkv at rows 27 and 54, inside key and query
    parts: the pieces load as torchtitan's own state_dict split of the whole wqkv."""
    import socket

    import torch.distributed.checkpoint as dcp

    _tt()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    torch.multiprocessing.spawn(_gqa_worker, args=(3, port, str(tmp_path)), nprocs=3, join=True)
    ref = torch.load(tmp_path / "reference.pt")
    sd = _gqa_config().build().state_dict()
    dcp.load(sd, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert sd.keys() == ref.keys() and any(k.endswith("qkv_linear.wk.weight") for k in sd)
    for k, v in ref.items():
        assert torch.equal(sd[k], v), k


@pytest.mark.slow
def test_attention_is_conditioned(two_ranks):
    """Read from the loaded state dict: every Q/K head block of every layer has all singular values 1,
    V is the rectangular identity (torchtitan's stock wq/wk/wv keys)."""
    sd = _load(two_ranks)
    H, Hkv, d = _layout()
    layers = sorted({int(k.split(".")[1]) for k in sd if k.startswith("layers.")})
    assert layers == list(range(len(_fresh().layers)))
    for i in layers:
        p = f"layers.{i}.attention.qkv_linear."
        for w, heads in (("wq", H), ("wk", Hkv)):
            blocks = sd[p + w + ".weight"].double().view(heads, d, -1)
            s = torch.linalg.svdvals(blocks)
            torch.testing.assert_close(s, torch.ones_like(s), rtol=0, atol=1e-5)
        v = sd[p + "wv.weight"]
        assert torch.equal(v, torch.eye(*v.shape))


@pytest.mark.slow
def test_everything_else_is_torchtitans_init(two_ranks):
    """Every other tensor against a single-process torchtitan init_states(): norms equal, each
    weight's standard deviation within 5%, and no rank's rows a copy of another's."""
    sd = _load(two_ranks)
    torch.manual_seed(SEED)
    ref_model = _fresh()
    ref_model.init_states()
    ref = ref_model.state_dict()
    checked = 0
    for k, v in sd.items():
        if ".qkv_linear." in k:
            continue
        if "norm" in k:
            assert torch.equal(v, ref[k]), k
            continue
        assert abs(v.std().item() / ref[k].std().item() - 1) < 0.05, k
        assert abs(v.mean().item()) < 0.1 * ref[k].std().item(), k
        half = v.shape[0] // 2
        assert not torch.equal(v[:half], v[half:2 * half]), k
        checked += 1
    assert checked >= 3 * len(ref_model.layers) + 2        # wo, w1, w2, w3 per layer; embedding, head


@pytest.mark.slow
def test_bf16_is_the_fp32_checkpoint_rounded_once(tmp_path, one_rank):
    import torch.distributed.checkpoint as dcp

    out = tmp_path / "bf16"
    assert _cli("--torchtitan", FLAVOR, "--seed", str(SEED), "--dtype", "bf16", "--out", str(out), "--quiet") == 0
    meta = dcp.FileSystemReader(str(out)).read_metadata()
    assert {m.properties.dtype for m in meta.state_dict_metadata.values()} == {torch.bfloat16}
    got, fp32 = _load(out, torch.bfloat16), _load(one_rank)
    for k, v in fp32.items():
        assert torch.equal(got[k], v.to(torch.bfloat16)), k


@pytest.mark.slow
def test_seed_changes_every_random_tensor(tmp_path, one_rank):
    out = tmp_path / "other"
    assert _cli("--torchtitan", FLAVOR, "--seed", str(SEED + 1), "--out", str(out), "--quiet") == 0
    a, b = _load(one_rank), _load(out)
    for k in a:
        random = "norm" not in k and not k.endswith("wv.weight")
        assert torch.equal(a[k], b[k]) != random, k


@pytest.mark.slow
def test_failed_save_leaves_nothing(tmp_path, monkeypatch):
    """A write that fails inside dcp.save: no out_dir, no temporary directory beside it."""
    _tt()
    import torch.distributed.checkpoint as dcp

    from condinit.models.engines.dcp import write_torchtitan_seed

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", fail)
    with pytest.raises(OSError, match="No space left") as err:
        write_torchtitan_seed(FLAVOR, tmp_path / "seed", seed=SEED)
    assert any("rank 0 of 1" in note for note in err.value.__notes__)
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
def test_a_rank_failing_in_save_leaves_nothing(tmp_path):
    """Rank 1 of 2 fails writing its file: the command fails in one line, nothing under --out nor
    beside it."""
    script = tmp_path / "fail_rank1.py"
    script.write_text(
        "import os, sys\n"
        "import torch.distributed.checkpoint as dcp\n"
        "if os.environ['RANK'] == '1':\n"
        "    def fail(*args, **kwargs):\n"
        "        raise OSError(28, 'No space left on device')\n"
        "    dcp.FileSystemWriter.write_data = fail\n"
        "from condinit.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n")
    parent = tmp_path / "parent"
    parent.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script),
           "init", "--format", "dcp", "--torchtitan", FLAVOR, "--out", str(parent / "seed")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode != 0
    lines = [l for l in proc.stderr.splitlines() if l.startswith("condinit init: error:")]
    assert len(lines) == 2 and all("No space left" in l and "rank 1 of 2" in l for l in lines), proc.stderr[-3000:]
    assert os.listdir(parent) == []
