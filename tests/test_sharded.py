"""Sharded conditioned init: 2 gloo ranks on the CPU, FSDP2 and DTensor Shard(0) / Shard(1) / Replicate.

Each rank fills only its local shards (no communication inside condinit.apply); the gathered full
tensors must equal, bit for bit, a single-process apply with the same seed. Models are pure torch
(no transformers import in the workers, to keep the test short) but cover the three storage
layouts the adapters produce: separate Q/K/V with GQA and biases, fused ``[3E, E]``
(``nn.MultiheadAttention``), fused and stored transposed ``[E, 3E]`` (GPT-2's Conv1D layout).
Shard sizes are chosen so that shard boundaries cut through heads.
"""
from __future__ import annotations

import copy
import os
import socket
import traceback

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed unavailable")

SEED = 11


class GQAAttn(nn.Module):
    """Separate q/k/v Linear with biases; dim 21, 3 heads of 7, 1 KV head: 2-way shards cut heads."""

    def __init__(self, dim=21, heads=3, kv=1):
        super().__init__()
        d = dim // heads
        self.heads, self.kv = heads, kv
        self.q = nn.Linear(dim, heads * d)
        self.k = nn.Linear(dim, kv * d)
        self.v = nn.Linear(dim, kv * d)
        self.o = nn.Linear(heads * d, dim)


class Conv1DAttn(nn.Module):
    """GPT-2 layout: one fused weight stored transposed, ``[in, 3E]``, and a ``[3E]`` bias."""

    def __init__(self, dim=15, heads=3):
        super().__init__()
        self.heads = heads
        self.c_attn_weight = nn.Parameter(torch.randn(dim, 3 * dim) * 0.02)
        self.c_attn_bias = nn.Parameter(torch.randn(3 * dim) * 0.02)
        self.proj = nn.Linear(dim, dim)


def _register():
    from condinit.models import AttentionSpec, register_adapter

    register_adapter(GQAAttn, lambda m: AttentionSpec.from_linears(m.q, m.k, m.v, num_heads=m.heads,
                                                                     num_kv_heads=m.kv), name="test.GQA")
    register_adapter(Conv1DAttn, lambda m: AttentionSpec.from_fused(m.c_attn_weight, num_heads=m.heads,
                                                                      bias=m.c_attn_bias, transposed=True),
                     name="test.Conv1D")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([GQAAttn(), nn.MultiheadAttention(15, 3), Conv1DAttn(), GQAAttn()])
        self.norm = nn.LayerNorm(21)


def _distribute(model, mesh, placement):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is None:
                continue
            pl = placement
            if isinstance(pl, Shard) and pl.dim >= p.dim():
                pl = Shard(0)
            dt = distribute_tensor(p.detach().clone(), mesh, [pl])
            mod._parameters[name] = nn.Parameter(dt, requires_grad=p.requires_grad)
    return model


def _full(model):
    out = {}
    for k, v in model.state_dict().items():
        out[k] = v.full_tensor() if hasattr(v, "full_tensor") else v
    return out


def _worker(rank, world, port, errfile):
    try:
        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        import torch.distributed as dist

        dist.init_process_group("gloo", rank=rank, world_size=world)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Replicate, Shard

        import condinit

        _register()
        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(0)
        base = Net()
        ref = copy.deepcopy(base)
        condinit.apply(ref, seed=SEED, report=False)
        expect = ref.state_dict()
        # a single-process apply on 2 layers picked by include must agree too (numbering unchanged)
        variants = {}
        m = copy.deepcopy(base)
        for blk in m.blocks:
            fully_shard(blk, mesh=mesh)
        fully_shard(m, mesh=mesh)
        variants["fsdp2"] = m
        for label, pl in (("shard0", Shard(0)), ("shard1", Shard(1)), ("replicate", Replicate())):
            variants[label] = _distribute(copy.deepcopy(base), mesh, pl)
        for label, m in variants.items():
            rep = condinit.apply(m, seed=SEED, report=True)
            assert rep.sharded, label
            assert len(rep) == 4, label
            got = _full(m)
            for k, v in expect.items():
                assert torch.equal(got[k], v), f"{label}: {k} differs from the single-process apply"
            for l in rep:
                assert l.before["q"] is None  # no 'before' for shards
                for p in "qkv":  # a rank whose shard holds none of a projection's rows measures nothing
                    st = l.after[p]
                    assert st is None or abs(st.cond - 1) < 1e-4, (label, l.name, p, st)
        # deferred + sharded: built on meta, fully_shard, then materialized (own init through
        # reset_parameters on the DTensor shards) and conditioned by apply
        with torch.device("meta"):
            m = Net()
        for blk in m.blocks:
            fully_shard(blk, mesh=mesh)
        fully_shard(m, mesh=mesh)
        rep = condinit.apply(m, seed=SEED, device="cpu")
        assert rep.materialized and rep.sharded
        got = _full(m)
        qkv = [k for k in expect if any(s in k for s in ("in_proj", "c_attn", ".q.", ".k.", ".v."))]
        assert len(qkv) == 16
        for k in qkv:
            assert torch.equal(got[k], expect[k]), f"meta+fsdp2: {k}"
        assert all(torch.isfinite(v).all() for v in got.values())
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        with open(f"{errfile}.{rank}", "w") as fh:
            fh.write(traceback.format_exc())
        raise


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_sharded_equals_single_process(tmp_path):
    import torch.multiprocessing as mp

    errfile = str(tmp_path / "err")
    try:
        mp.spawn(_worker, args=(2, _free_port(), errfile), nprocs=2, join=True)
    except Exception as exc:
        msgs = []
        for r in range(2):
            if os.path.exists(f"{errfile}.{r}"):
                msgs.append(f"rank {r}:\n" + open(f"{errfile}.{r}").read())
        raise AssertionError("\n".join(msgs) or str(exc)) from None


def test_local_part_plain_tensor():
    from condinit.models.sharded import local_part, overlap

    t = torch.randn(5, 3)
    local, off, shape = local_part(t)
    assert off == (0, 0) and shape == (5, 3) and local.data_ptr() == t.data_ptr()
    assert overlap(0, 4, 2, 9) == (2, 4) and overlap(0, 2, 2, 9) is None
