"""Argument checks of the attention ops, run once, in the public functions, before any kernel."""
import torch
from torch import Tensor
from typing import Optional

from condinit import _backends
from condinit._validate import check_bool, check_int, check_real, check_tensor

def check_primals(q, k, v) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, floating=True)
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, H, N, d], got shape {tuple(t.shape)}")
        if any(s == 0 for s in t.shape):
            raise ValueError(f"{name} must have no empty dimension, got shape {tuple(t.shape)}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")
    B, H, _, d = q.shape
    if k.shape[0] != B or v.shape[0] != B:
        raise ValueError(f"k and v must have q's batch size {B}, got k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.shape[-1] != d or v.shape[-1] != d:
        raise ValueError(f"k and v must have q's head dim d={d}, got k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape [B, Hkv, Nk, d], got k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    if H % k.shape[1] != 0:
        raise ValueError(f"k's head count Hkv={k.shape[1]} must divide q's head count H={H} "
                         f"(grouped-query attention)")


def check_options(scale, backend, d: int) -> tuple[float, Optional[str]]:
    scale = 1.0 / d ** 0.5 if scale is None else check_real("scale", scale)
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"backend must be a str or None, got {type(backend).__name__}")
    if backend is not None and backend != "auto" and backend not in _backends.BACKENDS:
        raise ValueError(f"backend must be one of {_backends.BACKENDS}, 'auto' or None, got {backend!r}")
    return scale, backend


def check_lens(name: str, lens, batch: int, n: int, what: str, device: torch.device) -> Optional[Tensor]:
    """``lens`` (None, or a ``[B]`` int tensor / sequence of ints in ``[0, n]``) as int32 on
    ``device``."""
    if lens is None:
        return None
    if isinstance(lens, (list, tuple)):
        for x in lens:
            check_int(f"{name} entries", x)
        lens = torch.tensor(lens, dtype=torch.int64)
    check_tensor(name, lens)
    if lens.dtype.is_floating_point or lens.dtype.is_complex or lens.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {lens.dtype}")
    if tuple(lens.shape) != (batch,):
        raise ValueError(f"{name} must have shape [B] = [{batch}] (one {what} length per batch entry), "
                         f"got {tuple(lens.shape)}")
    # (Reading the values would break a torch.compile graph: there the C++ kernels check them.)
    if not torch.compiler.is_compiling() and bool(((lens < 0) | (lens > n)).any()):
        raise ValueError(f"{name} must be in [0, {n}] ({what} length at most its dimension), "
                         f"got {lens.tolist()}")
    return lens.to(device=device, dtype=torch.int32).contiguous()


def check_mask(q: Tensor, k: Tensor, causal, window, q_lens, kv_lens) -> tuple:
    """``(causal, window_left, window_right, q_lens, kv_lens)`` as the kernels take them."""
    check_bool("causal", causal)
    if window is None:
        left, right = -1, -1
    else:
        if not isinstance(window, (tuple, list)) or len(window) != 2:
            raise TypeError(f"window must be None or a pair (left, right) of ints >= -1 (-1: unbounded), "
                            f"got {window!r}")
        left = check_int("window[0] (left)", window[0], min=-1)
        right = check_int("window[1] (right)", window[1], min=-1)
    B = q.shape[0]
    q_lens = check_lens("q_lens", q_lens, B, q.shape[2], "query", q.device)
    kv_lens = check_lens("kv_lens", kv_lens, B, k.shape[2], "key", q.device)
    return causal, left, right, q_lens, kv_lens


def check_tangents(primals, tangents) -> tuple[bool, int]:
    """Validate tangents against their primals; returns (has probe dim, P)."""
    probe, P = None, None
    for (pname, x), (tname, t) in zip(primals, tangents):
        if t is None:
            continue
        check_tensor(tname, t, floating=True)
        if t.dtype != x.dtype:
            raise TypeError(f"{tname} must have {pname}'s dtype {x.dtype}, got {t.dtype}")
        if t.device != x.device:
            raise ValueError(f"{tname} must be on {pname}'s device {x.device}, got {t.device}")
        if t.shape == x.shape:
            has_p, p = False, 1
        elif t.dim() == x.dim() + 1 and t.shape[1:] == x.shape and t.shape[0] >= 1:
            has_p, p = True, t.shape[0]
        else:
            raise ValueError(f"{tname} must have {pname}'s shape {tuple(x.shape)} or [P, "
                             f"*{tuple(x.shape)}] with a leading probe dim, got {tuple(t.shape)}")
        if probe is None:
            probe, P = has_p, p
        elif has_p != probe:
            raise ValueError("tangents must all have a leading probe dim P or all not, got "
                             + ", ".join(f"{n} {tuple(t.shape)}" for n, t in tangents if t is not None))
        elif p != P:
            raise ValueError(f"tangents must agree on the probe count P, got {tname} with P={p}, "
                             f"expected P={P}")
    return bool(probe), P or 1


