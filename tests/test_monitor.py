"""JacobianMonitor: logs per layer and never changes training (bit-identical losses and parameters)."""
import csv
import json

import pytest
import torch
from torch import nn

from condinit.probe import JacobianMonitor
from helpers import TinyTransformer


pytestmark = pytest.mark.usefixtures("one_thread")


def train(monitor_kwargs=None, steps=5, tmp_path=None):
    torch.manual_seed(0)
    model = TinyTransformer()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    mon = JacobianMonitor(model, **monitor_kwargs) if monitor_kwargs is not None else None
    losses = []
    for _ in range(steps):
        tok = torch.randint(0, 11, (2, 6))
        loss = nn.functional.cross_entropy(model(tok).reshape(-1, 11), tok.roll(1, 1).reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if mon is not None:
            mon.step()
    return model, losses, mon


def test_monitor_does_not_change_training(tmp_path):
    model0, losses0, _ = train()
    model1, losses1, mon = train(dict(every=2, steps=6, log_dir=tmp_path, seed=3, frobenius_samples=4))
    assert losses0 == losses1
    for (n0, p0), (n1, p1) in zip(model0.state_dict().items(), model1.state_dict().items()):
        assert n0 == n1 and torch.equal(p0, p1), n0
    assert model1.training
    # steps 0, 2, 4 sampled, 2 layers each
    recs = [r for r in mon.history if r["skipped"] is None]
    assert [(r["step"], r["layer"]) for r in recs] == [(s, l) for s in (0, 2, 4) for l in (0, 1)]
    assert all(r["sigma_max"] > 0 and r["frobenius"] > 0 for r in recs)
    assert all(r["kappa"] is None or r["kappa"] >= 1 for r in recs)
    mon.close()
    assert all(not l.self_attn._forward_pre_hooks for l in model1.layers)
    lines = [json.loads(line) for line in open(tmp_path / "jacobian.jsonl")]
    assert len(lines) == 6 and lines[0]["name"] == "layers.0.self_attn"
    rows = list(csv.DictReader(open(tmp_path / "jacobian.csv")))
    assert len(rows) == 6 and float(rows[0]["sigma_max"]) == pytest.approx(lines[0]["sigma_max"])


def test_budget_and_round_robin(tmp_path):
    # the largest seed: per-step seeds are derived modulo 2**64
    _, _, mon = train(dict(every=1, steps=4, max_layers=1, frobenius_samples=0, seed=2 ** 64 - 1,
                           path=tmp_path / "j.jsonl"), steps=3)
    done = [(r["step"], r["layer"]) for r in mon.history if r["skipped"] is None]
    assert done == [(0, 0), (1, 1), (2, 0)]
    assert sum(r["skipped"] == "max_layers" for r in mon.history) == 3
    mon.close()
    assert (tmp_path / "j.csv").exists()
    with JacobianMonitor(TinyTransformer(), every=5, budget=1e-9) as m2:
        assert m2.budget == 1e-9
    assert m2._capture is None


def test_monitor_bad_input(tmp_path):
    model = TinyTransformer()
    for bad in (0, -1.0):
        with pytest.raises(ValueError, match=r"budget must be in \(0.0, inf\]"):
            JacobianMonitor(model, budget=bad)
    with pytest.raises(ValueError, match="every"):
        JacobianMonitor(model, every=0)
    with pytest.raises(TypeError, match="every"):
        JacobianMonitor(model, every=True)
    with pytest.raises(ValueError, match=r"seed must be an int in \[0, 2\*\*64\)"):
        JacobianMonitor(model, seed=2 ** 64)
    with pytest.raises(TypeError, match="dtype"):
        JacobianMonitor(model, dtype=torch.int32)
    with pytest.raises(ValueError, match="no attention layer"):
        JacobianMonitor(nn.Sequential(nn.Linear(3, 3)))
    with pytest.raises(ValueError, match="directory"):
        JacobianMonitor(model, path=tmp_path / "missing" / "j.jsonl")
    assert all(not l.self_attn._forward_pre_hooks for l in model.layers)


@pytest.mark.parametrize("batch_first", [True, False])
def test_input_capture_layouts(batch_first, rng):
    """InputCapture hands over [B, N, D] (batch first) whatever the module's layout, and keeps the first call."""
    from condinit.probe import InputCapture

    mha = nn.MultiheadAttention(8, 2, batch_first=batch_first)
    x = torch.randn(3, 5, 8, generator=rng)                  # [B, N, D]
    xin = x if batch_first else x.transpose(0, 1)
    seen = []
    with InputCapture([mha]) as cap, InputCapture([mha], on_input=lambda i, m, t: seen.append(t)):
        mha(xin, xin, xin)
        mha(query=2 * xin, key=xin, value=xin)              # keyword input; not kept by the first capture
    assert torch.equal(cap.inputs[0], x)
    assert len(seen) == 2 and torch.equal(seen[0], x) and torch.equal(seen[1], 2 * x)
    assert not mha._forward_pre_hooks
    with InputCapture([mha]) as cap:
        mha(x[0], x[0], x[0])                                 # unbatched [N, D]
    assert torch.equal(cap.inputs[0], x[:1])


def test_capture_hands_over_the_call_and_position_embeddings():
    """call_info=True passes (args, kwargs); position_embeddings are found by keyword or by position."""
    from condinit.probe import InputCapture
    from condinit.probe.capture import layer_position_embeddings

    class Rotary(nn.Module):
        def forward(self, hidden_states, position_embeddings=None, attention_mask=None):
            return hidden_states

    m = Rotary()
    x = torch.randn(1, 3, 4)
    cs = (torch.randn(1, 3, 2), torch.randn(1, 3, 2))
    seen = []
    with InputCapture([m], on_input=lambda i, mod, t, call: seen.append(layer_position_embeddings(mod, *call)),
                      call_info=True):
        m(x, position_embeddings=cs)
        m(x, cs)
        m(x)
    assert all(torch.equal(a, b) for got in seen[:2] for a, b in zip(got, cs))
    assert seen[2] is None


def test_distributed_needs_a_process_group():
    """distributed=True without torch.distributed initialized is an argument error at construction;
    the default (None) stays off for a model without sharded layers."""
    import torch.distributed as dist

    from condinit.probe import JacobianMonitor

    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is already initialized")
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    with pytest.raises(ValueError, match="distributed=True"):
        JacobianMonitor(mha, every=1, distributed=True)
    with pytest.raises(TypeError, match="distributed"):
        JacobianMonitor(mha, every=1, distributed="yes")
    mon = JacobianMonitor(mha, every=1)
    assert mon.distributed is False
    mon.close()


def test_call_mask_rows_reads_the_mask_forms_models_pass():
    """Which sequences a call's attention mask treats otherwise than the layer's own pattern: additive
    and boolean 4-D masks (HF eager / sdpa), a broadcast key mask, causal and windowed patterns, and
    nn.MultiheadAttention's key_padding_mask / attn_mask by position."""
    from condinit.probe.capture import call_mask_rows

    B, N, lin = 3, 6, torch.nn.Linear(2, 2)
    low = torch.finfo(torch.float32).min
    i = torch.arange(N)
    causal = (i[None, :] > i[:, None])
    window = causal | (i[:, None] - i[None, :] >= 3)

    def rows(mask, causal_layer, win=None, module=lin, args=()):
        got, unread = call_mask_rows(module, (args, {} if mask is None else {"attention_mask": mask}), B, N,
                                     causal_layer, win)
        assert unread is None
        return None if got is None else got.tolist()

    assert rows(None, True) is None
    additive = torch.where(causal, low, 0.0)[None, None].expand(B, 1, N, N).clone()
    assert rows(additive, True) == [False] * 3 and rows(additive, False) == [True] * 3
    additive[2, :, :, 0] = low                                   # left padding of sequence 2
    assert rows(additive, True) == [False, False, True]
    allowed = (~window)[None, None].expand(B, 1, N, N).clone()
    assert rows(allowed, True, 3) == [False] * 3 and rows(allowed, True) == [True] * 3
    keys = torch.zeros(B, 1, 1, N)
    keys[0, ..., 4:] = low
    assert rows(keys, False) == [True, False, False]
    mha = torch.nn.MultiheadAttention(4, 1, batch_first=True)
    pad = torch.zeros(B, N, dtype=torch.bool)
    pad[1, -1] = True
    got, _ = call_mask_rows(mha, ((None, None, None, pad), {}), B, N, False, None)
    assert got.tolist() == [False, True, False]
    got, _ = call_mask_rows(mha, ((None, None, None, None, True, causal), {}), B, N, True, None)
    assert got.tolist() == [False] * 3
    _, unread = call_mask_rows(lin, ((), {"attention_mask": object()}), B, N, True, None)
    assert "object" in unread
