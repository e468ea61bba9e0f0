"""Megatron-Core's GPTModel (its own config, layer spec and parallel state, small dims): condinit.apply
on each of 2 gloo tensor-parallel ranks writes that rank's row partition of every fused linear_qkv,
equal to its slice of a single-process (TP = 1) apply, with everything else untouched; the Q/K/V
blocks, read through Megatron's own get_query_key_value_tensors, are semi-orthogonal per head and V
the rectangular identity. A plain-tensor Partition is also checked without Megatron."""
import os
import socket
import subprocess
import sys

import pytest
import torch
from torch import nn

import condinit
from condinit.models import AttentionSpec, Projection, register_adapter, unregister_adapter
from condinit.models.sharded import Partition

SEED = 4321
HIDDEN, LAYERS, VOCAB, SEQ, TP = 64, 2, 128, 32, 2
# name -> (heads, query groups, TransformerConfig extras): one group per rank with biases; two groups
# per rank with an output gate between the query and key heads; fewer groups than ranks (a rank
# holds half a group) with QK layernorm
CONFIGS = {
    "gqa": (8, 2, {}),
    "gate": (8, 4, {"attention_output_gate": True, "add_bias_linear": False, "add_qkv_bias": True}),
    "split_group": (4, 1, {"qk_layernorm": True}),
}
QKV = [f"decoder.layers.{i}.self_attention.linear_qkv.{w}" for i in range(LAYERS) for w in ("weight", "bias")]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _build(name, cpu_init):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig
    heads, groups, extra = CONFIGS[name]
    cfg = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=heads, num_query_groups=groups,
                            use_cpu_initialization=cpu_init, perform_initialization=cpu_init, init_method_std=0.02,
                            **extra)
    torch.manual_seed(0)
    model = GPTModel(cfg, get_gpt_layer_local_spec(qk_layernorm=cfg.qk_layernorm), vocab_size=VOCAB,
                     max_sequence_length=SEQ)
    gen = torch.Generator().manual_seed(1 + int(os.environ.get("RANK", "0")))
    with torch.no_grad():
        for pname, p in model.named_parameters():
            # without Megatron's init (device path) every tensor is filled; biases always, so that
            # zeroing them is seen
            if not cpu_init or pname.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=gen))
    return model


def _qkv_heads(attn, gate):
    """Q, K, V (and the gate) of every head as [heads, head_dim, in] blocks, through Megatron's own
    split of linear_qkv's output for the identity input (bias included), before QK layernorm."""
    x = torch.eye(HIDDEN).unsqueeze(1)                            # [sq = in, b = 1, hidden]
    norms = attn.q_layernorm, attn.k_layernorm
    attn.q_layernorm = attn.k_layernorm = None                    # the projections themselves
    try:
        with torch.no_grad():
            out = attn.get_query_key_value_tensors(x, output_gate=gate)
    finally:
        attn.q_layernorm, attn.k_layernorm = norms
    return [t[:, 0].permute(1, 2, 0).contiguous() for t in out]   # [sq, 1, heads, d] -> [heads, d, in]


