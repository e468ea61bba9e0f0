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


def _rank_main(rank, world, port, errfile, body):
    """One gloo rank: ``body(rank, world)`` inside an initialized process group; every rank waits at a
    barrier before the group is torn down (a peer destroyed mid-collective aborts the other); a
    failure's traceback goes to ``errfile.RANK``."""
    try:
        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        import torch.distributed as dist

        dist.init_process_group("gloo", rank=rank, world_size=world)
        body(rank, world)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        with open(f"{errfile}.{rank}", "w") as fh:
            fh.write(traceback.format_exc())
        raise


def _spawn(tmp_path, body, world):
    """``body`` on ``world`` gloo ranks; the failing ranks' tracebacks make the assertion message."""
    import torch.multiprocessing as mp

    errfile = str(tmp_path / "err")
    try:
        mp.spawn(_rank_main, args=(world, _free_port(), errfile, body), nprocs=world, join=True)
    except Exception as exc:
        msgs = [f"rank {r}:\n" + open(f"{errfile}.{r}").read() for r in range(world)
                if os.path.exists(f"{errfile}.{r}")]
        raise AssertionError("\n".join(msgs) or str(exc)) from None


def _worker(rank, world):
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


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_sharded_equals_single_process(tmp_path):
    _spawn(tmp_path, _worker, 2)


def test_local_part_plain_tensor():
    from condinit.models.sharded import local_part, overlap

    t = torch.randn(5, 3)
    local, off, shape = local_part(t)
    assert off == (0, 0) and shape == (5, 3) and local.data_ptr() == t.data_ptr()
    assert overlap(0, 4, 2, 9) == (2, 4) and overlap(0, 2, 2, 9) is None


# ------------------------------------------------------------------------------------------------
# _StridedShard: the global index of each local index

def _chunk(x, n, i):
    """Chunk ``i`` of ``torch.chunk(x, n)``; empty when torch.chunk makes fewer than ``n``."""
    parts = torch.chunk(x, n)
    return parts[i] if i < len(parts) else x[:0]


def test_global_indices_fsdp2_over_tensor_parallel():
    """FSDP2 over tensor parallel chunks the rows right to left (tensor parallel's chunk, then
    FSDP2's chunk of it); ``(_StridedShard(0, split_factor=tp), Shard(0))`` read left to right
    must name those rows; torch's own first offset and size agree. Uneven strided rows are refused."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard

    from condinit.models.sharded import global_indices

    g = torch.Generator().manual_seed(5)
    for dp, tp in ((2, 2), (2, 3), (3, 2), (4, 2)):
        placements = (_StridedShard(0, split_factor=tp), Shard(0))
        for rows in (dp * tp * torch.randint(1, 6, (3,), generator=g)).tolist():
            cols = int(torch.randint(1, 9, (1,), generator=g))
            for d in range(dp):
                for t in range(tp):
                    want = torch.arange(rows).chunk(tp)[t].chunk(dp)[d]
                    got = global_indices((rows, cols), (dp, tp), (d, t), placements)
                    assert got[1] is None and torch.equal(got[0], want), (dp, tp, rows, d, t, got[0], want)
                    shape, off = _compute_local_shape_and_global_offset((rows, cols), (dp, tp), [d, t], placements)
                    assert shape[0] == want.numel() and off[0] == want[0]
            # Replicate on one mesh dimension: both of its coordinates hold the same rows
            a = global_indices((rows, cols), (dp, tp), (0, 1), (Replicate(), Shard(0)))[0]
            b = global_indices((rows, cols), (dp, tp), (dp - 1, 1), (Replicate(), Shard(0)))[0]
            assert torch.equal(a, b) and torch.equal(a, torch.arange(rows).chunk(tp)[1])
        rows = dp * tp * 3 + 1
        with pytest.raises(ValueError, match=r"wqkv: DTensor placement _StridedShard\(dim=0.* not supported \(uneven"):
            global_indices((rows, 4), (dp, tp), (0, 0), placements, name="wqkv")


def test_global_indices_partition_every_entry_once():
    """Over all mesh coordinates the local index maps cover each global entry exactly once (no
    Replicate), for strided placements on either dimension and both orders."""
    import itertools

    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard as SS

    from condinit.models.sharded import global_indices

    cases = [((2, 2), (Shard(0), SS(0, split_factor=2))), ((2, 2), (SS(0, split_factor=4), Shard(0))),
             ((2, 3), (SS(1, split_factor=3), Shard(1))), ((3, 2), (Shard(1), SS(0, split_factor=2))),
             ((2, 2, 2), (SS(0, split_factor=4), SS(0, split_factor=2), Shard(0)))]
    for mesh, placements in cases:
        shape = (16, 12)
        count = torch.zeros(shape, dtype=torch.long)
        for coord in itertools.product(*map(range, mesh)):
            ix = global_indices(shape, mesh, coord, placements)
            rows = ix[0] if ix[0] is not None else torch.arange(shape[0])
            cols = ix[1] if ix[1] is not None else torch.arange(shape[1])
            count[rows[:, None], cols[None, :]] += 1
        assert torch.equal(count, torch.ones_like(count)), (mesh, placements, count)


def test_global_indices_strided_is_not_contiguous():
    """The documented example: 8 rows on a (2, 2) mesh, ``(Shard(0), _StridedShard(0, split_factor=2))``:
    coordinate (0, 0) holds chunk 0 of each half of Shard(0)'s rows 0..3."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from condinit.models.sharded import global_indices

    rows = torch.arange(8)
    for d in range(2):
        for t in range(2):
            mine = rows.chunk(2)[d]
            want = torch.cat([half.chunk(2)[t] for half in mine.chunk(2)])
            got = global_indices((8, 3), (2, 2), (d, t), (Shard(0), _StridedShard(0, split_factor=2)))[0]
            assert torch.equal(got, want)
            assert (got[1:] - got[:-1] != 1).any()


