"""JacobianMonitor under every kind of training loop: torch.func transforms, functional_call, autocast,
no_grad / inference_mode, torch.compile. The step's results equal those without the monitor; a
sampled forward that cannot be measured, and an estimate that raises, are records with the reason."""
import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, jacfwd, jacrev, jvp, vmap

import condinit.probe.estimators as estimators
import condinit.probe.operator as operator
from condinit.probe import JacobianMonitor
from condinit.probe.records import SKIPPED_COMPILED
from helpers import TinyTransformer


pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 11


def run(step_fn, monitor: bool, steps: int = 1):
    """``step_fn(model, tok)`` for ``steps`` steps of a seeded TinyTransformer (every step sampled);
    returns the step results and the monitor's records."""
    torch.manual_seed(0)
    model = TinyTransformer(vocab=VOCAB)
    mon = JacobianMonitor(model, every=1, steps=4, frobenius_samples=0, tensorboard=False) if monitor else None
    results, records = [], []
    for _ in range(steps):
        tok = torch.randint(0, VOCAB, (3, 6))
        results.append(step_fn(model, tok))
        if mon is not None:
            records += mon.step()
    if mon is not None:
        mon.close()
    return results, records


def assert_same(a, b):
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), k
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert torch.equal(a, b)


def check(step_fn, steps: int = 1):
    """The step gives the same results with the monitor on; returns the monitor's records."""
    plain, _ = run(step_fn, monitor=False, steps=steps)
    watched, records = run(step_fn, monitor=True, steps=steps)
    assert_same(plain, watched)
    assert [r["step"] for r in records] == [s for s in range(steps) for _ in (0, 1)]
    return records


def params(model):
    return {k: v.detach() for k, v in model.named_parameters()}


def sequence_loss(model, p, tok):
    """Cross entropy of next-token prediction, the model called functionally with parameters ``p``."""
    out = functional_call(model, p, (tok,))
    return nn.functional.cross_entropy(out.reshape(-1, VOCAB), tok.roll(1, -1).reshape(-1))


def per_sample_grads(model, tok):
    def loss(p, t):
        return sequence_loss(model, p, t.unsqueeze(0))
    return vmap(grad(loss), in_dims=(None, 0), randomness="different")(params(model), tok)


def skipped_under(records) -> str:
    """The one ``skipped`` reason of ``records``: a forward under a torch.func transform, the
    transforms it names."""
    reasons = {r["skipped"] for r in records}
    assert len(reasons) == 1, reasons
    reason = reasons.pop()
    prefix, suffix = "forward under a torch.func transform (", "): the monitor does not measure transformed tensors"
    assert reason.startswith(prefix) and reason.endswith(suffix), reason
    return reason[len(prefix):-len(suffix)]


def test_per_sample_gradients_under_vmap_of_grad():
    records = check(per_sample_grads)
    # the forward runs inside grad, inside vmap: the innermost transform is named
    assert "grad" in skipped_under(records).split(", ")


def test_vmap_forward():
    records = check(lambda m, tok: vmap(lambda t: m(t.unsqueeze(0)), randomness="different")(tok))
    assert skipped_under(records) == "vmap"


def test_grad_and_jvp():
    records = check(lambda m, tok: grad(lambda p: sequence_loss(m, p, tok))(params(m)))
    assert "grad" in skipped_under(records).split(", ")

    def forward_mode(m, tok):
        p = params(m)
        return jvp(lambda q: sequence_loss(m, q, tok), (p,), ({k: torch.ones_like(v) for k, v in p.items()},))
    records = check(forward_mode)
    assert "jvp" in skipped_under(records).split(" or ")


def test_jacrev_and_jacfwd_are_named():
    """jacrev runs the forward as grad does, jacfwd as jvp does: the reason names the transform
    called among those of its kind, never another one alone."""
    def logits_sum(m):
        def f(e):
            for layer in m.layers:
                e = layer(e)
            return m.head(e).sum((-2, -1))
        return f

    def reverse(m, tok):
        m.eval()      # no dropout: jacrev's vmap over the rows of the Jacobian draws no random numbers
        return jacrev(logits_sum(m))(m.emb(tok).detach())

    def forward(m, tok):   # in train mode (as jvp above): eval's fused path has no forward-mode rule
        return jacfwd(logits_sum(m), randomness="same")(m.emb(tok).detach())
    names = skipped_under(check(reverse))
    assert "jacrev" in names.replace(" or ", ", ").split(", "), names
    names = skipped_under(check(forward))
    assert "jacfwd" in names.replace(" or ", ", ").split(", "), names


def test_functional_call_is_measured():
    def step(m, tok):
        p = dict(m.named_parameters())
        loss = sequence_loss(m, p, tok)
        return [loss.detach()] + list(torch.autograd.grad(loss, list(p.values())))
    records = check(step)
    assert all(r["skipped"] is None and r["sigma_max"] > 0 for r in records)


def test_autocast_no_grad_inference_mode_are_measured():
    def autocast_step(m, tok):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = sequence_loss(m, dict(m.named_parameters()), tok)
        loss.backward()
        return [loss.detach()] + [p.grad for p in m.parameters()]

    def no_grad_step(m, tok):
        with torch.no_grad():
            return m(tok)

    def inference_step(m, tok):
        with torch.inference_mode():
            return m(tok).clone(memory_format=torch.contiguous_format)

    for step_fn in (autocast_step, no_grad_step, inference_step):
        records = check(step_fn, steps=2)
        assert all(r["skipped"] is None and r["sigma_max"] > 0 for r in records), step_fn.__name__


