"""Host functions of the Triton attention: the layout checks the kernels index by, the mask
arguments, and :func:`attention_fwd`, :func:`attention_jvp`, :func:`attention_bwd`,
:func:`attention_jvp_bwd`, which launch the kernels (through :func:`configs.launch`).

Which head dims and dtypes these kernels run for is declared once, in the backend table of
condinit/ops/attention/op.py; the public op validates arguments before calling them.
"""
import contextlib

import torch
import triton

from condinit.kernels.attention import bwd, configs

__all__ = ["attention_fwd", "attention_bwd", "attention_jvp", "attention_jvp_bwd", "mask_args"]

_LOG2E = 1.4426950408889634


def _check_layout(q, k, v, *tensors_like_q):
    """The shape facts the kernels index by (memory safety only; the public op validates)."""
    B, H, Nq, d = q.shape
    if not (k.dim() == v.dim() == 4 and k.shape == v.shape and k.shape[0] == B and k.shape[3] == d
            and H % k.shape[1] == 0 and 1 <= d <= 256):
        raise ValueError(f"attention kernel: bad layout q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    for t in tensors_like_q:
        if tuple(t.shape) != tuple(q.shape):
            raise ValueError(f"attention kernel: expected a tensor shaped like q {tuple(q.shape)}, "
                             f"got {tuple(t.shape)}")


def _check_tangents(q, k, v, tq, tk, tv):
    if not (tq.dim() == tk.dim() == tv.dim() == 5 and tq.shape[0] == tk.shape[0] == tv.shape[0] >= 1
            and tq.shape[1:] == q.shape and tk.shape[1:] == k.shape and tv.shape[1:] == v.shape):
        raise ValueError(f"attention kernel: bad tangent layout tq {tuple(tq.shape)}, "
                         f"tk {tuple(tk.shape)}, tv {tuple(tv.shape)}")


def _check_lse(q, lse):
    if tuple(lse.shape) != tuple(q.shape[:3]) or lse.dtype != torch.float32:
        raise ValueError(f"attention kernel: lse must be float32 {tuple(q.shape[:3])}, got "
                         f"{lse.dtype} {tuple(lse.shape)}")


def _on_device(t):
    """The launches of one host function run on ``t``'s GPU, whatever the current device is
    (Triton launches on the current device and its current stream); on the CPU (the
    interpreter) nothing to switch."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _rowmajor(t):
    # The kernels take arbitrary strides but need unit stride along the head dim.
    return t if t.stride(-1) == 1 else t.contiguous()


def mask_args(q, k, causal, window_left, window_right, q_lens, kv_lens):
    """The kernels' mask arguments ``(QLens, KLens, win_left, win_right, HAS_LENS)``.

    The window bounds become non-negative offsets: key ``j`` is allowed for query ``i`` iff
    ``i + off - win_left <= j <= i + off + win_right`` (``off = Lk - Lq``), with causal folded
    into ``win_right = 0`` and an unbounded side as ``Nq + Nk`` (beyond every index, and small
    enough for int32 arithmetic). With lengths, the missing one becomes the full length."""
    B, Nq, Nk = q.shape[0], q.shape[2], k.shape[2]
    unbounded = Nq + Nk
    left = unbounded if window_left < 0 else min(int(window_left), unbounded)
    right = unbounded if window_right < 0 else min(int(window_right), unbounded)
    if causal:
        right = 0
    has_lens = q_lens is not None or kv_lens is not None
    if not has_lens:
        return q, q, left, right, False  # placeholders, never read
    lens = []
    for name, given, n in (("q_lens", q_lens, Nq), ("kv_lens", kv_lens, Nk)):
        if given is None:
            given = torch.full((B,), n, dtype=torch.int32, device=q.device)
        if given.dtype != torch.int32 or tuple(given.shape) != (B,) or given.device != q.device:
            raise ValueError(f"attention kernel: {name} must be int32 [{B}] on {q.device}, got "
                             f"{given.dtype} {tuple(given.shape)} on {given.device}")
        lens.append(given.contiguous())
    return lens[0], lens[1], left, right, True


# --------------------------------------------------------------------------------------------
# Host functions
# --------------------------------------------------------------------------------------------


def _forward(q, k, v, causal, scale, mask, tq=None, tk=None, tv=None):
    q, k, v = _rowmajor(q), _rowmajor(k), _rowmajor(v)
    B, H, Nq, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    jvp = tq is not None
    q_lens, kv_lens, win_left, win_right, has_lens = mask_args(q, k, causal, *mask)
    out = torch.empty_like(q)
    lse = torch.empty((B, H, Nq), device=q.device, dtype=torch.float32)
    if jvp:
        tq, tk, tv = _rowmajor(tq), _rowmajor(tk), _rowmajor(tv)
        n_probes = tq.shape[0]
        tout = torch.empty(tq.shape, device=q.device, dtype=q.dtype)
    else:
        n_probes = 1
        tq, tk, tv, tout = q[None], k[None], v[None], out[None]  # placeholders, never touched
    meta = configs.common_meta(d)
    ppp = configs.probes_per_program(q.element_size(), meta["BLOCK_D"], jvp, n_probes)
    meta.update(CAUSAL=causal, HAS_LENS=has_lens, JVP=jvp, PROBES_PER_PROGRAM=ppp)
    args = (q, k, v, out, lse, tq, tk, tv, tout, q_lens, kv_lens,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            out.stride(0), out.stride(1), out.stride(2),
            lse.stride(0), lse.stride(1),
            *tq.stride()[:4], *tk.stride()[:4], *tv.stride()[:4], *tout.stride()[:4],
            H, Nq, Nk, n_probes, H // Hkv, float(scale) * _LOG2E, float(scale), win_left, win_right,
            configs.bucket(Nq), configs.bucket(Nk))

    def grid(m):
        return triton.cdiv(Nq, m["BLOCK_M"]) * triton.cdiv(n_probes, ppp) * B * H

    configs.launch("jvp" if jvp else "fwd", grid, args, meta)
    return out, lse, (tout if jvp else None)


def attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                  window_left: int = -1, window_right: int = -1, q_lens=None, kv_lens=None):
    """Flash-attention forward: ``(out, lse)``.

    ``out = softmax(scale q k^T + mask) v`` in q's dtype, ``[B, H, Nq, d]``; ``lse`` float32
    ``[B, H, Nq]``, the natural log of ``sum_j exp(scale q_i . k_j)`` over allowed keys (``-inf``
    for a row that sees none, whose output is 0). q ``[B, H, Nq, d]``, k/v ``[B, Hkv, Nk, d]``;
    the mask (causal, window, lengths) as in the module docstring.
    """
    _check_layout(q, k, v)
    with _on_device(q):
        out, lse, _ = _forward(q, k, v, causal, scale, (window_left, window_right, q_lens, kv_lens))
    return out, lse


def attention_jvp(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tq: torch.Tensor, tk: torch.Tensor,
                  tv: torch.Tensor, causal: bool, scale: float, window_left: int = -1, window_right: int = -1,
                  q_lens=None, kv_lens=None):
    """Forward plus P Jacobian-vector products in one fused launch: ``(out, tout, lse)``.

    Tangents ``tq [P, B, H, Nq, d]``, ``tk, tv [P, B, Hkv, Nk, d]`` (4-D tangents are one probe
    and give a 4-D ``tout``); ``tout[p] = P' V + P tV[p]`` with ``P' = P o (S' - rowsum(P o S'))``,
    ``S' = scale (tQ K^T + Q tK^T)``, in q's dtype.
    """
    single = tq.dim() == 4
    if single:
        tq, tk, tv = tq[None], tk[None], tv[None]
    _check_layout(q, k, v)
    _check_tangents(q, k, v, tq, tk, tv)
    with _on_device(q):
        out, lse, tout = _forward(q, k, v, causal, scale, (window_left, window_right, q_lens, kv_lens), tq, tk, tv)
    return out, (tout[0] if single else tout), lse


def _row_sums(out, dout, q_lens, has_lens, block_d):
    """rowsum(dO o O) in fp32 ``[B, H, Nq]`` (0 past Lq)."""
    B, H, Nq, d = out.shape
    delta = torch.empty((B, H, Nq), device=out.device, dtype=torch.float32)
    pre_block = configs.INTERPRET_CONFIG["BLOCK_M"] if configs.interpret() else max(16, min(128, 8192 // block_d))
    bwd.attn_bwd_preprocess_kernel[(triton.cdiv(Nq, pre_block) * B * H,)](
        out, dout, delta, q_lens, out.stride(0), out.stride(1), out.stride(2),
        dout.stride(0), dout.stride(1), dout.stride(2), H, Nq,
        HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=pre_block, HAS_LENS=has_lens)
    return delta


def attention_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, causal: bool, scale: float, window_left: int = -1, window_right: int = -1,
                  q_lens=None, kv_lens=None):
    """Flash-attention backward (the VJP): ``(dq, dk, dv)`` in q's dtype.

    ``D = rowsum(dO o O)``, ``P = exp(scale q k^T - lse)`` (0 where masked),
    ``dS = P o (dO v^T - D)``, ``dq = scale dS k``, ``dk = scale dS^T q``, ``dv = P^T dO``; dk, dv
    ``[B, Hkv, Nk, d]`` are summed over the query heads of each KV group. ``out`` and ``lse``
    come from :func:`attention_fwd` with the same arguments.
    """
    _check_layout(q, k, v, dout, out)
    _check_lse(q, lse)
    with _on_device(q):
        q, k, v, dout, out = (_rowmajor(t) for t in (q, k, v, dout, out))
        lse = lse.contiguous()
        B, H, Nq, d = q.shape
        Hkv, Nk = k.shape[1], k.shape[2]
        q_lens, kv_lens, win_left, win_right, has_lens = mask_args(q, k, causal, window_left, window_right,
                                                                     q_lens, kv_lens)
        meta = configs.common_meta(d)
        delta = _row_sums(out, dout, q_lens, has_lens, meta["BLOCK_D"])

        dq = torch.empty_like(q)
        dk = torch.empty_like(k)
        dv = torch.empty_like(v)
        meta.update(CAUSAL=causal, HAS_LENS=has_lens)
        tail = (float(scale) * _LOG2E, float(scale), win_left, win_right, configs.bucket(Nq), configs.bucket(Nk))
        configs.launch("dkdv", lambda m: triton.cdiv(Nk, m["BLOCK_N"]) * B * Hkv,
                (q, k, v, dout, lse, delta, dk, dv, q_lens, kv_lens,
                 q.stride(0), q.stride(1), q.stride(2),
                 k.stride(0), k.stride(1), k.stride(2),
                 v.stride(0), v.stride(1), v.stride(2),
                 dout.stride(0), dout.stride(1), dout.stride(2),
                 dk.stride(0), dk.stride(1), dk.stride(2),
                 dv.stride(0), dv.stride(1), dv.stride(2),
                 Hkv, Nq, Nk, H // Hkv, *tail), meta)
        configs.launch("dq", lambda m: triton.cdiv(Nq, m["BLOCK_M"]) * B * H,
                (q, k, v, dout, lse, delta, dq, q_lens, kv_lens,
                 q.stride(0), q.stride(1), q.stride(2),
                 k.stride(0), k.stride(1), k.stride(2),
                 v.stride(0), v.stride(1), v.stride(2),
                 dout.stride(0), dout.stride(1), dout.stride(2),
                 dq.stride(0), dq.stride(1), dq.stride(2),
                 H, Nq, Nk, H // Hkv, *tail), meta)
    return dq, dk, dv


def attention_jvp_bwd(gout: torch.Tensor, gtout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, tq: torch.Tensor, tk: torch.Tensor, tv: torch.Tensor, out: torch.Tensor,
                      tout: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float, window_left: int = -1,
                      window_right: int = -1, q_lens=None, kv_lens=None):
    """Backward through :func:`attention_jvp`: ``(dq, dk, dv, dtq, dtk, dtv)`` of a loss on
    ``(out, tout)``, given its gradients ``gout`` ``[B, H, Nq, d]`` and ``gtout`` ``[P, B, H, Nq,
    d]``, from the saved ``out``, ``tout`` and ``lse`` (docs/design.md, "Attention": backward
    through the tangent output). Tangents and ``tout`` / ``gtout`` are 5-D ``[P, ...]``, or all
    4-D for one probe (then dtq, dtk, dtv are 4-D).

    Three launches, O(N) memory, no atomics (deterministic): per query tile the row statistics
    ``r_p``, ``d'_p``, ``D`` (fp32, ``(2P + 1) B H Nq``); per query tile dq and every dtq; per
    key tile dk, dv and every dtk, dtv, summed over the query heads of each KV group.
    """
    single = tq.dim() == 4
    if single:
        tq, tk, tv, tout, gtout = tq[None], tk[None], tv[None], tout[None], gtout[None]
    _check_layout(q, k, v, gout, out)
    _check_tangents(q, k, v, tq, tk, tv)
    if tuple(tout.shape) != tuple(tq.shape) or tuple(gtout.shape) != tuple(tq.shape):
        raise ValueError(f"attention kernel: tout {tuple(tout.shape)} and gtout {tuple(gtout.shape)} "
                         f"must be shaped like tq {tuple(tq.shape)}")
    _check_lse(q, lse)
    with _on_device(q):
        q, k, v, gout, out, tq, tk, tv, tout, gtout = (
            _rowmajor(t) for t in (q, k, v, gout, out, tq, tk, tv, tout, gtout))
        lse = lse.contiguous()
        B, H, Nq, d = q.shape
        Hkv, Nk = k.shape[1], k.shape[2]
        n_probes = tq.shape[0]
        q_lens, kv_lens, win_left, win_right, has_lens = mask_args(q, k, causal, window_left, window_right,
                                                                     q_lens, kv_lens)
        meta = configs.common_meta(d)
        meta.update(CAUSAL=causal, HAS_LENS=has_lens)
        tail = (n_probes, H // Hkv, float(scale) * _LOG2E, float(scale), win_left, win_right,
                configs.bucket(Nq), configs.bucket(Nk))
        strides = [*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *tq.stride()[:4], *tk.stride()[:4],
                   *tv.stride()[:4]]

        r = torch.empty((n_probes, B, H, Nq), device=q.device, dtype=torch.float32)
        delta_t = torch.empty_like(r)
        d_row = torch.empty((B, H, Nq), device=q.device, dtype=torch.float32)
        configs.launch("jvp_bwd_rows", lambda m: triton.cdiv(Nq, m["BLOCK_M"]) * B * H,
                (q, k, tq, tk, out, tout, gout, gtout, lse, q_lens, kv_lens, r, delta_t, d_row,
                 *q.stride()[:3], *k.stride()[:3], *tq.stride()[:4], *tk.stride()[:4],
                 *out.stride()[:3], *tout.stride()[:4], *gout.stride()[:3], *gtout.stride()[:4],
                 H, Nq, Nk, *tail), meta)

        new = lambda x: torch.empty(x.shape, device=q.device, dtype=q.dtype)  # noqa: E731  (contiguous)
        dq, dtq = new(q), new(tq)
        configs.launch("jvp_bwd_dq", lambda m: triton.cdiv(Nq, m["BLOCK_M"]) * B * H,
                (q, k, v, tq, tk, tv, gout, gtout, lse, d_row, r, delta_t, q_lens, kv_lens, dq, dtq,
                 *strides, *gout.stride()[:3], *gtout.stride()[:4], *dq.stride()[:3], *dtq.stride()[:4],
                 H, Nq, Nk, *tail), meta)

        dk, dv, dtk, dtv = new(k), new(v), new(tk), new(tv)
        configs.launch("jvp_bwd_dkdv", lambda m: triton.cdiv(Nk, m["BLOCK_N"]) * B * Hkv,
                (q, k, v, tq, tk, tv, gout, gtout, lse, d_row, r, delta_t, q_lens, kv_lens, dk, dv, dtk, dtv,
                 *strides, *gout.stride()[:3], *gtout.stride()[:4], *dk.stride()[:3], *dv.stride()[:3],
                 *dtk.stride()[:4], *dtv.stride()[:4],
                 Hkv, Nq, Nk, *tail), meta)
    if single:
        dtq, dtk, dtv = dtq[0], dtk[0], dtv[0]
    return dq, dk, dv, dtq, dtk, dtv
