"""Streamed writes: module units drawn in pieces from the writes their init was recorded making.

The reference is the same write with every unit materialized whole (the model's init run on real
tensors, then checked; ``tuned(replay_units=False)``): the files must be byte-identical, whatever the
piece size. Which modules are computed whole, and why, is what the write's plan reports.
"""
import hashlib
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from coverage_models import CONFIG_FIXES, hf_config  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from condinit.models.stream import (OWN_INIT_BLOCK, own_normal_, tuned, tuning, write_checkpoint,  # noqa: E402
                                    write_pretrained)
from condinit.models.stream.recording import SMALL_NUMEL, ConstructorValue, ConstructorWrites, Fill, Normal, \
    build_on_meta  # noqa: E402


def _digests(d):
    return {n: hashlib.sha256((d / n).read_bytes()).hexdigest() for n in sorted(os.listdir(d))}


def _tensors(d):
    """Every tensor of the weights files in directory ``d``."""
    sd = {}
    for name in os.listdir(d):
        if name.endswith(".safetensors"):
            sd.update(load_file(d / name))
    return sd


def _plan(tmp_path, cfg):
    """The plan of writing ``cfg`` (nothing written)."""
    return write_pretrained(cfg, tmp_path / "plan", dry_run=True).plan


def _whole_and_pieces(tmp_path, cfg, **kw):
    """(directory written with pieces of one Philox block, directory written with every unit whole)."""
    pieces = tmp_path / "pieces"
    with tuned(piece_bytes=1):         # one 2**16-element block per piece
        write_pretrained(cfg, pieces, **kw)
    whole = tmp_path / "whole"
    with tuned(replay_units=False):
        write_pretrained(cfg, whole, **kw)
    return pieces, whole


def _tiny_llama(**kw):
    base = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=12, vocab_size=3000, tie_word_embeddings=False)
    base.update(kw)
    return transformers.LlamaConfig(**base)


# families whose every module unit is replayed, and two with a unit the recorder refuses (a sinusoidal
# table copied in; a truncated normal from torch's generator), written whole in the same write
@pytest.mark.parametrize("family, whole_units", [
    ("llama", []), ("gpt2", []), ("bert", []), ("t5", []), ("mixtral", []),
    ("whisper", ["encoder.embed_positions"]), ("vit", ["embeddings"])])
@pytest.mark.slow
def test_pieces_write_the_bytes_of_the_whole_init(tmp_path, family, whole_units):
    cfg = hf_config(family)
    if family in CONFIG_FIXES:
        CONFIG_FIXES[family](cfg)
    plan = _plan(tmp_path, cfg)
    assert sorted(plan.whole_modules) == whole_units      # each with its reason
    assert all(why.startswith(f"{name}.") for name, why in plan.whole_modules.items()), plan.whole_modules
    assert plan.replayed_units > 3
    pieces, whole = _whole_and_pieces(tmp_path, cfg, seed=5, max_shard_size="20KB")
    assert _digests(pieces) == _digests(whole)


def test_padding_row_across_a_piece_boundary(tmp_path, seed):
    # D = 48: row 1365 holds elements 65520..65567, across the first piece boundary (65536)
    cfg = _tiny_llama(pad_token_id=1365)
    assert "model.embed_tokens" not in _plan(tmp_path, cfg).whole_modules    # drawn in pieces
    pieces, whole = _whole_and_pieces(tmp_path, cfg, seed=seed, max_shard_size="200KB")
    assert _digests(pieces) == _digests(whole)
    emb = _tensors(pieces)["model.embed_tokens.weight"]
    assert emb.numel() > 2 * OWN_INIT_BLOCK
    ref = own_normal_(torch.empty(emb.shape), seed, "model.embed_tokens.weight", std=cfg.initializer_range)
    ref[1365] = 0
    assert torch.equal(emb, ref)


