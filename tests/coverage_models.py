"""An independent reading of every attention layer of a model, and tiny models of every architecture.

Used by ``tests/test_coverage.py`` (the acceptance test of :func:`condinit.apply`'s coverage) and by
``tools/coverage_table.py`` (the README's "Which models" table). Nothing here uses condinit's own
discovery, adapters or report: where a model keeps its Q/K/V weights, and how their rows are split
into heads, is read from what the model computes.

**Finding attention.** The model runs once on a tiny input while the places where attention is
computed are intercepted: ``torch.nn.functional.scaled_dot_product_attention``, transformers'
attention interface (``AttentionInterface``: the ``sdpa`` entry), and the hand-written pattern
``softmax(q @ k^T ...) @ v`` (``matmul`` / ``bmm`` / ``baddbmm`` / ``einsum`` / ``@`` between two
computed tensors, a softmax over a tensor of the scores' shape, then a product of that with ``v``).
Each computation is charged to the innermost running module that holds a weight matrix. A module
whose class name says "attention" or "attn" and holds weights, but where no attention computation
was seen, is reported as not read (the check then fails); classes named as linear attention
("LinearAttention", "LightningAttention") are not, as they have no softmax to find.

**Reading the weights.** Each such module is run again on the inputs it received (all-zero inputs
replaced by random ones), with its own parameters requiring grad, and the query, key and value
tensors ``[B, H, N, d]`` that reach the attention computation are captured. The gradient of each
element ``(h, i)`` of ``q[0, :, t, :]`` (token ``t = 0``, or another token when token 0's input is
zero) with respect to each weight matrix of the module is ``u x^T``: ``x`` the projection's input,
``u`` how the element depends on the projection's output channels. The matrix whose gradients have
that form, with ``u`` supported on one head's rows, is the Q projection, stored either way round
(``nn.Linear`` ``[out, in]`` or GPT-2 ``Conv1D`` ``[in, out]``; 1x1 convolutions and 3-D weights are
read as matrices; of two readings of one parameter, the one with more distinct heads). A matrix
whose rows are indexed by several dimensions (a stack of expert projections) is read at every
token and the heads united: a token reads only the experts it is routed to. A grouped
convolution's rows are checked over all its input channels, zeros outside their group (torch's
semantics of ``groups``). The rows that feed head ``h`` are the union of the supports of its elements:
exact for plain reshapes, for rotary embeddings (a rotation inside each head) and for per-head q/k
norms. When q/k norms span all heads, each element's dominant row is used instead. Fused and
interleaved layouts (``[q | k | v]``, per-head ``[q_h, k_h, v_h]``, grouped queries) need no special
case; heads repeated for grouped-query attention (or windows folded into heads) are recognized as
identical row sets. Bias vectors (1-D parameters named ``*bias*`` outside norm layers) that the
element depends on are the Q/K/V biases. A query that is a parameter itself (attention pooling with
a learned query) has no projection to condition and must stay unchanged.

**What conditioned means** (``docs/design.md``, "The method"): per head, the Q and K row blocks are
semi-orthogonal (every singular value 1: ``max |W W^T - I| <= 1e-5`` in fp32, ``W^T W`` for a head
wider than its input); V, the value heads' rows in the order the attention computations of the
module see them, is exactly the rectangular identity ``[H_kv * d_v, in]``; the Q/K/V biases are
exactly zero; every other parameter and buffer is bit for bit what it was before.
"""
from __future__ import annotations

import contextlib
import re
import signal
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import nn
import torch.nn.functional as F

ORTHO_ATOL = 1e-5          # fp32: max |W W^T - I| per Q/K head block
RANK_ONE_RTOL = 1e-5       # residual of an element's gradient off its rank-one part, relative to its largest row
SUPPORT_RTOL = 1e-6        # an output channel counts as feeding an element above this share of the largest
DOMINANCE = 2.0            # dominant-row reading: the largest dependence must be this many times the next

ATTENTION_NAME = re.compile(r"attention|attn", re.I)
# named attention, but linear attention by construction (no softmax to find): not reported as unread
LINEAR_ATTENTION_NAME = re.compile(r"linear_?attention|lightning_?attention", re.I)


class Unreadable(Exception):
    """The independent reading cannot say where a module's Q, K or V comes from."""


# ------------------------------------------------------------------------------------------------
# interception of attention computations

@dataclass
class Event:
    """One attention computation: where it was seen and its query, key, value as [B, H, N, d]."""

    kind: str
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    owners: tuple = ()       # running modules holding weights, innermost first (discovery only)


def _as_bhnd(t: torch.Tensor) -> torch.Tensor:
    """As [B, H, N, d]. 4-D tensors are taken as they are (windows, if any, folded into B); with more
    dimensions all leading ones become heads (mask units, windows and heads in an order only the model
    knows: identical row sets are merged when read)."""
    if t.dim() == 4:
        return t
    return t.reshape(1, -1, *t.shape[-2:])


def _computed(t) -> bool:
    return isinstance(t, torch.Tensor) and t.grad_fn is not None and t.is_floating_point()


def _einsum_as_bmm(eq: str, a: torch.Tensor, b: torch.Tensor):
    """``einsum(eq, a, b)`` as ``A @ B`` with ``A [S, I, C]``, ``B [S, C, J]``; None if it is not one."""
    if "..." in eq or "->" not in eq:
        return None
    ins, out = eq.replace(" ", "").split("->")
    parts = ins.split(",")
    if len(parts) != 2:
        return None
    la, lb = parts
    if len(set(la)) != len(la) or len(set(lb)) != len(lb) or a.dim() != len(la) or b.dim() != len(lb):
        return None
    shared = [c for c in la if c in lb and c in out]
    contracted = [c for c in la if c in lb and c not in out]
    only_a = [c for c in la if c not in lb]
    only_b = [c for c in lb if c not in la]
    if not contracted or any(c not in out for c in only_a + only_b):
        return None
    A = a.permute([la.index(c) for c in shared + only_a + contracted])
    B = b.permute([lb.index(c) for c in shared + contracted + only_b])
    s = int(torch.tensor([a.shape[la.index(c)] for c in shared]).prod()) if shared else 1
    A = A.reshape(s, -1, int(torch.tensor([a.shape[la.index(c)] for c in contracted]).prod()))
    B = B.reshape(s, A.shape[-1], -1)
    return A, B


