"""Conditioned initialization of attention weights: the paper's Algorithm 1 (``docs/design.md``,
"The method").

``W_Q`` and ``W_K``: every head's ``[head_dim, D]`` row block (``nn.Linear`` ``[out, in]`` layout)
gets Haar-distributed orthonormal rows, times ``qk_gain``; ``W_V``: the rectangular identity, times
``v_gain``; biases: zero. The default gains, 1, are the paper's method: every singular value is
exactly 1 (entries ~ 1/sqrt(D)); with gains, every Q/K head block's singular values are all
``qk_gain`` and V's are all ``v_gain``.

Randomness is counter based (``docs/design.md``, "Random streams"): block ``g`` of stream ``s`` is
the orthonormalized Gaussian block ``g`` of ``s`` and depends on nothing else. Head ``h`` of layer
``L`` is block ``L * 2**32 + h`` of stream ``stream_id("q")`` (Q) or ``stream_id("k")`` (K): the
layer sits in the high 32 bits of the block counter, the head in the low 32, so blocks never
collide, whatever the head counts. Initializing layers one by one, all at once, in chunks or
sharded gives bit-identical weights (for a given device type and memory budget).

Every public function validates its arguments (``condinit/_validate.py`` and the checks below), draws
the seed if none is given (``seed_from``, ``condinit/ops/random/op.py``), lists what it writes in an
:class:`~condinit.init.plan.InitPlan` and runs it with :func:`~condinit.init.plan.run_plan`, the
one executor (``condinit/init/plan.py``).

Meta tensors: like ``torch.nn.init``, initializing a meta tensor is a no-op (arguments are still
validated); a call whose destinations are partly meta, partly real is refused. Bad input raises
``TypeError``/``ValueError`` naming the argument before anything is written: every argument is
checked, the destinations must each have their own memory (no expanded weight, no two arguments
sharing elements), and every group's backends are chosen (``BackendUnavailableError`` when a forced
one cannot run it) before the first write.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from condinit import _backends
from condinit._validate import (check_bool, check_choice, check_disjoint, check_int, check_real, check_seed,
                                check_tensor)
from condinit.init.plan import BlockRun, InitPlan, rect_identity_region_, run_group, run_plan
from condinit.ops.orthogonalize.op import METHODS, resolve_method
from condinit.ops.random.op import seed_from, stream_id

__all__ = ["semi_orthogonal_", "rect_identity_", "conditioned_init_", "conditioned_init_layers_",
           "conditioned_blocks", "Q_STREAM", "K_STREAM", "V_MODES", "LAYER_STRIDE"]

Q_STREAM = "q"
K_STREAM = "k"
V_MODES = ("identity", "identity_per_head")

# Head h of layer L is block L * LAYER_STRIDE + h of its stream (Q or K): the layer sits in the high
# 32 bits of Philox's block counter, the head in the low 32, so blocks never collide across layers,
# whatever their head counts. Block ids are int64: layers below 2**31, at most 2**32 heads.
LAYER_STRIDE = 1 << 32
MAX_LAYER_INDEX = (1 << 31) - 1
MAX_HEADS = LAYER_STRIDE
STREAM_MAX = (1 << 32) - 1


# ---------------------------------------------------------------------------------------------------
# argument checks shared by the public functions (each public function calls them once)

def check_weight(w, name: str, *, dim: Optional[int] = None, min_dim: Optional[int] = None) -> torch.Tensor:
    check_tensor(name, w, floating=True, dim=dim, min_dim=min_dim)
    if any(s == 0 for s in w.shape):
        raise ValueError(f"{name} must not have a zero-size dim, got shape {tuple(w.shape)}")
    return w


def check_destinations(named) -> None:
    """The tensors one call writes (``(argument name, tensor or None)`` pairs): all on the meta
    device (the call is a no-op) or none, each with its own memory (:func:`check_disjoint`)."""
    named = [(n, t) for n, t in named if t is not None]
    meta = [n for n, t in named if t.device.type == "meta"]
    if meta and len(meta) != len(named):
        real = next((n, t.device) for n, t in named if t.device.type != "meta")
        raise ValueError(f"{meta[0]} is on the meta device but {real[0]} is on {real[1]}: either every "
                         f"destination is a meta tensor (nothing is written) or none is")
    check_disjoint(named)


def _check_backend(backend) -> Optional[str]:
    return check_choice("backend", backend, _backends.BACKENDS + ("auto",), allow_none=True)


def _check_gain(gain, dtypes: Sequence[torch.dtype], name: str = "gain") -> float:
    """``gain > 0`` whose results stay finite: an entry of an orthonormal row is at most 1 in
    magnitude (``1 + 2**-23`` after fp32 rounding), the product is formed in fp32 and rounded into
    each of ``dtypes`` (the destinations'), so ``gain`` is at most half the largest finite value of
    fp32 and of every one of ``dtypes``."""
    gain = check_real(name, gain, min=0.0, min_open=True)
    tightest = min([torch.float32, *dtypes], key=lambda d: torch.finfo(d).max)
    limit = torch.finfo(tightest).max / 2
    if gain > limit:
        raise ValueError(f"{name} must be at most {limit:.3g}, half the largest finite {str(tightest).replace('torch.', '')} "
                         f"(the scaled weights must stay finite), got {gain:g}")
    return gain


def check_gains(qk_gain, v_gain, qk_dtypes: Sequence[torch.dtype] = (),
                v_dtypes: Sequence[torch.dtype] = ()) -> tuple[float, float]:
    """``(qk_gain, v_gain)`` checked (:func:`_check_gain`) against the dtypes of the Q/K and V
    weights they scale. Shared with ``condinit.apply``."""
    return _check_gain(qk_gain, qk_dtypes, "qk_gain"), _check_gain(v_gain, v_dtypes, "v_gain")


def _check_head_dim(head_dim, rows: int, name: str) -> int:
    """``head_dim`` (default: all rows, one block) dividing the ``rows`` of ``name``."""
    head_dim = check_int("head_dim", head_dim, min=1, allow_none=True)
    if head_dim is None:
        return rows
    if rows % head_dim:
        raise ValueError(f"head_dim={head_dim} must divide the rows of {name} ({rows})")
    return head_dim


def _check_stream(stream, default: str) -> int:
    """A stream id in [0, 2**32): an int, or a name hashed with ``stream_id``."""
    if stream is None:
        return stream_id(default)
    if isinstance(stream, str):
        return stream_id(stream)
    return check_int("stream", stream, min=0, max=STREAM_MAX)


def check_seed_source(seed, generator) -> Optional[int]:
    """``seed`` (validated) or None when it is to be drawn from ``generator``. Shared with
    ``condinit.apply``, which takes the same ``seed`` / ``generator`` pair."""
    seed = check_seed("seed", seed, allow_none=True)
    if generator is not None:
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
        if seed is not None:
            raise ValueError("give either seed or generator, not both")
    return seed


def draw_seed(seed: Optional[int], generator: Optional[torch.Generator]) -> int:
    """``seed``, or one 64-bit draw from ``generator`` (torch's default generator when None), as
    ``torch.nn.init`` draws: ``torch.manual_seed`` controls it."""
    return seed if seed is not None else seed_from(generator)


def _check_heads(num_heads, num_kv_heads) -> tuple[int, int]:
    num_heads = check_int("num_heads", num_heads, min=1, max=MAX_HEADS)
    num_kv_heads = check_int("num_kv_heads", num_kv_heads, min=1, max=MAX_HEADS, allow_none=True)
    if num_kv_heads is None:
        num_kv_heads = num_heads
    if num_heads % num_kv_heads:
        raise ValueError(f"num_kv_heads={num_kv_heads} must divide num_heads={num_heads}")
    return num_heads, num_kv_heads


_LAYER_KEYS = ("q", "k", "v", "q_bias", "k_bias", "v_bias")


def _check_layer(tensors: dict, names: dict, num_heads: int, num_kv_heads: int, v_mode: str, where: str):
    """(q, k, v, [q_bias, k_bias, v_bias]) of one layer, every tensor checked; None entries skipped."""
    q, k, v = tensors["q"], tensors["k"], tensors["v"]
    d = D = None
    for key, w, heads, heads_name in (("q", q, num_heads, "num_heads"), ("k", k, num_kv_heads, "num_kv_heads")):
        if w is None:
            continue
        check_weight(w, names[key], dim=2)
        if w.shape[0] % heads:
            raise ValueError(f"{names[key]} has {w.shape[0]} rows, not a multiple of {heads_name}={heads}")
        hd = w.shape[0] // heads
        if d is not None and hd != d:
            raise ValueError(f"{where}: {names['q']} and {names['k']} head dims differ ({d} vs {hd})")
        if D is not None and w.shape[1] != D:
            raise ValueError(f"{where}: {names['q']} and {names['k']} in-features differ ({D} vs {w.shape[1]})")
        d, D = hd, w.shape[1]
    if v is not None:
        check_weight(v, names["v"], dim=2)
        if v_mode == "identity_per_head" and v.shape[0] % num_kv_heads:
            raise ValueError(f"{names['v']} has {v.shape[0]} rows, not a multiple of num_kv_heads={num_kv_heads} "
                             f"(v_mode='identity_per_head')")
    biases = []
    for key, w in (("q_bias", q), ("k_bias", k), ("v_bias", v)):
        b = tensors[key]
        if b is not None:
            check_weight(b, names[key], dim=1)
            if w is not None and b.shape[0] != w.shape[0]:
                raise ValueError(f"{names[key]} has {b.shape[0]} entries, expected {w.shape[0]}")
        biases.append(b)
    return q, k, v, biases


def _layer_entry(layer, i: int) -> dict:
    """``layers[i]`` (a dict or a tuple) as a dict with every key of ``_LAYER_KEYS``."""
    if isinstance(layer, dict):
        unknown = set(layer) - set(_LAYER_KEYS)
        if unknown:
            raise ValueError(f"layers[{i}] has unknown keys {sorted(unknown)}; expected q, k, v, "
                             f"q_bias, k_bias, v_bias")
        return {key: layer.get(key) for key in _LAYER_KEYS}
    if isinstance(layer, (tuple, list)):
        if len(layer) not in (3, 6):
            raise ValueError(f"layers[{i}] must be (q, k, v) or (q, k, v, q_bias, k_bias, v_bias), "
                             f"got a sequence of {len(layer)}")
        return {key: layer[pos] if pos < len(layer) else None for pos, key in enumerate(_LAYER_KEYS)}
    raise TypeError(f"layers[{i}] must be a dict or a tuple, got {type(layer).__name__}")


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


def _block_ids(block_ids, device) -> torch.Tensor:
    if isinstance(block_ids, torch.Tensor):
        if block_ids.dtype != torch.int64 or block_ids.dim() != 1:
            raise TypeError(f"block_ids must be a 1-D int64 tensor, range or sequence of ints, got a "
                            f"{block_ids.dtype} tensor of shape {tuple(block_ids.shape)}")
        ids = block_ids
    elif isinstance(block_ids, range):
        ids = torch.arange(block_ids.start, block_ids.stop, block_ids.step, dtype=torch.int64)
    else:
        if isinstance(block_ids, (str, bytes)) or not hasattr(block_ids, "__iter__"):
            raise TypeError(f"block_ids must be a 1-D int64 tensor, range or sequence of ints, got "
                            f"{type(block_ids).__name__}")
        ids = torch.tensor([check_int("block_ids entries", v) for v in block_ids], dtype=torch.int64)
    if ids.numel() and bool((ids < 0).any()):
        raise ValueError("block_ids must be >= 0")
    return ids.to(device).contiguous()


# ---------------------------------------------------------------------------------------------------
# public functions

@torch.no_grad()
def conditioned_blocks(seed: int, stream, block_ids, block_shape: tuple[int, int], method: str = "auto",
                       device=None, *, rows: Optional[slice] = None, cols: Optional[slice] = None,
                       memory_budget: Optional[int] = None, backend: Optional[str] = None) -> torch.Tensor:
    """The orthonormalized Gaussian blocks ``block_ids`` of ``stream``: float32 ``[len, m, n]``.

    Block ``g`` does not depend on which other blocks are asked for: a caller that owns part of a
    weight asks for its blocks and gets exactly the bits an initialization writes there. ``rows`` /
    ``cols`` slice every block (the whole block is still computed: orthonormality couples its rows).

    Args:
        seed: ``0 <= seed < 2**64``.
        stream: int stream id in ``[0, 2**32)`` or a name (hashed with ``stream_id``), e.g. ``"q"``.
        block_ids: 1-D int64 tensor, range or sequence of ints >= 0.
        block_shape: ``(m, n)``: orthonormal rows if ``m <= n``, else orthonormal columns.
        method: see :func:`condinit.ops.orthogonalize.op.orthogonalize`.
        device: where to compute (default CPU).
        memory_budget: bytes of fp32 scratch per chunk buffer (default 16 MiB on CPU, 1 GiB on GPU).
        backend: force a backend of the ``orthogonalize`` op.

    Examples:
        >>> q = conditioned_blocks(0, "q", range(4), (8, 64))   # Q heads 0..3 of layer 0
        >>> q.shape
        torch.Size([4, 8, 64])
    """
    seed = check_seed("seed", seed)
    stream = _check_stream(stream, "default")
    if not isinstance(block_shape, (tuple, list, torch.Size)) or len(block_shape) != 2:
        raise TypeError(f"block_shape must be a pair (m, n), got {block_shape!r}")
    m, n = (check_int("block_shape", v, min=1) for v in block_shape)
    check_choice("method", method, METHODS)
    check_int("memory_budget", memory_budget, min=1, allow_none=True)
    _check_backend(backend)
    device = torch.device(device) if device is not None else torch.device("cpu")
    ids = _block_ids(block_ids, device)
    tall = m > n
    wm, wn = (n, m) if tall else (m, n)
    res = torch.empty((ids.numel(), wm, wn), dtype=torch.float32, device=device)
    if device.type != "meta" and ids.numel():
        run_group(seed, [BlockRun(stream, ids, res, False)], (wm, wn), resolve_method(wm, wn, method), device,
                 memory_budget=memory_budget, backend=backend, collect=res)
    if tall:
        res = res.transpose(1, 2)
    if rows is not None or cols is not None:
        res = res[:, rows if rows is not None else slice(None), cols if cols is not None else slice(None)]
    return res if not tall else res.contiguous()


@torch.no_grad()
def semi_orthogonal_(weight: torch.Tensor, *, head_dim: Optional[int] = None, gain: float = 1.0,
                     generator: Optional[torch.Generator] = None, seed: Optional[int] = None,
                     stream=None, method: str = "auto") -> torch.Tensor:
    """Fill ``weight`` in place with Haar-distributed semi-orthogonal blocks, times ``gain``.

    ``weight`` is read as ``[rows, cols]`` (trailing dims flattened, like ``nn.init.orthogonal_``).
    With ``head_dim``, every head's ``[head_dim, cols]`` row block gets orthonormal rows (orthonormal
    columns if ``head_dim > cols``); without, the whole matrix does. Block ``h`` is block id ``h`` of
    ``stream`` (an int, a name hashed by ``stream_id``, default ``"semi_orthogonal"``) under ``seed``
    (default None: one draw from ``generator``, or torch's default generator, as ``torch.nn.init``
    does, so ``torch.manual_seed`` controls it). ``gain``: ``0 < gain <=`` half the largest finite
    value of fp32 and of ``weight``'s dtype (every entry stays finite). Returns ``weight``.

    Examples:
        >>> w = torch.empty(4 * 16, 64)
        >>> semi_orthogonal_(w, head_dim=16, seed=0)            # 4 heads, each [16, 64] orthonormal rows
        >>> semi_orthogonal_(w, generator=torch.Generator().manual_seed(1))
    """
    check_weight(weight, "weight", min_dim=2)
    rows, cols = _rows_cols(weight)
    hd = _check_head_dim(head_dim, rows, "weight")
    gain = _check_gain(gain, [weight.dtype])
    check_choice("method", method, METHODS)
    stream = _check_stream(stream, "semi_orthogonal")
    check_destinations([("weight", weight)])
    seed = check_seed_source(seed, generator)
    if weight.device.type == "meta":
        return weight
    seed = draw_seed(seed, generator)
    mat = _as_matrix(weight)
    target = mat if mat is not None else torch.empty((rows, cols), dtype=weight.dtype, device=weight.device)
    plan = InitPlan()
    plan.add_heads(stream, 0, target, hd, cols, gain=gain)
    run_plan(plan, seed, method)
    if mat is None:
        weight.copy_(target.view(weight.shape))
    return weight


@torch.no_grad()
def rect_identity_(weight: torch.Tensor, *, head_dim: Optional[int] = None, per_head: bool = False,
                   gain: float = 1.0) -> torch.Tensor:
    """Fill ``weight`` ``[rows, cols]`` in place with ``gain`` times the rectangular identity.

    Default: ones on the main diagonal of the whole matrix (``W[i, i] = 1``; head ``h`` of a V
    projection passes coordinates ``h*head_dim ...`` through). ``per_head=True`` (needs
    ``head_dim``): every head's ``[head_dim, cols]`` block is ``I`` (the paper's literal reading:
    every head sees the same first ``head_dim`` coordinates). ``gain``: the diagonal's value
    (rounded once into ``weight``'s dtype), ``0 < gain <=`` half the largest finite value of fp32
    and of ``weight``'s dtype. Returns ``weight``.

    Examples:
        >>> w = torch.empty(128, 256)
        >>> rect_identity_(w)                                  # torch.eye(128, 256)
        >>> rect_identity_(w, head_dim=32, per_head=True)      # torch.eye(32, 256).repeat(4, 1)
        >>> rect_identity_(w, gain=0.1)                        # 0.1 * torch.eye(128, 256)
    """
    check_weight(weight, "weight", min_dim=2)
    rows, cols = _rows_cols(weight)
    per_head = check_bool("per_head", per_head)
    if per_head and head_dim is None:
        raise ValueError("per_head=True needs head_dim")
    hd = _check_head_dim(head_dim, rows, "weight")
    gain = _check_gain(gain, [weight.dtype])
    check_destinations([("weight", weight)])
    if weight.device.type == "meta":
        return weight
    mat = _as_matrix(weight)
    target = mat if mat is not None else torch.empty((rows, cols), dtype=weight.dtype, device=weight.device)
    rect_identity_region_(target, head_dim=hd if per_head else None, gain=gain)
    if mat is None:
        weight.copy_(target.view(weight.shape))
    return weight


def _plan_layers(plan: InitPlan, checked, layer_indices, num_heads: int, num_kv_heads: int, v_mode: str,
                 qk_gain: float, v_gain: float) -> None:
    """Add checked layers ``(q, k, v, biases)`` (layer ``layer_indices[i]``) to ``plan``."""
    sq, sk = stream_id(Q_STREAM), stream_id(K_STREAM)
    for L, (q, k, v, biases) in zip(layer_indices, checked):
        for w, heads, stream in ((q, num_heads, sq), (k, num_kv_heads, sk)):
            if w is not None:
                plan.add_heads(stream, L * LAYER_STRIDE, w, w.shape[0] // heads, w.shape[1], gain=qk_gain)
        if v is not None:
            plan.add_identity(v, head_dim=v.shape[0] // num_kv_heads if v_mode == "identity_per_head" else None,
                              gain=v_gain)
        for b in biases:
            if b is not None:
                plan.add_zero(b)


@torch.no_grad()
def conditioned_init_layers_(layers: Sequence[Union[dict, tuple]], *, num_heads: int,
                             num_kv_heads: Optional[int] = None, seed: Optional[int] = None,
                             generator: Optional[torch.Generator] = None,
                             layer_indices: Optional[Sequence[int]] = None, v_mode: str = "identity",
                             qk_gain: float = 1.0, v_gain: float = 1.0, method: str = "auto",
                             memory_budget: Optional[int] = None, backend: Optional[str] = None) -> None:
    """Conditioned initialization of many attention layers in one batched pass.

    ``layers``: one entry per layer, a dict with keys ``q, k, v`` (and optional ``q_bias, k_bias,
    v_bias``) or a tuple ``(q, k, v[, q_bias, k_bias, v_bias])``; any entry may be None (skipped).
    Weights are ``nn.Linear`` ``[out, in]``: ``q`` is ``[num_heads * d, D]``, ``k`` is
    ``[num_kv_heads * d, D]``, ``v`` any 2-D (``[num_kv_heads * d, D]`` for ``identity_per_head``).

    Q head ``h`` of layer ``L = layer_indices[i]`` (default ``i``) gets block
    ``L * 2**32 + h`` of stream ``stream_id("q")``; K head ``h`` block ``L * 2**32 + h``
    of ``stream_id("k")``, so calls per layer, all at once or in chunks give bit-identical weights
    for the same ``seed`` (default None: one draw from ``generator``, or torch's default
    generator, per call). V: the rectangular identity (:func:`rect_identity_`;
    ``v_mode="identity"``: whole matrix, the default; ``"identity_per_head"``: each head's block).
    Biases are zeroed. ``layer_indices`` must be distinct; no two destinations may share memory.

    Gains (``docs/design.md``, "The method"): every Q and K head block is ``qk_gain`` times a
    semi-orthogonal block (all its singular values ``qk_gain``), V is ``v_gain`` times the
    rectangular identity. Default 1 for both: the paper's method, every singular value 1. Each is a
    finite real ``> 0`` (at most half the largest finite value of fp32 and of the weights' dtypes);
    the random blocks do not depend on the gains.

    ``memory_budget``: bytes of fp32 scratch per chunk buffer (default 16 MiB on CPU, 1 GiB on GPU;
    two or three such buffers are used). ``method``/``backend``: of :func:`orthogonalize`.

    Examples:
        >>> layers = [{"q": torch.empty(256, 256), "k": torch.empty(64, 256), "v": torch.empty(64, 256)}
        ...           for _ in range(4)]
        >>> conditioned_init_layers_(layers, num_heads=8, num_kv_heads=2, seed=0)
        >>> conditioned_init_layers_(layers[2:], num_heads=8, num_kv_heads=2, seed=0,
        ...                          layer_indices=[2, 3])        # the same bits for layers 2 and 3
        >>> conditioned_init_layers_(layers, num_heads=8, num_kv_heads=2, seed=0,
        ...                          v_gain=0.1, qk_gain=0.5)     # V = 0.1 I; Q/K singular values 0.5
    """
    if isinstance(layers, (dict, torch.Tensor)) or not hasattr(layers, "__len__"):
        raise TypeError(f"layers must be a sequence of dicts or tuples, got {type(layers).__name__}")
    num_heads, num_kv_heads = _check_heads(num_heads, num_kv_heads)
    check_choice("v_mode", v_mode, V_MODES)
    check_choice("method", method, METHODS)
    check_int("memory_budget", memory_budget, min=1, allow_none=True)
    _check_backend(backend)
    seed = check_seed_source(seed, generator)
    if layer_indices is None:
        layer_indices = list(range(len(layers)))
    else:
        layer_indices = [check_int(f"layer_indices[{i}]", L, min=0, max=MAX_LAYER_INDEX)
                         for i, L in enumerate(layer_indices)]
        if len(layer_indices) != len(layers):
            raise ValueError(f"layer_indices must have one entry per layer ({len(layers)}), got {len(layer_indices)}")
        seen, repeated = set(), []
        for L in layer_indices:
            if L in seen and L not in repeated:
                repeated.append(L)
            seen.add(L)
        if repeated:   # two layers with the same index would get the same random blocks
            raise ValueError(f"layer_indices must be distinct, got {repeated} more than once")
    checked, destinations = [], []
    for i, layer in enumerate(layers):   # every layer checked before the first write
        names = {key: f"layers[{i}].{key}" for key in _LAYER_KEYS}
        entry = _layer_entry(layer, i)
        checked.append(_check_layer(entry, names, num_heads, num_kv_heads, v_mode, f"layers[{i}]"))
        destinations += [(names[key], entry[key]) for key in _LAYER_KEYS]
    qk_gain, v_gain = check_gains(qk_gain, v_gain,
                                  [w.dtype for q, k, _, _ in checked for w in (q, k) if w is not None],
                                  [v.dtype for _, _, v, _ in checked if v is not None])
    check_destinations(destinations)
    plan = InitPlan()
    _plan_layers(plan, checked, layer_indices, num_heads, num_kv_heads, v_mode, qk_gain, v_gain)
    run_plan(plan, draw_seed(seed, generator), method, memory_budget=memory_budget, backend=backend)


@torch.no_grad()
def conditioned_init_(q_weight: torch.Tensor, k_weight: torch.Tensor, v_weight: torch.Tensor, *,
                      num_heads: int, num_kv_heads: Optional[int] = None,
                      q_bias: Optional[torch.Tensor] = None, k_bias: Optional[torch.Tensor] = None,
                      v_bias: Optional[torch.Tensor] = None, seed: Optional[int] = None,
                      generator: Optional[torch.Generator] = None, layer_index: int = 0,
                      v_mode: str = "identity", qk_gain: float = 1.0, v_gain: float = 1.0,
                      method: str = "auto", memory_budget: Optional[int] = None,
                      backend: Optional[str] = None) -> None:
    """Conditioned initialization of one attention layer (see :func:`conditioned_init_layers_`):
    Q and K per-head Haar semi-orthogonal times ``qk_gain``, V the rectangular identity times
    ``v_gain``, biases zero. Both gains default to 1 (the paper's method).

    ``layer_index`` selects the layer's random blocks, so calling this for every layer with the same
    ``seed`` equals one :func:`conditioned_init_layers_` call over all of them. ``seed`` default
    None: one draw from ``generator``, or torch's default generator (as ``torch.nn.init`` does).

    Examples:
        >>> q, k, v = torch.nn.Linear(512, 512), torch.nn.Linear(512, 128), torch.nn.Linear(512, 128)
        >>> conditioned_init_(q.weight, k.weight, v.weight, num_heads=8, num_kv_heads=2,
        ...                   q_bias=q.bias, k_bias=k.bias, v_bias=v.bias, seed=0, layer_index=3)
        >>> conditioned_init_(q.weight, k.weight, v.weight, num_heads=8, num_kv_heads=2, seed=0,
        ...                   v_gain=0.1)                    # V = 0.1 I, Q/K as above
    """
    num_heads, num_kv_heads = _check_heads(num_heads, num_kv_heads)
    check_choice("v_mode", v_mode, V_MODES)
    check_choice("method", method, METHODS)
    check_int("memory_budget", memory_budget, min=1, allow_none=True)
    seed = check_seed_source(seed, generator)
    layer_index = check_int("layer_index", layer_index, min=0, max=MAX_LAYER_INDEX)
    _check_backend(backend)
    tensors = {"q": q_weight, "k": k_weight, "v": v_weight, "q_bias": q_bias, "k_bias": k_bias, "v_bias": v_bias}
    names = {key: f"{key}_weight" if key in "qkv" else key for key in _LAYER_KEYS}
    checked = _check_layer(tensors, names, num_heads, num_kv_heads, v_mode, "conditioned_init_")
    qk_gain, v_gain = check_gains(qk_gain, v_gain, [w.dtype for w in checked[:2] if w is not None],
                                  [checked[2].dtype] if checked[2] is not None else [])
    check_destinations([(names[key], tensors[key]) for key in _LAYER_KEYS])
    plan = InitPlan()
    _plan_layers(plan, [checked], [layer_index], num_heads, num_kv_heads, v_mode, qk_gain, v_gain)
    run_plan(plan, draw_seed(seed, generator), method, memory_budget=memory_budget, backend=backend)
