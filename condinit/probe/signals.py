"""The attention signals :class:`~condinit.probe.JacobianMonitor` logs beside kappa, from one captured
layer: per head ``h`` (key/value head ``g(h)``) and aggregated per layer.

The scores are ``s_ij = scale q_i . k_j`` of the operator's ``A(X)`` (layer weights, biases, scale
and causal mask; not RoPE or other position transforms the module applies inside, nor padding
masks):

* ``max_logit`` (``max_logit_heads``): ``max_ij s_ij`` over the batch, queries and unmasked keys
  (before soft-capping, which bounds it by construction); the layer value is the largest head's.
* ``entropy_mean`` / ``entropy_min`` (``entropy_mean_heads`` / ``entropy_min_heads``): the
  attention entropy ``-sum_j p_ij log p_ij`` (nats, of the probabilities the layer uses: after
  soft-capping and masks) averaged over queries, and its minimum over the queries that attend more
  than one key (under a causal mask the first query sees one key only and has entropy 0 by
  construction); layer values: the mean over heads, the minimum over heads.
* ``qk_norm`` (``qk_norm_heads``): the spectral norm of the ``D x D`` bilinear form
  ``W_Q,h^T W_K,g(h)`` (``s_ij = scale x_i^T W_Q,h^T W_K,g x_j`` without biases), computed exactly
  as ``||R_Q,h R_K,g^T||_2`` from thin QRs ``W_Q,h^T = Q_Q,h R_Q,h`` (``d x d`` SVDs only); the layer
  value is the largest head's.

Cost: one attention-score pass per layer (``O(B H N^2 d)`` like one attention forward, plus
``O((H + Hkv) D d^2)`` for the QRs): the scores are formed in row blocks of at most
``SIGNAL_TILE_ELEMENTS`` entries (a few such blocks live at once; a block is never smaller than one
query row, ``B H N`` entries), so no ``N x N`` matrix is kept, and nothing is stored but ``O(H)``
statistics.
"""
from __future__ import annotations

import math

import torch

from .autocast import autocast_disabled

__all__ = ["HEAD_SIGNALS", "SIGNAL_TILE_ELEMENTS", "attention_signals"]

# per-head signals: the layer aggregate is the key without "_heads"
HEAD_SIGNALS = ("max_logit_heads", "entropy_mean_heads", "entropy_min_heads", "qk_norm_heads")

# Attention scores are formed in row blocks of at most this many entries (at least one query row).
SIGNAL_TILE_ELEMENTS = 1 << 22


def attention_signals(op) -> dict:
    """Per-head attention statistics of one captured layer (see the module docstring).

    ``op`` is a :class:`~condinit.probe.JacobianOperator` built from a module (it holds ``X`` and
    the weights). Returns the per-head lists (``max_logit_heads``, ``entropy_mean_heads``,
    ``entropy_min_heads``, ``qk_norm_heads``) and their layer aggregates, as Python floats
    (``entropy_min`` None when no query attends more than one key). Runs in the operator's dtype
    under ``torch.no_grad`` with autocast off; scores in row blocks of at most
    ``SIGNAL_TILE_ELEMENTS`` entries.
    """
    with torch.no_grad(), autocast_disabled(op.device):
        q, k = op._primal()[:2]                     # [B, H, N, d], [B, Hkv, N, d]: the operator's own
        B, H, N, d = q.shape
        Hkv, G = k.shape[1], H // k.shape[1]
        qg = q.reshape(B, Hkv, G, N, d)              # head h = g * G + j reads key/value head g
        kt = k.unsqueeze(2).transpose(-1, -2)        # [B, Hkv, 1, d, N]
        rows = max(1, SIGNAL_TILE_ELEMENTS // max(1, B * H * N))
        dev, dt = q.device, q.dtype
        max_logit = torch.full((H,), -math.inf, device=dev, dtype=dt)
        ent_sum = torch.zeros(H, device=dev, dtype=dt)
        ent_min = torch.full((H,), math.inf, device=dev, dtype=dt)
        for i0 in range(0, N, rows):
            i1 = min(N, i0 + rows)
            s = (qg[..., i0:i1, :] @ kt) * op.scale                       # [B, Hkv, G, r, N]
            ok = op.allowed_keys(i0, i1)                                  # [r, N] or None (all keys)
            if ok is not None:
                s = s.masked_fill(~ok, -math.inf)
            max_logit = torch.maximum(max_logit, s.amax(dim=(0, 3, 4)).reshape(H))
            if op.softcap is not None:      # c tanh(-inf / c) = -c: mask again after the cap
                s = torch.tanh(s / op.softcap) * op.softcap
                if ok is not None:
                    s = s.masked_fill(~ok, -math.inf)
            p = torch.softmax(s, dim=-1)
            ent = -torch.special.xlogy(p, p).sum(dim=-1)                  # [B, Hkv, G, r]; 0 log 0 = 0
            del s, p
            ent_sum += ent.sum(dim=(0, 3)).reshape(H)
            # the minimum over queries that see more than one key
            several = (ok.sum(dim=-1) > 1) if ok is not None else torch.full((i1 - i0,), N > 1, device=dev)
            if bool(several.any()):
                ent_min = torch.minimum(ent_min, ent[..., several].amin(dim=(0, 3)).reshape(H))
        ent_mean = ent_sum / (B * N)
        # ||W_Q,h^T W_K,g||_2 = ||R_Q,h R_K,g^T||_2 with W^T = Q R thin QRs ([D, d] -> R [d, d])
        # Each weight is divided by its largest |entry| first (finite weights, so the product and the
        # SVD cannot overflow the dtype and fail on inf), the norm multiplied back in float64.
        units = [float(w.abs().max()) or 1.0 for w in (op.Wq, op.Wk)]
        wq = (op.Wq / units[0]).reshape(H, d, op.D).transpose(-1, -2)
        wk = (op.Wk / units[1]).reshape(Hkv, d, op.D).transpose(-1, -2)
        if op.D > d:
            wq, wk = torch.linalg.qr(wq, mode="r")[1], torch.linalg.qr(wk, mode="r")[1]
        form = wq @ wk.repeat_interleave(G, dim=0).transpose(-1, -2)
        qk = torch.linalg.matrix_norm(form, ord=2).double() * (units[0] * units[1])
        # layer aggregates with torch's reductions, which propagate NaN (Python's max / min do not)
        seen = ent_min[~torch.isinf(ent_min)]
        return {"max_logit": max_logit.max().item(), "entropy_mean": ent_mean.mean().item(),
                "entropy_min": seen.min().item() if seen.numel() else None, "qk_norm": qk.max().item(),
                "max_logit_heads": max_logit.tolist(), "entropy_mean_heads": ent_mean.tolist(),
                "entropy_min_heads": [None if math.isinf(v) else v for v in ent_min.tolist()],
                "qk_norm_heads": qk.tolist()}
