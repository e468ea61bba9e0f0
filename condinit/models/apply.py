"""``condinit.apply``: conditioned initialization of every attention layer of a model.

For each attention module that an adapter or its structure describes
(:func:`condinit.models.describe`), the paper's
Algorithm 1 (``docs/design.md``, "The method"): per head, ``W_Q`` and ``W_K`` get independent
Haar-random semi-orthogonal ``[head_dim, in]`` row blocks (orthonormal rows, every singular value
1), ``W_V`` the rectangular identity over the whole ``[H_kv * head_dim, in]`` matrix
(``v_mode="identity"``; or ``I_{d x in}`` in every head block with ``"identity_per_head"``), Q/K/V
biases zero. ``qk_gain`` / ``v_gain`` (default 1, the paper's method) scale Q/K and V. Every other
parameter is left bitwise alone.

**Layer index.** Attention modules are numbered in the order ``model.named_modules()`` yields them
(a module inside a matched attention module is not visited again), plus ``layer_offset``. The index
picks the random blocks: head ``h`` of layer ``L``'s Q is block ``L * 2**32 + h`` of stream
``stream_id("q")``, K block ``L * 2**32 + h`` of ``stream_id("k")`` (the numbering of
:func:`condinit.init.conditioned_init_`). ``include`` / ``exclude`` (``fnmatch`` patterns on module
names) select layers *after* numbering, so initializing a model in pieces, or only some layers,
gives the same weights as one call on the whole model.

**Execution.** :func:`apply` validates its arguments, then describes every write as a
:class:`condinit.init.plan.InitPlan` (the local region of each Q/K/V projection and bias) and
runs it with :func:`condinit.init.plan.run_plan`, the executor behind
:func:`condinit.init.conditioned_init_layers_`: same-shaped Q and K blocks of all selected layers
are generated and orthogonalized together, in chunks of ``memory_budget`` bytes of float32, and
each result is written once (rounded to the storage dtype) into the weights. The budget bounds the
extra memory, whatever the model size.

**Meta models** (every parameter on ``torch.device("meta")``): materialized on ``device`` with the
model's own init for everything but the Q/K/V weights and biases being conditioned (see
:mod:`condinit.models.deferred`), then conditioned as above; no second full-size copy is ever held.

**Sharded models** (DTensor parameters, e.g. after FSDP2 ``fully_shard``): each rank fills its own
shard, generating only the blocks its rows touch, with no communication (see
:mod:`condinit.models.sharded`); the result equals a single-process apply bit for bit.

**ZeRO-3 partitioned models** (built under ``deepspeed.zero.Init``): discovered from the
parameters' full shapes, then written one gathered attention layer at a time by the first rank,
which DeepSpeed broadcasts and re-partitions (see :mod:`condinit.models.engines.deepspeed`).

**Nothing is skipped silently.** :func:`discover` also lists the attention-like modules it cannot
condition (refused with a reason, a class name that says attention without readable projections,
a second set of Q/K/V the layer leaves out): :func:`apply` warns about them
(:class:`UncoveredAttentionWarning`), lists them in ``report.uncovered`` and in ``print(report)``,
and with ``strict=True`` raises :class:`UncoveredAttentionError` before anything is written.

No attention layer found (or none left after include/exclude): ``ValueError`` (an
:class:`UncoveredAttentionError` listing the attention-like modules when there are some).
"""
from __future__ import annotations

import fnmatch
import time
import warnings
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Callable, Optional, Sequence, Union

import torch
from torch import nn

from condinit._validate import check_bool, check_choice, check_int
from condinit.init.functional import (K_STREAM, LAYER_STRIDE, MAX_LAYER_INDEX, Q_STREAM, V_MODES,
                                      check_gains, check_seed_source, draw_seed, rect_identity_)
from condinit.init.plan import InitPlan, run_plan
from condinit.ops.orthogonalize.op import METHODS
from condinit.ops.random.op import stream_id
from condinit.init.spectrum import spectrum