class Interceptor:
    """Patches the functions that compute attention for the duration of a ``with`` block.

    ``on_event(event)`` is called for every attention computation; the patched functions compute
    exactly what the originals do. ``owners()`` (optional) names the running modules to charge it to.
    """

    def __init__(self, on_event: Callable[[Event], None], owners: Optional[Callable[[], tuple]] = None):
        self.on_event = on_event
        self.owners = owners or (lambda: ())
        self.depth = 0            # > 0 inside an intercepted attention function: nothing inside counts
        self.candidates = []      # (a, b, scores shape) of products of two computed tensors, newest last
        self.softmax_shapes = []  # trailing shapes of tensors softmaxed since the candidates
        self._saved = []

    # -- patching
    def _patch(self, obj, name, wrapper_factory):
        orig = getattr(obj, name)
        self._saved.append((obj, name, orig))
        setattr(obj, name, wrapper_factory(orig))

    def __enter__(self):
        self._patch(F, "scaled_dot_product_attention", self._wrap_sdpa)
        try:
            from transformers.modeling_utils import AttentionInterface
        except ImportError:
            AttentionInterface = None
        if AttentionInterface is not None and "sdpa" in AttentionInterface._global_mapping:
            self._patch_mapping(AttentionInterface._global_mapping, "sdpa")
        for obj, name in ((torch, "matmul"), (torch.Tensor, "matmul"), (torch.Tensor, "__matmul__"),
                          (torch, "bmm"), (torch.Tensor, "bmm")):
            self._patch(obj, name, self._wrap_mm)
        for obj in (torch, torch.Tensor):
            self._patch(obj, "baddbmm", self._wrap_baddbmm)
        self._patch(torch, "einsum", self._wrap_einsum)
        for obj, name in ((F, "softmax"), (torch, "softmax"), (torch.Tensor, "softmax")):
            self._patch(obj, name, self._wrap_softmax)
        return self

    def _patch_mapping(self, mapping, key):
        orig = mapping[key]
        self._saved.append((mapping, key, orig))

        def interface(module, query, key_, value, *args, **kwargs):
            return self._attention("transformers", orig, (query, key_, value),
                                   (module, query, key_, value) + args, kwargs)
        mapping[key] = interface

    def __exit__(self, *exc):
        for obj, name, orig in reversed(self._saved):
            if isinstance(obj, dict):
                obj[name] = orig
            else:
                setattr(obj, name, orig)
        self._saved.clear()
        return False

    # -- events
    def _attention(self, kind, fn, qkv, args, kwargs):
        if self.depth == 0:
            q, k, v = qkv
            self.candidates.clear()
            self.softmax_shapes.clear()
            self.on_event(Event(kind, _as_bhnd(q), _as_bhnd(k), _as_bhnd(v), self.owners()))
        self.depth += 1
        try:
            return fn(*args, **kwargs)
        finally:
            self.depth -= 1

    def _wrap_sdpa(self, orig):
        def sdpa(query, key, value, *args, **kwargs):
            return self._attention("sdpa", orig, (query, key, value), (query, key, value) + args, kwargs)
        return sdpa

    def _product(self, a, b):
        """A product ``a @ b`` ([..., N, C] x [..., C, M]) between two computed tensors was taken."""
        if self.depth or not (_computed(a) and _computed(b)) or a.dim() < 2 or b.dim() < 2:
            return
        trailing = (a.shape[-2], b.shape[-1])
        # a softmax over the scores' rows (possibly with extra columns: attention sinks) was taken since
        if any(rows == a.shape[-2] for rows, _ in self.softmax_shapes):
            for qa, kb, scores in self.candidates:
                if scores == tuple(a.shape[-2:]):
                    self.candidates.clear()
                    self.softmax_shapes.clear()
                    self.on_event(Event("softmax(q k^T) v", _as_bhnd(qa), _as_bhnd(kb.transpose(-1, -2)),
                                        _as_bhnd(b), self.owners()))
                    return
        self.candidates.append((a, b, trailing))
        del self.candidates[:-16]

    def _wrap_mm(self, orig):
        def mm(a, b, *args, **kwargs):
            if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
                self._product(a, b)
            return orig(a, b, *args, **kwargs)
        return mm

    def _wrap_baddbmm(self, orig):
        def baddbmm(input, batch1, batch2, *args, **kwargs):
            self._product(batch1, batch2)
            return orig(input, batch1, batch2, *args, **kwargs)
        return baddbmm

    def _wrap_einsum(self, orig):
        def einsum(eq, *operands, **kwargs):
            ops = operands[0] if len(operands) == 1 and isinstance(operands[0], (list, tuple)) else operands
            if isinstance(eq, str) and len(ops) == 2 and all(isinstance(o, torch.Tensor) for o in ops):
                ab = _einsum_as_bmm(eq, *ops)
                if ab is not None:
                    self._product(*ab)
            return orig(eq, *operands, **kwargs)
        return einsum

    def _wrap_softmax(self, orig):
        def softmax(x, *args, **kwargs):
            if self.depth == 0 and self.candidates and isinstance(x, torch.Tensor) and x.dim() >= 2:
                self.softmax_shapes.append(tuple(x.shape[-2:]))
            return orig(x, *args, **kwargs)
        return softmax


# ------------------------------------------------------------------------------------------------
# discovery: which modules compute attention, and with which inputs

def _weight_holders(model: nn.Module) -> set:
    """ids of the modules that hold (themselves or below) a parameter with >= 2 dimensions."""
    holders = set()
    for mod in model.modules():
        if any(p.dim() >= 2 for p in mod.parameters()):
            holders.add(id(mod))
    return holders


def _snapshot(x):
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, tuple) and not hasattr(x, "_fields"):
        return tuple(_snapshot(v) for v in x)
    if isinstance(x, list):
        return [_snapshot(v) for v in x]
    if isinstance(x, dict):
        return type(x)((k, _snapshot(v)) for k, v in x.items()) if type(x) is dict else x
    return x


@dataclass
class Discovery:
    owners: dict = field(default_factory=dict)       # name -> module, in the order first seen
    chains: dict = field(default_factory=dict)       # name -> names of enclosing weight holders, innermost first
    calls: dict = field(default_factory=dict)        # name -> (args, kwargs) of its first call
    kinds: dict = field(default_factory=dict)        # name -> set of event kinds
    name_only: list = field(default_factory=list)    # attention-named weight holders where nothing was seen


def discover(model: nn.Module, run: Callable[[nn.Module], None]) -> Discovery:
    """Run ``run(model)`` with attention computations intercepted; charge each to its module."""
    names = {id(m): n for n, m in model.named_modules()}
    holders = _weight_holders(model)
    stack = []                       # (module, args, kwargs)
    found = Discovery()
    saved_calls = {}

    def owners():
        return tuple(names[id(m)] for m, _, _ in reversed(stack) if id(m) in holders and id(m) in names)

    def on_event(ev: Event):
        chain = ev.owners
        if not chain:
            return
        inner = chain[0]
        if inner not in found.owners:
            found.owners[inner] = dict(model.named_modules())[inner]
            found.chains[inner] = chain
        found.kinds.setdefault(inner, set()).add(ev.kind)
        for m, args, kwargs in stack:
            n = names.get(id(m))
            if n in chain and n not in saved_calls:
                saved_calls[n] = (_snapshot(args), _snapshot(kwargs))

    def pre(mod, args, kwargs):
        stack.append((mod, args, kwargs))

    def post(mod, args, kwargs, out):
        if stack and stack[-1][0] is mod:
            stack.pop()

    handles = []
    for m in model.modules():
        handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(m.register_forward_hook(post, with_kwargs=True, always_call=True))
    try:
        with torch.enable_grad(), Interceptor(on_event, owners):
            run(model)
    finally:
        for h in handles:
            h.remove()
    found.calls = saved_calls
    covered = set(found.owners)
    for n, m in model.named_modules():
        if (ATTENTION_NAME.search(type(m).__name__) and not LINEAR_ATTENTION_NAME.search(type(m).__name__)
                and id(m) in holders
                and not any(n == o or n.startswith(o + ".") or o.startswith(n + ".") or n == "" for o in covered)):
            found.name_only.append(n)
    # keep only the outermost of nested attention-named leftovers
    found.name_only = [n for n in found.name_only if not any(n.startswith(o + ".") for o in found.name_only)]
    return found


# ------------------------------------------------------------------------------------------------
# reading Q/K/V weights from gradients

@dataclass
class RoleReading:
    """Where one of Q, K, V comes from: a weight matrix and, per distinct head, its rows."""

    weight: Optional[str]           # parameter name, relative to the model (None: rule "learned")
    split: int                      # its first ``split`` dimensions index the matrix rows, the rest the columns
    transposed: bool                # stored [in, out] (GPT-2 Conv1D) rather than [out, in]
    heads: list                     # per distinct head: its rows (in the order the attention sees them)
    rule: str                       # "support" (exact), "dominant row", or "learned" (no projection)
    biases: list                    # [(parameter name, [indices])]
    learned: Optional[str] = None   # rule "learned": the parameter that is this tensor itself

    @property
    def rows(self) -> list:
        return sorted({r for h in self.heads for r in h})


@dataclass
class AttentionReading:
    name: str
    cls: str
    kinds: tuple
    q: RoleReading
    k: RoleReading
    v: RoleReading