def test_writes_the_recorder_cannot_replay_make_the_unit_whole(tmp_path, seed, monkeypatch):
    from transformers import initialization as init
    from transformers.models.llama.modeling_llama import LlamaPreTrainedModel, LlamaRMSNorm

    real = LlamaPreTrainedModel._init_weights

    def unusual(self, module):
        if isinstance(module, torch.nn.Linear) and module.out_features == 96:      # gate / up: doubled after
            init.normal_(module.weight, std=0.02)
            module.weight.data.mul_(2)
        elif isinstance(module, LlamaRMSNorm):                                      # through strided views
            module.weight.data[::2].fill_(1.0)
            module.weight.data[1::2].fill_(1.0)
        elif isinstance(module, torch.nn.Embedding):                                # torch's generator
            init.uniform_(module.weight, -0.1, 0.1)
        elif isinstance(module, torch.nn.Linear) and module.in_features == 96:      # down: a meta no-op after
            init.normal_(module.weight, std=0.02)
            init.trunc_normal_(module.weight, std=0.02)
        elif isinstance(module, torch.nn.Linear) and module.out_features == 3000:   # the head: data replaced
            init.normal_(module.weight, std=0.02)
            module.weight.data = torch.full_like(module.weight, 0.5)
        else:
            real(self, module)

    monkeypatch.setattr(LlamaPreTrainedModel, "_init_weights", unusual)
    cfg = _tiny_llama()
    why = _plan(tmp_path, cfg).whole_modules
    assert sorted(why) == sorted(["model.embed_tokens", "model.norm", "lm_head"] +
                                 [f"model.layers.{i}.{m}" for i in range(2)
                                  for m in ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm",
                                            "post_attention_layernorm")])
    assert "model.layers.0.self_attn.o_proj" not in why       # drawn in pieces
    assert "aten.mul_" in why["model.layers.0.mlp.up_proj"] and "uniform_" in why["model.embed_tokens"]
    assert "trunc_normal_" in why["model.layers.0.mlp.down_proj"]
    assert "non-contiguous view" in why["model.norm"] and "storage was replaced" in why["lm_head"]
    rep = write_checkpoint(cfg, tmp_path / "a.safetensors", seed=seed)
    sd = load_file(rep.files[0])
    name = "model.layers.1.mlp.up_proj.weight"
    assert torch.equal(sd[name], 2 * own_normal_(torch.empty(sd[name].shape), seed, name, std=0.02))
    assert torch.equal(sd["model.norm.weight"], torch.ones(48))
    assert torch.equal(sd["lm_head.weight"], torch.full((3000, 48), 0.5))
    down = "model.layers.0.mlp.down_proj.weight"     # torch's truncated normal, not the own-init normals
    assert not torch.equal(sd[down], own_normal_(torch.empty(sd[down].shape), seed, down, std=0.02))
    assert sd[down].abs().max() <= 2 and 0.015 < sd[down].std() < 0.025
    emb = sd["model.embed_tokens.weight"]
    assert emb.abs().max() <= 0.1 and emb.std() > 0.05
    again = load_file(write_checkpoint(cfg, tmp_path / "b.safetensors", seed=seed).files[0])
    assert all(torch.equal(again[k], sd[k]) for k in sd)


def test_own_normal_offset(seed):
    name = "model.layers.3.mlp.down_proj.weight"
    whole = own_normal_(torch.empty(5 * OWN_INIT_BLOCK + 77, dtype=torch.bfloat16), seed, name, std=0.02)
    for start in (OWN_INIT_BLOCK, 3 * OWN_INIT_BLOCK):
        part = own_normal_(torch.empty(whole.numel() - start, dtype=torch.bfloat16), seed, name, std=0.02,
                           offset=start)
        assert torch.equal(part, whole[start:])
    with pytest.raises(ValueError, match=r"offset must be a multiple of 65536, got 100"):
        own_normal_(torch.empty(10), seed, name, offset=100)
    with pytest.raises(ValueError, match="offset"):
        own_normal_(torch.empty(10), seed, name, offset=-OWN_INIT_BLOCK)


def test_dry_run_counts_the_units_drawn_in_pieces(tmp_path):
    cfg = _tiny_llama()
    rep = write_pretrained(cfg, tmp_path / "d", dry_run=True)
    plan = rep.plan
    layers = cfg.num_hidden_layers
    assert plan.units == layers + 6 * layers + 3 and plan.replayed_units == plan.units - layers
    assert plan.largest_unit.name == "model.layers.0.self_attn" and plan.piece_bytes == tuning().piece_bytes
    assert not (tmp_path / "d").exists()


# tensors only a constructor sets (the model's _init_weights leaves them): their values as
# from_config gives them (independent of condinit: the model built on the CPU)
@pytest.mark.parametrize("family, auto, pattern", [
    ("clip", "AutoModel", "logit_scale"),                        # nn.Parameter(torch.tensor(value))
    ("apertus", "AutoModelForCausalLM", "act_fn."),             # computed from literals in the constructor
    ("yolos", "AutoModel", "cls_token"),                          # torch.zeros
])
def test_values_only_a_constructor_sets_are_from_config_s(tmp_path, family, auto, pattern):
    cfg = hf_config(family)
    sd = load_file(write_checkpoint(cfg, tmp_path / "a.safetensors", seed=3).files[0])
    ref = getattr(transformers, auto).from_config(cfg).state_dict()
    keys = [k for k in sd if pattern in k]
    assert keys and all(torch.equal(sd[k], ref[k]) for k in keys), {k: (sd[k], ref[k]) for k in keys}