from .discovery import looks_like_attention, why_not_recognised
from .families.mla import MLA_MODES, latent_attention
from .registry import describe
from .spec import AttentionSpec, Projection, UnsupportedAttention
from .deferred import has_meta, materialize_
from .engines.deepspeed import check_partitioned, full_shapes, write_partitioned
from .report import ApplyReport, BlockStats, LayerReport, uncovered_listing
from .sharded import local_boxes, overlap

__all__ = ["apply", "find_attention", "discover", "AttentionLayer", "Uncovered", "Discovery",
           "UncoveredAttentionWarning", "UncoveredAttentionError", "V_MODES"]


# ------------------------------------------------------------------------------------------------
# discovery

class UncoveredAttentionWarning(UserWarning):
    """:func:`apply` left attention-like modules unconditioned (listed in ``report.uncovered``)."""


class UncoveredAttentionError(ValueError):
    """``apply(..., strict=True)`` found attention-like modules it cannot condition; nothing was written."""


@dataclass
class AttentionLayer:
    """One attention module found in a model: its layer index, qualified name, adapter and spec
    (``cross``: Q reads the decoder's states, K and V the encoder's). The spec is bound to the
    module (:meth:`AttentionSpec.bound_to`): it reads the module's tensors as they are at each use,
    also after they are materialized or swapped."""

    index: int
    name: str
    module: nn.Module
    adapter: str
    spec: AttentionSpec
    cross: bool = False

    def live(self) -> "AttentionLayer":
        """This layer with a spec that reads the module's current tensors: itself when its spec is
        bound to the module, else the module described again (an adapter that returned tensors the
        module holds under no parameter or buffer name)."""
        if self.spec.is_bound:
            return self
        hit = describe(self.module)
        if hit is None:
            raise ValueError(f"{self.name}: the layer is no longer recognised once materialized")
        return replace(self, adapter=hit.adapter, spec=hit.spec)


@dataclass(frozen=True)
class Uncovered:
    """An attention-like module that :func:`apply` does not condition, and why."""

    name: str
    cls: str
    reason: str

    def __str__(self):
        return f"{self.name or '(root)'} ({self.cls}): {self.reason}"


@dataclass
class Discovery:
    """What :func:`discover` found: the attention layers (after include/exclude) and the
    attention-like modules left out (``uncovered``), both in ``named_modules`` order."""

    layers: list
    uncovered: list


def find_attention(model: nn.Module, *, layer_offset: int = 0, include=None, exclude=None) -> list[AttentionLayer]:
    """Every attention module of ``model`` that condinit can condition, numbered as documented in
    this module (:func:`discover` also lists what it cannot).

    ``include`` / ``exclude``: a pattern or a list of ``fnmatch`` patterns on module names (``""`` is
    the root), applied after numbering.

    Examples:
        >>> model = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(64, 4), num_layers=2)
        >>> [(l.index, l.name, l.spec.num_heads) for l in find_attention(model)]
        [(0, 'layers.0.self_attn', 4), (1, 'layers.1.self_attn', 4)]
        >>> [l.index for l in find_attention(model, include="layers.1.*")]
        [1]
    """
    return discover(model, layer_offset=layer_offset, include=include, exclude=exclude).layers


def discover(model: nn.Module, *, layer_offset: int = 0, include=None, exclude=None) -> Discovery:
    """The attention layers of ``model`` and the attention-like modules that none covers.

    A module is a layer when an adapter or its structure describes it
    (:func:`condinit.models.describe`). It is *uncovered* when it is refused with a reason
    (multi-head latent attention, a fused projection whose layout its source does not confirm, no
    head count), when it holds a second set of Q/K/V projections that the layer leaves out, or when
    its class name says attention (:func:`condinit.models.discovery.looks_like_attention`) and no
    layer or refused module lies inside it. ``include`` / ``exclude`` select both lists.

    Examples:
        >>> found = discover(model)
        >>> [str(u) for u in found.uncovered]
        ['model.layers.0.self_attn (DeepseekV3Attention): multi-head latent attention ...']
    """
    _check_model(model)
    layer_offset = check_int("layer_offset", layer_offset, min=0, max=MAX_LAYER_INDEX)
    return _discover(model, layer_offset, check_patterns(include, "include"), check_patterns(exclude, "exclude"))