def _matrix_view(p: torch.Tensor, split: int) -> torch.Tensor:
    """``p`` as a matrix: its first ``split`` dimensions are the rows (``[out, in, 1, 1]`` convs: split 1)."""
    rows = 1
    for s in p.shape[:split]:
        rows *= s
    return p.reshape(rows, -1)


def _heads_by_support(U: torch.Tensor, H: int, d: int):
    """Per distinct head, its rows, if each head's elements draw on exactly d rows disjoint from the others'."""
    supp = U > SUPPORT_RTOL * U.amax()
    heads, seen = [], []
    for h in range(H):
        rows = torch.nonzero(supp[h * d:(h + 1) * d].any(0)).flatten().tolist()
        if len(rows) != d:
            return None
        if rows in seen:
            continue
        if any(set(rows) & set(s) for s in seen):
            return None
        seen.append(rows)
        # order: each element's row where its support is one row, else its dominant row
        order = [int(U[h * d + i].argmax()) for i in range(d)]
        heads.append(order if sorted(order) == rows else rows)
    return heads


def _heads_by_dominant(U: torch.Tensor, H: int, d: int):
    top = U.topk(min(2, U.shape[1]), dim=1).values
    if U.shape[1] > 1 and not bool((top[:, 0] > DOMINANCE * top[:, 1]).all()):
        return None
    arg = U.argmax(1).tolist()
    heads = []
    for h in range(H):
        rows = arg[h * d:(h + 1) * d]
        if len(set(rows)) != d:
            return None
        if rows in heads:
            continue
        if any(set(rows) & set(s) for s in heads):
            return None
        heads.append(rows)
    return heads


def _rank_one_with_vector_input(M: torch.Tensor) -> bool:
    """Each element's gradient ``M[e] [out, in]`` is ``u x^T`` with ``x`` a vector (at least two nonzero
    entries): the gradient of a projection's output wrt its matrix. An additive term (one entry per
    element) or a matrix upstream of another one (rows that mix) is not."""
    norms = M.norm(dim=-1)                                          # [E, out]
    top = norms.argmax(-1)
    v = M[torch.arange(M.shape[0]), top]                            # [E, in]
    vmax = v.abs().amax(-1, keepdim=True)
    if not bool((vmax > 0).all()) or not bool(((v.abs() > SUPPORT_RTOL * vmax).sum(-1) >= 2).all()):
        return False
    v = v / v.norm(dim=-1, keepdim=True)
    residual = M - (M @ v[:, :, None]) * v[:, None, :]
    return bool((residual.abs().amax((1, 2)) <= RANK_ONE_RTOL * norms.amax(-1)).all())


def _read_role(role: str, grads: dict, H: int, d: int, norm_params: set) -> RoleReading:
    """grads: parameter name -> gradient [H*d, *shape] of the role's first-token elements."""
    found = {"support": [], "dominant row": []}
    for name, g in grads.items():
        if g is None or g.dim() < 3 or not g.any():
            continue
        for split in range(1, g.dim() - 1):
            G = g.reshape(g.shape[0], *_matrix_view(g[0], split).shape)
            for transposed in (False, True):
                M = G.transpose(1, 2) if transposed else G            # [E, out, in]
                if not _rank_one_with_vector_input(M):
                    continue
                U = M.abs().amax(-1).double()                          # [E, out]
                heads = _heads_by_support(U, H, d)
                if heads is not None:
                    found["support"].append((name, split, transposed, heads))
                    continue
                heads = _heads_by_dominant(U, H, d)
                if heads is not None:
                    found["dominant row"].append((name, split, transposed, heads))
    for rule in ("support", "dominant row"):
        hits = {}
        for n, sp, t, h in found[rule]:
            # one parameter may read as a matrix in two ways (XLNet's [D, H, d] as [D, H*d] and as
            # [D*H, d]); the wrong one puts every head on the same rows, so the most heads wins
            if n not in hits or len(h) > len(hits[n][2]):
                hits[n] = (sp, t, h)
        if len(hits) == 1:
            name, (split, transposed, heads) = next(iter(hits.items()))
            break
        if len(hits) > 1:
            raise Unreadable(f"{role}: several weight matrices read as its projection ({', '.join(hits)})")
    else:
        learned = [n for n, g in grads.items() if g is not None and g.any()
                   and bool(((g != 0).reshape(g.shape[0], -1).sum(1) == 1).all())]
        dep = [n for n, g in grads.items() if g is not None and g.any() and g.dim() >= 3]
        if len(learned) == 1 and dep == learned:
            # the query (or key/value) is a parameter itself, as in attention pooling with a learned query:
            # there is no projection matrix to condition
            return RoleReading(None, 0, False, [], "learned", [], learned=learned[0])
        raise Unreadable(f"{role}: no weight matrix reads as its projection (it depends on {dep or 'no weight'})")
    biases = []
    for bname, g in grads.items():
        if g is None or g.dim() != 2 or "bias" not in bname.rsplit(".", 1)[-1] or bname in norm_params:
            continue
        idx = torch.nonzero((g != 0).any(0)).flatten().tolist()
        if idx:
            biases.append((bname, idx))
    return RoleReading(name, split, transposed, heads, rule, biases)


def _fill_zeros(x, g: torch.Generator):
    """Floating tensors that are all zero (DETR's first decoder input, ...) replaced by random ones:
    a projection of a zero input has a zero gradient, which would hide where it is read from."""
    if isinstance(x, torch.Tensor):
        if x.is_floating_point() and x.numel() > 1 and not bool(x.any()):
            return torch.randn(x.shape, generator=g, dtype=x.dtype)
        return x
    if isinstance(x, tuple) and not hasattr(x, "_fields"):
        return tuple(_fill_zeros(v, g) for v in x)
    if isinstance(x, list):
        return [_fill_zeros(v, g) for v in x]
    if type(x) is dict:
        return {k: _fill_zeros(v, g) for k, v in x.items()}
    return x


