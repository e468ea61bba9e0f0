"""torchtitan's Llama 3 (its own model class and config, small dims): condinit.apply on the model built
on the meta device and sharded with FSDP2 or tensor parallel over 2 gloo ranks, or both over 4 (mesh
(dp=2, tp=2): tensor parallel, then ``fully_shard`` over "dp", which places ``wqkv`` as
``(_StridedShard(0), Shard(0))``), equals a single-process apply; the model-only DCP directory loads
into a freshly built torchtitan model."""
import os
import socket

import pytest
import torch

pytest.importorskip("torchtitan.models.llama3")

import condinit  # noqa: E402

SEED = 1234
DIM, HEADS, KV_HEADS, LAYERS = 64, 8, 2, 2


def _config(fuse_qkv=True):
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
    from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers
    return Llama3Model.Config(
        dim=DIM, vocab_size=128,
        tok_embeddings=Embedding.Config(num_embeddings=128, embedding_dim=DIM, param_init={"weight": torch.nn.init.normal_}),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init={"weight": torch.nn.init.ones_}),
        lm_head=Linear.Config(in_features=DIM, out_features=128, param_init={"weight": torch.nn.init.normal_}),
        layers=_build_llama3_layers(n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS, fuse_qkv=fuse_qkv,
                                    hidden_dim=compute_ffn_hidden_dim(DIM, multiple_of=32),
                                    rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=64, theta=500000.0),
                                    attn_backend="flex"))


def _qkv_names(fuse_qkv):
    leaves = ("wqkv",) if fuse_qkv else ("wq", "wk", "wv")
    return [f"layers.{i}.attention.qkv_linear.{w}.weight" for i in range(LAYERS) for w in leaves]


def _reference(fuse_qkv):
    torch.manual_seed(0)
    model = _config(fuse_qkv).build()
    model.init_states()
    condinit.apply(model, seed=SEED, report=False, strict=True)
    return model


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, mode, fuse_qkv, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        with torch.device("meta"):
            model = _config(fuse_qkv).build()
        dims = {"tp": {"tp": world}, "fsdp2": {"dp": world}, "fsdp2_tp": {"dp": 2, "tp": world // 2}}[mode]
        mesh = init_device_mesh("cpu", tuple(dims.values()), mesh_dim_names=tuple(dims))
        if "tp" in dims:
            for block in model.layers.values():
                plan = {"attention.wo": RowwiseParallel()}
                plan.update({f"attention.qkv_linear.{n}": ColwiseParallel()
                             for n in (("wqkv",) if fuse_qkv else ("wq", "wk", "wv"))})
                parallelize_module(block, mesh["tp"], plan)
        if "dp" in dims:
            for block in model.layers.values():
                fully_shard(block, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
        if mode == "fsdp2_tp":       # the layout under test: FSDP2's strided rows over the tensor-parallel ones
            strided = [type(p).__name__ for k in _qkv_names(fuse_qkv) for p in model.get_parameter(k).placements]
            assert strided.count("_StridedShard") == len(_qkv_names(fuse_qkv)), strided
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        model.init_states()
        others = {k: _local(v).clone() for k, v in model.named_parameters() if "qkv_linear" not in k}
        rep = condinit.apply(model, seed=SEED, report=False, strict=True)
        assert rep.sharded and len(rep.layers) == LAYERS
        params = dict(model.named_parameters())
        for k, v in others.items():      # everything else as the model made it, bit for bit
            assert torch.equal(_local(params[k]), v), k
        got = {k: _full(params[k]).detach() for k in _qkv_names(fuse_qkv)}
        if rank == 0:
            torch.save(got, os.path.join(out_dir, f"{mode}.pt"))
        # every rank done with the group before any tears it down: a rank destroying gloo while its
        # peer still has collectives in flight aborts the peer ("terminate called without an
        # active exception")
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("mode,world", [("fsdp2", 2), ("tp", 2), ("fsdp2_tp", 4)])
@pytest.mark.parametrize("fuse_qkv", [True, False])
def test_sharded_apply_equals_single_process(tmp_path, mode, world, fuse_qkv):
    torch.multiprocessing.spawn(_worker, args=(world, _free_port(), mode, fuse_qkv, str(tmp_path)), nprocs=world,
                                join=True)
    got = torch.load(tmp_path / f"{mode}.pt")
    ref = dict(_reference(fuse_qkv).named_parameters())
    for k, v in got.items():
        torch.testing.assert_close(v.double(), ref[k].detach().double(), rtol=0, atol=1e-6, msg=k)


def test_fused_qkv_is_conditioned_per_group():
    """Independent check of the per-group reading: split wqkv the way torchtitan's own state-dict hook
    does and test every head block's singular values and V = I."""
    model = _reference(True)
    sd = model.state_dict()          # FusedQKVLinear splits wqkv into torchtitan's stock wq/wk/wv keys
    d = DIM // HEADS
    for i in range(LAYERS):
        p = f"layers.{i}.attention.qkv_linear."
        for w, heads in (("wq", HEADS), ("wk", KV_HEADS)):
            blocks = sd[p + w + ".weight"].double().view(heads, d, DIM)
            s = torch.linalg.svdvals(blocks)
            torch.testing.assert_close(s, torch.ones_like(s), rtol=0, atol=1e-5)
        torch.testing.assert_close(sd[p + "wv.weight"], torch.eye(KV_HEADS * d, DIM), rtol=0, atol=0)


@pytest.mark.slow
def test_write_dcp_loads_into_fresh_model(tmp_path):
    import torch.distributed.checkpoint as dcp
    from condinit.models.engines.dcp import write_dcp
    torch.manual_seed(0)
    model = _config().build()
    model.init_states()
    write_dcp(model, tmp_path / "seed", seed=SEED, report=False, strict=True)
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    assert any(k.endswith("qkv_linear.wq.weight") for k in ref)      # torchtitan's stock keys
    torch.manual_seed(1)
    fresh = _config().build()
    fresh.init_states()
    sd = fresh.state_dict()
    dcp.load(sd, checkpoint_id=str(tmp_path / "seed"))
    fresh.load_state_dict(sd)
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, ref[k]), k
    with pytest.raises(ValueError, match="out_dir"):
        write_dcp(model, tmp_path / "seed", seed=SEED)