def _check_model(model) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")


def _class_name(mod) -> str:
    return type(mod).__name__


def _selected(name: str, inc: Optional[list], exc: Optional[list]) -> bool:
    return ((inc is None or any(fnmatch.fnmatchcase(name, p) for p in inc))
            and not (exc and any(fnmatch.fnmatchcase(name, p) for p in exc)))


_CROSS_NAMES = {"encoder_attn", "EncDecAttention", "crossattention", "cross_attn", "cross_attention",
                "multihead_attn", "encoder_attention", "src_attn"}


def _is_cross(name: str, mod: nn.Module) -> bool:
    return getattr(mod, "is_cross_attention", None) is True or bool(_CROSS_NAMES & set(name.split(".")))


def discover_for_writing(model: nn.Module, layer_offset: int, inc, exc, include, exclude,
                          strict: bool, v_mode: str) -> Discovery:
    """:func:`_discover`, plus the checks every writer makes before its first write: some
    attention found, nothing uncovered under ``strict``, floating-point projections, and a V that
    ``v_mode`` can write in every layer (a grouped convolution holds only block-diagonal entries)."""
    found = _discover(model, layer_offset, inc, exc)
    if not found.layers:
        raise no_attention_error(model, include, exclude, found.uncovered)
    if found.uncovered and strict:
        raise UncoveredAttentionError(
            f"strict: {len(found.uncovered)} attention-like module(s) of {type(model).__name__} cannot be "
            f"conditioned, nothing was written ({_WHAT_TO_DO}): {uncovered_listing(found.uncovered)}")
    for l in found.layers:
        for p, proj in l.spec.projections():
            if not proj.weight.is_floating_point():
                raise TypeError(f"{l.name}: {p} weight has dtype {proj.weight.dtype}, expected a floating dtype")
        why = l.spec.v_identity_problem(v_mode)
        if why is not None:
            raise ValueError(f"{l.name}: v_mode={v_mode!r} cannot be written: {why}")
    return found


def _discover(model: nn.Module, layer_offset: int, inc: Optional[list], exc: Optional[list]) -> Discovery:
    found, uncovered, pending = [], [], []
    claimed: set = set()       # names of described or refused modules and all their ancestors
    stop = None                # the last described or refused module: its inside is its own (pre-order walk)

    def claim(name):
        claimed.add(name)
        parts = name.split(".") if name else []
        for i in range(len(parts)):
            claimed.add(".".join(parts[:i]))

    for order, (name, mod) in enumerate(model.named_modules()):
        if stop is not None and (stop == "" or name.startswith(stop + ".")):
            continue
        selected = _selected(name, inc, exc)
        try:
            hit = describe(mod)
        except UnsupportedAttention as exc_info:
            stop = name
            claim(name)
            if selected:
                uncovered.append((order, Uncovered(name, _class_name(mod), str(exc_info))))
            continue
        except ValueError as exc_info:
            if not selected:   # an excluded module: its inconsistency is not this call's business
                stop = name
                continue
            raise ValueError(f"{name or '(root)'} ({_class_name(mod)}): {exc_info}") from None
        if hit is None:
            if looks_like_attention(mod):
                pending.append((order, name, mod))
            continue
        stop = name
        claim(name)
        found.append(AttentionLayer(layer_offset + len(found), name, mod, hit.adapter, hit.spec, _is_cross(name, mod)))
        if hit.partial and selected:
            uncovered.append((order, Uncovered(name, _class_name(mod), hit.partial)))
    for order, name, mod in reversed(pending):   # innermost first: a wrapper of a listed module is not listed again
        if name in claimed or not _selected(name, inc, exc):
            continue
        claim(name)
        uncovered.append((order, Uncovered(name, _class_name(mod), why_not_recognised(mod))))
    uncovered.sort(key=lambda ent: ent[0])
    return Discovery([l for l in found if _selected(l.name, inc, exc)], [u for _, u in uncovered])


