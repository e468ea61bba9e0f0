"""Built-in model presets for ``condinit init``, and building Hugging Face models from a config, on meta.

Presets are Hugging Face transformers configs (no download: the config is written out here):

==============  ===========================================================================
tiny-llama      Llama, 4 layers, D=256, 8 heads / 4 KV heads of 32, vocab 4096 (a few MB: quick start)
llama-1b        Llama-3.2-1B-shaped: 16 layers, D=2048, 32 heads / 8 KV heads of 64, MLP 8192,
                vocab 128256, tied embeddings
gpt2            GPT-2 small: 12 layers, D=768, 12 heads, vocab 50257 (``Conv1D c_attn``)
vit-b16         ViT-B/16: 12 layers, D=768, 12 heads, patch 16, 224 x 224
==============  ===========================================================================
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Optional

import torch

__all__ = ["Preset", "PRESETS", "build_model", "check_config_values", "load_config_dict", "model_class_for",
           "DTYPES"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Preset:
    family: str
    description: str
    config: dict = field(default_factory=dict)


PRESETS = {
    "tiny-llama": Preset("llama", "Llama, 4 layers, D=256, 8/4 heads of 32, vocab 4096", dict(
        model_type="llama", hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, head_dim=32, vocab_size=4096, max_position_embeddings=2048,
        tie_word_embeddings=True, architectures=["LlamaForCausalLM"])),
    "llama-1b": Preset("llama", "Llama-3.2-1B-shaped: 16 layers, D=2048, 32/8 heads of 64, vocab 128256", dict(
        model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5,
        tie_word_embeddings=True, architectures=["LlamaForCausalLM"])),
    "gpt2": Preset("gpt2", "GPT-2 small: 12 layers, D=768, 12 heads, vocab 50257", dict(
        model_type="gpt2", n_embd=768, n_layer=12, n_head=12, vocab_size=50257, n_positions=1024,
        architectures=["GPT2LMHeadModel"])),
    "vit-b16": Preset("vit", "ViT-B/16: 12 layers, D=768, 12 heads, patch 16, 224x224", dict(
        model_type="vit", hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
        patch_size=16, image_size=224, qkv_bias=True, architectures=["ViTModel"])),
}


def load_config_dict(path) -> dict:
    """Read a Hugging Face ``config.json`` into a dict (ValueError on unreadable / non-object JSON)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"config {path} does not exist or is not a file")
    try:
        with open(path, encoding="utf-8") as fh:
            cfg = json.load(fh)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"config {path} is not readable JSON: {exc}") from None
    if not isinstance(cfg, dict) or not isinstance(cfg.get("model_type"), str):
        raise ValueError(f"config {path} must be a JSON object with a 'model_type' (a Hugging Face config.json)")
    return cfg


def model_class_for(model_type: str, config) -> str:
    """``"AutoModelForCausalLM"`` when ``model_type`` is a decoder language model, else ``"AutoModel"``.

    A decoder LM: transformers has a causal-LM class for the type, the config is not an
    encoder-decoder (BART and T5 also have causal-LM heads: their decoder alone), and the type has no
    masked-LM class (BERT, RoBERTa and ELECTRA have causal-LM heads too, but are encoders).

    Examples:
        >>> model_class_for("llama", transformers.LlamaConfig())
        'AutoModelForCausalLM'
        >>> model_class_for("bert", transformers.BertConfig())
        'AutoModel'
    """
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_MASKED_LM_MAPPING_NAMES)

    if (model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not getattr(config, "is_encoder_decoder", False)
            and model_type not in MODEL_FOR_MASKED_LM_MAPPING_NAMES):
        return "AutoModelForCausalLM"
    return "AutoModel"


# Size fields of Hugging Face configs (the names of the common families): an int >= 1 when present
# (None where the config accepts it: derived from the others).
_SIZE_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "vocab_size", "max_position_embeddings", "n_embd", "n_layer", "n_head", "n_positions",
                "n_inner", "n_ctx", "d_model", "num_layers", "num_heads", "d_ff", "d_kv", "ffn_dim",
                "encoder_layers", "decoder_layers", "encoder_attention_heads", "decoder_attention_heads",
                "encoder_ffn_dim", "decoder_ffn_dim", "num_decoder_layers", "image_size", "patch_size",
                "num_channels", "embed_dim", "num_experts", "num_local_experts", "num_experts_per_tok",
                "moe_intermediate_size", "rotary_dim")