def test_no_grad_and_inference_mode_estimates_agree():
    def forward(mode):
        def step(m, tok):
            with mode():
                return m(tok).sum().item()
        return step
    _, a = run(forward(torch.no_grad), monitor=True)
    _, b = run(forward(torch.inference_mode), monitor=True)
    assert [r["sigma_max"] for r in a] == [r["sigma_max"] for r in b]


def test_activation_checkpointing_is_measured_once():
    """torch.utils.checkpoint reruns the forward in the backward pass: the hooks see it again, the
    monitor keeps the first capture, and the estimate equals the one of the plain forward."""
    from torch.utils.checkpoint import checkpoint

    def step(m, tok):
        loss = checkpoint(m, tok, use_reentrant=False).square().mean()
        loss.backward()
        return [loss.detach()] + [p.grad.clone() for p in m.parameters()]
    records = check(step)
    _, plain = run(lambda m, tok: m(tok), monitor=True)
    assert all(r["skipped"] is None for r in records)
    assert [r["sigma_max"] for r in records] == [r["sigma_max"] for r in plain]


@pytest.mark.slow
def test_compiled_forward():
    compiled_models = {}

    def compiled(m, tok):
        if id(m) not in compiled_models:
            # torch.compile does not guard on hooks: a graph traced before the monitor's hooks existed
            # would be reused
            torch.compiler.reset()
            compiled_models[id(m)] = torch.compile(m, fullgraph=True, backend="eager")
        loss = compiled_models[id(m)](tok).square().mean()
        loss.backward()
        return [loss.detach()] + [p.grad.clone() for p in m.parameters()]
    records = check(compiled, steps=3)
    assert {r["skipped"] for r in records} == {SKIPPED_COMPILED}


def test_estimate_error_is_recorded_with_its_type(monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("kernel launch failed")
    monkeypatch.setattr(estimators, "lanczos_svd", boom)
    records = check(lambda m, tok: m(tok))
    assert {r["skipped"] for r in records} == {"error: RuntimeError: kernel launch failed"}
    assert all(r["batch"] == 1 and r["tokens"] == 6 for r in records)


def test_capture_error_is_recorded_with_its_type(monkeypatch):
    class Broken:
        def __init__(self, *args, **kwargs):
            raise IndexError("index 3 is out of bounds")
    monkeypatch.setattr(operator, "JacobianOperator", Broken)
    records = check(lambda m, tok: m(tok))
    assert {r["skipped"] for r in records} == {"error: IndexError: index 3 is out of bounds"}


# ------------------------------------------------------------------------------------------------
# The monitor's own log files
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["jacobian.jsonl", "jacobian.csv"])
@pytest.mark.parametrize("kind", ["link out", "dangling link", "fifo", "directory"])
def test_log_file_that_is_not_a_regular_file_is_refused(tmp_path, name, kind):
    """A symlink (to a file outside the log directory, or dangling), a FIFO or a directory at the
    JSONL or CSV file's name: refused at construction naming it; nothing written through it, no
    hook left on the model."""
    import os
    logs, outside = tmp_path / "logs", tmp_path / "outside.txt"
    logs.mkdir()
    outside.write_bytes(b"not yours\n")
    where = logs / name
    if kind == "link out":
        os.symlink(outside, where)
    elif kind == "dangling link":
        os.symlink(tmp_path / "elsewhere.jsonl", where)
    elif kind == "fifo":
        os.mkfifo(where)
    else:
        where.mkdir()
    model = TinyTransformer(vocab=VOCAB)
    expected = {"link out": f"is a symlink to {outside}", "dangling link": "is a symlink to",
                "fifo": "is a FIFO", "directory": "directory"}[kind]
    with pytest.raises(ValueError, match=expected) as err:
        JacobianMonitor(model, every=1, log_dir=logs, tensorboard=False)
    assert str(where) in str(err.value)
    assert outside.read_bytes() == b"not yours\n" and not (tmp_path / "elsewhere.jsonl").exists()
    assert all(not m._forward_pre_hooks for m in model.modules())


def test_os_error_writing_the_log_is_recorded_never_raised(tmp_path):
    """A write of the log that fails (here EFBIG: a file-size limit below the first record) is in
    that step's records as ``log_error``; the training step goes on, the next step's records too."""
    import resource
    import signal
    torch.manual_seed(0)
    model = TinyTransformer(vocab=VOCAB)
    mon = JacobianMonitor(model, every=1, steps=4, frobenius_samples=0, tensorboard=False, log_dir=tmp_path)
    size = (tmp_path / "jacobian.csv").stat().st_size      # its header
    limits, handler = resource.getrlimit(resource.RLIMIT_FSIZE), signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (size + 1, limits[1]))
        records = []
        for _ in range(2):
            model(torch.randint(0, VOCAB, (3, 6))).sum().backward()
            records += mon.step()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, handler)
    mon.close()
    assert len(records) == 4 and all(r["skipped"] is None for r in records)
    assert all(r["log_error"].startswith("OSError: [Errno 27] File too large") for r in records), records[0]