def check_patterns(pats, what):
    if pats is None:
        return None
    if isinstance(pats, str):
        return [pats]
    pats = list(pats)
    if not all(isinstance(p, str) for p in pats):
        raise TypeError(f"{what} must be a pattern string or a list of them, got {pats!r}")
    return pats


_WHAT_TO_DO = ("describe them with condinit.models.register_adapter(TheirClass, lambda m: AttentionSpec.from_linears"
               "(...) or AttentionSpec.from_fused(..., layout=...)) (condinit init: --adapter module:function), or "
               "acknowledge them with exclude=[...]")


def no_attention_error(model, include, exclude, uncovered: Sequence[Uncovered] = ()):
    if include is not None or exclude is not None:
        return ValueError(f"no attention layer of {type(model).__name__} matches include={include!r} "
                          f"exclude={exclude!r}")
    if uncovered:
        return UncoveredAttentionError(f"no attention layer of {type(model).__name__} can be conditioned (to condition "
                                       f"them, {_WHAT_TO_DO}); attention-like modules found: "
                                       f"{uncovered_listing(uncovered, 20)}")
    return ValueError(f"no attention layer found in {type(model).__name__}: no submodule has a registered adapter or "
                      f"the projections condinit reads (q_proj/k_proj/v_proj, query/key/value, qkv, ...); add one with "
                      f"condinit.models.register_adapter(YourAttention, lambda m: AttentionSpec.from_linears(...))")


# ------------------------------------------------------------------------------------------------
# local regions: each projection intersected with the part of its storage this process holds

@dataclass
class _Region:
    """The part of one projection's logical ``[rows, in]`` matrix that is local, and a view of it."""

    r_lo: int
    r_hi: int
    c_lo: int
    c_hi: int
    view: torch.Tensor  # [r_hi - r_lo, c_hi - c_lo], aliasing the (local) storage


def _local_regions(proj: Projection, name: str) -> list[_Region]:
    """The local part of each group of ``proj`` (rows in the projection's logical coordinates), per
    contiguous box of the local storage (one box unless a ``_StridedShard`` splits it)."""
    whole, boxes, _ = local_boxes(proj.weight, name, proj.partition)
    out = []
    for box in boxes:
        local, off = proj.local_matrix(whole[box.slices()], box.offset, name)
        for logical, lo, hi, col in proj.blocks():
            if proj.in_groups > 1:  # a grouped convolution (held whole): the block reads input columns col:
                out.append(_Region(logical, logical + hi - lo, col, col + local.shape[1], local[lo:hi]))
                continue
            if proj.transposed:  # storage [in, out_total]: logical rows are storage columns
                r = overlap(off[1], off[1] + local.shape[1], lo, hi)
                c = (off[0], off[0] + local.shape[0])
                if r is None or c[0] >= c[1]:
                    continue
                view = local[c[0] - off[0]:c[1] - off[0], r[0] - off[1]:r[1] - off[1]].t()
            else:
                r = overlap(off[0], off[0] + local.shape[0], lo, hi)
                c = (off[1], off[1] + local.shape[1])
                if r is None or c[0] >= c[1]:
                    continue
                view = local[r[0] - off[0]:r[1] - off[0], c[0] - off[1]:c[1] - off[1]]
            out.append(_Region(logical + r[0] - lo, logical + r[1] - lo, c[0], c[1], view))
    return out


def _one_head_groups(proj: Projection, head_dim: int) -> Optional[torch.Tensor]:
    """A ``[groups, head_dim, in]`` strided view of a plain (non-DTensor) projection whose groups
    are one head each (GPT-NeoX's ``[H, 3, d]``), or None."""
    if proj.groups == 1 or proj.group_rows != head_dim or proj.in_groups > 1 or proj.distributed:
        return None
    w = proj.matrix()
    row, col = (w.stride(1), w.stride(0)) if proj.transposed else (w.stride(0), w.stride(1))
    return w.as_strided((proj.groups, head_dim, proj.in_features), (proj.stride * row, row, col),
                        w.storage_offset() + proj.start * row)


