"""JacobianMonitor on an FSDP2-sharded model (torch.distributed.fsdp.fully_shard), 2 gloo ranks on CPU:
records from every rank reach rank 0, each estimated on the rank's own input with only one layer's
weights gathered at a time, and training is bit-identical with the monitor on or off."""
import json
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")

WORLD, STEPS, D = 2, 3, 16


def _model():
    torch.manual_seed(0)
    return nn.Sequential(*(nn.TransformerEncoderLayer(D, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
                           for _ in range(2)))


def _train(rank, monitor_dir):
    """STEPS SGD steps on this rank's own data; returns (losses, full parameters, monitor or None)."""
    from torch.distributed.fsdp import fully_shard

    from condinit.probe import JacobianMonitor

    model = _model()
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(100 + rank)         # each rank its own batches
    mon = None
    if monitor_dir is not None:
        mon = JacobianMonitor(model, every=2, steps=4, frobenius_samples=2, log_dir=monitor_dir, seed=7,
                              max_batch=None)
        assert mon.distributed and mon._sharded == {0, 1}
    losses, inputs = [], []
    for step in range(STEPS):
        x = torch.randn(2, 5, D, generator=g)
        inputs.append(x)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if mon is not None:
            mon.step()
            # between steps every unit is sharded again
            from torch.distributed.tensor import DTensor
            assert all(isinstance(p, DTensor) for p in model.parameters())
    params = [p.full_tensor().clone() for p in model.parameters()]
    return losses, params, mon, model, inputs


def _reference_sigma(model, inputs, rank):
    """sigma_max of layer 0 at step 2 from this rank's own input, the weights gathered by hand (the
    monitor's estimate must be the same computation)."""
    from condinit.probe import JacobianOperator, lanczos_svd
    from condinit._validate import SEED_MAX

    layer = model[0]
    # layer 0's input at step 2 is the step's x (the first layer reads the model input)
    layer.unshard()
    try:
        op = JacobianOperator(layer.self_attn, inputs[2], wrt="weights", causal=False)
    finally:
        layer.reshard()
    seed = (7 * 1_000_003 + 2 * 1009 + 0) % SEED_MAX
    return lanczos_svd(op, steps=4, seed=seed).sigma_max


def _worker(rank, port, tmp):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        out = {}
        losses_on, params_on, mon, model_on, inputs = _train(rank, os.path.join(tmp, "jac"))
        losses_off, params_off, _, _, _ = _train(rank, None)
        out["identical"] = losses_on == losses_off and all(torch.equal(a, b) for a, b in zip(params_on, params_off))
        out["peak_unsharded"] = mon.peak_unsharded
        out["history"] = mon.history
        mon.close()
        # the reference is computed on the final weights, as the monitor's step-2 estimate was (its
        # gather ran after step 2's update, the last one)
        out["reference_sigma"] = _reference_sigma(model_on, inputs, rank)
        with open(os.path.join(tmp, f"rank{rank}.json"), "w") as fh:
            json.dump(out, fh)
        dist.barrier()       # no rank tears gloo down while its peer still has collectives in flight
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_fsdp2_two_gloo_ranks(tmp_path):
    mp.spawn(_worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    res = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(WORLD)]
    for r in res:
        assert r["identical"], "training changed with the monitor on"
        assert r["peak_unsharded"] == 1, "more than one layer's weights gathered at once"
    lines = [json.loads(s) for s in open(tmp_path / "jac" / "jacobian.jsonl")]
    recs = [rec for rec in lines if "alert" not in rec]
    # sampled steps 0 and 2, 2 layers, 2 ranks: every record on rank 0's file, none skipped
    assert sorted((rec["step"], rec["rank"], rec["layer"]) for rec in recs) == \
        sorted((s, k, l) for s in (0, 2) for k in range(WORLD) for l in range(2))
    assert all(rec["skipped"] is None and rec["kappa"] is not None for rec in recs), recs
    assert not (tmp_path / "jac" / "rank1").exists()
    # each rank's estimate is from its own input: equal to that rank's own recomputation, and the
    # two ranks differ (different batches)
    for k in range(WORLD):
        rec = next(r for r in recs if r["step"] == 2 and r["rank"] == k and r["layer"] == 0)
        assert abs(rec["sigma_max"] - res[k]["reference_sigma"]) <= 1e-6 * res[k]["reference_sigma"]
    a, b = (next(r for r in recs if r["step"] == 2 and r["rank"] == k and r["layer"] == 0) for k in range(WORLD))
    assert a["sigma_max"] != b["sigma_max"]
    # the other ranks keep their own records
    assert {rec["rank"] for rec in res[1]["history"]} == {1}
