"""The examples the README points at run as scripts, and what they compute is right.

Each runs in this process (a fresh interpreter would spend most of the time importing timm or
transformers again)."""
import copy
import pathlib
import runpy
import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_close

ROOT = pathlib.Path(__file__).resolve().parents[1]
F64 = torch.float64
SDPA = F.scaled_dot_product_attention   # PyTorch's, captured before any example patches it


def _run_example(name: str, capsys) -> str:
    """examples/NAME run as ``__main__``; what it printed."""
    runpy.run_path(str(ROOT / "examples" / name), run_name="__main__")
    return capsys.readouterr().out


@pytest.fixture(scope="module")
def meanflow_step():
    pytest.importorskip("timm")
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import meanflow_step
    finally:
        sys.path.remove(str(ROOT / "examples"))
    return meanflow_step


def test_meanflow_gradients_match_explicit_attention_in_float64(meanflow_step, seed):
    """The gradient of the tangent loss through condinit's attention equals float64 autograd through
    timm's explicit (non-fused) attention, which forward AD handles op by op."""
    from timm.models.vision_transformer import VisionTransformer
    import condinit
    torch.manual_seed(seed)
    model = VisionTransformer(img_size=16, patch_size=8, embed_dim=32, depth=2, num_heads=4,
                              num_classes=5).to(F64)
    explicit = copy.deepcopy(model)
    for blk in explicit.blocks:
        blk.attn.fused_attn = False
    g = torch.Generator().manual_seed(seed)
    z, dz = (torch.randn(3, 3, 16, 16, generator=g, dtype=F64) for _ in range(2))
    tu, tdu = (torch.randn(3, 5, generator=g, dtype=F64) for _ in range(2))

    with condinit.patch_sdpa():
        loss = meanflow_step.meanflow_loss(model, z, dz, tu, tdu)
        grads = torch.autograd.grad(loss, list(model.parameters()))
    ref_loss = meanflow_step.meanflow_loss(explicit, z, dz, tu, tdu)
    ref = torch.autograd.grad(ref_loss, list(explicit.parameters()))
    assert abs(loss.item() - ref_loss.item()) <= 1e-10 * max(1.0, abs(ref_loss.item()))
    for (name, _), a, r in zip(model.named_parameters(), grads, ref):
        assert_close(a, r, F64, f"d loss / d {name}", floor=1e-12)


def test_meanflow_example_runs_as_a_script_and_trains(capsys):
    pytest.importorskip("timm")
    out = _run_example("meanflow_step.py", capsys)
    losses = [float(line.split()[-1]) for line in out.splitlines() if "loss" in line]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]


def test_probe_hf_llama_example_runs_as_a_script(capsys):
    pytest.importorskip("transformers")
    rows = [line for line in _run_example("probe_hf_llama.py", capsys).splitlines() if "kappa" in line]
    assert [r.split(":")[0] for r in rows] == ["layers.0.self_attn", "layers.1.self_attn"]
    for r in rows:
        values = [float(t) for t in r.split()[2::2]]
        assert len(values) == 3 and all(v > 0 and v < float("inf") for v in values)


@pytest.mark.usefixtures("one_thread")
def test_jvp_through_llama_example_runs(capsys):
    pytest.importorskip("transformers")
    assert "tangent norm" in _run_example("jvp_through_llama.py", capsys)


@pytest.mark.usefixtures("one_thread")
def test_jvp_through_timm_example_runs_and_unpatches_sdpa(capsys):
    pytest.importorskip("timm")
    assert "tangent norm" in _run_example("jvp_through_timm.py", capsys)
    assert F.scaled_dot_product_attention is SDPA