def _local_biases(proj: Projection, name: str) -> list[torch.Tensor]:
    """The local part of each group of this projection's bias entries (empty: no bias, or none local)."""
    if proj.bias is None:
        return []
    whole, boxes, _ = local_boxes(proj.bias, name, proj.bias_partition)
    out = []
    for box in boxes:
        local, off = whole[box.slices()], box.offset
        for lo, hi in proj.bias_segments():
            s = overlap(off[0], off[0] + local.shape[0], lo, hi)
            if s is not None:
                out.append(local[s[0] - off[0]:s[1] - off[0]])
    return out


def covered_tensors(layers: Sequence[AttentionLayer]) -> list[torch.Tensor]:
    """Parameters that the Q/K/V weights and biases of ``layers`` overwrite entirely."""
    spans: dict[int, tuple[torch.Tensor, int, list]] = {}

    def add(t, size, lo, hi):
        ent = spans.setdefault(id(t), (t, size, []))
        ent[2].append((lo, hi))

    for l in layers:
        for _, p in l.spec.projections():
            for _, lo, hi in ([] if p.fixed else p.segments()):
                add(p.weight, p.storage_rows, lo, hi)
            for lo, hi in p.bias_segments():
                add(p.bias, p.bias.shape[0], lo, hi)
    out = []
    for t, size, iv in spans.values():
        at = 0
        for lo, hi in sorted(iv):
            if lo > at:
                break
            at = max(at, hi)
        if at >= size:
            out.append(t)
    return out


# ------------------------------------------------------------------------------------------------
# the public entry point

