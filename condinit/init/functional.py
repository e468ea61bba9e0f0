"""Conditioned initialization of attention weights (the paper's Algorithm 1, DESIGN.md section 2).

``W_Q`` and ``W_K``: every head's ``[head_dim, D]`` row block (``nn.Linear`` ``[out, in]`` layout)
gets Haar-distributed orthonormal rows; ``W_V``: the rectangular identity; biases: zero. No gain:
every singular value is exactly 1 (entries ~ 1/sqrt(D)).

Randomness is counter based (:mod:`condinit.init.random`): block ``g`` of stream ``s`` is
``orthogonalize(block_randn(seed, s, [g], shape))`` and depends on nothing else. Q blocks of layer
``L``, head ``h`` use stream ``stream_id("q")`` and block id ``L * 2**32 + h``; K blocks
``stream_id("k")`` and the same ``L * 2**32 + h`` (layer in the counter's high word, head in the
low word: distinct for any mix of head counts across layers). Initializing layers one by one, all at once, in
chunks or sharded (:func:`conditioned_blocks` on the blocks a rank owns) gives bit-identical weights
(for a given device type and memory budget).

All same-shaped blocks of all layers are stacked and processed in fixed-size chunks: one batched
generate + orthogonalize per chunk, each chunk's result written once (fp32 compute, rounded once
into the weight's dtype) into the weights' own memory.

Meta tensors: like ``torch.nn.init``, initializing a meta tensor is a no-op (arguments are still
validated). Bad input raises ``TypeError``/``ValueError`` naming the argument before anything is
written.
"""
from __future__ import annotations

import numbers
import operator
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from condinit.init.orthogonalize import _check_floating, check_method, resolve_method, run_chunks

__all__ = ["semi_orthogonal_", "rect_identity_", "conditioned_init_", "conditioned_init_layers_",
           "conditioned_blocks", "Q_STREAM", "K_STREAM"]

Q_STREAM = "q"
K_STREAM = "k"
V_MODES = ("identity", "identity_per_head")

# Head h of layer L is block L * LAYER_STRIDE + h of its stream (Q or K): the layer sits in the high
# 32 bits of Philox's block counter, the head in the low 32, so blocks never collide across layers,
# whatever their head counts.
LAYER_STRIDE = 1 << 32


def _random():
    from condinit.init import random as _r  # sibling module, imported on first use
    return _r


# ---------------------------------------------------------------------------------------------------
# validation helpers

def _check_weight(w, name: str, *, min_dim: int = 2, max_dim: Optional[int] = None) -> torch.Tensor:
    _check_floating(w, name)
    if w.dim() < min_dim or (max_dim is not None and w.dim() > max_dim):
        want = f"{min_dim}" if max_dim == min_dim else f">= {min_dim}"
        raise ValueError(f"{name} must have {want} dims, got shape {tuple(w.shape)}")
    if any(s == 0 for s in w.shape):
        raise ValueError(f"{name} must not have a zero-size dim, got shape {tuple(w.shape)}")
    return w


def _check_pos_int(v, name: str, *, allow_none=False) -> Optional[int]:
    if v is None and allow_none:
        return None
    if isinstance(v, bool):
        raise TypeError(f"{name} must be a positive int, got a bool")
    try:
        v = operator.index(v)
    except TypeError:
        raise TypeError(f"{name} must be a positive int, got {type(v).__name__}") from None
    if v < 1:
        raise ValueError(f"{name} must be a positive int, got {v}")
    return v


