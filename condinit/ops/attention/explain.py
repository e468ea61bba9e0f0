"""What an attention call runs: the backend of each kernel, the fused or dense path, the mask plan.

* :func:`explain` ``(q, k, v, op=..., **the op's keyword arguments)`` -> :class:`Explanation`:
  for :func:`condinit.attention` and :func:`condinit.attention_jvp` the backends come from the
  same choice the op makes (the function the op calls; nothing runs); for :func:`condinit.sdpa`,
  whose path depends on the mask's values, the forward runs once (no gradient) under a dispatch
  log and the explanation reports the kernel calls it made.
* :func:`dispatch_log` records every attention kernel call while it is open (the op, the backend
  that ran, the shapes and the mask kinds): the probes and the monitor call the kernels directly,
  so this is how to see what they ran.

Nothing here changes what runs.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
from typing import Optional

import torch
from torch import Tensor

from condinit import _backends
from condinit._validate import check_choice
from condinit.ops.attention import op as attention_op
from condinit.ops.attention import sdpa as sdpa_module
from condinit.ops.attention.backends import mask_kinds
from condinit.ops.attention.checks import check_mask, check_options, check_primals, check_tangents
from condinit.ops.attention.library import ACTIVE_LOGS, DispatchRecord

__all__ = ["explain", "dispatch_log", "Explanation", "DispatchLog", "DispatchRecord", "OPS"]

OPS = ("attention", "attention_jvp", "sdpa")
_FUNCTIONS = {"attention": attention_op.attention, "attention_jvp": attention_op.attention_jvp,
              "sdpa": sdpa_module.sdpa}
# What each kernel op does for the call (the lines of Explanation.__str__).
_ROLES = {"attention_fwd": "forward", "attention_bwd": "backward (flash VJP)",
          "attention_jvp": "forward mode (fused JVP)",
          "attention_jvp_bwd": "backward through the forward-mode tangent"}


class DispatchLog(list):
    """The :class:`DispatchRecord` of each attention kernel call, in order."""

    def __str__(self) -> str:
        return "\n".join(map(str, self)) if self else "no attention kernel ran"


@contextlib.contextmanager
def dispatch_log():
    """Record every attention kernel call (``condinit_C`` / Triton / reference rows alike) made
    while the block runs, from any thread, including calls under ``torch.compile``, ``vmap`` and
    the probes' direct kernel calls. Yields a :class:`DispatchLog`; logs nest.

    Examples:
        >>> with condinit.ops.attention.explain.dispatch_log() as log:
        ...     op = condinit.JacobianOperator(layer, x, dtype=torch.float64)
        ...     op.mv(torch.randn(op.n, dtype=torch.float64))
        >>> print(log)   # attention_jvp on cpp-cpu: cpu float64 B=1 H=2 ...
    """
    log = DispatchLog()
    ACTIVE_LOGS.append(log)
    try:
        yield log
    finally:
        # by identity: logs with equal contents are still different logs
        del ACTIVE_LOGS[next(i for i, x in enumerate(ACTIVE_LOGS) if x is log)]


@dataclasses.dataclass(frozen=True)
class Explanation:
    """What one call of ``op`` runs. ``str()`` gives it in a few readable lines.

    Attributes:
        op: ``"attention"``, ``"attention_jvp"`` or ``"sdpa"``.
        device, dtype: the inputs'; ``accumulate``: the dtype the kernels compute in.
        shapes: the inputs' shapes by name (``q``, ``k``, ``v``; sdpa: ``query``, ``key``,
            ``value``, and ``attn_mask`` when given).
        path: ``"fused"`` (condinit's kernels, O(N) memory) or ``"dense"`` (sdpa's plain torch
            ops, O(Nq Nk) memory per head).
        mask: the mask plan in words: what the kernels are asked to mask (causal, window, lens),
            or for sdpa what its mask was recognised as and which kernel calls run it.
        backends: kernel op name -> the backend that runs it (``condinit info`` lists the rows):
            every op the call can run (forward, backward, forward mode, the backward through the
            tangent). Empty on the dense path.
        passed_over: kernel op name -> the preferred rows not taken and why (``"cpp-cpu: ..."``),
            empty when the first choice runs or a backend is forced.
        forced: the kernel ops whose backend ``backend=`` or ``CONDINIT_BACKEND`` chose (empty: every
            one is the automatic choice).
        calls: sdpa: the kernel calls its forward made (one :class:`DispatchRecord` each).
        reason: why this path (sdpa's dense path: which condition kept the fused op out).
    """
    op: str
    device: str
    dtype: torch.dtype
    accumulate: torch.dtype
    shapes: dict
    path: str
    mask: str
    backends: dict
    passed_over: dict
    forced: tuple
    calls: tuple = ()
    reason: str = ""

    def __str__(self) -> str:
        dt = lambda x: str(x).replace("torch.", "")  # noqa: E731
        shapes = ", ".join(f"{name} {list(shape)}" for name, shape in self.shapes.items())
        lines = [f"condinit.{self.op}: {self.device} {dt(self.dtype)} (computed in {dt(self.accumulate)}); {shapes}"]
        if self.path == "fused":
            lines.append("path: fused (condinit's kernels, O(N) memory)" + (f": {self.reason}" if self.reason else ""))
        else:
            lines.append(f"path: dense (plain torch ops, O(Nq Nk) memory per head): {self.reason}")
        lines.append(f"mask: {self.mask}")
        for call in self.calls:
            lines.append(f"  ran {call}")
        width = max((len(name) for name in self.backends), default=0)
        for name, backend in self.backends.items():
            note = f"  {_ROLES[name]}" if name in _ROLES else ""
            skipped = self.passed_over.get(name)
            if skipped:
                note += f" (passed over {'; '.join(skipped)})"
            lines.append(f"{name:<{width}}  {backend}{' (forced)' if name in self.forced else ''}{note}")
        return "\n".join(lines)


def _accumulate(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _passed_over(op_name: str, chosen: str, q: Tensor, masks: tuple[str, ...]) -> tuple[str, ...]:
    """The rows of the device's preference order before ``chosen`` and why each was not taken
    (what :meth:`condinit._backends.Op.choose` walked past)."""
    op = _backends.get(op_name)
    call = {"dtype": q.dtype, "head_dim": int(q.shape[-1]), "masks": masks}
    out = []
    for name in _backends.PREFERENCE.get(q.device.type, ("torch",)):
        if name == chosen:
            break
        why = op.why_not(name, q.device.type, call)
        out.append(f"{name}: {why or 'not deterministic (force it to use it)'}")
    return tuple(out)


def _forced(backend: Optional[str], op_names) -> tuple:
    """The ops of ``op_names`` whose backend ``backend=`` or ``CONDINIT_BACKEND`` forces."""
    if backend is not None:
        return tuple(op_names) if backend != "auto" else ()
    env = _backends.forced_from_env()
    return tuple(name for name in op_names if env.get(name) not in (None, "auto"))


def _shown_lens(name: str, lens: Tensor) -> str:
    values = lens.tolist()
    return f"{name} {values if len(values) <= 8 else values[:8] + ['...']}"


def _mask_words(causal: bool, left: int, right: int, q_lens, kv_lens) -> str:
    parts = []
    if causal:
        parts.append("causal (bottom-right aligned: query i sees keys j <= i + Nk - Nq)")
    if left >= 0 or right >= 0:
        side = lambda w: "unbounded" if w < 0 else str(w)  # noqa: E731
        parts.append(f"window (left {side(left)}, right {side(right)})")
    for name, lens in (("q_lens", q_lens), ("kv_lens", kv_lens)):
        if lens is not None:
            parts.append(_shown_lens(name, lens))
    return "; ".join(parts) or "none (every query sees every key)"


def _bind(op: str, q, k, v, kwargs: dict) -> dict:
    """The call's arguments by name, with the op's own defaults (its signature)."""
    try:
        bound = inspect.signature(_FUNCTIONS[op]).bind(q, k, v, **kwargs)
    except TypeError as exc:
        raise TypeError(f"explain(op={op!r}): {exc} (the keyword arguments are condinit.{op}'s)") from None
    bound.apply_defaults()
    return bound.arguments


def _explain_kernel_op(op: str, a: dict) -> Explanation:
    """condinit.attention / attention_jvp: the same checks and the same choice as the op."""
    q, k, v = a["q"], a["k"], a["v"]
    check_primals(q, k, v)
    causal, left, right, q_lens, kv_lens = check_mask(q, k, a["causal"], a["window"], a["q_lens"], a["kv_lens"])
    _, backend = check_options(a["scale"], a["backend"], q.shape[-1])
    masks = mask_kinds(causal, left, right, q_lens, kv_lens)
    shapes = {"q": tuple(q.shape), "k": tuple(k.shape), "v": tuple(v.shape)}
    reason = ""
    if op == "attention":
        backends = attention_op.chosen_backends(q, backend, masks)
    else:
        tangents = (("tq", a["tq"]), ("tk", a["tk"]), ("tv", a["tv"]))
        has_p, P = check_tangents((("q", q), ("k", k), ("v", v)), tangents)
        for name, t in tangents:
            if t is not None:
                shapes[name] = tuple(t.shape)
        jvp_bwd = a["grad_through_tangent"]
        bwd_op = attention_op.ATTENTION_JVP_BWD if jvp_bwd else attention_op.ATTENTION_BWD
        backends = {"attention_jvp": attention_op.choose(attention_op.ATTENTION_JVP, q, backend, masks),
                    bwd_op.name: attention_op.backward_backend(bwd_op, q, backend, masks)}
        reason = f"{P if has_p else 1} probe{'s' * (has_p and P != 1)} in one pass"
    forced = _forced(backend, backends)
    passed = {name: skipped for name, chosen in backends.items()
              if name not in forced and (skipped := _passed_over(name, chosen, q, masks))}
    return Explanation(op, q.device.type, q.dtype, _accumulate(q.dtype), shapes, "fused",
                       _mask_words(causal, left, right, q_lens, kv_lens), backends, passed, forced, reason=reason)


def _explain_sdpa(a: dict) -> Explanation:
    """condinit.sdpa: run its forward once under a dispatch log; the records are the fused calls."""
    query, key, value, attn_mask, is_causal = a["query"], a["key"], a["value"], a["attn_mask"], a["is_causal"]
    layout = sdpa_module.check_sdpa_args(query, key, value, attn_mask, a["dropout_p"], is_causal, a["scale"],
                                     a["enable_gqa"])
    with torch.no_grad(), dispatch_log() as log:
        sdpa_module.sdpa(**a)
    shapes = {"query": tuple(query.shape), "key": tuple(key.shape), "value": tuple(value.shape)}
    if attn_mask is not None:
        shapes["attn_mask"] = tuple(attn_mask.shape)
    given = ("is_causal (top-left aligned: query i sees keys j <= i)" if is_causal else
             "none" if attn_mask is None else
             f"attn_mask {str(attn_mask.dtype).replace('torch.', '')} {list(attn_mask.shape)}")
    calls = tuple(log)
    if not calls:
        if not layout.fused():
            reason = (f"the value head dim {layout.value_dim} differs from the query's {layout.head_dim}"
                      if layout.head_dim != layout.value_dim else "an empty dimension")
        elif not sdpa_module.mask_values_readable(attn_mask):
            reason = ("the mask's values cannot be read here (torch.compile, vmap, or a float mask that "
                      "carries a gradient or a tangent)")
        else:
            reason = ("the mask is none the kernels run (it differs per head, adds a bias, pads keys outside "
                      "one interval per batch entry, or has a window with padded query rows after the real keys)")
        return Explanation("sdpa", query.device.type, query.dtype, _accumulate(query.dtype), shapes, "dense",
                           given, {}, {}, False, reason=reason)
    # The fused calls ran on the automatic backends (sdpa forces none): the backward and forward
    # mode of each call are the ones condinit.attention chooses for its masks.
    like = query.new_empty((0, layout.head_dim))
    per_op: dict = {}
    passed: dict = {}
    for call in calls:
        for name, backend in attention_op.chosen_backends(like, None, call.masks).items():
            per_op.setdefault(name, [])
            if backend not in per_op[name]:
                per_op[name].append(backend)
            skipped = _passed_over(name, backend, like, call.masks)
            if skipped:
                passed[name] = skipped
    backends = {name: " / ".join(found) for name, found in per_op.items()}
    forced = _forced(None, backends)
    n = len(calls)
    mask = f"{given}, run as {n} kernel call{'s' * (n != 1)}: " + " + ".join(
        ", ".join(c.masks) or "no mask" for c in calls)
    return Explanation("sdpa", query.device.type, query.dtype, _accumulate(query.dtype), shapes, "fused", mask,
                       backends, {k: v for k, v in passed.items() if k not in forced}, forced, calls)


def explain(q: Tensor, k: Tensor, v: Tensor, *, op: str = "attention", **kwargs) -> Explanation:
    """What ``condinit.<op>(q, k, v, **kwargs)`` runs: the backend of each kernel op, the fused
    or dense path and the mask plan, as an :class:`Explanation` (``print`` it).

    Args:
        q, k, v: the op's first three arguments (``query``, ``key``, ``value`` for sdpa).
        op: ``"attention"`` (default), ``"attention_jvp"`` or ``"sdpa"``.
        **kwargs: the op's own keyword arguments (``causal``, ``window``, ``q_lens``,
            ``kv_lens``, ``scale``, ``backend``; attention_jvp also ``tq``, ``tk``, ``tv``,
            ``grad_through_tangent``; sdpa ``attn_mask``, ``is_causal``, ``enable_gqa``, ...),
            checked as the op checks them: the same errors.

    For attention and attention_jvp nothing runs: the backends are the op's own choice for this
    call (device, dtype, head dim, mask kinds, ``backend=`` and ``CONDINIT_BACKEND``). For sdpa
    the forward runs once without gradients (its path depends on the mask's values), and the
    kernel calls it made are reported.

    Examples:
        >>> q = k = v = torch.randn(1, 8, 512, 64, dtype=torch.float64)
        >>> print(condinit.explain(q, k, v, causal=True))
        condinit.attention: cpu float64 (computed in float64); q [1, 8, 512, 64], ...
        path: fused (condinit's kernels, O(N) memory)
        mask: causal (bottom-right aligned: query i sees keys j <= i + Nk - Nq)
        attention_fwd      cpp-cpu  forward
        ...
        >>> condinit.explain(q, k, v, op="sdpa", attn_mask=mask).path     # "fused" or "dense"
    """
    check_choice("op", op, OPS)
    arguments = _bind(op, q, k, v, kwargs)
    return _explain_sdpa(arguments) if op == "sdpa" else _explain_kernel_op(op, arguments)