def _worker(rank, world, port, cpu_init, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        if not cpu_init:
            # Megatron's device path allocates each rank's partition on torch.cuda.current_device();
            # here that device is the CPU (its init_method runs under a CUDA RNG tracker: not run)
            torch.cuda.current_device = lambda: torch.device("cpu")
        from megatron.core import parallel_state
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
        got = {}
        for name, (heads, groups, extra) in CONFIGS.items():
            model = _build(name, cpu_init)
            gate = extra.get("attention_output_gate", False)
            attns = [layer.self_attention for layer in model.decoder.layers]
            if groups >= world:
                gates_before = [_qkv_heads(a, True)[3] for a in attns] if gate else []
            params = dict(model.named_parameters())
            others = {k: v.detach().clone() for k, v in params.items() if k not in QKV}
            rep = condinit.apply(model, seed=SEED, strict=True)    # with the default report
            assert rep.sharded and len(rep.layers) == LAYERS and "megatron.SelfAttention" in str(rep), name
            for layer in rep.layers:         # measured on this rank's blocks only; nothing before
                assert layer.before["q"] is None
                for p in ("q", "k"):         # with fewer groups than ranks, rank 0 holds no K rows
                    st = layer.after[p]
                    assert (st is None and groups < world) or abs(st.sigma_min - 1) + abs(st.sigma_max - 1) < 1e-5
            for k, v in others.items():      # everything else as the model made it, bit for bit
                assert torch.equal(params[k].detach(), v), (name, k)
            got[name] = {k: params[k].detach().clone() for k in QKV if k in params}
            if groups >= world:              # this rank's heads, read by Megatron's split (no collective)
                got[name]["heads"] = [_qkv_heads(a, gate) for a in attns]
                for a, before in zip(attns, gates_before):
                    assert torch.equal(_qkv_heads(a, True)[3], before), name   # the gate untouched
        torch.save(got, os.path.join(out_dir, f"rank{rank}.pt"))
        torch.distributed.barrier()   # every rank done before the group is torn down
    finally:
        from megatron.core import parallel_state
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def megatron_tp1():
    """Megatron's parallel state for one process (TP = 1) on a gloo group of one."""
    pytest.importorskip("megatron.core")
    from megatron.core import parallel_state
    if torch.distributed.is_initialized():
        pytest.skip("a default process group already exists in this process")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


def _reference(name):
    model = _build(name, True)
    condinit.apply(model, seed=SEED, report=False, strict=True)
    return model


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_self_attention_is_conditioned_per_group(megatron_tp1, name):
    """Single process: every head block read through Megatron's own split has singular values 1
    (Q, K), V is the rectangular identity, the gate and every other tensor untouched."""
    heads, groups, extra = CONFIGS[name]
    gate = extra.get("attention_output_gate", False)
    model = _build(name, True)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    gates = [_qkv_heads(l.self_attention, True)[3] for l in model.decoder.layers] if gate else []
    rep = condinit.apply(model, seed=SEED, report=False, strict=True)
    assert [l.adapter for l in rep.layers] == ["megatron.SelfAttention"] * LAYERS and not rep.sharded
    d = HIDDEN // heads
    for i, layer in enumerate(model.decoder.layers):
        q, k, v, *g = _qkv_heads(layer.self_attention, gate)
        assert q.shape == (heads, d, HIDDEN) and k.shape == (groups, d, HIDDEN)
        for blocks in (q, k):
            s = torch.linalg.svdvals(blocks.double())
            torch.testing.assert_close(s, torch.ones_like(s), rtol=0, atol=1e-5)
        torch.testing.assert_close(v.reshape(groups * d, HIDDEN), torch.eye(groups * d, HIDDEN), rtol=0, atol=0)
        if gate:
            assert torch.equal(g[0], gates[i])
    for k, v in model.named_parameters():
        if k not in QKV:
            assert torch.equal(v.detach(), before[k]), k
        elif k.endswith("bias"):
            assert not before[k].eq(0).all() and v.eq(0).sum() >= v.numel() - (heads * d if gate else 0), k


@pytest.mark.slow
def test_linear_qkv_of_another_class_is_refused(megatron_tp1):
    model = _build("gqa", True)
    attn = model.decoder.layers[0].self_attention
    attn.linear_qkv = nn.Linear(HIDDEN, attn.linear_qkv.weight.shape[0])
    before = attn.linear_qkv.weight.detach().clone()
    with pytest.warns(condinit.models.UncoveredAttentionWarning, match="ColumnParallelLinear is"):
        rep = condinit.apply(model, seed=SEED, report=False)
    assert [u.name for u in rep.uncovered] == ["decoder.layers.0.self_attention"]
    assert [l.name for l in rep.layers] == ["decoder.layers.1.self_attention"]
    assert torch.equal(attn.linear_qkv.weight, before)


@pytest.mark.slow
@pytest.mark.parametrize("cpu_init", [True, False], ids=["cpu_initialization", "device_initialization"])
def test_tensor_parallel_apply_equals_single_process(megatron_tp1, tmp_path, cpu_init):
    torch.multiprocessing.spawn(_worker, args=(TP, _free_port(), cpu_init, str(tmp_path)), nprocs=TP, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(TP)]
    for name, (heads, groups, extra) in CONFIGS.items():
        gate = extra.get("attention_output_gate", False)
        ref = _reference(name)
        ref_params = dict(ref.named_parameters())
        for r, got in enumerate(ranks):
            for k in QKV:
                if k not in ref_params:
                    continue
                n = ref_params[k].shape[0] // TP
                assert got[name][k].shape[0] == n, (name, k)
                if not gate:    # the gate rows keep each model's own init: compared below, by Megatron's split
                    torch.testing.assert_close(got[name][k].double(), ref_params[k].detach()[r * n:(r + 1) * n].double(),
                                               rtol=0, atol=1e-6, msg=f"{name} rank {r} {k}")
            if groups >= TP:
                for layer, local in zip(ref.decoder.layers, got[name]["heads"]):
                    full = _qkv_heads(layer.self_attention, gate)
                    for g, (l_, f) in enumerate(zip(local, full)):
                        if g == 3:     # the gate
                            continue
                        n = f.shape[0] // TP
                        torch.testing.assert_close(l_, f[r * n:(r + 1) * n], rtol=0, atol=1e-6)


@pytest.mark.slow
def test_import_condinit_does_not_import_megatron():
    code = ("import sys, condinit, condinit.models.engines.megatron\n"
            "condinit.models.describe(__import__('torch').nn.Linear(2, 2))\n"
            "print([m for m in sys.modules if m.split('.')[0] == 'megatron'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


# ------------------------------------------------------------------------------------------------
# the Partition hook alone, without Megatron: a fused per-group weight split row-wise over "ranks"

class _PartitionedQKV(nn.Module):
    """Rows ``rank * n : (rank + 1) * n`` of a fused [G, H/G + 2, d] weight and its bias."""

    def __init__(self, weight, bias, rank, world, heads, groups):
        super().__init__()
        n = weight.shape[0] // world
        self.qkv = nn.Linear(weight.shape[1], n)
        with torch.no_grad():
            self.qkv.weight.copy_(weight[rank * n:(rank + 1) * n])
            self.qkv.bias.copy_(bias[rank * n:(rank + 1) * n])
        self.rank, self.world, self.heads, self.groups = rank, world, heads, groups


class _WholeQKV(nn.Module):
    def __init__(self, weight, bias, heads, groups):
        super().__init__()
        self.qkv = nn.Linear(weight.shape[1], weight.shape[0])
        with torch.no_grad():
            self.qkv.weight.copy_(weight)
            self.qkv.bias.copy_(bias)
        self.heads, self.groups = heads, groups


def _partitioned_spec(m):
    rows = m.qkv.weight.shape[0] * m.world
    d = rows // (m.heads + 2 * m.groups)
    hq, per = m.heads // m.groups, rows // m.groups
    part = Partition(0, m.rank * m.qkv.weight.shape[0], rows)

    def proj(start, heads):
        return Projection(m.qkv.weight, start * d, (start + heads) * d, bias=m.qkv.bias, groups=m.groups, stride=per,
                          partition=part, bias_partition=part)

    return AttentionSpec(proj(0, hq), proj(hq, 1), proj(hq + 1, 1), m.heads, m.groups, d)


@pytest.fixture
def partitioned_adapter():
    register_adapter(_PartitionedQKV, _partitioned_spec, name="test.partitioned")
    # the whole weight, described by the library's own per-group reading
    register_adapter(_WholeQKV, lambda m: AttentionSpec.from_fused(m.qkv.weight, num_heads=m.heads,
                                                                   num_kv_heads=m.groups, bias=m.qkv.bias,
                                                                   layout="per_group"), name="test.whole")
    try:
        yield
    finally:
        unregister_adapter(_PartitionedQKV)
        unregister_adapter(_WholeQKV)


@pytest.mark.parametrize("heads,groups,world", [(8, 2, 2), (8, 4, 2), (4, 1, 2), (6, 3, 3)])
def test_partition_writes_the_slice_of_the_whole(partitioned_adapter, heads, groups, world):
    d, D = 8, 40
    gen = torch.Generator().manual_seed(heads * 100 + groups * 10 + world)
    w, b = torch.randn((heads + 2 * groups) * d, D, generator=gen), torch.randn((heads + 2 * groups) * d, generator=gen)
    whole = _WholeQKV(w, b, heads, groups)
    condinit.apply(whole, seed=SEED, report=False, strict=True)
    n = w.shape[0] // world
    for rank in range(world):
        part = _PartitionedQKV(w, b, rank, world, heads, groups)
        rep = condinit.apply(part, seed=SEED, report=False, strict=True)
        assert rep.sharded
        assert torch.equal(part.qkv.weight, whole.qkv.weight[rank * n:(rank + 1) * n]), rank
        assert torch.equal(part.qkv.bias, torch.zeros(n))


def test_partition_is_validated(partitioned_adapter):
    w = torch.randn(12, 5)
    with pytest.raises(ValueError, match="runs past the global size"):
        Projection(w, 0, 4, partition=Partition(0, 8, 16))
    with pytest.raises(ValueError, match="a bias_partition without a bias"):
        Projection(w, 0, 4, bias_partition=Partition(0, 0, 12))
    p = Projection(w, 0, 4, partition=Partition(0, 12, 24))
    assert p.storage_shape == (24, 5) and p.distributed
    with pytest.raises(ValueError, match="gather it first"):
        p.view()
