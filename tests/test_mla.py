"""Multi-head latent attention (DeepSeek-V2/V3) conditioned through its factors: ``condinit.init.factors``
and the opt-in adapter ``condinit.models.families.mla``.

The reader is independent of condinit (``coverage_models.latent_maps``): it runs the module's own
``forward`` in float64, captures the query, key and value states where the module hands them to its
attention function, and takes their Jacobian with respect to the input (``torch.func.jacrev``) with
each latent RMSNorm passing its input through (a forward hook); a plain forward checks that the norm
multiplies each token by one scalar. So each head's effective map is the product of the factors as
the forward applies them, in the head split the forward makes.
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from coverage_models import latent_maps, latent_problems  # noqa: E402

from condinit.init.factors import latent_attention_init_  # noqa: E402
from condinit.init.functional import conditioned_blocks  # noqa: E402
from condinit.init.plan import InitPlan, run_plan  # noqa: E402
from condinit.models import UnsupportedAttention, describe  # noqa: E402
from condinit.models.families.mla import LatentAttentionSpec, latent_attention, mla_mode  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

SEED = 0x5EED


def _attention(version: int, *, q_lora_rank=24, kv_lora_rank=12, heads=4, nope=6, rope=4, v=5, hidden=40):
    """A float64 DeepseekV{version}Attention module and its config."""
    if version == 2:
        from transformers import DeepseekV2Config as Config
        from transformers.models.deepseek_v2 import modeling_deepseek_v2 as mod
        cls = mod.DeepseekV2Attention
    else:
        from transformers import DeepseekV3Config as Config
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as mod
        cls = mod.DeepseekV3Attention
    cfg = Config(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=heads, q_lora_rank=q_lora_rank,
                 kv_lora_rank=kv_lora_rank, qk_rope_head_dim=rope, qk_nope_head_dim=nope, v_head_dim=v,
                 num_hidden_layers=1, intermediate_size=16, moe_intermediate_size=8, n_routed_experts=4,
                 vocab_size=32)
    cfg._attn_implementation = "eager"
    torch.manual_seed(1)
    return cls(cfg, 0).double(), cfg, mod


def _condition(attn, *, layer=3, v_mode="identity", qk_gain=1.0, v_gain=1.0, seed=SEED):
    with latent_attention("factors"):
        found = describe(attn)
    assert isinstance(found.spec, LatentAttentionSpec)
    plan = InitPlan()
    found.spec.plan_into(plan, layer, 0, v_mode=v_mode, qk_gain=qk_gain, v_gain=v_gain)
    run_plan(plan, seed, "auto")
    return found.spec


def _check_maps(attn, cfg, mod, *, qk_gain=1.0, v_gain=1.0, v_mode="identity", position=5):
    """Each head's map read from the forward (``coverage_models.latent_maps``) as the factor reading says."""
    rotary = (mod.DeepseekV2RotaryEmbedding if "v2" in mod.__name__ else mod.DeepseekV3RotaryEmbedding)(cfg)
    pos = rotary(torch.zeros(1, 1, cfg.hidden_size, dtype=torch.float64), torch.tensor([[position]]))
    pos = pos if isinstance(pos, torch.Tensor) else tuple(p.double() for p in pos)
    maps = latent_maps(attn, pos, cfg.hidden_size)
    assert len(maps.ratios) == (2 if attn.q_lora_rank is not None else 1)
    problems = latent_problems(maps, nope_dim=attn.qk_nope_head_dim, kv_rank=attn.kv_lora_rank, qk_gain=qk_gain,
                               v_gain=v_gain, per_head_v=v_mode == "identity_per_head")
    assert not problems, problems
    H, dv, r, D = attn.num_heads, attn.v_head_dim, attn.kv_lora_rank, cfg.hidden_size
    if v_mode == "identity" and H * dv <= r:    # every head fits in the latent: the rectangular identity
        assert torch.allclose(maps.v.reshape(H * dv, D), v_gain * torch.eye(H * dv, D, dtype=torch.float64),
                              atol=1e-6, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("version", [2, 3])
@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_each_heads_map_read_from_the_forward_is_semi_orthogonal(version, q_lora_rank):
    attn, cfg, mod = _attention(version, q_lora_rank=q_lora_rank)
    _condition(attn)
    _check_maps(attn, cfg, mod)


def test_v_is_the_rectangular_identity_where_the_latent_holds_every_head():
    attn, cfg, mod = _attention(3, kv_lora_rank=24, heads=3, v=8, nope=5)   # H d_v = 24 = r_kv
    _condition(attn)
    _check_maps(attn, cfg, mod)


def test_gains_and_per_head_identity():
    attn, cfg, mod = _attention(3)
    _condition(attn, qk_gain=0.5, v_gain=2.0, v_mode="identity_per_head")
    _check_maps(attn, cfg, mod, qk_gain=0.5, v_gain=2.0, v_mode="identity_per_head")


def test_blocks_are_the_documented_streams_and_biases_zero():
    attn, cfg, _ = _attention(3)
    attn.q_a_proj.bias = torch.nn.Parameter(torch.randn(24, dtype=torch.float64))
    attn.kv_a_proj_with_mqa.bias = torch.nn.Parameter(torch.randn(16, dtype=torch.float64))
    norms = [attn.q_a_layernorm.weight.clone(), attn.kv_a_layernorm.weight.clone(), attn.o_proj.weight.clone()]
    _condition(attn, layer=7)
    L, H = 7 << 32, 4
    q = attn.q_b_proj.weight.detach().view(H, 10, 24)
    assert torch.equal(q.float(), conditioned_blocks(SEED, "q", torch.arange(L, L + H), (10, 24)))
    assert torch.equal(attn.q_a_proj.weight.detach().float(), conditioned_blocks(SEED, "q_latent", [L], (24, 40))[0])
    kv_b = attn.kv_b_proj.weight.detach().view(H, 11, 12)
    assert torch.equal(kv_b[:, :6].float(), conditioned_blocks(SEED, "k", torch.arange(L, L + H), (6, 12)))
    kv_a = attn.kv_a_proj_with_mqa.weight.detach()
    assert torch.equal(kv_a[12:].float(), conditioned_blocks(SEED, "k", [L + H], (4, 40))[0])
    assert torch.equal(kv_a[:12], torch.eye(12, 40, dtype=torch.float64))
    assert not attn.q_a_proj.bias.any() and not attn.kv_a_proj_with_mqa.bias.any()
    after = [attn.q_a_layernorm.weight, attn.kv_a_layernorm.weight, attn.o_proj.weight]
    assert all(torch.equal(a, b) for a, b in zip(norms, after))


def test_the_public_function_writes_what_the_adapter_writes():
    a, _, _ = _attention(3)
    b, _, _ = _attention(3)
    _condition(a, layer=2)
    latent_attention_init_(b.q_b_proj.weight, b.kv_a_proj_with_mqa.weight, b.kv_b_proj.weight, q_a=b.q_a_proj.weight,
                           num_heads=4, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5, seed=SEED,
                           layer_index=2)
    for n in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"):
        assert torch.equal(getattr(a, n).weight, getattr(b, n).weight), n


def test_opt_in_only():
    attn, _, _ = _attention(3)
    assert mla_mode() == "refuse"
    with pytest.raises(UnsupportedAttention, match="multi-head latent attention"):
        describe(attn)                      # default: structural discovery refuses it
    with latent_attention("factors"):
        assert mla_mode() == "factors"
        assert describe(attn).spec.layout == "latent"
    assert mla_mode() == "refuse"
    with pytest.raises(ValueError, match="mla must be one of"):
        with latent_attention("yes"):
            pass


@pytest.mark.parametrize("kw, why", [
    (dict(kv_lora_rank=5), "no-RoPE key head dim 6 exceeds kv_lora_rank 5"),
    (dict(kv_lora_rank=7, v=8), "value head dim 8 exceeds kv_lora_rank 7"),
    (dict(q_lora_rank=8), "query head dim 10 exceeds q_lora_rank 8"),
    (dict(q_lora_rank=48), "q_lora_rank 48 exceeds the input width 40"),
])
def test_shapes_whose_factors_cannot_be_semi_orthogonal_are_refused(kw, why):
    attn, _, _ = _attention(3, **kw)
    with latent_attention("factors"), pytest.raises(UnsupportedAttention, match=why):
        describe(attn)


def test_a_norm_weight_that_is_not_constant_is_refused():
    attn, _, _ = _attention(3)
    with torch.no_grad():
        attn.kv_a_layernorm.weight[0] = 2.0
    with latent_attention("factors"), pytest.raises(UnsupportedAttention, match="RMSNorm weight is not constant"):
        describe(attn)


def test_bad_arguments_name_the_argument_before_any_write():
    attn, _, _ = _attention(3)
    w = {n: getattr(attn, n).weight for n in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")}
    before = {n: t.detach().clone() for n, t in w.items()}
    args = dict(q_a=w["q_a_proj"], num_heads=4, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5, seed=0)
    cases = [(dict(num_heads=3), "q_b has 40 rows"), (dict(v_head_dim=6), "kv_b has shape"),
             (dict(q_a=None), "q_b reads 24 features, expected 40"), (dict(qk_gain=0.0), "qk_gain"),
             (dict(v_mode="x"), "v_mode"), (dict(kv_a_bias=torch.zeros(3, dtype=torch.float64)), "kv_a_bias has 3")]
    for change, msg in cases:
        with pytest.raises(ValueError, match=msg):
            latent_attention_init_(w["q_b_proj"], w["kv_a_proj_with_mqa"], w["kv_b_proj"], **dict(args, **change))
    assert all(torch.equal(w[n], before[n]) for n in w)


@pytest.mark.slow
def test_the_registered_classes_compute_what_deepseek_v3_computes():
    """Every class the adapter describes has DeepseekV3Attention's code (up to class names), or is
    DeepseekV2Attention, whose forward the test above reads."""
    import importlib
    import inspect
    import re

    from condinit.models.families.mla import MLA_CLASSES

    def code(path):
        mod, name = path.rsplit(".", 1)
        cls = getattr(importlib.import_module(mod), name)
        return re.sub(r"\b\w*(Attention|Config|RMSNorm)\b", "X", inspect.getsource(cls))

    v3 = code(MLA_CLASSES[1])
    assert [code(p) == v3 for p in MLA_CLASSES[2:]] == [True] * (len(MLA_CLASSES) - 2)


# ------------------------------------------------------------------------------------------------
# condinit.apply(mla="factors") and condinit init --mla factors

def _model_config(q_lora_rank=24, layers=2):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(hidden_size=40, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=q_lora_rank,
                            kv_lora_rank=12, qk_rope_head_dim=4, qk_nope_head_dim=6, v_head_dim=5,
                            num_hidden_layers=layers, intermediate_size=16, moe_intermediate_size=8, n_routed_experts=4,
                            first_k_dense_replace=1, vocab_size=32, attn_implementation="eager")


@pytest.mark.slow
@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_apply_conditions_every_layer_by_its_factors(q_lora_rank):
    from transformers import AutoModelForCausalLM
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as mod

    import condinit

    cfg = _model_config(q_lora_rank)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).double()
    written = {"q_a_proj", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "kv_b_proj"}
    before = {n: p.detach().clone() for n, p in model.named_parameters() if n.split(".")[-2] not in written}
    report = condinit.apply(model, seed=SEED, mla="factors", strict=True)
    assert [l.layout for l in report.layers] == ["latent", "latent"]
    for rep in report.layers:
        for p in "qkv":
            assert abs(rep.after[p].cond - 1) < 1e-5 and rep.before[p].cond > 1.5
    for n, p in model.named_parameters():
        if n in before:
            assert torch.equal(p, before[n]), n
    for layer in model.model.layers:
        _check_maps(layer.self_attn, cfg, mod)


def test_apply_refuses_latent_attention_by_default_saying_how_to_opt_in():
    from transformers import AutoModelForCausalLM

    import condinit
    from condinit.models import UncoveredAttentionError

    model = AutoModelForCausalLM.from_config(_model_config(layers=1))
    with pytest.raises(UncoveredAttentionError, match=r'opt in to conditioning the factors with mla="factors"'):
        condinit.apply(model, seed=0)
    with pytest.raises(ValueError, match="mla must be one of"):
        condinit.apply(model, seed=0, mla="yes")


@pytest.mark.slow
def test_meta_apply_and_the_streamed_write_give_the_same_tensors(tmp_path, capsys):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    import condinit
    from helpers import run_cli

    cfg = _model_config()
    path = tmp_path / "config.json"
    path.write_text(cfg.to_json_string())
    rc, _, err = run_cli(capsys, "init", "--config", str(path), "--seed", "5", "--out", str(tmp_path / "no"))
    assert rc == 2 and "--mla factors" in err
    rc, text, err = run_cli(capsys, "init", "--config", str(path), "--seed", "5", "--mla", "factors", "--strict",
                            "--out", str(tmp_path / "out") + "/")
    assert rc == 0, err
    files = sorted((tmp_path / "out").glob("*.safetensors"))
    written = {k: v for f in files for k, v in load_file(str(f)).items()}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    condinit.apply(model, seed=5, mla="factors", strict=True, report=False)
    state = model.state_dict()
    attn = "model.layers.1.self_attn."
    for name in ("q_a_proj.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight", "kv_b_proj.weight"):
        assert torch.equal(written[attn + name], state[attn + name]), name
    assert torch.equal(written[attn + "kv_a_proj_with_mqa.weight"][:12], torch.eye(12, 40))
    assert all(torch.equal(written[k], state[k]) for k in written)
    rc, text, err = run_cli(capsys, "inspect", str(tmp_path / "out"))     # the up blocks per head
    assert rc == 0 and "latent" in text, err
