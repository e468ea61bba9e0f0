"""Capturing the input hidden states of attention layers with forward pre-hooks.

The probe CLI, the training-time monitor and the demo all need the tensor an attention layer reads
(its ``X``), as it is during a real forward pass. :class:`InputCapture` registers one forward
pre-hook per module; each hook finds the input with :func:`layer_input` and either keeps the first
one it sees (``inputs[i]``, a detached copy) or hands it to a callback. The hooks return None, so
they never change the forward pass.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from torch import nn

__all__ = ["InputCapture", "layer_input", "layer_position_embeddings", "call_position_embeddings", "call_mask_rows"]

# keyword names under which attention modules receive their input
_INPUT_KEYWORDS = ("hidden_states", "query", "x", "input")


def layer_input(module: nn.Module, args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
    """The attention input of one call as a detached ``[B, N, D]`` view (batch first), or None.

    The input is the first positional tensor, else the first of the keywords ``hidden_states``,
    ``query``, ``x``, ``input``. ``nn.MultiheadAttention`` without ``batch_first`` takes
    ``[N, B, D]`` (transposed here); an unbatched ``[N, D]`` input becomes ``[1, N, D]``. None when
    no tensor is found or it is not 2-D or 3-D.
    """
    x = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if x is None:
        x = next((kwargs[k] for k in _INPUT_KEYWORDS if isinstance(kwargs.get(k), torch.Tensor)), None)
    if x is None or x.dim() not in (2, 3):
        return None
    x = x.detach()
    if x.dim() == 2:
        return x.unsqueeze(0)
    if isinstance(module, nn.MultiheadAttention) and not module.batch_first:
        return x.transpose(0, 1)
    return x


def layer_position_embeddings(module: nn.Module, args: tuple, kwargs: dict):
    """The ``(cos, sin)`` rotary tables a call passes to the module (Hugging Face attention modules
    receive them as ``position_embeddings``, by keyword or by position), detached, or None."""
    from condinit.models.discovery import position_embeddings_arg

    return call_position_embeddings(args, kwargs, position_embeddings_arg(module))


def call_position_embeddings(args: tuple, kwargs: dict, position: Optional[int]):
    """The ``(cos, sin)`` tables of one call, detached, or None: the keyword ``position_embeddings``,
    else positional argument ``position`` (where ``position_embeddings`` sits among the parameters
    of the module's ``forward``, :attr:`condinit.models.spec.AttentionDetails.position_embeddings_arg`;
    None: the module takes none)."""
    pe = kwargs.get("position_embeddings")
    if pe is None and position is not None and position < len(args):
        pe = args[position]
    if (isinstance(pe, (tuple, list)) and len(pe) == 2 and all(isinstance(t, torch.Tensor) for t in pe)):
        return tuple(t.detach() for t in pe)
    return None


class InputCapture:
    """Forward pre-hooks on ``modules`` that capture each one's input (see :func:`layer_input`).

    Without ``on_input``, ``inputs[i]`` holds a detached copy of the first input module ``i`` reads
    (None until it runs, or when its input is not a 2-D/3-D tensor). With ``on_input``, every call
    of module ``i`` runs ``on_input(i, module, x)`` instead, with ``x`` the detached view or None;
    the callback copies what it keeps; with ``call_info=True`` it gets a fourth argument, the call's
    ``(args, kwargs)`` (e.g. for :func:`layer_position_embeddings`). Use as a context manager, or call
    :meth:`remove`.

    Examples:
        >>> mha = torch.nn.MultiheadAttention(16, 2, batch_first=True)
        >>> x = torch.randn(2, 5, 16)
        >>> with condinit.probe.InputCapture([mha]) as cap:
        ...     _ = mha(x, x, x)
        >>> torch.equal(cap.inputs[0], x)
        True
    """

    def __init__(self, modules: Sequence[nn.Module],
                 on_input: Optional[Callable[..., None]] = None, call_info: bool = False):
        self.inputs: list = [None] * len(modules)
        self._on_input = on_input
        self._call_info = call_info
        self._handles = [m.register_forward_pre_hook(self._hook(i), with_kwargs=True) for i, m in enumerate(modules)]

    def _hook(self, i: int):
        def hook(module, args, kwargs):
            x = layer_input(module, args, kwargs)
            if self._on_input is not None and self._call_info:
                self._on_input(i, module, x, (args, kwargs))
            elif self._on_input is not None:
                self._on_input(i, module, x)
            elif x is not None and self.inputs[i] is None:
                self.inputs[i] = x.clone()
            return None
        return hook

    def remove(self) -> None:
        """Remove the hooks (idempotent)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self) -> "InputCapture":
        return self

    def __exit__(self, *exc) -> bool:
        self.remove()
        return False