# (width, heads) field pairs: heads must divide the width unless the config gives head_dim
_HEAD_PAIRS = (("hidden_size", "num_attention_heads"), ("n_embd", "n_head"), ("d_model", "num_heads"),
               ("d_model", "encoder_attention_heads"), ("d_model", "decoder_attention_heads"))


def check_config_values(config: dict, source: str = "config") -> dict:
    """Check the size fields of a config dict before transformers sees it: each an int >= 1 (or
    None), the attention heads dividing the width (unless ``head_dim`` is given), the key/value
    heads dividing the heads. A bad value is a one-line ValueError / TypeError naming ``source``
    and the field.

    Examples:
        >>> check_config_values({"model_type": "llama", "hidden_size": 100, "num_attention_heads": 7})
        Traceback (most recent call last):
        ValueError: config: num_attention_heads (7) must divide hidden_size (100), or give head_dim
    """
    from condinit._validate import check_int

    for key in _SIZE_FIELDS:
        if key in config and config[key] is not None:
            v = config[key]
            if isinstance(v, str):
                raise TypeError(f"{source}: {key} must be an int, got the string {v!r}")
            check_int(f"{source}: {key}", v, min=1)
    if config.get("head_dim") is None:
        for width, heads in _HEAD_PAIRS:
            w, h = config.get(width), config.get(heads)
            if isinstance(w, int) and isinstance(h, int) and w % h:
                raise ValueError(f"{source}: {heads} ({h}) must divide {width} ({w}), or give head_dim")
    heads, kv = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if isinstance(heads, int) and isinstance(kv, int) and heads % kv:
        raise ValueError(f"{source}: num_key_value_heads ({kv}) must divide num_attention_heads ({heads})")
    return config


def _one_line(exc) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def build_model(preset: Optional[str] = None, config: Optional[dict] = None, *, dtype=torch.float32,
                device="meta", source: str = "config"):
    """Build a Hugging Face model from a preset name or a config dict, on ``device`` (default meta:
    nothing allocated). Returns ``(model, family)``.

    Any ``model_type`` that ``transformers.AutoConfig`` knows is accepted. The model class: the
    config's ``architectures[0]`` when transformers has it; else ``AutoModelForCausalLM`` when the
    config is a decoder language model (:func:`model_class_for`); else ``AutoModel`` (the bare
    encoder, encoder-decoder, vision or vision-language model, which holds every attention layer).

    Examples:
        >>> model, family = build_model("tiny-llama")                      # on meta
        >>> model, family = build_model(config={"model_type": "t5", "d_model": 64, "num_layers": 2})
    """
    if (preset is None) == (config is None):
        raise ValueError("give exactly one of preset and config")
    if preset is not None:
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
        config = dict(PRESETS[preset].config)
        family = PRESETS[preset].family
    else:
        config = dict(config)
        family = config.get("model_type")
    try:
        import transformers
        from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
    except ImportError as exc:
        raise ValueError(f"building a model needs Hugging Face transformers (pip install transformers): {exc}") from None
    check_config_values(config, source)
    model_type = config.pop("model_type", None)
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    if model_type not in CONFIG_MAPPING:
        import difflib
        known = list(CONFIG_MAPPING.keys())
        near = difflib.get_close_matches(str(model_type), known, n=3)
        raise ValueError(f"{source}: model_type {model_type!r} is not one this transformers "
                         f"({transformers.__version__}) knows" + (f"; did you mean {', '.join(near)}?" if near else
                                                                  f" ({len(known)} types, e.g. llama, qwen3, gpt2)"))
    try:
        cfg = AutoConfig.for_model(model_type, **config)
    except Exception as exc:   # transformers' and huggingface_hub's validation errors, as one line
        raise ValueError(f"{source}: cannot build a transformers config for model_type {model_type!r}: "
                         f"{_one_line(exc)}") from None
    archs = getattr(cfg, "architectures", None) or []
    cls = getattr(transformers, archs[0], None) if archs else None
    if cls is None or not hasattr(cls, "_from_config"):
        cls = AutoModelForCausalLM if model_class_for(model_type, cfg) == "AutoModelForCausalLM" else AutoModel
    try:
        with torch.device(device):
            model = cls.from_config(cfg) if cls in (AutoModel, AutoModelForCausalLM) else cls._from_config(cfg)
    except (ValueError, TypeError, RuntimeError, AttributeError, KeyError) as exc:   # the model's own checks
        raise ValueError(f"{source}: transformers cannot build {getattr(cls, '__name__', cls)} from it: "
                         f"{_one_line(exc)}") from None
    if dtype is not None:
        model = model.to(dtype)
    model.eval()
    return model, family