def apply(model: nn.Module, *, seed: Optional[int] = None, generator: Optional[torch.Generator] = None,
          method: str = "auto", v_mode: str = "identity", qk_gain: float = 1.0, v_gain: float = 1.0,
          include: Union[str, Sequence[str], None] = None,
          exclude: Union[str, Sequence[str], None] = None, report: bool = True, layer_offset: int = 0,
          device=None, memory_budget: Optional[int] = None, init_fn: Optional[Callable[[nn.Module], None]] = None,
          check_init: bool = True, progress: bool = False, strict: bool = False, mla: str = "refuse") -> ApplyReport:
    """Conditioned initialization of every attention layer of ``model``, in place (see module doc).

    Per layer: every head's ``W_Q`` and ``W_K`` block gets Haar-random orthonormal rows, ``W_V`` the
    rectangular identity, the Q/K/V biases zero; everything else (output projection, norms,
    QK-norm weights, MoE experts, embeddings) is left bit for bit. **Cross-attention**
    (encoder-decoder models: BART, T5, Whisper, ``nn.TransformerDecoderLayer``): ``W_Q`` reads the
    decoder's states and ``W_K`` / ``W_V`` the encoder's; each projection gets the same rule with
    its own input width (``in_features``), so Q is ``[H d, D_dec]`` semi-orthogonal per head and K,
    V ``[H_kv d, D_enc]``. Models made of several parts (vision-language models, encoder-decoders,
    attention pooling heads) get every attention layer of every part.

    Nothing is skipped silently: attention-like modules that no adapter or structure covers are
    listed in ``report.uncovered`` with the reason and in a :class:`UncoveredAttentionWarning`
    (see :func:`discover`); ``strict=True`` raises :class:`UncoveredAttentionError` instead, before
    anything is written. ``exclude`` acknowledges such modules.

    Args:
        model: any ``nn.Module``; attention submodules are found through registered adapters and
            by structure (:mod:`condinit.models.registry`).
        seed: ``0 <= seed < 2**64``; default None: one draw from ``generator``, or torch's default
            generator, as ``torch.nn.init`` does (so ``torch.manual_seed`` controls it). The report
            records the seed used.
        generator: a ``torch.Generator`` to draw the seed from (only without ``seed``).
        method: orthogonalization method ("auto", "householder", "cholqr2", "polar", "svd"; see
            :func:`condinit.ops.orthogonalize.op`).
        v_mode: ``"identity"`` (rectangular identity over the whole V matrix) or
            ``"identity_per_head"`` (``I_{d x in}`` in every head's rows).
        qk_gain: every Q and K head block is ``qk_gain`` times a semi-orthogonal block (all its
            singular values ``qk_gain``). Default 1, the paper's method.
        v_gain: ``W_V`` is ``v_gain`` times the rectangular identity. Default 1, the paper's method.
            Both gains: finite reals ``> 0`` (at most half the largest finite value of fp32 and of
            the projections' dtype), recorded in the report; the random blocks do not depend on them.
        include, exclude: ``fnmatch`` patterns on module names selecting layers (after numbering),
            and which uncovered modules are reported.
        report: measure singular values of every Q/K/V head block before (when the weights hold
            values: not for meta or sharded models) and after.
        layer_offset: added to every layer index (initialize a sub-module as part of a bigger model).
        device: where to materialize a meta model (default CPU). Only for meta models.
        memory_budget: bytes of fp32 scratch per chunk buffer (default 16 MiB on CPU, 1 GiB on GPU;
            two or three such buffers are used), as in :func:`condinit.init.conditioned_init_layers_`.
        init_fn: for meta models, ``init_fn(model)`` replaces the model's own init of the other
            parameters (see :mod:`condinit.models.deferred`).
        check_init: for meta models, check that the own init left no parameter uninitialized.
        progress: show a tqdm progress bar over the generated blocks.
        strict: raise when any attention-like module is left uncovered.
        mla: multi-head latent attention (DeepSeek-V2/V3): ``"refuse"`` (default: listed as
            uncovered) or ``"factors"``: its low-rank factors conditioned so that each head's map
            is semi-orthogonal up to the latent norm's per-token scale
            (:mod:`condinit.models.families.mla`).

    Returns:
        :class:`ApplyReport`.

    Raises:
        UncoveredAttentionError: ``strict=True`` and uncovered modules, or no layer can be
            conditioned but attention-like modules were found (a ``ValueError``).
        ValueError: no attention layer (after include/exclude), head counts that contradict the
            projections (naming the module), bad argument, partly-meta model.
        TypeError: a Q/K/V weight that is not floating point, a bad argument type.

    Examples:
        >>> model = transformers.AutoModelForCausalLM.from_config(config)
        >>> report = condinit.apply(model, seed=0)          # every attention layer, in place
        >>> print(report)                                   # per layer and projection: sigma, kappa
        >>> condinit.apply(model, seed=0, include="model.layers.0.*")   # the same bits for layer 0
        >>> condinit.apply(vlm, seed=0, strict=True)        # refuses if any attention is left out
        >>> condinit.apply(model, seed=0, v_gain=0.1)       # W_V = 0.1 I; Q/K as without it
        >>> with torch.device("meta"):
        ...     big = transformers.AutoModelForCausalLM.from_config(config)
        >>> condinit.apply(big, seed=0, device="cuda")       # materialized, then conditioned
    """
    t_start = time.perf_counter()
    _check_model(model)
    seed = check_seed_source(seed, generator)
    check_choice("method", method, METHODS)
    check_choice("v_mode", v_mode, V_MODES)
    inc, exc = check_patterns(include, "include"), check_patterns(exclude, "exclude")
    report = check_bool("report", report)
    layer_offset = check_int("layer_offset", layer_offset, min=0, max=MAX_LAYER_INDEX)
    memory_budget = check_int("memory_budget", memory_budget, min=1, allow_none=True)
    if init_fn is not None and not callable(init_fn):
        raise TypeError(f"init_fn must be a callable init_fn(model) or None, got {type(init_fn).__name__}")
    check_init = check_bool("check_init", check_init)
    progress = check_bool("progress", progress)
    strict = check_bool("strict", strict)
    mla = check_choice("mla", mla, MLA_MODES)

    zero3 = check_partitioned(model)   # DeepSpeed ZeRO-3: discovery reads the parameters' full shapes
    with latent_attention(mla), (full_shapes(model) if zero3 else nullcontext()):
        found = discover_for_writing(model, layer_offset, inc, exc, include, exclude, strict, v_mode)
    layers, uncovered = found.layers, found.uncovered
    # checked against the projections' dtypes (known on meta models too), before anything is written
    qk_gain, v_gain = check_gains(qk_gain, v_gain, [p.weight.dtype for l in layers for p in (l.spec.q, l.spec.k)],
                                  [l.spec.v.weight.dtype for l in layers])
    params = list(model.parameters())
    meta = has_meta(model)
    if meta:
        if not all(p.is_meta for p in params):
            raise ValueError("model is partly on the meta device: materialize it fully (or build all of it on meta) "
                             "before condinit.apply")
        if device is not None and torch.device(device).type == "meta":
            raise ValueError("device must be a real device (cpu, cuda, ...) to materialize the meta model on, "
                             "got meta")
    elif device is not None:
        raise ValueError(f"device={device!r} is only used to materialize a meta model; this model is already on "
                         f"{params[0].device if params else 'no device'} (move it with model.to(device) instead)")
    if uncovered:
        warnings.warn(f"condinit.apply: {len(uncovered)} attention-like module(s) of {type(model).__name__} are not "
                      f"conditioned and keep the model's own init (report.uncovered lists them; strict=True makes "
                      f"this an error): {uncovered_listing(uncovered, 10)}", UncoveredAttentionWarning, stacklevel=2)

    # drawn before the model's own init below, which draws from torch's generator too
    seed_drawn = seed is None
    seed = draw_seed(seed, generator)
    if zero3:
        return write_partitioned(layers, uncovered, seed=seed, seed_drawn=seed_drawn, method=method,
                                 v_mode=v_mode, qk_gain=qk_gain, v_gain=v_gain, report=report,
                                 memory_budget=memory_budget, progress=progress, mla=mla, t_start=t_start)
    init_time = 0.0
    if meta:
        t0 = time.perf_counter()
        materialize_(model, device, skip=covered_tensors(layers), init_fn=init_fn, check=check_init,
                     seed=seed)
        init_time = time.perf_counter() - t0
        layers = [l.live() for l in layers]     # the bound specs read the materialized tensors

    sharded = any(p.distributed for l in layers for _, p in l.spec.projections())
    with torch.no_grad():
        plan, reports = plan_blocks(layers, v_mode, measure_before=report and not meta and not sharded,
                              qk_gain=qk_gain, v_gain=v_gain)
        after: dict = {}   # (layer position, stream) -> [(first block id, Spectrum)]

        def observe(run, first, stop, blocks):
            stored = blocks if run.dest.dtype == torch.float32 else blocks.to(run.dest.dtype)
            after.setdefault((run.owner, run.stream), []).append((int(run.ids[first]), spectrum(stored)))

        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=plan.num_blocks, unit="block", desc="condinit", leave=False)
        try:
            launches, seconds = run_plan(plan, seed, method, memory_budget=memory_budget,
                                         observe=observe if report else None,
                                         on_chunk=bar.update if bar is not None else None)
        finally:
            if bar is not None:
                bar.close()
    for i, rep in enumerate(reports):
        rep.time_s = seconds.get(i, 0.0)
    if report:
        projection = {stream_id(Q_STREAM): "q", stream_id(K_STREAM): "k"}
        for (i, stream), parts in after.items():
            if layers[i].spec.layout == "latent":     # reported below, from the factors' products
                continue
            parts.sort(key=lambda part: part[0])
            smax, smin, cond = (torch.cat([part[1][j].reshape(-1) for part in parts]) for j in range(3))
            reports[i].after[projection[stream]] = BlockStats.from_heads(smax, smin, cond)
        v_stats: dict = {}
        for rep, l in zip(reports, layers):
            if l.spec.layout == "latent":     # each head's map from the input, the factors' products
                rep.after.update(l.spec.effective_stats())
                continue
            key = (l.spec.num_kv_heads, l.spec.head_dim, l.spec.v.in_features, l.spec.v.weight.dtype)
            if key not in v_stats:
                v_stats[key] = BlockStats.of(_identity_blocks(v_mode, *key, v_gain))
            rep.after["v"] = v_stats[key]
    return ApplyReport(layers=reports, seed=seed, method=method, v_mode=v_mode, launches=launches, materialized=meta,
                       sharded=sharded, init_time_s=init_time, total_time_s=time.perf_counter() - t_start,
                       uncovered=list(uncovered), qk_gain=qk_gain, v_gain=v_gain)