def _read_role_at_some_token(role: str, t: torch.Tensor, params: list, prefix: str, norm_params: set) -> RoleReading:
    """Read ``role`` from token 0 of ``t [B, H, N, d]``; from tokens 1, last, middle when token 0's input
    is zero (a class token initialized to zero; detection tokens appended at the end, ...)."""
    if not _computed(t):
        raise Unreadable(f"{role}: does not depend on the module's parameters")
    n = t.shape[2]
    err = None
    for tok in dict.fromkeys((0, min(1, n - 1), n - 1, n // 2)):
        part = t[0, :, tok, :]
        grads = _jacobian(part.reshape(-1), [p for _, p in params])
        per = {prefix + pn: g for (pn, _), g in zip(params, grads)}
        try:
            found = _read_role(role, per, part.shape[0], part.shape[1], norm_params)
        except Unreadable as e:
            err = e
            if "no weight matrix" not in str(e):
                raise
            continue
        if found.split >= 2:
            # rows indexed by several dimensions: a stack of expert matrices, of which a token reads
            # those it is routed to (JetMoE's query experts); every token is read, the heads united
            for other in range(n):
                grads = _jacobian(t[0, :, other, :].reshape(-1), [p for _, p in params])
                per = {prefix + pn: g for (pn, _), g in zip(params, grads)}
                more = _read_role(role, per, part.shape[0], part.shape[1], norm_params)
                if (more.weight, more.split, more.transposed) != (found.weight, found.split, found.transposed):
                    raise Unreadable(f"{role}: token {other} reads as {more.weight}, token {tok} as {found.weight}")
                found.heads += [h for h in more.heads if sorted(h) not in [sorted(o) for o in found.heads]]
                found.biases += [b for b in more.biases if b not in found.biases]
        return found
    raise err


def read_module(model: nn.Module, name: str, call, kinds=()) -> list:
    """Run module ``name`` again on ``call = (args, kwargs)``; read Q/K/V of each attention it computes."""
    mod = dict(model.named_modules())[name]
    events = []
    g = torch.Generator().manual_seed(0)
    args, kwargs = _fill_zeros(_snapshot(call[0]), g), _fill_zeros(_snapshot(call[1]), g)
    try:
        with torch.enable_grad(), Interceptor(events.append):
            mod(*args, **kwargs)
    except Exception as e:  # the reason goes into the report; the check then fails
        raise Unreadable(f"running it again on its own inputs failed: {type(e).__name__}: {e}") from e
    if not events:
        raise Unreadable("no attention computation when run again on its own inputs")
    params = [(n, p) for n, p in mod.named_parameters() if p.requires_grad and p.is_floating_point()]
    if not params:
        raise Unreadable("holds no trainable floating parameter")
    prefix = name + "." if name else ""
    norm_params = {prefix + n for mn, m in mod.named_modules() if "norm" in type(m).__name__.lower()
                   for n in (mn + "." + pn if mn else pn for pn, _ in m.named_parameters(recurse=False))}
    readings = []
    for ev in events:
        roles = [_read_role_at_some_token(role, t, params, prefix, norm_params)
                 for role, t in zip("qkv", (ev.q, ev.k, ev.v))]
        r = AttentionReading(name, type(mod).__name__, tuple(sorted(kinds or {ev.kind})), *roles)
        if not any(_same_reading(r, o) for o in readings):
            readings.append(r)
    return readings


def _same_reading(a: AttentionReading, b: AttentionReading) -> bool:
    return all((x.weight, x.heads) == (y.weight, y.heads) for x, y in ((a.q, b.q), (a.k, b.k), (a.v, b.v)))


def _jacobian(flat: torch.Tensor, params: list) -> list:
    eye = torch.eye(flat.numel(), dtype=flat.dtype)
    try:
        grads = torch.autograd.grad(flat, params, grad_outputs=eye, is_grads_batched=True,
                                    allow_unused=True, retain_graph=True)
    except RuntimeError:
        rows = [torch.autograd.grad(flat[i], params, allow_unused=True, retain_graph=True) for i in range(flat.numel())]
        grads = [None if rows[0][j] is None else torch.stack([r[j] if r[j] is not None else torch.zeros_like(params[j])
                                                               for r in rows]) for j in range(len(params))]
    return [None if g is None else g.detach() for g in grads]


# ------------------------------------------------------------------------------------------------
# the whole reading of a model, and the check

@dataclass
class ModelReading:
    attention: list = field(default_factory=list)   # AttentionReading
    unread: dict = field(default_factory=dict)      # module name -> why it could not be read
    name_only: list = field(default_factory=list)   # attention-named modules where no attention was seen

    @property
    def has_attention(self) -> bool:
        return bool(self.attention or self.unread or self.name_only)

    def problems(self) -> list:
        out = [f"{n}: not read: {why}" for n, why in self.unread.items()]
        out += [f"{n}: attention-named module holding weights, but no attention computation was seen in it"
                for n in self.name_only]
        return out


def read_model(model: nn.Module, run: Callable[[nn.Module], None]) -> ModelReading:
    """Find and read every attention module of ``model`` (run by ``run``), independently of condinit."""
    found = discover(model, run)
    reading = ModelReading(name_only=list(found.name_only))
    for name in found.owners:
        chain = found.chains[name]
        errors = []
        for outer in chain[:3]:
            if outer not in found.calls:
                continue
            try:
                reading.attention.extend(read_module(model, outer, found.calls[outer], found.kinds[name]))
                break
            except Unreadable as e:
                errors.append(f"{outer or '<root>'}: {e}")
        else:
            reading.unread[name] = "; ".join(errors) or "its inputs were not captured"
    # a module read twice (through two of its children) counts once
    uniq = []
    for r in reading.attention:
        if not any(_same_reading(r, o) for o in uniq):
            uniq.append(r)
    reading.attention = uniq
    return reading


def state_snapshot(model: nn.Module) -> dict:
    return {n: t.detach().clone() for n, t in model.state_dict(keep_vars=True).items()}


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bits (so NaN == NaN, and -0.0 != 0.0)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def _conv_groups(model: nn.Module, pname: str) -> int:
    """``groups`` of the convolution whose weight ``pname`` is (1 for anything else)."""
    owner, _, attr = pname.rpartition(".")
    mod = model.get_submodule(owner) if owner else model
    if attr == "weight" and isinstance(mod, nn.modules.conv._ConvNd):
        return mod.groups
    return 1


def _param_rows(p: torch.Tensor, rows: list, split: int, transposed: bool, groups: int = 1) -> torch.Tensor:
    """The matrix rows ``rows`` of ``p``, over all the input channels: for a grouped convolution
    (torch's semantics: output channel ``r`` of ``groups`` equal groups reads the input channels of
    group ``r // (out / groups)`` only) the row is widened to ``[in]`` with zeros outside them."""
    m = _matrix_view(p.detach(), split).float()
    m = (m[:, rows].T if transposed else m[rows]).double()
    if groups == 1:
        return m
    out, width = p.shape[0], m.shape[1]
    full = m.new_zeros(m.shape[0], width * groups)
    for i, r in enumerate(rows):
        g = r // (out // groups)
        full[i, g * width:(g + 1) * width] = m[i]
    return full


def check_conditioned(model: nn.Module, reading: ModelReading, before: dict) -> list:
    """Everything that is not as the method says, as messages (empty: conditioned)."""
    failures = list(reading.problems())
    params = dict(model.named_parameters())
    changed_ok = {}                                 # parameter name -> (mask of entries allowed to change)
    for r in reading.attention:
        for role, rr in (("Q", r.q), ("K", r.k), ("V", r.v)):
            if rr.weight is None:      # a learned query: nothing to condition, it must stay as it was
                continue
            p = params[rr.weight]
            mask = changed_ok.setdefault(rr.weight, torch.zeros(p.shape, dtype=torch.bool))
            flat_mask = _matrix_view(mask, rr.split)
            if rr.transposed:
                flat_mask[:, rr.rows] = True
            else:
                flat_mask[rr.rows] = True
            for bname, idx in rr.biases:
                bmask = changed_ok.setdefault(bname, torch.zeros(params[bname].shape, dtype=torch.bool))
                bmask[idx] = True
                b = params[bname].detach()[idx]
                if bool((b != 0).any()):
                    failures.append(f"{r.name}: {role} bias {bname} not zero (max |b| {b.abs().max().item():.3g})")
            if role in "QK":
                for h, rows in enumerate(rr.heads):
                    w = _param_rows(p, rows, rr.split, rr.transposed, _conv_groups(model, rr.weight))
                    # semi-orthogonal: every singular value 1 (orthonormal columns if the head is wider than its input)
                    gram = w @ w.T if w.shape[0] <= w.shape[1] else w.T @ w
                    err = (gram - torch.eye(gram.shape[0], dtype=w.dtype)).abs().max().item()
                    if not err <= ORTHO_ATOL:
                        failures.append(f"{r.name}: {role} head {h} ({rr.weight}) not semi-orthogonal: "
                                        f"max |W W^T - I| = {err:.3g}")
                        break
    # V over the whole projection: the value heads of every attention computation of the module that
    # read it, in the order the attention sees them (one computation may read half of the heads)
    v_heads = {}
    for r in reading.attention:
        if r.v.weight is not None:
            heads = v_heads.setdefault((r.name, r.v.weight, r.v.split, r.v.transposed), [])
            heads += [h for h in r.v.heads if h not in heads]
    for (name, weight, split, transposed), heads in v_heads.items():
        w = _param_rows(params[weight], [x for h in heads for x in h], split, transposed, _conv_groups(model, weight))
        eye = torch.eye(*w.shape, dtype=w.dtype)
        if not torch.equal(w, eye):
            failures.append(f"{name}: V ({weight}, {w.shape[0]} rows in attention order) is not the "
                            f"rectangular identity (max |W - I| = {(w - eye).abs().max().item():.3g})")
    for n, t in model.state_dict(keep_vars=True).items():
        old = before[n]
        new = t.detach()
        if n in changed_ok:
            keep = ~changed_ok[n]
            if old.shape != new.shape or not bit_equal(old[keep], new[keep]):
                failures.append(f"{n}: entries outside the Q/K/V rows changed")
        elif not bit_equal(old, new):
            failures.append(f"{n}: changed, but it is not a Q/K/V weight or bias")
    return failures


# ------------------------------------------------------------------------------------------------
# a per-model time cap

class ModelTimeout(Exception):
    pass


@contextlib.contextmanager
def time_cap(seconds: float):
    """Raise ModelTimeout in the main thread after ``seconds`` of wall time (POSIX; elsewhere no cap)."""
    if not hasattr(signal, "SIGALRM"):
        yield
        return

    def alarm(signum, frame):
        raise ModelTimeout(f"over the {seconds:.0f} s per-model cap")
    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


# ------------------------------------------------------------------------------------------------
# tiny models: transformers (every architecture of its auto mappings), timm, torch.nn

HIDDEN, HEADS, HEAD_DIM, INTER, VOCAB, EXPERTS = 32, 2, 16, 48, 256, 4
SPECIAL_TOP = 32            # ids VOCAB-SPECIAL_TOP.. are kept for special tokens; inputs draw below
TOKENS = 6                  # sequence length of text inputs
IMAGE, PATCH = 32, 8

_SET = (  # (tiny value, attribute names)
    (HIDDEN, ("hidden_size", "d_model", "n_embd", "embed_dim", "emb_dim", "dim", "hidden_dim", "word_embed_proj_dim",
             "encoder_hidden_size", "decoder_hidden_size", "projection_dim", "d_embed", "n_embed",
             "embedding_size", "text_embed_dim", "vision_embed_dim", "audio_embed_dim", "output_hidden_size",
             "out_hidden_size", "projector_hidden_size", "encoder_embed_dim", "decoder_embed_dim")),
    (1, ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "encoder_layers", "decoder_layers",
        "num_encoder_layers", "num_decoder_layers", "depth", "decoder_num_hidden_layers", "num_text_layers",
        "num_vision_layers", "text_layers", "vision_layers", "num_mtp_layers", "num_nextn_predict_layers_unused")),
    (HEADS, ("num_attention_heads", "n_head", "num_heads", "n_heads", "encoder_attention_heads",
            "decoder_attention_heads", "num_decoder_attention_heads", "decoder_num_attention_heads",
            "text_num_heads", "vision_num_heads")),
    (HEAD_DIM, ("head_dim", "d_kv", "attention_head_dim", "kv_channels", "attention_head_size", "v_head_dim",
               "qk_head_dim", "index_head_dim", "dim_head", "key_dim", "global_head_dim")),
    (INTER, ("intermediate_size", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "n_inner", "d_ff",
            "moe_intermediate_size", "shared_expert_intermediate_size", "decoder_intermediate_size",
            "ffn_hidden_size", "mlp_dim", "dim_feedforward", "intermediate_dim", "expert_intermediate_size")),
    (EXPERTS, ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")),
    (2, ("num_experts_per_tok", "moe_topk", "index_n_heads")),
    (8, ("qk_rope_head_dim", "qk_nope_head_dim", "index_topk")),
    (24, ("kv_lora_rank", "q_lora_rank")),
    (16, ("max_source_positions", "num_conv_pos_embeddings", "linear_key_head_dim", "linear_value_head_dim",
          "mamba_d_head")),
    (8, ("rotary_dim",)),
    (4, ("mamba_n_heads",)),
)

_SET_ONE = ("n_group", "topk_group", "n_shared_experts", "num_shared_experts", "num_conv_pos_embedding_groups")
_STANDARD_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "unk_token_id", "sep_token_id", "cls_token_id",
                 "mask_token_id", "decoder_start_token_id")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def shrink_config(cfg, _seen=None):
    """Set every known size attribute of ``cfg`` and its sub-configs to a tiny value (in place)."""
    from transformers import PretrainedConfig
    _seen = set() if _seen is None else _seen
    if id(cfg) in _seen:
        return cfg
    _seen.add(id(cfg))
    attrs = vars(cfg)
    heads_before = attrs.get("num_attention_heads")
    for key, val in list(attrs.items()):
        if isinstance(val, PretrainedConfig):
            shrink_config(val, _seen)
            continue
        if _is_int(val):
            for new, keys in _SET:
                if key in keys:
                    setattr(cfg, key, new)
            if key in _SET_ONE:
                setattr(cfg, key, 1)
            if key in ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num",
                       "linear_num_key_heads", "linear_num_value_heads"):
                grouped = _is_int(heads_before) and val < heads_before
                setattr(cfg, key, 1 if grouped else HEADS)
            if key in ("vocab_size", "n_words", "vocab_size_per_layer_input") and val > VOCAB:
                setattr(cfg, key, VOCAB)
            if key == "image_size":
                setattr(cfg, key, IMAGE)
            if key == "patch_size" and val > 1:
                setattr(cfg, key, PATCH if val >= PATCH else val)
        elif isinstance(val, (list, tuple)) and val and all(_is_int(v) for v in val):
            if key == "depths":
                setattr(cfg, key, type(val)([1] * len(val)))
            elif key in ("num_heads", "num_attention_heads", "encoder_attention_heads"):
                setattr(cfg, key, type(val)([HEADS] * len(val)))
            elif key in ("hidden_sizes", "embed_dims", "conv_dim", "encoder_hidden_sizes"):
                setattr(cfg, key, type(val)([HIDDEN] * len(val)))
            elif key == "image_size":
                setattr(cfg, key, type(val)([IMAGE] * len(val)))
    if getattr(cfg, "model_type", None) == "timm_backbone" and str(attrs.get("backbone", "")).startswith("resnet"):
        cfg.backbone = "test_resnet"        # timm's 0.4M-parameter test ResNet, four stages like resnet50
    periodic = [k for k, v in attrs.items() if k.endswith("_layer_period") and _is_int(v)]
    for key in periodic:               # e.g. an attention layer every 8th layer, from the 4th: keep one of each
        setattr(cfg, key, 2)
        offset = key.replace("_period", "_offset")
        if _is_int(attrs.get(offset)):
            setattr(cfg, offset, min(attrs[offset], 1))
    if periodic:
        for key in ("num_hidden_layers", "num_layers", "n_layer"):
            if _is_int(attrs.get(key)):
                setattr(cfg, key, 2)
    if isinstance(attrs.get("depths"), (list, tuple)):
        # hierarchical vision models double the width per stage: start narrower
        for key in ("embed_dim", "hidden_size"):
            if _is_int(attrs.get(key)):
                setattr(cfg, key, HIDDEN // 2)
    if _is_int(attrs.get("window_size")) and isinstance(attrs.get("depths"), (list, tuple)):
        # windowed hierarchical vision models: every stage at least one 2x2 window wide
        cfg.window_size = 2
        patch = _first_int(attrs.get("patch_size"), default=4)
        cfg.image_size = patch * 2 * 2 ** (len(attrs["depths"]) - 1)
    layer_types = attrs.get("layer_types")
    if isinstance(layer_types, (list, tuple)) and layer_types:
        distinct = list(dict.fromkeys(layer_types))
        cfg.layer_types = type(layer_types)(distinct)
        for key in ("num_hidden_layers", "num_layers", "n_layer"):
            if _is_int(attrs.get(key)):
                setattr(cfg, key, len(distinct))
    if _is_int(attrs.get("kv_lora_rank")) and _is_int(attrs.get("head_dim")):
        cfg.head_dim = attrs.get("qk_rope_head_dim", cfg.head_dim)   # multi-head latent attention: rotary dim
    rope = attrs.get("rope_parameters") or attrs.get("rope_scaling")
    multimodal_rope = "mrope_section" in getattr(type(cfg), "ignore_keys_at_rope_validation", ())
    if isinstance(rope, dict) and (isinstance(rope.get("mrope_section"), (list, tuple)) or multimodal_rope):
        sec = rope.get("mrope_section") or [16, 24, 24]
        head_dim = attrs.get("head_dim") or HEAD_DIM
        factor = rope.get("partial_rotary_factor", attrs.get("partial_rotary_factor", 1.0)) or 1.0
        half = int(head_dim * factor) // 2
        base = [half // len(sec)] * len(sec)
        base[0] += half - sum(base)
        rope["mrope_section"] = base
    _remap_special_ids(cfg)
    return cfg


def _remap_special_ids(cfg):
    vocab = getattr(cfg, "vocab_size", None)
    if not _is_int(vocab):
        return
    nxt = [vocab - 1]

    def fresh(v, key):
        if key in _STANDARD_IDS and 0 <= v < vocab - SPECIAL_TOP:
            return v
        nxt[0] -= 1
        return max(nxt[0] + 1, 0)
    for key, val in list(vars(cfg).items()):
        if not (key.endswith("_token_id") or key.endswith("_token_index") or key.endswith("_token_ids")):
            continue
        if _is_int(val):
            setattr(cfg, key, fresh(val, key))
        elif isinstance(val, list) and all(_is_int(v) for v in val):
            setattr(cfg, key, [fresh(v, key) for v in val])


def _first_int(*vals, default):
    for v in vals:
        if _is_int(v):
            return v
        if isinstance(v, (list, tuple)) and v and _is_int(v[0]):
            return v[0]
    return default


def _text_ids(cfg, n=TOKENS):
    vocab = _first_int(getattr(cfg, "vocab_size", None), default=VOCAB)
    hi = max(vocab - SPECIAL_TOP, 8)
    avoid = set()
    for k in _STANDARD_IDS:
        v = getattr(cfg, k, None)
        avoid.update(v if isinstance(v, (list, tuple)) else [v])
    ids = [i for i in range(4, hi) if i not in avoid][:64]
    g = torch.Generator().manual_seed(0)
    return torch.tensor(ids)[torch.randint(0, len(ids), (1, n), generator=g)]


INPUT_NAMES = ("input_ids", "pixel_values", "pixel_values_videos", "input_values", "input_features", "past_values")


def _forward_params(mod: nn.Module) -> list:
    import inspect
    try:
        return list(inspect.signature(mod.forward).parameters)
    except (TypeError, ValueError):
        return []


def _configs(cfg) -> list:
    """``cfg`` and its sub-configs, depth first."""
    from transformers import PretrainedConfig
    out, todo = [], [cfg]
    while todo:
        c = todo.pop(0)
        if id(c) not in {id(o) for o in out}:
            out.append(c)
            todo += [v for v in vars(c).values() if isinstance(v, PretrainedConfig)]
    return out


def _modality_input(cfg, name: str, g: torch.Generator):
    """A tiny tensor for the input ``name`` of a model configured by ``cfg``; None if it cannot say."""
    vcfg = getattr(cfg, "vision_config", None) or cfg
    acfg = getattr(cfg, "audio_config", None) or cfg
    if name == "input_ids":
        tcfg = getattr(cfg, "text_config", None) or cfg
        return _text_ids(tcfg) if _is_int(getattr(tcfg, "vocab_size", None)) else None
    if name in ("pixel_values", "pixel_values_videos"):
        size = _first_int(getattr(vcfg, "image_size", None), getattr(cfg, "image_size", None), default=IMAGE)
        ch = _first_int(getattr(vcfg, "num_channels", None), getattr(cfg, "num_channels", None), default=3)
        frames = _first_int(getattr(vcfg, "num_frames", None), default=0)
        if name == "pixel_values_videos" or frames:
            return torch.randn(1, max(frames, 2), ch, size, size, generator=g)
        return torch.randn(1, ch, size, size, generator=g)
    if name == "input_values":
        return torch.randn(1, 1600, generator=g)
    if name == "input_features":
        mel = _first_int(*(getattr(c, k, None) for c in _configs(acfg)
                           for k in ("num_mel_bins", "feature_size", "input_feat_per_channel", "n_mels")), default=80)
        frames = 2 * _first_int(getattr(acfg, "max_source_positions", None), default=16)
        return torch.randn(1, mel, frames, generator=g)
    if name == "past_values":
        length = _first_int(getattr(cfg, "context_length", None), default=32)
        channels = _first_int(getattr(cfg, "num_input_channels", None), getattr(cfg, "input_size", None), default=1)
        return torch.randn(1, length, channels, generator=g)
    return None


GRID_NAMES = ("grid_thw", "image_grid_thw")


def _patch_grid_inputs(cfg, params: list, g: torch.Generator) -> dict:
    """Vision towers fed flattened patches and a (t, h, w) grid (Qwen2-VL style)."""
    vcfg = getattr(cfg, "vision_config", None) or cfg
    patch = _first_int(getattr(vcfg, "patch_size", None), default=PATCH)
    tp = _first_int(getattr(vcfg, "temporal_patch_size", None), default=1)
    ch = _first_int(getattr(vcfg, "in_channels", None), getattr(vcfg, "in_chans", None),
                    getattr(vcfg, "num_channels", None), default=3)
    merge = _first_int(getattr(vcfg, "spatial_merge_size", None), default=1)
    side = 2 * merge
    pixels = torch.randn(side * side, ch * tp * patch * patch, generator=g)
    first = next(p for p in params if p not in ("self",))
    grid_name = next(p for p in params if p in GRID_NAMES)
    return {first: pixels, grid_name: torch.tensor([[1, side, side]])}


def input_attempts(model: nn.Module, main: Optional[str] = None) -> list:
    """Tiny inputs for ``model`` (a transformers model, or a part with a ``config``), most complete first:
    every modality its forward takes, then its main input alone."""
    cfg = model.config
    params = _forward_params(model)
    main = main or getattr(model, "main_input_name", "input_ids")
    if main not in params:
        main = next((p for p in params if p in INPUT_NAMES), None)
    g = torch.Generator().manual_seed(0)
    attempts = []
    if any(p in GRID_NAMES for p in params) and params and params[0] != "input_ids":
        attempts.append(_patch_grid_inputs(cfg, params, g))
    base = {}
    t = _modality_input(cfg, main, g) if main else None
    if t is not None:
        base[main] = t
    full = dict(base)
    for name in ("input_ids", "pixel_values", "input_features", "input_values"):
        if name in params and name not in full:
            sub = {"input_ids": "text_config", "pixel_values": "vision_config",
                   "input_features": "audio_config", "input_values": "audio_config"}[name]
            if getattr(cfg, sub, None) is not None:
                t = _modality_input(cfg, name, g)
                if t is not None:
                    full[name] = t
    attempts += [full] if full != base else []
    attempts.append(base)
    if main == "input_features" and main in base:
        attempts.append({main: base[main].transpose(1, 2).contiguous()})     # [1, frames, mel] encoders
    for a in attempts:
        for mask in ("input_features_mask", "feature_attention_mask", "attention_mask"):
            if mask in params and "input_features" in a and "input_ids" not in a:
                frames = a["input_features"].shape[2 if a["input_features"].shape[1] == _modality_input(
                    cfg, "input_features", torch.Generator()).shape[1] else 1]
                a[mask] = torch.ones(1, frames, dtype=torch.long)
                break
        if getattr(cfg, "is_encoder_decoder", False) and "decoder_input_ids" in params:
            a["decoder_input_ids"] = _text_ids(getattr(cfg, "decoder", None) or cfg, 4)
        if "use_cache" in params:
            a["use_cache"] = False
    return attempts


def hf_run(model: nn.Module) -> list:
    """Forward ``model`` on a tiny input, then each part the first forward did not reach that has a
    ``config`` and takes one of :data:`INPUT_NAMES` (a vision tower, an audio encoder, ...).

    Returns the errors, one line per failed forward.
    """
    reached, entered = set(), set()     # modules run by a forward that succeeded / by the current attempt
    handles = [m.register_forward_pre_hook(lambda mod, args: entered.add(id(mod))) for m in model.modules()]
    errors = []

    def forward(mod, what, main=None):
        first = None
        try:
            attempts = input_attempts(mod, main)
        except Exception as e:  # recorded: no input, no verification
            errors.append(f"{what}: the sweep builds no input for it: {type(e).__name__}: {e}")
            return
        for inputs in attempts:
            entered.clear()
            try:
                mod(**inputs)
                reached.update(entered)
                return
            except ModelTimeout:
                raise
            except Exception as e:  # recorded if no attempt works: a model whose forward fails is not verified
                first = first or e
        msg = str(first).splitlines()[0][:200] if str(first) else ""
        errors.append(f"{what} forward failed: {type(first).__name__}: {msg}")

    try:
        forward(model, type(model).__name__)
        done = []
        for n, m in model.named_modules():
            if not n or id(m) in reached or any(n.startswith(d + ".") for d in done) or not hasattr(m, "config"):
                continue
            params = _forward_params(m)
            main = next((p for p in params if p in INPUT_NAMES), None)
            if main is None and any(p in GRID_NAMES for p in params):
                main = "pixel_values"
            if main is None:
                continue
            done.append(n)
            forward(m, f"{n} ({type(m).__name__})", main)
    finally:
        for h in handles:
            h.remove()
    return errors


def hf_model_class(model_type: str):
    import transformers
    from transformers.models.auto import modeling_auto
    names = modeling_auto.MODEL_MAPPING_NAMES.get(model_type)
    if names is None:
        for attr in dir(modeling_auto):
            mapping = getattr(modeling_auto, attr)
            if attr.startswith("MODEL_") and attr.endswith("_MAPPING_NAMES") and isinstance(mapping, dict) \
                    and model_type in mapping:
                names = mapping[model_type]
                break
    name = names[0] if isinstance(names, (list, tuple)) else names
    return getattr(transformers, name)


def hf_config(model_type: str):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    return shrink_config(CONFIG_MAPPING[model_type]())


def _set(**values):
    def fix(cfg):
        for k, v in values.items():
            setattr(cfg, k, v)
    return fix


# Per-architecture corrections to the shrunk config, where the generic sizes break an invariant.
CONFIG_FIXES = {
    "codegen": _set(n_head=4),                       # its fused qkv is split in 4 model-parallel groups
    "mamba2": _set(num_heads=4),                     # num_heads * head_dim == expand * hidden_size
    "squeezebert": _set(num_attention_heads=8),      # two heads in each of the 4 conv groups, as in its default
}


def build_hf(model_type: str) -> nn.Module:
    """The base model of ``model_type`` from its default config, shrunk, on CPU in fp32, eval mode."""
    cfg = hf_config(model_type)
    if model_type in CONFIG_FIXES:
        CONFIG_FIXES[model_type](cfg)
    cls = hf_model_class(model_type)
    torch.manual_seed(0)
    model = cls._from_config(cfg, dtype=torch.float32)
    return model.eval()


def _timm(name: str, **kw) -> Callable[[], nn.Module]:
    def build():
        import timm
        torch.manual_seed(0)
        return timm.create_model(name, pretrained=False, num_classes=4, **kw).eval()
    return build


def _image_run(size: int) -> Callable[[nn.Module], list]:
    def run(model):
        model(torch.randn(1, 3, size, size, generator=torch.Generator().manual_seed(0)))
        return []
    return run


TIMM = {  # family -> (builder, run)
    "vit": (_timm("vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2), 32),
    "vit (global_pool='map')": (_timm("vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=1,
                                      num_heads=2, global_pool="map"), 32),
    "deit (distilled)": (_timm("deit_tiny_distilled_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=1,
                               num_heads=2), 32),
    "swin": (_timm("swin_tiny_patch4_window7_224", img_size=32, patch_size=4, embed_dim=32, depths=(1, 1),
                   num_heads=(2, 2), window_size=2), 32),
    "eva02": (_timm("eva02_tiny_patch14_224", img_size=28, patch_size=14, embed_dim=32, depth=1, num_heads=2), 28),
    "beit": (_timm("beit_base_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2), 32),
    "convit": (_timm("convit_tiny", img_size=32, patch_size=8, embed_dim=32, depth=2, local_up_to_layer=1,
                     num_heads=2), 32),
    "cait": (_timm("cait_xxs24_224", img_size=32, patch_size=8, embed_dim=32, depth=1, depth_token_only=1,
                   num_heads=2), 32),
    "xcit": (_timm("xcit_nano_12_p16_224", img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2,
                   cls_attn_layers=1), 32),
}


def _seq(*shapes):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(*s, generator=g) for s in shapes]


TORCH_NN = {  # name -> (builder, run)
    "MultiheadAttention": (lambda: nn.MultiheadAttention(32, 2, batch_first=True),
                           lambda m: m(*_seq((1, 6, 32)) * 3)),
    "MultiheadAttention (kdim, vdim)": (lambda: nn.MultiheadAttention(32, 2, kdim=24, vdim=40, batch_first=True),
                                        lambda m: m(*_seq((1, 6, 32), (1, 5, 24), (1, 5, 40)))),
    "TransformerEncoderLayer": (lambda: nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True),
                                lambda m: m(*_seq((1, 6, 32)))),
    "TransformerDecoderLayer": (lambda: nn.TransformerDecoderLayer(32, 2, 64, dropout=0.0, batch_first=True),
                                lambda m: m(*_seq((1, 6, 32), (1, 5, 32)))),
    "Transformer": (lambda: nn.Transformer(32, 2, 1, 1, 64, dropout=0.0, batch_first=True),
                    lambda m: m(*_seq((1, 6, 32), (1, 5, 32)))),
}


@dataclass
class Arch:
    """One architecture of the sweep: ``build()`` a tiny model, ``run(model)`` forwards it (returns errors)."""

    name: str                 # "transformers:llama", "timm:vit", "torch.nn:Transformer"
    build: Callable[[], nn.Module]
    run: Callable[[nn.Module], list]


def _wrap_run(run):
    def r(model):
        run(model)
        return []
    return r


def architectures() -> list:
    """Every architecture of the sweep: each transformers model type that has a model class in the
    auto mappings, the timm families of :data:`TIMM`, and the torch.nn modules of :data:`TORCH_NN`."""
    from transformers.models.auto import modeling_auto
    types = dict.fromkeys(modeling_auto.MODEL_MAPPING_NAMES)
    for attr in sorted(dir(modeling_auto)):
        mapping = getattr(modeling_auto, attr)
        if attr.startswith("MODEL_") and attr.endswith("_MAPPING_NAMES") and isinstance(mapping, dict):
            types.update(dict.fromkeys(mapping))
    archs = [Arch(f"transformers:{t}", (lambda t=t: build_hf(t)), hf_run) for t in types]
    archs += [Arch(f"timm:{n}", b, _wrap_run(_image_run(size))) for n, (b, size) in TIMM.items()]
    archs += [Arch(f"torch.nn:{n}", b, _wrap_run(r)) for n, (b, r) in TORCH_NN.items()]
    return archs


def _vm_data() -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmData:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@contextlib.contextmanager
def memory_cap(extra_bytes: int):
    """Make allocations beyond ``extra_bytes`` more than now fail (RLIMIT_DATA), so that a config the
    shrinker missed raises instead of exhausting the machine's memory. Linux only; elsewhere no cap."""
    now = _vm_data()
    if now is None:
        yield
        return
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    limit = now + extra_bytes
    resource.setrlimit(resource.RLIMIT_DATA, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


# ------------------------------------------------------------------------------------------------
# one architecture, end to end

TIME_CAP_S = 20.0
MEMORY_CAP = 1536 << 20


@dataclass
class Outcome:
    """``status``: "conditioned" (every attention layer read and conditioned as the method says),
    "no attention" (none found, and condinit.apply said so), or "failed" (``details`` say why)."""

    arch: str
    status: str
    details: list = field(default_factory=list)
    layers: int = 0
    seconds: float = 0.0


def _attention_named_classes(model: nn.Module) -> set:
    holders = _weight_holders(model)
    return {type(m).__name__ for m in model.modules() if ATTENTION_NAME.search(type(m).__name__) and id(m) in holders}


def _full_size_has_attention(arch: Arch) -> set:
    """Attention-named classes of the architecture at its default (not shrunk) size, built on meta:
    guards against a shrunk config that dropped the attention layers (a hybrid with one every 8th)."""
    if not arch.name.startswith("transformers:"):
        return set()
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    model_type = arch.name.split(":", 1)[1]
    with torch.device("meta"):
        model = hf_model_class(model_type)._from_config(CONFIG_MAPPING[model_type]())
    return _attention_named_classes(model)


def verify(arch: Arch, apply: Callable[[nn.Module], object]) -> Outcome:
    """Build ``arch``, read its attention independently, ``apply(model)``, and check the result."""
    import time
    t0 = time.perf_counter()
    out = Outcome(arch.name, "failed")
    try:
        with time_cap(TIME_CAP_S), memory_cap(MEMORY_CAP):
            _verify(arch, apply, out)
    except ModelTimeout as e:
        out.details.append(str(e))
    except Exception as e:  # building or reading failed: that is this architecture's outcome
        out.details.append(f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
    out.seconds = time.perf_counter() - t0
    if out.details:
        out.status = "failed"
    return out


def _verify(arch: Arch, apply, out: Outcome) -> None:
    try:
        model = arch.build()
    except (ModelTimeout, MemoryError):
        raise
    except Exception as e:
        out.details.append(f"build failed: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
        return
    errors = []
    reading = read_model(model, lambda m: errors.extend(arch.run(m) or []))
    out.details += errors
    out.layers = len(reading.attention)
    before = state_snapshot(model)
    try:
        apply(model)
        apply_error = None
    except (ModelTimeout, MemoryError):
        raise
    except Exception as e:  # condinit's refusal (or failure) is part of the outcome
        apply_error = e
    if not reading.has_attention and not errors:
        lost = _full_size_has_attention(arch) - _attention_named_classes(model)
        if lost:
            out.details.append(f"the shrunk config has no attention layer, the default one has {sorted(lost)}")
        elif apply_error is None:
            changed = [n for n, t in model.state_dict(keep_vars=True).items() if not bit_equal(before[n], t.detach())]
            out.details.append(f"no attention found, but condinit.apply did not refuse it (changed {changed[:4]})")
        elif not (isinstance(apply_error, ValueError) and "no attention" in str(apply_error)):
            out.details.append(f"no attention found; condinit.apply raised {type(apply_error).__name__}: {apply_error}")
        else:
            out.status = "no attention"
        return
    if apply_error is not None:
        msg = str(apply_error).splitlines()[0][:300] if str(apply_error) else ""
        out.details.append(f"condinit.apply raised {type(apply_error).__name__}: {msg}")
        out.details += reading.problems()
    else:
        out.details += check_conditioned(model, reading, before)
    if not out.details:
        out.status = "conditioned"


# ------------------------------------------------------------------------------------------------
# multi-head latent attention (DeepSeek MLA), conditioned by its factors: each head read through its input

LATENT_TOL = 1e-6          # float64 reading of fp32-accurate factors: max |M M^T - I| of a head's map


@dataclass
class LatentMaps:
    """One token's query, key and value states ``[H, d]`` differentiated with respect to its input
    ``[D]`` (``q``, ``k``, ``v``: ``[H, d, D]``), every norm inside the module passing its input
    through, and each norm's output / input per channel in a plain forward (``ratios``)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    ratios: list


def latent_maps(attn: nn.Module, position_embeddings, hidden: int) -> LatentMaps:
    """Run ``attn`` (a transformers attention module calling its modeling file's
    ``eager_attention_forward``) on one random token in float64 and read :class:`LatentMaps` where
    the module hands its states to the attention function (``torch.func.jacrev``)."""
    import sys

    mod = sys.modules[type(attn).__module__]
    captured = {}

    def capture(module, query, key, value, attention_mask, **kwargs):
        captured.update(q=query, k=key, v=value)
        b, h, n, _ = value.shape
        return value.new_zeros(b, n, h, value.shape[-1]), None

    norms = [m for m in attn.modules() if m is not attn and type(m).__name__.endswith("RMSNorm")]
    x0 = torch.randn(1, 1, hidden, dtype=torch.float64)
    saved = (mod.eager_attention_forward, attn.config._attn_implementation)
    mod.eager_attention_forward, attn.config._attn_implementation = capture, "eager"
    try:
        ratios = []
        hooks = [n.register_forward_hook(lambda m, i, o: ratios.append((o / i[0]).detach())) for n in norms]
        attn(x0, position_embeddings=position_embeddings, attention_mask=None)
        for h in hooks:
            h.remove()
        hooks = [n.register_forward_hook(lambda m, i, o: i[0]) for n in norms]
        try:
            def states(x):
                attn(x.view(1, 1, hidden), position_embeddings=position_embeddings, attention_mask=None)
                return tuple(captured[n][0, :, 0] for n in "qkv")     # [H, d] each

            jac = torch.func.jacrev(states)(x0.view(hidden))
        finally:
            for h in hooks:
                h.remove()
    finally:
        mod.eager_attention_forward, attn.config._attn_implementation = saved
    return LatentMaps(*(j.detach() for j in jac), ratios)


def _off_orthonormal(m: torch.Tensor) -> float:
    """max |M M^T - I| of a ``[d, D]`` map."""
    return float((m @ m.t() - torch.eye(m.shape[0], dtype=m.dtype)).abs().max())


def latent_problems(maps: LatentMaps, *, nope_dim: int, kv_rank: int, qk_gain: float = 1.0, v_gain: float = 1.0,
                    per_head_v: bool = False) -> list:
    """What keeps ``maps`` from the factor reading (``docs/design.md``, "Multi-head latent
    attention"), empty when nothing does: each norm scales a token by one number; per head the
    query map and the no-RoPE key map are ``qk_gain`` times orthonormal rows; the RoPE key is one
    map shared by all heads, ``qk_gain`` times orthonormal rows; the stacked value map is ``v_gain``
    times ``I_{kv_rank x D}`` with row ``i`` reading coordinate ``i mod kv_rank`` (``i mod d_v``
    with ``per_head_v``), the rectangular identity when every head fits in the latent."""
    out = []
    q, k, v = maps.q, maps.k, maps.v
    H, dv, D = v.shape
    for i, ratio in enumerate(maps.ratios):
        spread = float((ratio - ratio.mean()).abs().max() / ratio.mean().abs())
        if spread > 1e-6:
            out.append(f"norm {i}: output / input varies by {spread:.2e} across channels (not one scale)")
    for h in range(H):
        for name, m, gain in (("q", q[h], qk_gain), ("k no-RoPE", k[h, :nope_dim], qk_gain), ("v", v[h], v_gain)):
            err = _off_orthonormal(m / gain)
            if err > LATENT_TOL:
                out.append(f"head {h}: {name} map off orthonormal rows by {err:.2e}")
        if not torch.equal(k[h, nope_dim:], k[0, nope_dim:]):
            out.append(f"head {h}: its RoPE key differs from head 0's")
    err = _off_orthonormal(k[0, nope_dim:] / qk_gain)
    if err > LATENT_TOL:
        out.append(f"RoPE key off orthonormal rows by {err:.2e}")
    rows = torch.arange(H * dv) % (dv if per_head_v else kv_rank)
    want = v_gain * torch.eye(kv_rank, D, dtype=v.dtype)[rows]
    err = float((v.reshape(H * dv, D) - want).abs().max())
    if err > LATENT_TOL:
        out.append(f"V off the coordinate selection (row i reads coordinate i mod "
                   f"{dv if per_head_v else kv_rank}) by {err:.2e}")
    return out
