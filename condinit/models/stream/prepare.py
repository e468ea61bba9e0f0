"""Before a streamed write: every argument checked, the model built (or taken) on the meta device,
its layers discovered, its tensors and their materializer set up; nothing written.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from condinit._util import tensor_bytes
from condinit._validate import check_bool, check_choice, check_int, check_seed
from condinit.init.functional import V_MODES, check_gains
from condinit.io.safetensors_format import DTYPE_NAMES
from condinit.ops.orthogonalize.op import METHODS

from ..apply import UncoveredAttentionWarning, check_patterns, discover_for_writing, uncovered_listing
from ..checkpoint import condinit_metadata
from ..report import ApplyReport, LayerReport
from .materialize import Conditioning, Materializer
from .recording import build_on_meta
from .shards import saved_state
from .streams import unit_seed
from .tuning import tuning
from .writer import BufferPool

__all__ = ["Settings", "Job", "prepare"]


@dataclass(frozen=True)
class Settings:
    """The arguments of a streamed write that decide its tensors and metadata (as
    :func:`condinit.models.stream.write_pretrained` takes them, unchecked)."""

    seed: int = 0
    method: str = "auto"
    v_mode: str = "identity"
    qk_gain: float = 1.0
    v_gain: float = 1.0
    dtype: Optional[torch.dtype] = None
    model_class: object = None
    include: object = None
    exclude: object = None
    strict: bool = False
    memory_budget: Optional[int] = None
    family: Optional[str] = None
    extra_metadata: Optional[dict] = None
    device: object = None


@dataclass
class Job:
    """A checked, planned write: the meta model, its saved tensors (``state``: ``{key: meta
    tensor}`` in checkpoint order), the materializer that computes them, the conditioning report,
    the whole ``condinit`` metadata entry (:func:`condinit.models.checkpoint.condinit_metadata`, a
    JSON object of every layer), the parameter count and the bytes of tensors."""

    model: nn.Module
    state: dict
    engine: Materializer
    report: ApplyReport
    metadata: dict
    num_parameters: int
    total_size: int
    device: torch.device


def _is_pretrained(obj) -> bool:
    from transformers import PreTrainedModel

    return isinstance(obj, PreTrainedModel)


def _build_meta_model(config, model_class, seed: int = 0):
    """A :class:`condinit.models.stream.recording.MetaBuild` of a meta-device model for a
    transformers config (``model_class``, or the config's ``architectures[0]``, or the Auto class
    :func:`condinit.models.presets.model_class_for` picks), torch's CPU generator seeded from
    ``seed`` meanwhile."""
    import transformers
    from transformers import AutoModel, AutoModelForCausalLM

    from ..presets import model_class_for

    cls = model_class
    if cls is None:
        archs = getattr(config, "architectures", None) or []
        cls = getattr(transformers, archs[0], None) if archs else None
        if cls is None or not hasattr(cls, "_from_config"):
            cls = AutoModelForCausalLM if model_class_for(config.model_type, config) == "AutoModelForCausalLM" \
                else AutoModel

    def build():
        if hasattr(cls, "from_config") and not hasattr(cls, "_from_config"):   # an Auto class
            return cls.from_config(config)
        return cls._from_config(config)

    try:
        return build_on_meta(build, unit_seed(seed, "\0build"))
    except Exception as exc:
        raise ValueError(f"config (model_type {getattr(config, 'model_type', None)!r}): transformers' "
                         f"{getattr(cls, '__name__', cls)} does not build a model from it ({type(exc).__name__}: "
                         f"{str(exc)[:300]}); name the model class to build in the config's \"architectures\"") \
            from exc


def _check_device(device) -> torch.device:
    try:
        device = torch.device("cpu" if device is None else device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be a torch device such as 'cpu' or 'cuda', got {device!r}") from None
    if device.type == "meta":
        raise ValueError("device must be a real device (cpu, cuda, ...), got meta")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device}: no CUDA device is available")
    return device


def prepare(model_or_config, s: Settings) -> Job:
    """Every check and the whole plan of a write of ``model_or_config`` with settings ``s``, nothing written."""
    from transformers import PretrainedConfig

    seed = check_seed("seed", s.seed)
    check_choice("method", s.method, METHODS)
    check_choice("v_mode", s.v_mode, V_MODES)
    dtype = s.dtype
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating torch.dtype or None, got {dtype!r}")
    inc, exc = check_patterns(s.include, "include"), check_patterns(s.exclude, "exclude")
    strict = check_bool("strict", s.strict)
    memory_budget = check_int("memory_budget", s.memory_budget, min=1, allow_none=True)
    if s.family is not None and not isinstance(s.family, str):
        raise TypeError(f"family must be a string or None, got {type(s.family).__name__}")
    if s.extra_metadata is not None and not isinstance(s.extra_metadata, dict):
        raise TypeError(f"extra_metadata must be a dict or None, got {type(s.extra_metadata).__name__}")
    device = _check_device(s.device)

    if isinstance(model_or_config, PretrainedConfig):
        config = model_or_config
        model, constructed = _build_meta_model(config, s.model_class, seed)
        if dtype is None:
            cfg_dtype = getattr(config, "dtype", None)
            if isinstance(cfg_dtype, str):
                cfg_dtype = getattr(torch, cfg_dtype, None)
            dtype = cfg_dtype if isinstance(cfg_dtype, torch.dtype) else torch.float32
    elif _is_pretrained(model_or_config):
        constructed = {}       # built elsewhere: what its constructors wrote is not known
        if s.model_class is not None:
            raise ValueError("model_class is only used with a config; a model was given")
        model = model_or_config
        tensors = list(model.parameters()) + [b for b in model.buffers() if b is not None]
        if not all(t.is_meta for t in tensors):
            raise ValueError("write_pretrained: the model must be entirely on the meta device (build it under "
                             "torch.device('meta')); to save a materialized model use model.save_pretrained")
    else:
        raise TypeError(f"model_or_config must be a transformers PretrainedConfig or a meta-device PreTrainedModel, "
                        f"got {type(model_or_config).__name__}")
    if dtype is not None:
        model = model.to(dtype)
    model.eval()

    found = discover_for_writing(model, 0, inc, exc, s.include, s.exclude, strict, s.v_mode)
    layers, uncovered = found.layers, found.uncovered
    qk_gain, v_gain = check_gains(s.qk_gain, s.v_gain, [p.weight.dtype for l in layers for p in (l.spec.q, l.spec.k)],
                                  [l.spec.v.weight.dtype for l in layers])
    state = saved_state(model)
    for k, t in state.items():
        if t.dtype not in DTYPE_NAMES:
            raise TypeError(f"{k}: dtype {t.dtype} cannot be stored in safetensors by write_pretrained")
    if memory_budget is None and device.type == "cpu":
        memory_budget = tuning().cpu_layer_budget
    conditioning = Conditioning(layers, s.method, s.v_mode, qk_gain, v_gain, memory_budget)
    engine = Materializer(model, state, seed, device, conditioning=conditioning, constructed=constructed,
                          pool=BufferPool() if device.type == "cpu" else None)
    if uncovered:
        warnings.warn(f"write_pretrained: {len(uncovered)} attention-like module(s) of {type(model).__name__} are "
                      f"not conditioned and keep the model's own init (report.uncovered lists them; strict=True "
                      f"makes this an error): {uncovered_listing(uncovered, 10)}", UncoveredAttentionWarning,
                      stacklevel=3)
    report = ApplyReport(layers=[LayerReport.of(l) for l in layers], seed=seed, method=s.method, v_mode=s.v_mode,
                         materialized=True, uncovered=list(uncovered), qk_gain=qk_gain, v_gain=v_gain)
    fam = s.family if s.family is not None else getattr(model.config, "model_type", None)
    metadata = condinit_metadata(model, layers, report, fam, extra=s.extra_metadata)
    num_parameters = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    total_size = sum(tensor_bytes(t) for t in state.values())
    return Job(model=model, state=state, engine=engine, report=report, metadata=metadata,
               num_parameters=num_parameters, total_size=total_size, device=device)
