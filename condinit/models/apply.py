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

import time
import warnings
from contextlib import nullcontext
from typing import Callable, Optional, Sequence, Union

import torch
from torch import nn

from condinit._validate import check_bool, check_choice, check_int
from condinit.init.functional import (K_STREAM, MAX_LAYER_INDEX, Q_STREAM, V_MODES, check_gains, check_seed_source,
                                      draw_seed, rect_identity_)
from condinit.init.plan import run_plan
from condinit.ops.orthogonalize.op import METHODS
from condinit.ops.random.op import stream_id
from condinit.init.spectrum import spectrum

from .families.mla import MLA_MODES, latent_attention
from .deferred import has_meta, materialize_
from .engines.deepspeed import check_partitioned, full_shapes, write_partitioned
from .find import (AttentionLayer, Discovery, Uncovered, UncoveredAttentionError, UncoveredAttentionWarning,
                   check_model, check_patterns, discover, discover_for_writing, find_attention, no_attention_error)
from .report import ApplyReport, BlockStats, uncovered_listing
from .writes import covered_tensors, plan_blocks

__all__ = ["apply", "find_attention", "discover", "AttentionLayer", "Uncovered", "Discovery",
           "UncoveredAttentionWarning", "UncoveredAttentionError", "V_MODES"]
# the writers' steps, importable from here too: discover_for_writing, check_patterns, no_attention_error
# (condinit.models.find), uncovered_listing (.report), plan_blocks and covered_tensors (.writes)


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
    check_model(model)
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
        _record_after(reports, layers, after, v_mode, v_gain)
    return ApplyReport(layers=reports, seed=seed, method=method, v_mode=v_mode, launches=launches, materialized=meta,
                       sharded=sharded, init_time_s=init_time, total_time_s=time.perf_counter() - t_start,
                       uncovered=list(uncovered), qk_gain=qk_gain, v_gain=v_gain)


def _record_after(reports: list, layers: Sequence[AttentionLayer], after: dict, v_mode: str,
                  v_gain: float) -> None:
    """Fill each report's ``after``: Q/K from the spectra ``run_plan`` observed (``after``: (layer
    position, stream) -> [(first block id, Spectrum)]), V from the identity it wrote."""
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
    written = {f"{rep.name}.{p}": stats for rep in reports for p, stats in rep.after.items()}
    for rep in reports:       # a projection shared with an earlier layer holds what that layer's write left
        for p, first in rep.shared.items():
            rep.after[p] = written.get(first)


def _identity_blocks(v_mode: str, num_kv_heads: int, d: int, n: int, dtype: torch.dtype,
                     gain: float) -> torch.Tensor:
    """The V that :func:`apply` writes, as ``[num_kv_heads, d, n]`` head blocks of ``dtype`` (for
    the report: ``gain`` rounded as the weight stores it)."""
    w = rect_identity_(torch.empty(num_kv_heads * d, n, dtype=dtype), head_dim=d,
                       per_head=v_mode == "identity_per_head", gain=gain)
    return w.view(num_kv_heads, d, n)