def plan_blocks(layers: Sequence[AttentionLayer], v_mode: str, *, measure_before: bool, qk_gain: float = 1.0,
          v_gain: float = 1.0):
    """The :class:`InitPlan` writing the local part of every layer's Q/K/V (Q/K times ``qk_gain``,
    V ``v_gain`` times the identity) and biases (owner: the layer's position in ``layers``), and
    one :class:`LayerReport` per layer (``before`` measured when asked). A projection in several
    groups (interleaved layouts) is planned group by group, each at its logical rows, so head ``h``
    is block ``h`` whatever the storage order."""
    plan, reports = InitPlan(), []
    sq, sk = stream_id(Q_STREAM), stream_id(K_STREAM)
    for i, l in enumerate(layers):
        s = l.spec
        rep = LayerReport.of(l)
        reports.append(rep)
        if s.layout == "latent":     # multi-head latent attention: its factors (condinit.init.factors)
            rep.before.update(s.effective_stats() if measure_before else dict.fromkeys("qkv"))
            s.plan_into(plan, l.index, i, v_mode=v_mode, qk_gain=qk_gain, v_gain=v_gain)
            continue
        for p, proj in s.projections():
            heads = s.num_heads if p == "q" else s.num_kv_heads
            rep.before[p] = BlockStats.of(proj.view().reshape(heads, s.head_dim, proj.in_features)) \
                if measure_before else None
            rep.after[p] = None
        for p, proj, stream in (("q", s.q, sq), ("k", s.k, sk)):
            if proj.fixed:            # a learned query: no projection, nothing to write
                continue
            heads = _one_head_groups(proj, s.head_dim)
            if heads is not None:     # one view of every head: one run, batched like a contiguous weight
                plan.add_heads(stream, l.index * LAYER_STRIDE, heads, s.head_dim, proj.in_features,
                               gain=qk_gain, owner=i)
                continue
            for reg in _local_regions(proj, f"{l.name}.{p}"):
                # a grouped convolution's head is semi-orthogonal in the block of input channels it reads
                n = proj.block_in_features
                plan.add_heads(stream, l.index * LAYER_STRIDE, reg.view, s.head_dim, n,
                               row_lo=reg.r_lo, col_lo=reg.c_lo % n, gain=qk_gain, owner=i)
        why = s.v_identity_problem(v_mode)
        if why is not None:
            raise ValueError(f"{l.name}: v_mode={v_mode!r} cannot be written: {why}")
        for reg in _local_regions(s.v, f"{l.name}.v"):
            plan.add_identity(reg.view, row_lo=reg.r_lo, col_lo=reg.c_lo,
                              head_dim=s.head_dim if v_mode == "identity_per_head" else None, gain=v_gain, owner=i)
        for p, proj in s.projections():
            for bias in _local_biases(proj, f"{l.name}.{p} bias"):
                plan.add_zero(bias, owner=i)
    return plan, reports


def _identity_blocks(v_mode: str, num_kv_heads: int, d: int, n: int, dtype: torch.dtype,
                     gain: float) -> torch.Tensor:
    """The V that :func:`apply` writes, as ``[num_kv_heads, d, n]`` head blocks of ``dtype`` (for
    the report: ``gain`` rounded as the weight stores it)."""
    w = rect_identity_(torch.empty(num_kv_heads * d, n, dtype=dtype), head_dim=d,
                       per_head=v_mode == "identity_per_head", gain=gain)
    return w.view(num_kv_heads, d, n)