def test_constructor_normals_are_own_init_normals_and_drawn_in_pieces(tmp_path, seed):
    # OpenAI-GPT's Conv1D draws normal(0, 0.02) in its constructor; the model's init never touches it.
    # D = 288: the projections are above SMALL_NUMEL, so their draws are recorded, not computed
    cfg = hf_config("openai-gpt")
    cfg.n_embd = 288
    assert 288 * 288 > SMALL_NUMEL
    assert "transformer.h.0.attn.c_proj" not in _plan(tmp_path, cfg).whole_modules   # drawn in pieces
    pieces, whole = _whole_and_pieces(tmp_path, cfg, seed=seed, max_shard_size="50KB")
    assert _digests(pieces) == _digests(whole)
    sd = _tensors(pieces)
    for k in ("transformer.h.0.attn.c_proj.weight", "transformer.h.0.mlp.c_fc.weight"):
        assert torch.equal(sd[k], own_normal_(torch.empty(sd[k].shape), seed, k, std=0.02)), k
    assert torch.count_nonzero(sd["transformer.h.0.attn.c_proj.bias"]) == 0


def test_a_constructor_draw_from_torch_depends_on_the_seed_only(tmp_path):
    # SEW-D's masked_spec_embed: torch.Tensor(n).uniform_() in its constructor, made on the CPU
    cfg = hf_config("sew-d")
    a, b, c = (load_file(write_checkpoint(cfg, tmp_path / f"{i}.safetensors", seed=s).files[0])
               for i, s in enumerate((4, 4, 5)))
    k = "masked_spec_embed"
    assert torch.equal(a[k], b[k]) and not torch.equal(a[k], c[k])
    assert 0 <= a[k].min() and a[k].max() < 1 and a[k].std() > 0.1


def test_a_config_transformers_cannot_build_is_refused_with_what_to_do(tmp_path):
    cfg = hf_config("funnel")      # its default config names no architecture; its Auto entry needs one
    cfg.architectures = None
    with pytest.raises(ValueError, match=r"model_type 'funnel'.*does not build a model from it.*\"architectures\""):
        write_pretrained(cfg, tmp_path / "x")
    assert not (tmp_path / "x").exists()
    cfg.architectures = ["FunnelModel"]
    assert write_pretrained(cfg, tmp_path / "y").files


class _Constructed(torch.nn.Module):
    """Constructor writes of every kind the meta-build recorder follows, or must refuse."""

    def __init__(self):
        super().__init__()
        big = SMALL_NUMEL + 1
        self.literal = torch.nn.Parameter(torch.tensor([2.5, -1.0]))                 # a torch.tensor literal
        self.computed = torch.nn.Parameter(torch.log(torch.exp(torch.tensor([0.8, 0.3])) - 1))   # arithmetic
        self.ones = torch.nn.Parameter(torch.ones(8))                                 # small: a constant
        self.drawn = torch.nn.Parameter(torch.empty(16).uniform_(-1, 1))            # small: torch's generator
        self.big_zeros = torch.nn.Parameter(torch.zeros(big))
        self.big_normal = torch.nn.Parameter(torch.empty(big))
        torch.nn.init.normal_(self.big_normal, std=0.5)                             # whole normal_: recorded
        self.big_normal.data[:3].fill_(7.0)                                          # then a fill of a range
        self.big_uniform = torch.nn.Parameter(torch.empty(big).uniform_())          # big draw: unknown
        self.big_scaled = torch.nn.Parameter(torch.ones(big) * 3)                   # big arithmetic: unknown
        self.truncated = torch.nn.Parameter(torch.zeros(8))
        torch.nn.init.trunc_normal_(self.truncated)                                  # a no-op on meta: unknown
        self.unset = torch.nn.Parameter(torch.empty(4))                              # never written: unknown


def test_build_recorder_follows_constructors():
    model, got = build_on_meta(_Constructed, seed=11)
    assert all(p.is_meta for p in model.parameters())
    assert set(got) == {"literal", "computed", "ones", "drawn", "big_zeros", "big_normal"}, sorted(got)
    assert isinstance(got["literal"], ConstructorValue)
    assert torch.equal(got["literal"].tensor, torch.tensor([2.5, -1.0]))
    assert torch.equal(got["computed"].tensor, torch.log(torch.exp(torch.tensor([0.8, 0.3])) - 1))
    big = SMALL_NUMEL + 1
    assert got["ones"] == ConstructorWrites([Fill(0, 8, 1.0)])
    assert got["big_zeros"] == ConstructorWrites([Fill(0, big, 0)])
    assert got["big_normal"] == ConstructorWrites([Normal(0, big, 0.0, 0.5), Fill(0, 3, 7.0)])
    # the small draw: torch's CPU generator, seeded for the build
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(11)
        expected = torch.empty(16).uniform_(-1, 1)
    assert torch.equal(got["drawn"].tensor, expected)