def _check_index(v, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or int(v) < 0:
        raise TypeError(f"{name} must be ints >= 0, got {v!r}")
    return int(v)


def _check_head_dim(head_dim, rows: int, name: str) -> int:
    if head_dim is None:
        return rows
    head_dim = _check_pos_int(head_dim, "head_dim")
    if rows % head_dim:
        raise ValueError(f"head_dim={head_dim} must divide the rows of {name} ({rows})")
    return head_dim


def _stream(stream, default: str) -> int:
    if stream is None:
        return _random().stream_id(default)
    if isinstance(stream, str):
        return _random().stream_id(stream)
    if isinstance(stream, bool) or not isinstance(stream, numbers.Integral) or not 0 <= int(stream) < 2 ** 32:
        raise TypeError(f"stream must be a str or an int in [0, 2**32), got {stream!r}")
    return int(stream)


def _rows_cols(w: torch.Tensor) -> tuple[int, int]:
    return w.shape[0], w[0].numel()


def _as_matrix(w: torch.Tensor) -> Optional[torch.Tensor]:
    """A 2-D view ``[rows, cols]`` of ``w`` (trailing dims flattened), or None if not viewable."""
    if w.dim() == 2:
        return w
    try:
        return w.view(w.shape[0], -1)
    except RuntimeError:
        return None


# ---------------------------------------------------------------------------------------------------
# the engine

@dataclass
class _Run:
    """Consecutive blocks of one stream written to one destination: blocks ``ids`` of stream
    ``stream``; ``dest`` [k, m, n] (wide orientation; a transposed view for tall blocks) or None."""
    stream: int
    ids: torch.Tensor
    dest: Optional[torch.Tensor]
    gain: float = 1.0


def _execute(seed: int, runs: Sequence[_Run], wide_shape, method: str, device, *, memory_budget=None,
             backend=None, rng_backend=None, collect: Optional[torch.Tensor] = None) -> None:
    """Generate + orthogonalize every block of ``runs`` (all of wide shape ``wide_shape``) in chunks
    and write each result to its run's ``dest`` (or into ``collect`` [total, m, n] fp32)."""
    m, n = wide_shape
    rnd = _random()
    offsets = [0]
    for r in runs:
        offsets.append(offsets[-1] + r.ids.numel())
    total = offsets[-1]
    if total == 0:
        return

    def segments(start, stop):
        # (run, first index in run, last index in run, first index in chunk)
        for i, r in enumerate(runs):
            lo, hi = max(start, offsets[i]), min(stop, offsets[i + 1])
            if lo < hi:
                yield r, lo - offsets[i], hi - offsets[i], lo - start

    def fill(start, stop, A):
        for r, a, b, c in segments(start, stop):
            rnd.block_randn(seed, r.stream, r.ids[a:b], (m, n), out=A[c:c + b - a], backend=rng_backend)

    def sink(start, stop, R):
        if collect is not None:
            collect[start:stop].copy_(R)
            return
        for r, a, b, c in segments(start, stop):
            src = R[c:c + b - a]
            if r.gain != 1.0:
                src = src * r.gain
            r.dest[a:b].copy_(src)

    def direct(start, stop):
        if collect is not None:
            return collect[start:stop]
        segs = list(segments(start, stop))
        if len(segs) != 1:
            return None
        r, a, b, _ = segs[0]
        d = r.dest[a:b]
        if r.gain == 1.0 and d.dtype == torch.float32 and d.is_contiguous():
            return d
        return None

    run_chunks(total, (m, n), method, device, fill, sink, memory_budget=memory_budget,
               backend=backend, direct=direct, breaks=offsets if collect is None else ())


def _ids(block_ids, device) -> torch.Tensor:
    if isinstance(block_ids, torch.Tensor):
        if block_ids.dtype != torch.int64 or block_ids.dim() != 1:
            raise TypeError(f"block_ids must be a 1-D int64 tensor, range or sequence of ints, got a "
                            f"{block_ids.dtype} tensor of shape {tuple(block_ids.shape)}")
        ids = block_ids
    elif isinstance(block_ids, range):
        ids = torch.arange(block_ids.start, block_ids.stop, block_ids.step, dtype=torch.int64)
    else:
        try:
            ids = torch.tensor([operator.index(v) for v in block_ids], dtype=torch.int64)
        except TypeError:
            raise TypeError(f"block_ids must be a 1-D int64 tensor, range or sequence of ints, got "
                            f"{type(block_ids).__name__}") from None
    if ids.numel() and bool((ids < 0).any()):
        raise ValueError("block_ids must be >= 0")
    return ids.to(device)


@torch.no_grad()
def conditioned_blocks(seed: int, stream, block_ids, block_shape: tuple[int, int], method: str = "auto",
                       device=None, *, rows: Optional[slice] = None, cols: Optional[slice] = None,
                       memory_budget: Optional[int] = None, backend: Optional[str] = None) -> torch.Tensor:
    """The orthonormalized Gaussian blocks ``block_ids`` of ``stream``: float32 ``[len, m, n]``.

    Block ``g`` is ``orthogonalize(block_randn(seed, stream, [g], (min, max)))`` (transposed when
    ``m > n``) and does not depend on which other blocks are asked for: a sharded caller asks for
    the blocks it owns and gets exactly the bits a single-device initialization writes there.
    ``rows`` / ``cols`` slice every block (a rank that owns part of a block still computes all of
    it: orthonormality couples its rows).

    Args:
        seed: 64-bit seed (:func:`condinit.init.random.seed_from`).
        stream: int stream id or a name (hashed with ``stream_id``), e.g. ``"q"``.
        block_ids: 1-D int64 tensor, range or sequence of ints >= 0.
        block_shape: ``(m, n)``: orthonormal rows if ``m <= n``, else orthonormal columns.
        method: see :func:`condinit.init.orthogonalize.orthogonalize`.
        device: where to compute (default CPU).
    """
    m, n = (_check_pos_int(v, "block_shape") for v in block_shape)
    check_method(method)
    device = torch.device(device) if device is not None else torch.device("cpu")
    stream = _stream(stream, "default")
    ids = _ids(block_ids, device)
    tall = m > n
    wm, wn = (n, m) if tall else (m, n)
    res = torch.empty((ids.numel(), wm, wn), dtype=torch.float32, device=device)
    if device.type != "meta" and ids.numel():
        _execute(seed, [_Run(stream, ids, None)], (wm, wn), resolve_method(wm, wn, method), device,
                 memory_budget=memory_budget, backend=backend, collect=res)
    if tall:
        res = res.transpose(1, 2)
    if rows is not None or cols is not None:
        res = res[:, rows if rows is not None else slice(None), cols if cols is not None else slice(None)]
    return res if not tall else res.contiguous()


# ---------------------------------------------------------------------------------------------------
# public init functions

@torch.no_grad()
def semi_orthogonal_(weight: torch.Tensor, *, head_dim: Optional[int] = None, gain: float = 1.0,
                     generator: Optional[torch.Generator] = None, seed: Optional[int] = None,
                     stream=None, method: str = "auto") -> torch.Tensor:
    """Fill ``weight`` in place with Haar-distributed semi-orthogonal blocks, times ``gain``.

    ``weight`` is read as ``[rows, cols]`` (trailing dims flattened, like ``nn.init.orthogonal_``).
    With ``head_dim``, every head's ``[head_dim, cols]`` row block gets orthonormal rows (orthonormal
    columns if ``head_dim > cols``); without, the whole matrix does. Block ``h`` is block id ``h`` of
    ``stream`` (an int, a name hashed by ``stream_id``, default ``"semi_orthogonal"``) under ``seed``
    (default: drawn from ``generator`` / torch's default generator, so ``torch.manual_seed``
    controls it). Returns ``weight``.
    """
    _check_weight(weight, "weight")
    rows, cols = _rows_cols(weight)
    hd = _check_head_dim(head_dim, rows, "weight")
    if isinstance(gain, bool) or not isinstance(gain, numbers.Real) or not gain > 0 or gain != gain \
            or gain == float("inf"):
        raise ValueError(f"gain must be a finite number > 0, got {gain!r}")
    check_method(method)
    stream = _stream(stream, "semi_orthogonal")
    if weight.device.type == "meta":
        return weight
    seed = _random().seed_from(generator, seed)
    H = rows // hd
    mat = _as_matrix(weight)
    target = mat if mat is not None else torch.empty((rows, cols), dtype=weight.dtype, device=weight.device)
    blocks = target.unflatten(0, (H, hd))            # [H, hd, cols], a view of target
    tall = hd > cols
    dest = blocks.transpose(1, 2) if tall else blocks
    wide = (cols, hd) if tall else (hd, cols)
    with torch.no_grad():
        _execute(seed, [_Run(stream, torch.arange(H, device=weight.device), dest, float(gain))], wide,
                 resolve_method(*wide, method), weight.device)
        if mat is None:
            weight.copy_(target.view(weight.shape))
    return weight


@torch.no_grad()
def rect_identity_(weight: torch.Tensor, *, head_dim: Optional[int] = None, per_head: bool = False) -> torch.Tensor:
    """Fill ``weight`` ``[rows, cols]`` in place with the rectangular identity.

    Default: ones on the main diagonal of the whole matrix (``W[i, i] = 1``; head ``h`` of a V
    projection passes coordinates ``h*head_dim ...`` through). ``per_head=True`` (needs
    ``head_dim``): every head's ``[head_dim, cols]`` block is ``I`` (the paper's literal reading:
    every head sees the same first ``head_dim`` coordinates). Returns ``weight``.
    """
    _check_weight(weight, "weight")
    rows, cols = _rows_cols(weight)
    if not isinstance(per_head, bool):
        raise TypeError(f"per_head must be a bool, got {type(per_head).__name__}")
    if per_head and head_dim is None:
        raise ValueError("per_head=True needs head_dim")
    hd = _check_head_dim(head_dim, rows, "weight")
    if weight.device.type == "meta":
        return weight
    mat = _as_matrix(weight)
    target = mat if mat is not None else torch.empty((rows, cols), dtype=weight.dtype, device=weight.device)
    with torch.no_grad():
        target.zero_()
        if per_head:
            target.unflatten(0, (rows // hd, hd)).diagonal(dim1=1, dim2=2).fill_(1)
        else:
            target.diagonal().fill_(1)
        if mat is None:
            weight.copy_(target.view(weight.shape))
    return weight


def _get(layer, i: int, key: str, pos: int):
    if isinstance(layer, dict):
        unknown = set(layer) - {"q", "k", "v", "q_bias", "k_bias", "v_bias"}
        if unknown:
            raise ValueError(f"layers[{i}] has unknown keys {sorted(unknown)}; expected q, k, v, "
                             f"q_bias, k_bias, v_bias")
        return layer.get(key)
    if isinstance(layer, (tuple, list)):
        if len(layer) not in (3, 6):
            raise ValueError(f"layers[{i}] must be (q, k, v) or (q, k, v, q_bias, k_bias, v_bias), "
                             f"got a sequence of {len(layer)}")
        return layer[pos] if pos < len(layer) else None
    raise TypeError(f"layers[{i}] must be a dict or a tuple, got {type(layer).__name__}")


@torch.no_grad()
def conditioned_init_layers_(layers: Sequence[Union[dict, tuple]], *, num_heads: int,
                             num_kv_heads: Optional[int] = None, seed: Optional[int] = None,
                             generator: Optional[torch.Generator] = None,
                             layer_indices: Optional[Sequence[int]] = None, v_mode: str = "identity",
                             method: str = "auto", memory_budget: Optional[int] = None,
                             backend: Optional[str] = None) -> None:
    """Conditioned initialization of many attention layers in one batched pass.

    ``layers``: one entry per layer, a dict with keys ``q, k, v`` (and optional ``q_bias, k_bias,
    v_bias``) or a tuple ``(q, k, v[, q_bias, k_bias, v_bias])``; any entry may be None (skipped).
    Weights are ``nn.Linear`` ``[out, in]``: ``q`` is ``[num_heads * d, D]``, ``k`` is
    ``[num_kv_heads * d, D]``, ``v`` any 2-D (``[num_kv_heads * d, D]`` for ``identity_per_head``).

    Q head ``h`` of layer ``L = layer_indices[i]`` (default ``i``) gets block
    ``L * 2**32 + h`` of stream ``stream_id("q")``; K head ``h`` block ``L * 2**32 + h``
    of ``stream_id("k")``, so calls per layer, all at once or in chunks give bit-identical weights
    for the same ``seed`` (default: one draw from ``generator`` / torch's default generator per
    call). V: :func:`rect_identity_` (``v_mode="identity"``: whole matrix, the default;
    ``"identity_per_head"``: each head's block). Biases are zeroed.

    ``memory_budget``: bytes of fp32 scratch per chunk buffer (default 16 MiB on CPU, 1 GiB on GPU;
    two or three such buffers are used). ``method``/``backend``: of :func:`orthogonalize`.
    """
    if isinstance(layers, (dict, torch.Tensor)) or not hasattr(layers, "__len__"):
        raise TypeError(f"layers must be a sequence of dicts or tuples, got {type(layers).__name__}")
    num_heads = _check_pos_int(num_heads, "num_heads")
    num_kv_heads = _check_pos_int(num_kv_heads, "num_kv_heads", allow_none=True) or num_heads
    if num_heads % num_kv_heads:
        raise ValueError(f"num_kv_heads={num_kv_heads} must divide num_heads={num_heads}")
    if v_mode not in V_MODES:
        raise ValueError(f"v_mode must be one of {V_MODES}, got {v_mode!r}")
    check_method(method)
    if layer_indices is None:
        layer_indices = list(range(len(layers)))
    else:
        layer_indices = [_check_index(L, "layer_indices entries") for L in layer_indices]
        if len(layer_indices) != len(layers):
            raise ValueError(f"layer_indices must have one entry per layer ({len(layers)}), got {len(layer_indices)}")
    if memory_budget is not None:
        _check_pos_int(memory_budget, "memory_budget")

    # -- validate everything before the first write
    plan = []  # (L, q, k, v, biases)
    for i, layer in enumerate(layers):
        q, k, v = (_get(layer, i, key, pos) for pos, key in enumerate(("q", "k", "v")))
        biases = [_get(layer, i, key, pos + 3) for pos, key in enumerate(("q_bias", "k_bias", "v_bias"))]
        d = None
        D = None
        for name, w, heads in (("q", q, num_heads), ("k", k, num_kv_heads)):
            if w is None:
                continue
            _check_weight(w, f"layers[{i}].{name}", min_dim=2, max_dim=2)
            if w.shape[0] % heads:
                raise ValueError(f"layers[{i}].{name} has {w.shape[0]} rows, not a multiple of "
                                 f"{'num_heads' if name == 'q' else 'num_kv_heads'}={heads}")
            hd = w.shape[0] // heads
            if d is not None and hd != d:
                raise ValueError(f"layers[{i}]: q and k head dims differ ({d} vs {hd})")
            if D is not None and w.shape[1] != D:
                raise ValueError(f"layers[{i}]: q and k in-features differ ({D} vs {w.shape[1]})")
            d, D = hd, w.shape[1]
        if v is not None:
            _check_weight(v, f"layers[{i}].v", min_dim=2, max_dim=2)
            if v_mode == "identity_per_head" and v.shape[0] % num_kv_heads:
                raise ValueError(f"layers[{i}].v has {v.shape[0]} rows, not a multiple of "
                                 f"num_kv_heads={num_kv_heads} (v_mode='identity_per_head')")
        for name, b, w in zip(("q_bias", "k_bias", "v_bias"), biases, (q, k, v)):
            if b is None:
                continue
            _check_weight(b, f"layers[{i}].{name}", min_dim=1, max_dim=1)
            if w is not None and b.shape[0] != w.shape[0]:
                raise ValueError(f"layers[{i}].{name} has {b.shape[0]} entries, expected {w.shape[0]}")
        plan.append((layer_indices[i], q, k, v, biases))

    seed = _random().seed_from(generator, seed)
    sq, sk = _random().stream_id(Q_STREAM), _random().stream_id(K_STREAM)
    groups: dict = {}  # (device, wide shape) -> runs
    with torch.no_grad():
        for L, q, k, v, biases in plan:
            for w, heads, stream in ((q, num_heads, sq), (k, num_kv_heads, sk)):
                if w is None or w.device.type == "meta":
                    continue
                hd, D = w.shape[0] // heads, w.shape[1]
                blocks = w.unflatten(0, (heads, hd))
                tall = hd > D
                wide = (D, hd) if tall else (hd, D)
                ids = torch.arange(L * LAYER_STRIDE, L * LAYER_STRIDE + heads, dtype=torch.int64, device=w.device)
                groups.setdefault((w.device, wide), []).append(
                    _Run(stream, ids, blocks.transpose(1, 2) if tall else blocks))
            if v is not None and v.device.type != "meta":
                hd_v = v.shape[0] // num_kv_heads if v_mode == "identity_per_head" else None
                rect_identity_(v, head_dim=hd_v, per_head=v_mode == "identity_per_head")
            for b in biases:
                if b is not None and b.device.type != "meta":
                    b.zero_()
        for (device, wide), runs in groups.items():
            _execute(seed, runs, wide, resolve_method(*wide, method), device,
                     memory_budget=memory_budget, backend=backend)


@torch.no_grad()
def conditioned_init_(q_weight: torch.Tensor, k_weight: torch.Tensor, v_weight: torch.Tensor, *,
                      num_heads: int, num_kv_heads: Optional[int] = None,
                      q_bias: Optional[torch.Tensor] = None, k_bias: Optional[torch.Tensor] = None,
                      v_bias: Optional[torch.Tensor] = None, seed: Optional[int] = None,
                      generator: Optional[torch.Generator] = None, layer_index: int = 0,
                      v_mode: str = "identity", method: str = "auto",
                      memory_budget: Optional[int] = None, backend: Optional[str] = None) -> None:
    """Conditioned initialization of one attention layer (see :func:`conditioned_init_layers_`):
    Q and K per-head Haar semi-orthogonal, V the rectangular identity, biases zero.

    ``layer_index`` selects the layer's random blocks, so calling this for every layer with the same
    ``seed`` equals one :func:`conditioned_init_layers_` call over all of them.
    """
    conditioned_init_layers_([{"q": q_weight, "k": k_weight, "v": v_weight, "q_bias": q_bias,
                               "k_bias": k_bias, "v_bias": v_bias}],
                             num_heads=num_heads, num_kv_heads=num_kv_heads, seed=seed,
                             generator=generator, layer_indices=[_check_index(layer_index, "layer_index")],
                             v_mode=v_mode,
                             method=method, memory_budget=memory_budget, backend=backend)