# the mask arguments attention modules take: Hugging Face ``attention_mask`` (4-D, True / 0 where a
# key is attended; or 2-D [B, N_k], 1 for a token, 0 for padding), and nn.MultiheadAttention's
# ``key_padding_mask`` ([B, N_k], True / -inf for padding) and ``attn_mask`` ([N, N] or [B H, N, N],
# True / -inf where not attended); positions among nn.MultiheadAttention.forward's parameters
_MHA_MASK_ARGS = {"key_padding_mask": 3, "attn_mask": 5}


def call_mask_rows(module: nn.Module, call, B: int, N: int, causal: bool, window: Optional[int]):
    """Which of the ``B`` sequences of one call the call's attention mask treats otherwise than the
    layer's own pattern over the first ``N`` tokens (``causal``, and a sliding ``window`` of keys per
    query as :class:`~condinit.probe.JacobianOperator` models it): a padding token, a masked or an
    extra attended (query, key) pair, an additive bias. Returns ``(rows, unread)``: ``rows`` a bool
    tensor ``[B]`` (None: the call passes no mask), ``unread`` why a mask that was passed could not be
    read (None when it was)."""
    args, kwargs = call
    masks = []
    for name in ("attention_mask", "attn_mask", "key_padding_mask"):
        m = kwargs.get(name)
        if m is None and isinstance(module, nn.MultiheadAttention) and name in _MHA_MASK_ARGS:
            pos = _MHA_MASK_ARGS[name]
            m = args[pos] if pos < len(args) else None
        if m is not None:
            masks.append((name, m))
    if not masks:
        return None, None
    i = torch.arange(N).unsqueeze(1)
    j = torch.arange(N).unsqueeze(0)
    allowed = (j <= i) if causal else torch.ones(N, N, dtype=torch.bool)
    if window is not None:
        allowed = allowed & ((i - j < window) if causal else ((i - j).abs() <= window))
    rows = torch.zeros(B, dtype=torch.bool)
    for name, m in masks:
        if not isinstance(m, torch.Tensor):
            return None, f"its {name} is a {type(m).__name__}, which the monitor does not read"
        m = m.detach().to("cpu")
        mha = isinstance(module, nn.MultiheadAttention)
        if m.dim() == 2 and (name == "key_padding_mask" or (name == "attention_mask" and not mha)) \
                and m.shape[0] >= B and m.shape[1] >= N:
            # per key: [B, N_k]
            m = m[:B, :N]
            if m.dtype == torch.bool:
                off = m if name == "key_padding_mask" else ~m
            elif name == "key_padding_mask":
                off = m != 0
            else:
                off = m == 0
            rows |= off.any(1)
            continue
        if m.dim() == 2 and m.shape[-2] >= N and m.shape[-1] >= N:
            m = m[None, None]                               # [N, N] for every sequence
        elif m.dim() == 3 and m.shape[0] % max(B, 1) == 0 and m.shape[-2] >= N and m.shape[-1] >= N:
            m = m.reshape(B, -1, *m.shape[-2:]) if m.shape[0] >= B else m[None]
        if m.dim() == 4 and m.shape[-2] == 1:              # [B, 1, 1, N_k]: one key mask for every query
            m = m.expand(*m.shape[:2], N, m.shape[-1])
        if m.dim() != 4 or m.shape[-2] < N or m.shape[-1] < N or (m.shape[0] != 1 and m.shape[0] < B):
            return None, f"its {name} of shape {tuple(m.shape)} is not one the monitor reads"
        m = m[:B, :, :N, :N]
        if m.dtype == torch.bool:
            attended = ~m if mha else m
            differs = attended != allowed
        else:
            floor = torch.finfo(m.dtype).min / 2 if m.is_floating_point() else -1
            masked = m <= floor
            differs = (masked == allowed) | (~masked & (m != 0))
        rows |= differs.flatten(1).any(1).expand(B)
    return rows, None