def test_global_indices_refuses_partial():
    from torch.distributed.tensor import Partial, Shard

    from condinit.models.sharded import global_indices

    with pytest.raises(ValueError, match=r"w: DTensor placement Partial\(sum\) is not supported"):
        global_indices((4, 4), (2, 2), (0, 0), (Shard(0), Partial()), name="w")


class EvenNet(nn.Module):
    """The three layouts with sizes that 2 x 2 strided shards split evenly (head_dim 8, so the
    non-contiguous shards cut heads)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([GQAAttn(24, 3, 1), nn.MultiheadAttention(24, 3), Conv1DAttn(24, 3)])


_STRIDED = {   # label: (placements on a (2, 2) mesh, whether a rank's rows of an [8, 12] tensor are several boxes)
    "fsdp2_tp": (("SS", 0, 2, "S", 0), False),   # FSDP2 over tensor parallel: one contiguous range per rank
    "s_ss": (("S", 0, None, "SS", 0), True),     # Shard, then a strided split of each half: not contiguous
    "cols": (("SS", 1, 2, "S", 1), False),       # FSDP2 over tensor parallel along the columns
    "mixed": (("S", 1, None, "SS", 0), True),    # columns over one mesh dim, strided rows over the other
}


def _placements(spec, ndim):
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    k1, d1, sf, k2, d2 = spec
    d1, d2 = min(d1, ndim - 1), min(d2, ndim - 1)
    first = _StridedShard(d1, split_factor=sf) if k1 == "SS" else Shard(d1)
    second = _StridedShard(d2, split_factor=2) if k2 == "SS" else Shard(d2)
    return (first, second)


def _strided_worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, distribute_tensor

    import condinit
    from condinit.models.sharded import local_boxes

    _register()
    mesh = init_device_mesh("cpu", (2, 2))
    # the index map against torch's own scatter and gather: a global tensor of distinct values
    g = torch.Generator().manual_seed(3)
    for label, (spec, several) in _STRIDED.items():
        for shape in ((8, 12), (16, 4), (24,)):
            placements = _placements(spec, len(shape))
            full = torch.randn(shape, generator=g, dtype=torch.float64)
            dt = distribute_tensor(full, mesh, placements)
            local, boxes, gshape = local_boxes(dt, label)
            assert gshape == shape and sum(b.shape[0] * (b.shape[1] if len(shape) > 1 else 1)
                                           for b in boxes) == local.numel(), (label, shape, boxes)
            for b in boxes:      # every box holds those global entries
                at = tuple(slice(o, o + n) for o, n in zip(b.offset, b.shape))
                assert torch.equal(local[b.slices()], full[at]), (label, shape, b)
            # write the global values through the boxes into a fresh local; gathered, it is the tensor
            mine = torch.full_like(local, float("nan"))
            for b in boxes:
                mine[b.slices()] = full[tuple(slice(o, o + n) for o, n in zip(b.offset, b.shape))]
            back = DTensor.from_local(mine, mesh, placements, shape=dt.shape, stride=dt.stride()).full_tensor()
            assert torch.equal(back, full), (label, shape)
            if shape == (8, 12):
                assert (len(boxes) > 1) == several, (label, boxes)
    # condinit.apply on models whose parameters carry those placements equals a single process
    torch.manual_seed(0)
    base = EvenNet()
    ref = copy.deepcopy(base)
    condinit.apply(ref, seed=SEED, report=False)
    expect = ref.state_dict()
    for label, (spec, _) in _STRIDED.items():
        m = copy.deepcopy(base)
        for mod in m.modules():
            for name, p in list(mod._parameters.items()):
                if p is not None:
                    dt = distribute_tensor(p.detach().clone(), mesh, _placements(spec, p.dim()))
                    mod._parameters[name] = nn.Parameter(dt, requires_grad=p.requires_grad)
        rep = condinit.apply(m, seed=SEED, report=True)
        assert rep.sharded and len(rep) == 3, label
        got = _full(m)
        for k, v in expect.items():
            assert torch.equal(got[k], v), f"{label}: {k} differs from the single-process apply"
    # an uneven strided shard (21 rows over 2 x 2) is refused, naming it, before anything is written
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    m = GQAAttn()
    for mod in m.modules():   # torch's distribute_tensor refuses uneven strided shards: build them from local parts
        for name, p in list(mod._parameters.items()):
            pl = _placements(_STRIDED["fsdp2_tp"][0], p.dim())
            shape, _ = compute_local_shape_and_global_offset(p.shape, mesh, pl)
            dt = DTensor.from_local(torch.randn(shape), mesh, pl, shape=p.shape, stride=p.stride())
            mod._parameters[name] = nn.Parameter(dt, requires_grad=p.requires_grad)
    before = {k: v.to_local().clone() for k, v in m.named_parameters()}
    with pytest.raises(ValueError, match=r"q: DTensor placement _StridedShard\(dim=0, sf=2\) over 21 entries"):
        condinit.apply(m, seed=SEED, report=False)
    assert all(torch.equal(v.to_local(), before[k]) for k, v in m.named_parameters())


@pytest.mark.slow
def test_strided_shards_equal_single_process(tmp_path):
    """4 gloo ranks, a (2, 2) mesh, ``_StridedShard`` placements (FSDP2-over-tensor-parallel's and
    non-contiguous ones): each box :func:`local_boxes` names holds those global entries (torch's
    scatter), writing them through the boxes gathers back to the tensor (torch's gather), and
    ``condinit.apply`` equals a single-process apply bit for bit."""
    _spawn(tmp_path, _strided_worker, 4)
