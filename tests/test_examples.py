"""The examples the README points at run, and what they compute is right."""
import copy
import pathlib
import runpy
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
timm = pytest.importorskip("timm")

sys.path.insert(0, str(ROOT / "examples"))
import meanflow_step  # noqa: E402

from conftest import assert_close  # noqa: E402

F64 = torch.float64


def test_meanflow_gradients_match_explicit_attention_in_float64(seed):
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
    runpy.run_path(str(ROOT / "examples" / "meanflow_step.py"), run_name="__main__")
    losses = [float(line.split()[-1]) for line in capsys.readouterr().out.splitlines() if "loss" in line]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]


def test_probe_hf_llama_example_runs_as_a_script(capsys):
    pytest.importorskip("transformers")
    runpy.run_path(str(ROOT / "examples" / "probe_hf_llama.py"), run_name="__main__")
    rows = [line for line in capsys.readouterr().out.splitlines() if "kappa" in line]
    assert [r.split(":")[0] for r in rows] == ["layers.0.self_attn", "layers.1.self_attn"]
    for r in rows:
        values = [float(t) for t in r.split()[2::2]]
        assert len(values) == 3 and all(v > 0 and v < float("inf") for v in values)
