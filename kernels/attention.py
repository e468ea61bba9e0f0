"""Triton kernels of condinit's fused attention: forward, multi-probe JVP, flash backward (VJP),
and the backward through the JVP's tangent output.

Per head (the math: docs/design.md, "Attention"), with ``s`` the softmax scale::

    S = s Q K^T (+ mask),  P = softmax(S),  O = P V,  lse = log rowsum(exp(S))

**Forward** (flash attention 2): one program per query tile walks the key tiles with an online
softmax, ``P~ = exp(S - m)``, ``l = rowsum(P~)``, ``acc = P~ V``, all rescaled by
``alpha = exp(m_old - m_new)``; ``O = acc / l``.

**JVP** with tangents ``(tQ, tK, tV)``: ``S' = s (tQ K^T + Q tK^T)``,
``P' = P o (S' - rowsum(P o S'))``, ``O' = P' V + P tV``. Fused into the same pass: per probe
carry ``acc_t = P~ tV + (P~ o S') V`` (the paper's ``accA + accB``: both are divided by the same
``l``, so one accumulator holds their sum) and ``r = rowsum(P~ o S')``, rescaled by the same
``alpha``; at the end ``O' = (acc_t - r O) / l``. All accumulators are fp32 (the ``r O``
subtraction cancels).

**Several probes.** Tangents carry a leading probe axis ``[P, B, H, N, d]``. One launch serves all
P probes: the grid holds ``ceil(P / PROBES_PER_PROGRAM)`` probe groups per query tile, and a
program computes the primal work of its tile (``S = s Q K^T``, ``P~``, ``P~ V``: 2 of the 6 matrix
products and every exponential) once for the ``PROBES_PER_PROGRAM`` (1 or 2) probes it owns, each
probe adding its own 4 products. A pair of probes costs 10 products instead of 12, and the
programs of one query tile (all its probe groups) are adjacent in the launch order, so their K and
V tiles are read from L2 rather than HBM. Two probes per program, not more, because every probe
adds a ``BLOCK_M x d`` fp32 accumulator to the register file (three at two probes); the host takes
2 whenever a two-probe list exists for the dtype and head dim (see ``_CONFIGS``).

**Backward** (flash attention 2, deterministic, no atomics): ``D = rowsum(dO o O)``; one kernel per
key tile of each KV head accumulates ``dV = P^T dO`` and ``dK = s dS^T Q`` with
``dS = P o (dO V^T - D)`` over the query heads of its GQA group (so dK, dV come out with Hkv heads
and no extra [B, H, Nk, d] buffer); a separate kernel per query tile computes ``dQ = s dS K``.

**Backward through the tangent output** (:func:`attention_jvp_bwd`; formulas in docs/design.md,
"Attention"), three launches, deterministic: per query tile the row statistics ``r_p =
rowsum(P o S'_p)`` (a sweep over the keys: ``r`` is not saved by the JVP), ``d'_p = rowsum(gO'_p o
O)`` and ``D``; per query tile ``dQ`` and every ``dtQ_p``; per key tile ``dK``, ``dV`` and every
``dtK_p``, ``dtV_p``, summed over the GQA group. ``gS = P o (gP - D)`` is linear in the probes'
terms of ``gP``, so each program first runs the flash loop with ``D`` for delta (the primal part)
and then one sweep per probe: the live accumulators (two per query tile, four per key tile) do
not grow with P. Products per (query tile, key tile): ``1 + 2P`` (statistics) + ``3 + 8P`` (dQ) +
``3 + 10P`` (dK, dV); memory O(N): ``(2P + 1) B H Nq`` fp32 statistics.

**Masks** (the contract every backend implements): per batch ``b`` lengths ``Lq`` / ``Lk``
(``q_lens`` / ``kv_lens``, else ``Nq`` / ``Nk``) and ``off = Lk - Lq``; key ``j`` is allowed for
query ``i`` iff ``i < Lq``, ``j < Lk``, ``j <= i + off`` when causal, ``j >= i + off - window_left``
and ``j <= i + off + window_right`` (a negative window side is unbounded). The host turns this into
two offsets, ``i + off - win_left <= j <= i + off + win_right`` (causal: ``win_right = 0``,
unbounded: ``Nq + Nk``), and each program (:func:`_tile_range`) visits only the tiles that meet an
allowed pair: unmasked where every pair of the tile is allowed, masked around them. A sliding
window of ``W`` keys costs ``O(N W)``. Masked tiles read rows past ``Lq`` / ``Lk`` as 0, so padded
positions never reach a product even if they hold NaN; a NaN in an allowed entry propagates to its
row (as in SDPA). A NaN in a *valid* key or value that the window or causal mask hides from a row
can still reach that row through a tile product (``0 x NaN``) when another row of the same tile
attends it, as in every tiled kernel.

Conventions: q ``[B, H, Nq, d]``, k/v ``[B, Hkv, Nk, d]``, query head ``h`` reads KV head
``h // (H // Hkv)``; causal is bottom-right aligned (``j <= i + Lk - Lq``). A query row that sees
no key gets ``O = 0``, ``O' = 0``, ``lse = -inf`` and zero gradients. Any head dim 1-256: tiles
are padded to ``BLOCK_D``, the next power of two (at least 16), with masked loads and stores.
Exponentials run in base 2 (``exp2``, the scale folded with ``log2 e``), ``lse`` is returned in
natural log. Loads are upcast to fp32 for elementwise math;
matrix products take fp16/bf16 operands with fp32 accumulators (``P~`` and ``P~ o S'`` rounded to
the input dtype before the product with V, as flash attention does; ``P~ o S'`` is formed from the
rounded ``P~``, which frees the fp32 ``P~`` registers early); fp32 inputs use IEEE fp32
products (no TF32). Under ``TRITON_INTERPRET=1`` the operands are rounded to the input dtype and
then upcast to fp32 (the interpreter has no bf16 arithmetic), so results match the GPU rounding.

GPU launch choices (to be timed on a GPU): ``_CONFIGS`` holds one short autotune list per
(kernel, bytes per element, head-dim bucket, probes per program); fp32 has its own smaller tiles.
Every entry fits the shared memory of both sm_80 and sm_90 and spills little there, as compiled
offline by tests/test_gpu_resources.py (figures in BENCHMARKS.md, "Static resource model of the
GPU kernels"). The autotune key holds power-of-two buckets of (Nq, Nk), the padded head dim, the
causal and lengths flags, the JVP flag and the probes per program, and the tensors' dtypes.
``CONDINIT_ATTN_AUTOTUNE=0`` skips the autotuner and runs the first entry of the list for the
call's dtype. Causal programs stop the key loop at the diagonal and mask only the tiles
straddling it (or a ragged last tile); the query tiles are issued heaviest first.
``benchmarks/gpu_check.py`` checks and times the kernels on a GPU. Under the interpreter one fixed
16 x 16 config runs.
"""

import functools
import os

import torch
import triton
import triton.language as tl

__all__ = ["attention_fwd", "attention_bwd", "attention_jvp", "attention_jvp_bwd"]

# Which head dims and dtypes these kernels run for is declared once, in the backend table of
# condinit/ops/attention/op.py; the public op validates arguments before calling them.
_LOG2E = 1.4426950408889634


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _load_rows(ptrs, rows, n_rows, cols, HEAD_DIM: tl.constexpr, MASK_ROWS: tl.constexpr,
               EVEN_D: tl.constexpr):
    """Load a [rows, BLOCK_D] tile; rows >= n_rows and columns >= HEAD_DIM read as 0."""
    if MASK_ROWS:
        if EVEN_D:
            x = tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
        else:
            x = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (cols[None, :] < HEAD_DIM), other=0.0)
    else:
        if EVEN_D:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=cols[None, :] < HEAD_DIM, other=0.0)
    return x


@triton.jit
def _dot_operand(x, DTYPE: tl.constexpr, INTERPRETER: tl.constexpr):
    """``x`` rounded to the input dtype, as an operand of ``tl.dot``. The interpreter has no
    bf16/fp16 arithmetic, so there the rounded value is upcast to fp32 again (same rounding as
    the GPU, products in fp32)."""
    y = x.to(DTYPE)
    if INTERPRETER:
        y = y.to(tl.float32)
    return y


@triton.jit
def _seq_lens(QLens, KLens, off_b, n_q, n_k, HAS_LENS: tl.constexpr):
    """(Lq, Lk) of batch ``off_b``: the given lengths clamped to [0, N] (so that no load leaves
    the tensors whatever they hold), or the full lengths."""
    if HAS_LENS:
        len_q = tl.minimum(tl.maximum(tl.load(QLens + off_b), 0), n_q)
        len_k = tl.minimum(tl.maximum(tl.load(KLens + off_b), 0), n_k)
    else:
        len_q = n_q
        len_k = n_k
    return len_q, len_k


@triton.jit
def _tile_range(start, n_own, len_own, len_other, lo_off, hi_off,
                BLOCK_OWN: tl.constexpr, BLOCK_OTHER: tl.constexpr):
    """The tiles of the other axis that the own tile ``[start, start + BLOCK_OWN)`` meets, where
    other index ``o`` is allowed for own index ``x`` iff ``x < len_own``, ``o < len_other`` and
    ``x + lo_off <= o <= x + hi_off`` (own = queries: the mask of the module docstring; own =
    keys: the same mask seen from a key, offsets negated and swapped).

    Returns ``(lo, n_masked, n_left, gap, full_lo, n_full)``: ``n_full`` unmasked tiles (every
    pair allowed, every index in bounds) start at ``full_lo + t * BLOCK_OTHER``; the ``n_masked``
    masked tiles around them at ``lo + t * BLOCK_OTHER``, plus ``gap`` (the unmasked span) once
    ``t >= n_left``. Tiles that meet no allowed pair are not visited at all, so a sliding window
    costs O(N W), not O(N^2)."""
    end = tl.minimum(start + BLOCK_OWN, len_own)
    lo = (tl.maximum(start + lo_off, 0) // BLOCK_OTHER) * BLOCK_OTHER
    hi = tl.minimum(end + hi_off, len_other)
    hi = tl.where(end > start, tl.maximum(hi, lo), lo)
    full_lo = tl.cdiv(tl.maximum(start + BLOCK_OWN - 1 + lo_off, 0), BLOCK_OTHER) * BLOCK_OTHER
    full_hi = (tl.maximum(tl.minimum(start + hi_off + 1, len_other), 0) // BLOCK_OTHER) * BLOCK_OTHER
    # Unmasked tiles need every own index of the tile valid; indices past the tensor (when the
    # lengths are the tensor's) are never stored, so they need no mask.
    whole = (start + BLOCK_OWN <= len_own) | (len_own == n_own)
    full_lo = tl.where(whole, tl.minimum(tl.maximum(full_lo, lo), hi), hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    n_left = tl.cdiv(full_lo - lo, BLOCK_OTHER)
    n_masked = n_left + tl.cdiv(hi - full_hi, BLOCK_OTHER)
    return lo, n_masked, n_left, full_hi - full_lo, full_lo, (full_hi - full_lo) // BLOCK_OTHER


@triton.jit
def _tile_start(base, t, n_left, gap, BLOCK: tl.constexpr):
    """Start of tile ``t`` of a loop from :func:`_tile_range` (a multiple of BLOCK)."""
    return tl.multiple_of(base + t * BLOCK + tl.where(t >= n_left, gap, 0), BLOCK)


@triton.jit
def _allowed(rows, cols, len_q, len_k, lo_off, hi_off):
    """[rows, cols]: query ``i`` may attend key ``j``."""
    i = rows[:, None]
    j = cols[None, :]
    return (i < len_q) & (j < len_k) & (j >= i + lo_off) & (j <= i + hi_off)


@triton.jit
def _allowed_t(cols, rows, len_q, len_k, lo_off, hi_off):
    """[cols, rows]: :func:`_allowed` transposed (the key-tile programs)."""
    j = cols[:, None]
    i = rows[None, :]
    return (i < len_q) & (j < len_k) & (j >= i + lo_off) & (j <= i + hi_off)


@triton.jit
def _attn_fwd_loop(acc, m_i, l_i, acc_t0, r_0, acc_t1, r_1, q, tq0, tq1,
                   k_ptrs, v_ptrs, tk0_ptrs, tv0_ptrs, tk1_ptrs, tv1_ptrs,
                   stride_kn, stride_vn, stride_tkn, stride_tvn,
                   base, n_tiles, n_left, gap, rows_m, offs_n, offs_d, len_q, len_k, lo_off, hi_off,
                   qk_scale, sm_scale,
                   HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                   EVEN_D: tl.constexpr, JVP: tl.constexpr,
                   TWO_PROBES: tl.constexpr, DTYPE: tl.constexpr, INTERPRETER: tl.constexpr,
                   DOT_PRECISION: tl.constexpr):
    """Key tiles of one query tile: online softmax (+ tangent accumulators). MASKED applies the
    mask (and reads keys past Lk as 0); unmasked tiles are fully allowed and in bounds."""
    for t in range(0, n_tiles):
        start_n = _tile_start(base, t, n_left, gap, BLOCK_N)
        cols = start_n + offs_n
        rows64 = cols.to(tl.int64)[:, None]
        k = _load_rows(k_ptrs + rows64 * stride_kn + offs_d[None, :], cols, len_k, offs_d, HEAD_DIM, MASKED, EVEN_D)
        v = _load_rows(v_ptrs + rows64 * stride_vn + offs_d[None, :], cols, len_k, offs_d, HEAD_DIM, MASKED, EVEN_D)
        k = _dot_operand(k, DTYPE, INTERPRETER)
        v = _dot_operand(v, DTYPE, INTERPRETER)
        kt = tl.trans(k)
        s = tl.dot(q, kt, input_precision=DOT_PRECISION) * qk_scale  # log2 units
        if MASKED:
            visible = _allowed(rows_m, cols, len_q, len_k, lo_off, hi_off)
            s = tl.where(visible, s, float("-inf"))
        # A NaN score is kept (tl.max / tl.maximum may drop it, but exp2(NaN - m) is NaN anyway).
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen only masked keys keeps m = -inf: shift by 0 so that no
        # exp(-inf - -inf) = NaN appears (its p and alpha are then exactly 0).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        p_mma = _dot_operand(p, DTYPE, INTERPRETER)
        acc = tl.dot(p_mma, v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        if JVP:
            tk = _load_rows(tk0_ptrs + rows64 * stride_tkn + offs_d[None, :], cols, len_k, offs_d, HEAD_DIM,
                            MASKED, EVEN_D)
            tv = _load_rows(tv0_ptrs + rows64 * stride_tvn + offs_d[None, :], cols, len_k, offs_d, HEAD_DIM,
                            MASKED, EVEN_D)
            tk = _dot_operand(tk, DTYPE, INTERPRETER)
            tv = _dot_operand(tv, DTYPE, INTERPRETER)
            sd = tl.dot(q, tl.trans(tk), input_precision=DOT_PRECISION)
            sd = tl.dot(tq0, kt, sd, input_precision=DOT_PRECISION)
            # P~ o S' from the rounded P~ (the fp32 P~ is dead by now: fewer live registers);
            # masked entries have P~ = 0 (and a non-finite S' there must not reach r).
            ps = p_mma.to(tl.float32) * (sd * sm_scale)
            if MASKED:
                ps = tl.where(visible, ps, 0.0)
            r_0 = r_0 * alpha + tl.sum(ps, 1)
            acc_t0 = tl.dot(p_mma, tv, acc_t0 * alpha[:, None], input_precision=DOT_PRECISION)
            acc_t0 = tl.dot(_dot_operand(ps, DTYPE, INTERPRETER), v, acc_t0, input_precision=DOT_PRECISION)
            if TWO_PROBES:
                tk = _load_rows(tk1_ptrs + rows64 * stride_tkn + offs_d[None, :], cols, len_k, offs_d, HEAD_DIM,
                                MASKED, EVEN_D)
                tv = _load_rows(tv1_ptrs + rows64 * stride_tvn + offs_d[None, :], cols, len_k, offs_d, HEAD_DIM,
                                MASKED, EVEN_D)
                tk = _dot_operand(tk, DTYPE, INTERPRETER)
                tv = _dot_operand(tv, DTYPE, INTERPRETER)
                sd = tl.dot(q, tl.trans(tk), input_precision=DOT_PRECISION)
                sd = tl.dot(tq1, kt, sd, input_precision=DOT_PRECISION)
                ps = p_mma.to(tl.float32) * (sd * sm_scale)
                if MASKED:
                    ps = tl.where(visible, ps, 0.0)
                r_1 = r_1 * alpha + tl.sum(ps, 1)
                acc_t1 = tl.dot(p_mma, tv, acc_t1 * alpha[:, None], input_precision=DOT_PRECISION)
                acc_t1 = tl.dot(_dot_operand(ps, DTYPE, INTERPRETER), v, acc_t1, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i, acc_t0, r_0, acc_t1, r_1


@triton.jit
def _attn_fwd_kernel(
    Q, K, V, Out, Lse, TQ, TK, TV, TOut, QLens, KLens,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    stride_lb, stride_lh,
    stride_tqp, stride_tqb, stride_tqh, stride_tqm,
    stride_tkp, stride_tkb, stride_tkh, stride_tkn,
    stride_tvp, stride_tvb, stride_tvh, stride_tvn,
    stride_top, stride_tob, stride_toh, stride_tom,
    n_heads, n_q, n_k, n_probes, kv_group, qk_scale, sm_scale, win_left, win_right, tune_q, tune_k,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_LENS: tl.constexpr, JVP: tl.constexpr, INTERPRETER: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PROBES_PER_PROGRAM: tl.constexpr,
):
    """One program: one query tile of one (batch, head), for PROBES_PER_PROGRAM probes (JVP)."""
    TWO_PROBES: tl.constexpr = PROBES_PER_PROGRAM == 2  # the host passes 1 unless JVP
    DTYPE: tl.constexpr = Q.dtype.element_ty
    # Launch order: query tile fastest, then probe group, then (batch, head): programs sharing
    # K/V run together. Causal: the heaviest (last) query tiles go first.
    pid = tl.program_id(0)
    num_m = tl.cdiv(n_q, BLOCK_M)
    num_g = tl.cdiv(n_probes, PROBES_PER_PROGRAM)
    pid_m = pid % num_m
    if CAUSAL:
        pid_m = num_m - 1 - pid_m
    pid_g = (pid // num_m) % num_g
    pid_bh = pid // (num_m * num_g)
    off_b = (pid_bh // n_heads).to(tl.int64)
    off_h = (pid_bh % n_heads).to(tl.int64)
    off_hkv = off_h // kv_group
    len_q, len_k = _seq_lens(QLens, KLens, off_b, n_q, n_k, HAS_LENS)
    lo_off = len_k - len_q - win_left
    hi_off = len_k - len_q + win_right

    start_m = pid_m * BLOCK_M
    rows_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_off = rows_m.to(tl.int64)

    q_ptrs = Q + off_b * stride_qb + off_h * stride_qh + row_off[:, None] * stride_qm + offs_d[None, :]
    # K, V (and tangent) tiles: scalar base pointers; the per-element offsets are formed inside
    # the key loop, so no loop-invariant tile of 64-bit pointers occupies registers.
    k_ptrs = K + off_b * stride_kb + off_hkv * stride_kh
    v_ptrs = V + off_b * stride_vb + off_hkv * stride_vh
    q = _dot_operand(_load_rows(q_ptrs, rows_m, len_q, offs_d, HEAD_DIM, True, EVEN_D), DTYPE, INTERPRETER)

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    # Tangent state; placeholders (never read) when JVP / TWO_PROBES are off.
    acc_t0 = acc
    r_0 = l_i
    acc_t1 = acc
    r_1 = l_i
    tq0 = q
    tq1 = q
    tk0_ptrs = k_ptrs
    tv0_ptrs = v_ptrs
    tk1_ptrs = k_ptrs
    tv1_ptrs = v_ptrs
    p0 = pid_g * PROBES_PER_PROGRAM
    p1 = p0
    if JVP:
        p0_off = p0.to(tl.int64)
        tq0 = _dot_operand(_load_rows(TQ + p0_off * stride_tqp + off_b * stride_tqb + off_h * stride_tqh
                                      + row_off[:, None] * stride_tqm + offs_d[None, :],
                                      rows_m, len_q, offs_d, HEAD_DIM, True, EVEN_D), DTYPE, INTERPRETER)
        tk0_ptrs = TK + p0_off * stride_tkp + off_b * stride_tkb + off_hkv * stride_tkh
        tv0_ptrs = TV + p0_off * stride_tvp + off_b * stride_tvb + off_hkv * stride_tvh
        if TWO_PROBES:
            # An odd P: the last group's second probe repeats probe P-1 and is not stored.
            p1 = tl.minimum(p0 + 1, n_probes - 1)
            p1_off = p1.to(tl.int64)
            tq1 = _dot_operand(_load_rows(TQ + p1_off * stride_tqp + off_b * stride_tqb + off_h * stride_tqh
                                          + row_off[:, None] * stride_tqm + offs_d[None, :],
                                          rows_m, len_q, offs_d, HEAD_DIM, True, EVEN_D), DTYPE, INTERPRETER)
            tk1_ptrs = TK + p1_off * stride_tkp + off_b * stride_tkb + off_hkv * stride_tkh
            tv1_ptrs = TV + p1_off * stride_tvp + off_b * stride_tvb + off_hkv * stride_tvh

    lo, n_masked, n_left, gap, full_lo, n_full = _tile_range(
        start_m, n_q, len_q, len_k, lo_off, hi_off, BLOCK_M, BLOCK_N)
    acc, m_i, l_i, acc_t0, r_0, acc_t1, r_1 = _attn_fwd_loop(
        acc, m_i, l_i, acc_t0, r_0, acc_t1, r_1, q, tq0, tq1,
        k_ptrs, v_ptrs, tk0_ptrs, tv0_ptrs, tk1_ptrs, tv1_ptrs,
        stride_kn, stride_vn, stride_tkn, stride_tvn,
        full_lo, n_full, n_full, 0, rows_m, offs_n, offs_d, len_q, len_k, lo_off, hi_off, qk_scale, sm_scale,
        HEAD_DIM, BLOCK_N, False, EVEN_D, JVP, TWO_PROBES, DTYPE, INTERPRETER, DOT_PRECISION)
    acc, m_i, l_i, acc_t0, r_0, acc_t1, r_1 = _attn_fwd_loop(
        acc, m_i, l_i, acc_t0, r_0, acc_t1, r_1, q, tq0, tq1,
        k_ptrs, v_ptrs, tk0_ptrs, tv0_ptrs, tk1_ptrs, tv1_ptrs,
        stride_kn, stride_vn, stride_tkn, stride_tvn,
        lo, n_masked, n_left, gap, rows_m, offs_n, offs_d, len_q, len_k, lo_off, hi_off, qk_scale, sm_scale,
        HEAD_DIM, BLOCK_N, True, EVEN_D, JVP, TWO_PROBES, DTYPE, INTERPRETER, DOT_PRECISION)

    # Epilogue. l = 0 exactly when the row saw no key (otherwise its max contributes exp2(0) = 1);
    # a NaN l (a NaN input the row attends to) keeps the row NaN.
    empty = l_i == 0.0
    inv_l = 1.0 / tl.where(empty, 1.0, l_i)
    o = acc * inv_l[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    store_mask = (rows_m[:, None] < n_q) & (offs_d[None, :] < HEAD_DIM)
    primal = pid_g == 0  # every probe group computes O; the first one stores it
    tl.store(Out + off_b * stride_ob + off_h * stride_oh + row_off[:, None] * stride_om + offs_d[None, :],
             o.to(DTYPE), mask=store_mask & primal)
    tl.store(Lse + off_b * stride_lb + off_h * stride_lh + row_off, lse, mask=(rows_m < n_q) & primal)
    if JVP:
        to = (acc_t0 - r_0[:, None] * o) * inv_l[:, None]
        tl.store(TOut + p0.to(tl.int64) * stride_top + off_b * stride_tob + off_h * stride_toh
                 + row_off[:, None] * stride_tom + offs_d[None, :], to.to(DTYPE), mask=store_mask)
        if TWO_PROBES:
            to = (acc_t1 - r_1[:, None] * o) * inv_l[:, None]
            tl.store(TOut + p1.to(tl.int64) * stride_top + off_b * stride_tob + off_h * stride_toh
                     + row_off[:, None] * stride_tom + offs_d[None, :], to.to(DTYPE),
                     mask=store_mask & (p0 + 1 < n_probes))


@triton.jit
def _attn_bwd_preprocess_kernel(Out, DOut, Delta, QLens, stride_ob, stride_oh, stride_om,
                                stride_db, stride_dh, stride_dm, n_heads, n_q,
                                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                                HAS_LENS: tl.constexpr):
    """Delta = rowsum(dO o O) in fp32, [B, H, Nq] contiguous; 0 on rows past Lq."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(n_q, BLOCK_M)
    pid_m = pid % num_m
    pid_bh = pid // num_m
    off_b = (pid_bh // n_heads).to(tl.int64)
    off_h = (pid_bh % n_heads).to(tl.int64)
    len_q, _ = _seq_lens(QLens, QLens, off_b, n_q, n_q, HAS_LENS)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < len_q) & (offs_d[None, :] < HEAD_DIM)
    row_off = rows.to(tl.int64)[:, None]
    o = tl.load(Out + off_b * stride_ob + off_h * stride_oh + row_off * stride_om + offs_d[None, :],
                mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DOut + off_b * stride_db + off_h * stride_dh + row_off * stride_dm + offs_d[None, :],
                 mask=mask, other=0.0).to(tl.float32)
    tl.store(Delta + pid_bh.to(tl.int64) * n_q + rows, tl.sum(o * do, 1), mask=rows < n_q)


@triton.jit
def _attn_bwd_dkdv_loop(dk, dv, k, v, q_ptrs, do_ptrs, lse_ptrs, delta_ptrs, stride_qm, stride_dom,
                        base, n_tiles, n_left, gap, cols_n, offs_m, offs_d, len_q, len_k, lo_off, hi_off,
                        qk_scale,
                        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, MASKED: tl.constexpr,
                        EVEN_D: tl.constexpr, DTYPE: tl.constexpr,
                        INTERPRETER: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Query tiles of one head against one key tile, transposed orientation [BN, BM]:
    dV += P^T dO, dK += dS^T Q with dS = P o (dO V^T - delta)."""
    for t in range(0, n_tiles):
        start_m = _tile_start(base, t, n_left, gap, BLOCK_M)
        rows = start_m + offs_m
        m_off = start_m.to(tl.int64)
        q = _dot_operand(_load_rows(q_ptrs + m_off * stride_qm, rows, len_q, offs_d, HEAD_DIM, MASKED, EVEN_D),
                         DTYPE, INTERPRETER)
        do = _dot_operand(_load_rows(do_ptrs + m_off * stride_dom, rows, len_q, offs_d, HEAD_DIM, MASKED, EVEN_D),
                          DTYPE, INTERPRETER)
        if MASKED:
            lse = tl.load(lse_ptrs + rows, mask=rows < len_q, other=float("inf"))
            delta = tl.load(delta_ptrs + rows, mask=rows < len_q, other=0.0)
        else:
            lse = tl.load(lse_ptrs + rows)
            delta = tl.load(delta_ptrs + rows)
        # lse = -inf marks a row that sees no key: its P is 0, not exp(s + inf).
        lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
        pt = tl.exp2(tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale - lse2[None, :])
        dpt = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        dst = pt * (dpt - delta[None, :])
        if MASKED:
            visible = _allowed_t(cols_n, rows, len_q, len_k, lo_off, hi_off)
            pt = tl.where(visible, pt, 0.0)
            dst = tl.where(visible, dst, 0.0)
        dv = tl.dot(_dot_operand(pt, DTYPE, INTERPRETER), do, dv, input_precision=DOT_PRECISION)
        dk = tl.dot(_dot_operand(dst, DTYPE, INTERPRETER), q, dk, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv_kernel(
    Q, K, V, DOut, Lse, Delta, DK, DV, QLens, KLens,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    n_heads_kv, n_q, n_k, kv_group, qk_scale, sm_scale, win_left, win_right, tune_q, tune_k,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_LENS: tl.constexpr, INTERPRETER: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program: one key tile of one KV head; dK, dV summed over the group's query heads."""
    DTYPE: tl.constexpr = Q.dtype.element_ty
    pid = tl.program_id(0)
    num_n = tl.cdiv(n_k, BLOCK_N)
    pid_n = pid % num_n
    pid_bh = pid // num_n
    off_b = (pid_bh // n_heads_kv).to(tl.int64)
    off_hkv = (pid_bh % n_heads_kv).to(tl.int64)
    len_q, len_k = _seq_lens(QLens, KLens, off_b, n_q, n_k, HAS_LENS)
    lo_off = len_k - len_q - win_left
    hi_off = len_k - len_q + win_right
    start_n = pid_n * BLOCK_N
    cols_n = start_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    col_off = cols_n.to(tl.int64)

    k = _dot_operand(_load_rows(K + off_b * stride_kb + off_hkv * stride_kh + col_off[:, None] * stride_kn
                                + offs_d[None, :], cols_n, len_k, offs_d, HEAD_DIM, True, EVEN_D), DTYPE, INTERPRETER)
    v = _dot_operand(_load_rows(V + off_b * stride_vb + off_hkv * stride_vh + col_off[:, None] * stride_vn
                                + offs_d[None, :], cols_n, len_k, offs_d, HEAD_DIM, True, EVEN_D), DTYPE, INTERPRETER)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    # The query rows that see key j: j - hi_off <= i <= j - lo_off.
    lo, n_masked, n_left, gap, full_lo, n_full = _tile_range(
        start_n, n_k, len_k, len_q, -hi_off, -lo_off, BLOCK_N, BLOCK_M)
    for g in range(0, kv_group):
        off_h = off_hkv * kv_group + g
        q_ptrs = Q + off_b * stride_qb + off_h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :]
        do_ptrs = DOut + off_b * stride_dob + off_h * stride_doh + offs_m[:, None] * stride_dom + offs_d[None, :]
        row_base = (off_b * n_heads_kv * kv_group + off_h) * n_q
        lse_ptrs = Lse + row_base
        delta_ptrs = Delta + row_base
        dk, dv = _attn_bwd_dkdv_loop(
            dk, dv, k, v, q_ptrs, do_ptrs, lse_ptrs, delta_ptrs, stride_qm, stride_dom,
            full_lo, n_full, n_full, 0, cols_n, offs_m, offs_d, len_q, len_k, lo_off, hi_off, qk_scale,
            HEAD_DIM, BLOCK_M, False, EVEN_D, DTYPE, INTERPRETER, DOT_PRECISION)
        dk, dv = _attn_bwd_dkdv_loop(
            dk, dv, k, v, q_ptrs, do_ptrs, lse_ptrs, delta_ptrs, stride_qm, stride_dom,
            lo, n_masked, n_left, gap, cols_n, offs_m, offs_d, len_q, len_k, lo_off, hi_off, qk_scale,
            HEAD_DIM, BLOCK_M, True, EVEN_D, DTYPE, INTERPRETER, DOT_PRECISION)

    mask = (cols_n[:, None] < n_k) & (offs_d[None, :] < HEAD_DIM)
    tl.store(DK + off_b * stride_dkb + off_hkv * stride_dkh + col_off[:, None] * stride_dkn + offs_d[None, :],
             (dk * sm_scale).to(DTYPE), mask=mask)
    tl.store(DV + off_b * stride_dvb + off_hkv * stride_dvh + col_off[:, None] * stride_dvn + offs_d[None, :],
             dv.to(DTYPE), mask=mask)


@triton.jit
def _attn_bwd_dq_loop(dq, q, do, lse2, delta, k_ptrs, v_ptrs, stride_kn, stride_vn,
                      base, n_tiles, n_left, gap, rows_m, offs_n, offs_d, len_q, len_k, lo_off, hi_off,
                      qk_scale,
                      HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                      EVEN_D: tl.constexpr, DTYPE: tl.constexpr,
                      INTERPRETER: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Key tiles of one query tile: dQ += dS K with dS = P o (dO V^T - delta)."""
    for t in range(0, n_tiles):
        start_n = _tile_start(base, t, n_left, gap, BLOCK_N)
        cols = start_n + offs_n
        kv_off = start_n.to(tl.int64)
        k = _dot_operand(_load_rows(k_ptrs + kv_off * stride_kn, cols, len_k, offs_d, HEAD_DIM, MASKED, EVEN_D),
                         DTYPE, INTERPRETER)
        v = _dot_operand(_load_rows(v_ptrs + kv_off * stride_vn, cols, len_k, offs_d, HEAD_DIM, MASKED, EVEN_D),
                         DTYPE, INTERPRETER)
        p = tl.exp2(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale - lse2[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        if MASKED:
            ds = tl.where(_allowed(rows_m, cols, len_q, len_k, lo_off, hi_off), ds, 0.0)
        dq = tl.dot(_dot_operand(ds, DTYPE, INTERPRETER), k, dq, input_precision=DOT_PRECISION)
    return dq


@triton.jit
def _attn_bwd_dq_kernel(
    Q, K, V, DOut, Lse, Delta, DQ, QLens, KLens,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    stride_dqb, stride_dqh, stride_dqm,
    n_heads, n_q, n_k, kv_group, qk_scale, sm_scale, win_left, win_right, tune_q, tune_k,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_LENS: tl.constexpr, INTERPRETER: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program: dQ of one query tile of one (batch, head)."""
    DTYPE: tl.constexpr = Q.dtype.element_ty
    pid = tl.program_id(0)
    num_m = tl.cdiv(n_q, BLOCK_M)
    pid_m = pid % num_m
    if CAUSAL:
        pid_m = num_m - 1 - pid_m
    pid_bh = pid // num_m
    off_b = (pid_bh // n_heads).to(tl.int64)
    off_h = (pid_bh % n_heads).to(tl.int64)
    off_hkv = off_h // kv_group
    len_q, len_k = _seq_lens(QLens, KLens, off_b, n_q, n_k, HAS_LENS)
    lo_off = len_k - len_q - win_left
    hi_off = len_k - len_q + win_right
    start_m = pid_m * BLOCK_M
    rows_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_off = rows_m.to(tl.int64)

    q = _dot_operand(_load_rows(Q + off_b * stride_qb + off_h * stride_qh + row_off[:, None] * stride_qm
                                + offs_d[None, :], rows_m, len_q, offs_d, HEAD_DIM, True, EVEN_D), DTYPE, INTERPRETER)
    do = _dot_operand(_load_rows(DOut + off_b * stride_dob + off_h * stride_doh + row_off[:, None] * stride_dom
                                 + offs_d[None, :], rows_m, len_q, offs_d, HEAD_DIM, True, EVEN_D), DTYPE, INTERPRETER)
    row_base = pid_bh.to(tl.int64) * n_q
    lse = tl.load(Lse + row_base + rows_m, mask=rows_m < len_q, other=float("inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    delta = tl.load(Delta + row_base + rows_m, mask=rows_m < len_q, other=0.0)
    k_ptrs = K + off_b * stride_kb + off_hkv * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :]
    v_ptrs = V + off_b * stride_vb + off_hkv * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :]
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    lo, n_masked, n_left, gap, full_lo, n_full = _tile_range(
        start_m, n_q, len_q, len_k, lo_off, hi_off, BLOCK_M, BLOCK_N)
    dq = _attn_bwd_dq_loop(dq, q, do, lse2, delta, k_ptrs, v_ptrs, stride_kn, stride_vn,
                           full_lo, n_full, n_full, 0, rows_m, offs_n, offs_d, len_q, len_k, lo_off, hi_off,
                           qk_scale, HEAD_DIM, BLOCK_N, False, EVEN_D, DTYPE, INTERPRETER, DOT_PRECISION)
    dq = _attn_bwd_dq_loop(dq, q, do, lse2, delta, k_ptrs, v_ptrs, stride_kn, stride_vn,
                           lo, n_masked, n_left, gap, rows_m, offs_n, offs_d, len_q, len_k, lo_off, hi_off,
                           qk_scale, HEAD_DIM, BLOCK_N, True, EVEN_D, DTYPE, INTERPRETER, DOT_PRECISION)
    tl.store(DQ + off_b * stride_dqb + off_h * stride_dqh + row_off[:, None] * stride_dqm + offs_d[None, :],
             (dq * sm_scale).to(DTYPE), mask=(rows_m[:, None] < n_q) & (offs_d[None, :] < HEAD_DIM))


# ---- Backward through the tangent output (the JVP's VJP) ------------------------------------


@triton.jit
def _attn_rows_loop(r, q, tq, lse2, k_ptrs, tk_ptrs, stride_kn, stride_tkn,
                    base, n_tiles, n_left, gap, rows_m, offs_n, offs_d, len_q, len_k, lo_off, hi_off,
                    qk_scale,
                    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                    EVEN_D: tl.constexpr, DTYPE: tl.constexpr,
                    INTERPRETER: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Key tiles of one query tile: r += rowsum(P o (tQ K^T + Q tK^T)) (unscaled)."""
    for t in range(0, n_tiles):
        start_n = _tile_start(base, t, n_left, gap, BLOCK_N)
        cols = start_n + offs_n
        kv_off = start_n.to(tl.int64)
        k = _dot_operand(_load_rows(k_ptrs + kv_off * stride_kn, cols, len_k, offs_d, HEAD_DIM, MASKED, EVEN_D),
                         DTYPE, INTERPRETER)
        tk = _dot_operand(_load_rows(tk_ptrs + kv_off * stride_tkn, cols, len_k, offs_d, HEAD_DIM, MASKED, EVEN_D),
                          DTYPE, INTERPRETER)
        kt = tl.trans(k)
        p = tl.exp2(tl.dot(q, kt, input_precision=DOT_PRECISION) * qk_scale - lse2[:, None])
        sd = tl.dot(tq, kt, tl.dot(q, tl.trans(tk), input_precision=DOT_PRECISION), input_precision=DOT_PRECISION)
        ps = p * sd
        if MASKED:
            ps = tl.where(_allowed(rows_m, cols, len_q, len_k, lo_off, hi_off), ps, 0.0)
        r += tl.sum(ps, 1)
    return r


@triton.jit
def _attn_jvp_bwd_rows_kernel(
    Q, K, TQ, TK, Out, TOut, GOut, GTOut, Lse, QLens, KLens, R, DeltaT, D,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_tqp, stride_tqb, stride_tqh, stride_tqm,
    stride_tkp, stride_tkb, stride_tkh, stride_tkn,
    stride_ob, stride_oh, stride_om,
    stride_top, stride_tob, stride_toh, stride_tom,
    stride_gob, stride_goh, stride_gom,
    stride_gtop, stride_gtob, stride_gtoh, stride_gtom,
    n_heads, n_q, n_k, n_probes, kv_group, qk_scale, sm_scale, win_left, win_right, tune_q, tune_k,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_LENS: tl.constexpr, INTERPRETER: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program: the row statistics of one query tile of one (batch, head), every probe:
    ``r_p = rowsum(P o S'_p)`` (a sweep over the keys), ``d'_p = rowsum(gO'_p o O)``, and
    ``D = rowsum(gO o O) + sum_p (rowsum(gO'_p o O'_p) - r_p d'_p)``; all 0 on rows that see no
    key. R, DeltaT ``[P, B, H, Nq]`` and D ``[B, H, Nq]`` are contiguous fp32."""
    DTYPE: tl.constexpr = Q.dtype.element_ty
    pid = tl.program_id(0)
    num_m = tl.cdiv(n_q, BLOCK_M)
    pid_m = pid % num_m
    if CAUSAL:
        pid_m = num_m - 1 - pid_m
    pid_bh = pid // num_m
    num_bh = tl.num_programs(0) // num_m
    off_b = (pid_bh // n_heads).to(tl.int64)
    off_h = (pid_bh % n_heads).to(tl.int64)
    off_hkv = off_h // kv_group
    len_q, len_k = _seq_lens(QLens, KLens, off_b, n_q, n_k, HAS_LENS)
    lo_off = len_k - len_q - win_left
    hi_off = len_k - len_q + win_right
    start_m = pid_m * BLOCK_M
    rows_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_off = rows_m.to(tl.int64)[:, None]

    q = _dot_operand(_load_rows(Q + off_b * stride_qb + off_h * stride_qh + row_off * stride_qm + offs_d[None, :],
                                rows_m, len_q, offs_d, HEAD_DIM, True, EVEN_D), DTYPE, INTERPRETER)
    o = _load_rows(Out + off_b * stride_ob + off_h * stride_oh + row_off * stride_om + offs_d[None, :],
                   rows_m, len_q, offs_d, HEAD_DIM, True, EVEN_D).to(tl.float32)
    go = _load_rows(GOut + off_b * stride_gob + off_h * stride_goh + row_off * stride_gom + offs_d[None, :],
                    rows_m, len_q, offs_d, HEAD_DIM, True, EVEN_D).to(tl.float32)
    row_base = pid_bh.to(tl.int64) * n_q
    lse = tl.load(Lse + row_base + rows_m, mask=rows_m < len_q, other=float("-inf"))
    seen = lse != float("-inf")  # NaN stays NaN
    lse2 = tl.where(seen, lse * 1.4426950408889634, float("inf"))
    d_row = tl.sum(go * o, 1)
    k_ptrs = K + off_b * stride_kb + off_hkv * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :]
    lo, n_masked, n_left, gap, full_lo, n_full = _tile_range(
        start_m, n_q, len_q, len_k, lo_off, hi_off, BLOCK_M, BLOCK_N)
    stat_mask = rows_m < n_q
    for p in range(0, n_probes):
        p_off = p + off_b * 0  # int64 offsets
        tq = _dot_operand(_load_rows(TQ + p_off * stride_tqp + off_b * stride_tqb + off_h * stride_tqh
                                     + row_off * stride_tqm + offs_d[None, :],
                                     rows_m, len_q, offs_d, HEAD_DIM, True, EVEN_D), DTYPE, INTERPRETER)
        tk_ptrs = (TK + p_off * stride_tkp + off_b * stride_tkb + off_hkv * stride_tkh
                   + offs_n[:, None] * stride_tkn + offs_d[None, :])
        gto = _load_rows(GTOut + p_off * stride_gtop + off_b * stride_gtob + off_h * stride_gtoh
                         + row_off * stride_gtom + offs_d[None, :],
                         rows_m, len_q, offs_d, HEAD_DIM, True, EVEN_D).to(tl.float32)
        to = _load_rows(TOut + p_off * stride_top + off_b * stride_tob + off_h * stride_toh
                        + row_off * stride_tom + offs_d[None, :],
                        rows_m, len_q, offs_d, HEAD_DIM, True, EVEN_D).to(tl.float32)
        dlt = tl.sum(gto * o, 1)
        r = tl.zeros([BLOCK_M], dtype=tl.float32)
        r = _attn_rows_loop(r, q, tq, lse2, k_ptrs, tk_ptrs, stride_kn, stride_tkn,
                            full_lo, n_full, n_full, 0, rows_m, offs_n, offs_d, len_q, len_k, lo_off, hi_off,
                            qk_scale, HEAD_DIM, BLOCK_N, False, EVEN_D, DTYPE, INTERPRETER, DOT_PRECISION)
        r = _attn_rows_loop(r, q, tq, lse2, k_ptrs, tk_ptrs, stride_kn, stride_tkn,
                            lo, n_masked, n_left, gap, rows_m, offs_n, offs_d, len_q, len_k, lo_off, hi_off,
                            qk_scale, HEAD_DIM, BLOCK_N, True, EVEN_D, DTYPE, INTERPRETER, DOT_PRECISION)
        r = r * sm_scale
        d_row += tl.sum(gto * to, 1) - r * dlt
        stat_base = (p_off * num_bh + pid_bh) * n_q
        tl.store(R + stat_base + rows_m, tl.where(seen, r, 0.0), mask=stat_mask)
        tl.store(DeltaT + stat_base + rows_m, tl.where(seen, dlt, 0.0), mask=stat_mask)
    tl.store(D + row_base + rows_m, tl.where(seen, d_row, 0.0), mask=stat_mask)


@triton.jit
def _attn_jvp_bwd_dq_loop(dq, dtq, q, tq, gto, lse2, r, dlt, k_ptrs, v_ptrs, tk_ptrs, tv_ptrs,
                          stride_kn, stride_vn, stride_tkn, stride_tvn,
                          base, n_tiles, n_left, gap, rows_m, offs_n, offs_d, len_q, len_k, lo_off, hi_off,
                          qk_scale, sm_scale,
                          HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                          EVEN_D: tl.constexpr, DTYPE: tl.constexpr,
                          INTERPRETER: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Key tiles of one query tile, one probe: with ``S' = s (tQ K^T + Q tK^T)``,
    ``dP' = gO' V^T``, ``gS' = P o (dP' - d')`` and the probe's part of ``gS``,
    ``P o (gO' tV^T + dP' o (S' - r) - S' d')``: dQ += gS K + gS' tK, dtQ += gS' K."""
    for t in range(0, n_tiles):
        start_n = _tile_start(base, t, n_left, gap, BLOCK_N)
        cols = start_n + offs_n
        kv_off = start_n.to(tl.int64)
        k = _dot_operand(_load_rows(k_ptrs + kv_off * stride_kn, cols, len_k, offs_d, HEAD_DIM, MASKED, EVEN_D),
                         DTYPE, INTERPRETER)
        v = _dot_operand(_load_rows(v_ptrs + kv_off * stride_vn, cols, len_k, offs_d, HEAD_DIM, MASKED, EVEN_D),
                         DTYPE, INTERPRETER)
        tk = _dot_operand(_load_rows(tk_ptrs + kv_off * stride_tkn, cols, len_k, offs_d, HEAD_DIM, MASKED, EVEN_D),
                          DTYPE, INTERPRETER)
        tv = _dot_operand(_load_rows(tv_ptrs + kv_off * stride_tvn, cols, len_k, offs_d, HEAD_DIM, MASKED, EVEN_D),
                          DTYPE, INTERPRETER)
        kt = tl.trans(k)
        p = tl.exp2(tl.dot(q, kt, input_precision=DOT_PRECISION) * qk_scale - lse2[:, None])
        sd = tl.dot(tq, kt, tl.dot(q, tl.trans(tk), input_precision=DOT_PRECISION),
                    input_precision=DOT_PRECISION) * sm_scale
        dpt = tl.dot(gto, tl.trans(v), input_precision=DOT_PRECISION)
        y = tl.dot(gto, tl.trans(tv), input_precision=DOT_PRECISION) + dpt * (sd - r[:, None]) - sd * dlt[:, None]
        gs = p * y
        gst = p * (dpt - dlt[:, None])
        if MASKED:
            visible = _allowed(rows_m, cols, len_q, len_k, lo_off, hi_off)
            gs = tl.where(visible, gs, 0.0)
            gst = tl.where(visible, gst, 0.0)
        gst = _dot_operand(gst, DTYPE, INTERPRETER)
        dq = tl.dot(_dot_operand(gs, DTYPE, INTERPRETER), k, dq, input_precision=DOT_PRECISION)
        dq = tl.dot(gst, tk, dq, input_precision=DOT_PRECISION)
        dtq = tl.dot(gst, k, dtq, input_precision=DOT_PRECISION)
    return dq, dtq


@triton.jit
def _attn_jvp_bwd_dq_kernel(
    Q, K, V, TQ, TK, TV, GOut, GTOut, Lse, D, R, DeltaT, QLens, KLens, DQ, DTQ,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_tqp, stride_tqb, stride_tqh, stride_tqm,
    stride_tkp, stride_tkb, stride_tkh, stride_tkn,
    stride_tvp, stride_tvb, stride_tvh, stride_tvn,
    stride_gob, stride_goh, stride_gom,
    stride_gtop, stride_gtob, stride_gtoh, stride_gtom,
    stride_dqb, stride_dqh, stride_dqm,
    stride_dtqp, stride_dtqb, stride_dtqh, stride_dtqm,
    n_heads, n_q, n_k, n_probes, kv_group, qk_scale, sm_scale, win_left, win_right, tune_q, tune_k,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_LENS: tl.constexpr, INTERPRETER: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program: dQ and every probe's dtQ of one query tile of one (batch, head). gS splits
    into ``P o (gO V^T - D)`` (one sweep over the keys, the flash dQ loop with D for delta) plus
    one term per probe (one sweep per probe, which also gives that probe's dtQ): two fp32
    accumulators live, whatever P."""
    DTYPE: tl.constexpr = Q.dtype.element_ty
    pid = tl.program_id(0)
    num_m = tl.cdiv(n_q, BLOCK_M)
    pid_m = pid % num_m
    if CAUSAL:
        pid_m = num_m - 1 - pid_m
    pid_bh = pid // num_m
    num_bh = tl.num_programs(0) // num_m
    off_b = (pid_bh // n_heads).to(tl.int64)
    off_h = (pid_bh % n_heads).to(tl.int64)
    off_hkv = off_h // kv_group
    len_q, len_k = _seq_lens(QLens, KLens, off_b, n_q, n_k, HAS_LENS)
    lo_off = len_k - len_q - win_left
    hi_off = len_k - len_q + win_right
    start_m = pid_m * BLOCK_M
    rows_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_off = rows_m.to(tl.int64)[:, None]

    q = _dot_operand(_load_rows(Q + off_b * stride_qb + off_h * stride_qh + row_off * stride_qm + offs_d[None, :],
                                rows_m, len_q, offs_d, HEAD_DIM, True, EVEN_D), DTYPE, INTERPRETER)
    go = _dot_operand(_load_rows(GOut + off_b * stride_gob + off_h * stride_goh + row_off * stride_gom
                                 + offs_d[None, :], rows_m, len_q, offs_d, HEAD_DIM, True, EVEN_D),
                      DTYPE, INTERPRETER)
    row_base = pid_bh.to(tl.int64) * n_q
    lse = tl.load(Lse + row_base + rows_m, mask=rows_m < len_q, other=float("inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    d_row = tl.load(D + row_base + rows_m, mask=rows_m < len_q, other=0.0)
    k_ptrs = K + off_b * stride_kb + off_hkv * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :]
    v_ptrs = V + off_b * stride_vb + off_hkv * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :]
    lo, n_masked, n_left, gap, full_lo, n_full = _tile_range(
        start_m, n_q, len_q, len_k, lo_off, hi_off, BLOCK_M, BLOCK_N)
    store_mask = (rows_m[:, None] < n_q) & (offs_d[None, :] < HEAD_DIM)

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    dq = _attn_bwd_dq_loop(dq, q, go, lse2, d_row, k_ptrs, v_ptrs, stride_kn, stride_vn,
                           full_lo, n_full, n_full, 0, rows_m, offs_n, offs_d, len_q, len_k, lo_off, hi_off,
                           qk_scale, HEAD_DIM, BLOCK_N, False, EVEN_D, DTYPE, INTERPRETER, DOT_PRECISION)
    dq = _attn_bwd_dq_loop(dq, q, go, lse2, d_row, k_ptrs, v_ptrs, stride_kn, stride_vn,
                           lo, n_masked, n_left, gap, rows_m, offs_n, offs_d, len_q, len_k, lo_off, hi_off,
                           qk_scale, HEAD_DIM, BLOCK_N, True, EVEN_D, DTYPE, INTERPRETER, DOT_PRECISION)
    for p in range(0, n_probes):
        p_off = p + off_b * 0  # int64 offsets
        tq = _dot_operand(_load_rows(TQ + p_off * stride_tqp + off_b * stride_tqb + off_h * stride_tqh
                                     + row_off * stride_tqm + offs_d[None, :],
                                     rows_m, len_q, offs_d, HEAD_DIM, True, EVEN_D), DTYPE, INTERPRETER)
        gto = _dot_operand(_load_rows(GTOut + p_off * stride_gtop + off_b * stride_gtob + off_h * stride_gtoh
                                      + row_off * stride_gtom + offs_d[None, :],
                                      rows_m, len_q, offs_d, HEAD_DIM, True, EVEN_D), DTYPE, INTERPRETER)
        stat_base = (p_off * num_bh + pid_bh) * n_q
        r = tl.load(R + stat_base + rows_m, mask=rows_m < len_q, other=0.0)
        dlt = tl.load(DeltaT + stat_base + rows_m, mask=rows_m < len_q, other=0.0)
        tk_ptrs = (TK + p_off * stride_tkp + off_b * stride_tkb + off_hkv * stride_tkh
                   + offs_n[:, None] * stride_tkn + offs_d[None, :])
        tv_ptrs = (TV + p_off * stride_tvp + off_b * stride_tvb + off_hkv * stride_tvh
                   + offs_n[:, None] * stride_tvn + offs_d[None, :])
        dtq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        dq, dtq = _attn_jvp_bwd_dq_loop(
            dq, dtq, q, tq, gto, lse2, r, dlt, k_ptrs, v_ptrs, tk_ptrs, tv_ptrs,
            stride_kn, stride_vn, stride_tkn, stride_tvn,
            full_lo, n_full, n_full, 0, rows_m, offs_n, offs_d, len_q, len_k, lo_off, hi_off, qk_scale, sm_scale,
            HEAD_DIM, BLOCK_N, False, EVEN_D, DTYPE, INTERPRETER, DOT_PRECISION)
        dq, dtq = _attn_jvp_bwd_dq_loop(
            dq, dtq, q, tq, gto, lse2, r, dlt, k_ptrs, v_ptrs, tk_ptrs, tv_ptrs,
            stride_kn, stride_vn, stride_tkn, stride_tvn,
            lo, n_masked, n_left, gap, rows_m, offs_n, offs_d, len_q, len_k, lo_off, hi_off, qk_scale, sm_scale,
            HEAD_DIM, BLOCK_N, True, EVEN_D, DTYPE, INTERPRETER, DOT_PRECISION)
        tl.store(DTQ + p_off * stride_dtqp + off_b * stride_dtqb + off_h * stride_dtqh + row_off * stride_dtqm
                 + offs_d[None, :], (dtq * sm_scale).to(DTYPE), mask=store_mask)
    tl.store(DQ + off_b * stride_dqb + off_h * stride_dqh + row_off * stride_dqm + offs_d[None, :],
             (dq * sm_scale).to(DTYPE), mask=store_mask)


@triton.jit
def _attn_jvp_bwd_dkdv_loop(dk, dv, dtk, dtv, k, v, tk, tv, q_ptrs, tq_ptrs, gto_ptrs, lse_ptrs, r_ptrs,
                            dlt_ptrs, stride_qm, stride_tqm, stride_gtom,
                            base, n_tiles, n_left, gap, cols_n, offs_m, offs_d, len_q, len_k, lo_off, hi_off,
                            qk_scale, sm_scale,
                            HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, MASKED: tl.constexpr,
                            EVEN_D: tl.constexpr, DTYPE: tl.constexpr,
                            INTERPRETER: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Query tiles of one head against one key tile, one probe, transposed [BN, BM]:
    dK += gS^T Q + gS'^T tQ (the probe's part of gS), dV += P'^T gO', dtK += gS'^T Q,
    dtV += P^T gO', with P' = P o (S' - r)."""
    for t in range(0, n_tiles):
        start_m = _tile_start(base, t, n_left, gap, BLOCK_M)
        rows = start_m + offs_m
        m_off = start_m.to(tl.int64)
        q = _dot_operand(_load_rows(q_ptrs + m_off * stride_qm, rows, len_q, offs_d, HEAD_DIM, MASKED, EVEN_D),
                         DTYPE, INTERPRETER)
        tq = _dot_operand(_load_rows(tq_ptrs + m_off * stride_tqm, rows, len_q, offs_d, HEAD_DIM, MASKED, EVEN_D),
                          DTYPE, INTERPRETER)
        gto = _dot_operand(_load_rows(gto_ptrs + m_off * stride_gtom, rows, len_q, offs_d, HEAD_DIM, MASKED,
                                      EVEN_D), DTYPE, INTERPRETER)
        if MASKED:
            lse = tl.load(lse_ptrs + rows, mask=rows < len_q, other=float("inf"))
            r = tl.load(r_ptrs + rows, mask=rows < len_q, other=0.0)
            dlt = tl.load(dlt_ptrs + rows, mask=rows < len_q, other=0.0)
        else:
            lse = tl.load(lse_ptrs + rows)
            r = tl.load(r_ptrs + rows)
            dlt = tl.load(dlt_ptrs + rows)
        lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
        qt = tl.trans(q)
        pt = tl.exp2(tl.dot(k, qt, input_precision=DOT_PRECISION) * qk_scale - lse2[None, :])
        sdt = tl.dot(k, tl.trans(tq), tl.dot(tk, qt, input_precision=DOT_PRECISION),
                     input_precision=DOT_PRECISION) * sm_scale
        gtot = tl.trans(gto)
        dptt = tl.dot(v, gtot, input_precision=DOT_PRECISION)
        yt = tl.dot(tv, gtot, input_precision=DOT_PRECISION) + dptt * (sdt - r[None, :]) - sdt * dlt[None, :]
        gst = pt * (dptt - dlt[None, :])
        gs = pt * yt
        ppt = pt * (sdt - r[None, :])
        if MASKED:
            visible = _allowed_t(cols_n, rows, len_q, len_k, lo_off, hi_off)
            pt = tl.where(visible, pt, 0.0)
            gst = tl.where(visible, gst, 0.0)
            gs = tl.where(visible, gs, 0.0)
            ppt = tl.where(visible, ppt, 0.0)
        gst = _dot_operand(gst, DTYPE, INTERPRETER)
        dk = tl.dot(_dot_operand(gs, DTYPE, INTERPRETER), q, dk, input_precision=DOT_PRECISION)
        dk = tl.dot(gst, tq, dk, input_precision=DOT_PRECISION)
        dv = tl.dot(_dot_operand(ppt, DTYPE, INTERPRETER), gto, dv, input_precision=DOT_PRECISION)
        dtk = tl.dot(gst, q, dtk, input_precision=DOT_PRECISION)
        dtv = tl.dot(_dot_operand(pt, DTYPE, INTERPRETER), gto, dtv, input_precision=DOT_PRECISION)
    return dk, dv, dtk, dtv


@triton.jit
def _attn_jvp_bwd_dkdv_kernel(
    Q, K, V, TQ, TK, TV, GOut, GTOut, Lse, D, R, DeltaT, QLens, KLens, DK, DV, DTK, DTV,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_tqp, stride_tqb, stride_tqh, stride_tqm,
    stride_tkp, stride_tkb, stride_tkh, stride_tkn,
    stride_tvp, stride_tvb, stride_tvh, stride_tvn,
    stride_gob, stride_goh, stride_gom,
    stride_gtop, stride_gtob, stride_gtoh, stride_gtom,
    stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    stride_dtkp, stride_dtkb, stride_dtkh, stride_dtkn,
    stride_dtvp, stride_dtvb, stride_dtvh, stride_dtvn,
    n_heads_kv, n_q, n_k, n_probes, kv_group, qk_scale, sm_scale, win_left, win_right, tune_q, tune_k,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_LENS: tl.constexpr, INTERPRETER: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program: dK, dV and every probe's dtK, dtV of one key tile of one KV head, summed over
    the group's query heads: the flash dK/dV loop with D for delta, then one sweep per probe
    (four fp32 accumulators live, whatever P)."""
    DTYPE: tl.constexpr = Q.dtype.element_ty
    pid = tl.program_id(0)
    num_n = tl.cdiv(n_k, BLOCK_N)
    pid_n = pid % num_n
    pid_bh = pid // num_n
    num_bh = (tl.num_programs(0) // num_n) * kv_group  # query (batch, head) pairs
    off_b = (pid_bh // n_heads_kv).to(tl.int64)
    off_hkv = (pid_bh % n_heads_kv).to(tl.int64)
    len_q, len_k = _seq_lens(QLens, KLens, off_b, n_q, n_k, HAS_LENS)
    lo_off = len_k - len_q - win_left
    hi_off = len_k - len_q + win_right
    start_n = pid_n * BLOCK_N
    cols_n = start_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    col_off = cols_n.to(tl.int64)[:, None]

    k = _dot_operand(_load_rows(K + off_b * stride_kb + off_hkv * stride_kh + col_off * stride_kn + offs_d[None, :],
                                cols_n, len_k, offs_d, HEAD_DIM, True, EVEN_D), DTYPE, INTERPRETER)
    v = _dot_operand(_load_rows(V + off_b * stride_vb + off_hkv * stride_vh + col_off * stride_vn + offs_d[None, :],
                                cols_n, len_k, offs_d, HEAD_DIM, True, EVEN_D), DTYPE, INTERPRETER)
    lo, n_masked, n_left, gap, full_lo, n_full = _tile_range(
        start_n, n_k, len_k, len_q, -hi_off, -lo_off, BLOCK_N, BLOCK_M)
    store_mask = (cols_n[:, None] < n_k) & (offs_d[None, :] < HEAD_DIM)

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    for g in range(0, kv_group):
        off_h = off_hkv * kv_group + g
        q_ptrs = Q + off_b * stride_qb + off_h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :]
        go_ptrs = GOut + off_b * stride_gob + off_h * stride_goh + offs_m[:, None] * stride_gom + offs_d[None, :]
        row_base = (off_b * n_heads_kv * kv_group + off_h) * n_q
        dk, dv = _attn_bwd_dkdv_loop(
            dk, dv, k, v, q_ptrs, go_ptrs, Lse + row_base, D + row_base, stride_qm, stride_gom,
            full_lo, n_full, n_full, 0, cols_n, offs_m, offs_d, len_q, len_k, lo_off, hi_off, qk_scale,
            HEAD_DIM, BLOCK_M, False, EVEN_D, DTYPE, INTERPRETER, DOT_PRECISION)
        dk, dv = _attn_bwd_dkdv_loop(
            dk, dv, k, v, q_ptrs, go_ptrs, Lse + row_base, D + row_base, stride_qm, stride_gom,
            lo, n_masked, n_left, gap, cols_n, offs_m, offs_d, len_q, len_k, lo_off, hi_off, qk_scale,
            HEAD_DIM, BLOCK_M, True, EVEN_D, DTYPE, INTERPRETER, DOT_PRECISION)
    for p in range(0, n_probes):
        p_off = p + off_b * 0  # int64 offsets
        tk = _dot_operand(_load_rows(TK + p_off * stride_tkp + off_b * stride_tkb + off_hkv * stride_tkh
                                     + col_off * stride_tkn + offs_d[None, :],
                                     cols_n, len_k, offs_d, HEAD_DIM, True, EVEN_D), DTYPE, INTERPRETER)
        tv = _dot_operand(_load_rows(TV + p_off * stride_tvp + off_b * stride_tvb + off_hkv * stride_tvh
                                     + col_off * stride_tvn + offs_d[None, :],
                                     cols_n, len_k, offs_d, HEAD_DIM, True, EVEN_D), DTYPE, INTERPRETER)
        dtk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        dtv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        for g in range(0, kv_group):
            off_h = off_hkv * kv_group + g
            q_ptrs = Q + off_b * stride_qb + off_h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :]
            tq_ptrs = (TQ + p_off * stride_tqp + off_b * stride_tqb + off_h * stride_tqh
                       + offs_m[:, None] * stride_tqm + offs_d[None, :])
            gto_ptrs = (GTOut + p_off * stride_gtop + off_b * stride_gtob + off_h * stride_gtoh
                        + offs_m[:, None] * stride_gtom + offs_d[None, :])
            row_base = (off_b * n_heads_kv * kv_group + off_h) * n_q
            stat_base = p_off * num_bh * n_q + row_base
            dk, dv, dtk, dtv = _attn_jvp_bwd_dkdv_loop(
                dk, dv, dtk, dtv, k, v, tk, tv, q_ptrs, tq_ptrs, gto_ptrs, Lse + row_base, R + stat_base,
                DeltaT + stat_base, stride_qm, stride_tqm, stride_gtom,
                full_lo, n_full, n_full, 0, cols_n, offs_m, offs_d, len_q, len_k, lo_off, hi_off, qk_scale, sm_scale,
                HEAD_DIM, BLOCK_M, False, EVEN_D, DTYPE, INTERPRETER, DOT_PRECISION)
            dk, dv, dtk, dtv = _attn_jvp_bwd_dkdv_loop(
                dk, dv, dtk, dtv, k, v, tk, tv, q_ptrs, tq_ptrs, gto_ptrs, Lse + row_base, R + stat_base,
                DeltaT + stat_base, stride_qm, stride_tqm, stride_gtom,
                lo, n_masked, n_left, gap, cols_n, offs_m, offs_d, len_q, len_k, lo_off, hi_off, qk_scale, sm_scale,
                HEAD_DIM, BLOCK_M, True, EVEN_D, DTYPE, INTERPRETER, DOT_PRECISION)
        tl.store(DTK + p_off * stride_dtkp + off_b * stride_dtkb + off_hkv * stride_dtkh + col_off * stride_dtkn
                 + offs_d[None, :], (dtk * sm_scale).to(DTYPE), mask=store_mask)
        tl.store(DTV + p_off * stride_dtvp + off_b * stride_dtvb + off_hkv * stride_dtvh + col_off * stride_dtvn
                 + offs_d[None, :], dtv.to(DTYPE), mask=store_mask)
    tl.store(DK + off_b * stride_dkb + off_hkv * stride_dkh + col_off * stride_dkn + offs_d[None, :],
             (dk * sm_scale).to(DTYPE), mask=store_mask)
    tl.store(DV + off_b * stride_dvb + off_hkv * stride_dvh + col_off * stride_dvn + offs_d[None, :],
             dv.to(DTYPE), mask=store_mask)


# --------------------------------------------------------------------------------------------
# Launch configurations
# --------------------------------------------------------------------------------------------

# Under the interpreter: one small config, so ragged tiles, several tiles and the diagonal all
# show up at tiny N (tests swap in other block shapes).
_INTERPRET_CONFIG = dict(BLOCK_M=16, BLOCK_N=16)

# GPU launch configurations: (kernel, bytes per element, head-dim bucket, probes per program) ->
# [(BLOCK_M, BLOCK_N, num_warps, num_stages), ...]. The head-dim bucket is the padded head dim
# BLOCK_D rounded up to 64, 128 or 256. "fwd" and "jvp" are the forward kernel without and with
# tangents; for "dkdv" BLOCK_N is the key tile that carries the two fp32 accumulators.
#
# Every entry was compiled offline for sm_80 and sm_90 (tests/test_gpu_resources.py; figures in
# BENCHMARKS.md, "Static resource model of the GPU kernels"): each fits both targets' shared
# memory per block (163 KiB on sm_80, 227 KiB on sm_90), so one list serves both, and spills at
# most _spill_limit bytes per thread on either. The first entry, what runs with
# CONDINIT_ATTN_AUTOTUNE=0, is a large tile that spills little or nothing on both targets; the
# others are the autotuner's alternatives. Wider tiles than these spill: when ptxas (12.9, -O3)
# cannot fit a kernel in 255 registers it often drops to 32 registers and spills 3-13 KB per
# thread (the JVP above all, and sm_80 more often than sm_90), so a tile that fits sm_90 may be
# unusable on sm_80.
#
# fp32 inputs take IEEE fp32 products (FMA, no tensor cores): each thread then holds whole rows of
# both operands of a product, so fp32 gets small tiles over 8 warps, and two probes per program
# only at d <= 64.
_CONFIGS = {
    # bf16 / fp16
    ("fwd", 2, 64, 1): [(128, 64, 4, 3), (128, 128, 8, 3), (64, 64, 4, 3)],
    ("fwd", 2, 128, 1): [(128, 64, 8, 3), (128, 128, 8, 2), (128, 32, 4, 3), (64, 64, 4, 3)],
    ("fwd", 2, 256, 1): [(128, 64, 8, 2), (64, 32, 4, 2), (64, 64, 4, 2)],
    ("jvp", 2, 64, 1): [(128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 4, 3)],
    ("jvp", 2, 64, 2): [(128, 32, 8, 2), (128, 16, 8, 2), (64, 32, 4, 2)],
    ("jvp", 2, 128, 1): [(128, 16, 8, 2), (64, 32, 8, 2), (64, 64, 8, 2)],
    ("jvp", 2, 128, 2): [(128, 16, 8, 2)],
    ("jvp", 2, 256, 1): [(32, 16, 8, 2), (32, 32, 8, 2)],
    ("dkdv", 2, 64, 1): [(64, 128, 8, 3), (32, 128, 4, 3), (64, 64, 4, 3)],
    ("dkdv", 2, 128, 1): [(32, 128, 8, 3), (32, 64, 8, 3), (64, 64, 8, 3), (32, 64, 4, 3)],
    ("dkdv", 2, 256, 1): [(32, 32, 8, 2), (32, 64, 8, 2), (16, 64, 8, 2)],
    ("dq", 2, 64, 1): [(128, 32, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3)],
    ("dq", 2, 128, 1): [(128, 32, 8, 3), (128, 64, 8, 2), (64, 64, 4, 2), (64, 32, 4, 3)],
    ("dq", 2, 256, 1): [(64, 64, 8, 2), (64, 32, 4, 2)],
    # fp32
    ("fwd", 4, 64, 1): [(32, 16, 8, 2), (64, 16, 8, 2)],
    ("fwd", 4, 128, 1): [(32, 16, 8, 2), (64, 16, 8, 2)],
    ("fwd", 4, 256, 1): [(32, 16, 8, 2), (16, 16, 4, 2)],
    ("jvp", 4, 64, 1): [(16, 16, 8, 2), (32, 16, 8, 2)],
    ("jvp", 4, 64, 2): [(16, 16, 8, 2)],
    ("jvp", 4, 128, 1): [(16, 16, 8, 2)],
    ("jvp", 4, 256, 1): [(16, 16, 8, 2)],
    ("dkdv", 4, 64, 1): [(16, 32, 8, 2), (16, 16, 4, 2)],
    ("dkdv", 4, 128, 1): [(16, 32, 8, 2), (16, 16, 4, 2)],
    ("dkdv", 4, 256, 1): [(16, 32, 8, 2), (16, 16, 4, 2)],
    ("dq", 4, 64, 1): [(32, 16, 8, 2), (16, 16, 4, 2)],
    ("dq", 4, 128, 1): [(32, 16, 8, 2), (16, 16, 4, 2)],
    ("dq", 4, 256, 1): [(32, 16, 8, 2), (16, 16, 4, 2)],
    # Backward through the tangent output: "jvp_bwd_rows" (the row statistics, a forward-like
    # sweep without accumulators), "jvp_bwd_dq" (two fp32 accumulators, BLOCK_M rows) and
    # "jvp_bwd_dkdv" (four fp32 accumulators, BLOCK_N keys).
    ("jvp_bwd_rows", 2, 64, 1): [(128, 64, 8, 2), (64, 64, 4, 2)],
    ("jvp_bwd_rows", 2, 128, 1): [(128, 32, 8, 2), (64, 64, 8, 2)],
    ("jvp_bwd_rows", 2, 256, 1): [(64, 32, 8, 2), (32, 32, 4, 2)],
    ("jvp_bwd_dq", 2, 64, 1): [(64, 32, 4, 2), (128, 32, 8, 2)],
    ("jvp_bwd_dq", 2, 128, 1): [(64, 32, 8, 2), (64, 16, 4, 2)],
    ("jvp_bwd_dq", 2, 256, 1): [(32, 16, 8, 2), (32, 32, 8, 2)],
    ("jvp_bwd_dkdv", 2, 64, 1): [(32, 64, 8, 2), (32, 32, 4, 2)],
    ("jvp_bwd_dkdv", 2, 128, 1): [(32, 32, 8, 2), (16, 32, 4, 2)],
    ("jvp_bwd_dkdv", 2, 256, 1): [(16, 16, 8, 2), (32, 16, 8, 2)],
    ("jvp_bwd_rows", 4, 64, 1): [(32, 16, 8, 2)],
    ("jvp_bwd_rows", 4, 128, 1): [(32, 16, 8, 2)],
    ("jvp_bwd_rows", 4, 256, 1): [(16, 16, 8, 2)],
    ("jvp_bwd_dq", 4, 64, 1): [(16, 16, 8, 2)],
    ("jvp_bwd_dq", 4, 128, 1): [(16, 16, 8, 2)],
    ("jvp_bwd_dq", 4, 256, 1): [(16, 16, 8, 1)],
    ("jvp_bwd_dkdv", 4, 64, 1): [(16, 16, 8, 2)],
    ("jvp_bwd_dkdv", 4, 128, 1): [(16, 16, 8, 1)],
    ("jvp_bwd_dkdv", 4, 256, 1): [(16, 16, 8, 1)],
}


def _head_dim_bucket(block_d: int) -> int:
    return 64 if block_d <= 64 else block_d


def _spill_limit(kind: str, elem_bytes: int, block_d: int) -> int:
    """Largest stack frame (spilled registers, bytes per thread) an entry of _CONFIGS may need on
    sm_80 or sm_90 (checked by tests/test_gpu_resources.py). Exceptions: the fp32 JVP at
    d = 256 holds two fp32 BLOCK_M x 256 accumulators and Q, tQ as FMA operands, and spills
    about 4.5 KB per thread with every tile tl.dot allows (16 x 16 and up); for fp32 at that size
    the CUDA kernels (no spills) are the better backend."""
    if (kind, elem_bytes, _head_dim_bucket(block_d)) == ("jvp", 4, 256):
        return 5 * 1024
    # The same at d = 256 for the fp32 tangent backward: its dQ kernel (two fp32 accumulators,
    # Q, tQ, gO') spills about 600 B per thread, its dK/dV kernel (four fp32 accumulators and the
    # K, V, tK, tV tiles) 1.7 KB on sm_90 and 2.5 KB on sm_80, with the smallest tiles tl.dot
    # allows.
    return {("jvp_bwd_dq", 4, 256): 1024, ("jvp_bwd_dkdv", 4, 256): 3072}.get(
        (kind, elem_bytes, _head_dim_bucket(block_d)), 512)


def _probes_per_program(elem_bytes: int, block_d: int, jvp: bool, n_probes: int) -> int:
    """2 when a JVP call has several probes and a two-probe list exists for its dtype and head
    dim (the pair shares S, P~ and P~ V), else 1."""
    two = jvp and n_probes > 1 and ("jvp", elem_bytes, _head_dim_bucket(block_d), 2) in _CONFIGS
    return 2 if two else 1


def _configs(kind: str, elem_bytes: int, block_d: int, probes_per_program: int = 1) -> list:
    """The GPU launch configurations of one kernel (``"fwd"``, ``"jvp"``, ``"dkdv"``, ``"dq"``)
    for inputs of ``elem_bytes`` bytes per element, padded head dim ``block_d`` and
    ``probes_per_program``, as :class:`triton.Config` (first one: the autotune-off choice)."""
    return [triton.Config(dict(BLOCK_M=m, BLOCK_N=n), num_warps=w, num_stages=s)
            for m, n, w, s in _CONFIGS[(kind, elem_bytes, _head_dim_bucket(block_d), probes_per_program)]]


_KERNELS = {"fwd": _attn_fwd_kernel, "jvp": _attn_fwd_kernel, "dkdv": _attn_bwd_dkdv_kernel,
            "dq": _attn_bwd_dq_kernel, "jvp_bwd_rows": _attn_jvp_bwd_rows_kernel,
            "jvp_bwd_dq": _attn_jvp_bwd_dq_kernel, "jvp_bwd_dkdv": _attn_jvp_bwd_dkdv_kernel}
# Autotune key: bucketed sequence lengths, the padded head dim, the causal and lengths flags and,
# for the forward kernel, the JVP flag and the probes per program; the autotuner appends the
# tensors' dtypes itself.
_BASE_KEY = ["tune_q", "tune_k", "BLOCK_D", "CAUSAL", "HAS_LENS"]
_TUNE_KEY = {kind: _BASE_KEY for kind in _KERNELS}
_TUNE_KEY["fwd"] = _TUNE_KEY["jvp"] = _BASE_KEY + ["JVP", "PROBES_PER_PROGRAM"]


@functools.lru_cache(maxsize=None)
def _tuned(kind: str, elem_bytes: int, block_d: int, probes_per_program: int):
    """One autotuner per config list."""
    return triton.autotune(_configs(kind, elem_bytes, block_d, probes_per_program),
                           key=_TUNE_KEY[kind])(_KERNELS[kind])


def _bucket(n: int) -> int:
    # Autotune once per power-of-two bucket of the sequence length, not per length.
    return triton.next_power_of_2(max(int(n), 16))


def _common_meta(head_dim: int) -> dict:
    """The compile-time arguments every kernel takes, for head dim ``head_dim``."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    return dict(
        HEAD_DIM=head_dim, BLOCK_D=block_d, EVEN_D=head_dim == block_d,
        INTERPRETER=_interpret(),
        DOT_PRECISION="ieee",  # fp32 inputs: IEEE products (no TF32); ignored for fp16 / bf16
    )


def _launch(kind, grid_fn, args, meta):
    """Launch kernel ``kind`` on ``args`` (``args[0]`` is q) with compile-time arguments ``meta``.
    Interpreter: the fixed small config. GPU: the autotuner over the list of ``_configs``, or with
    CONDINIT_ATTN_AUTOTUNE=0 its first config."""
    kernel = _KERNELS[kind]
    if _interpret():
        cfg = dict(_INTERPRET_CONFIG)
        kernel[(grid_fn(cfg),)](*args, **meta, **cfg)
        return
    elem_bytes = args[0].element_size()
    ppp = meta.get("PROBES_PER_PROGRAM", 1)
    if os.environ.get("CONDINIT_ATTN_AUTOTUNE", "1") == "0":
        first = _configs(kind, elem_bytes, meta["BLOCK_D"], ppp)[0]
        kernel[(grid_fn(first.kwargs),)](*args, **meta, **first.kwargs,
                                         num_warps=first.num_warps, num_stages=first.num_stages)
    else:
        _tuned(kind, elem_bytes, meta["BLOCK_D"], ppp)[lambda m: (grid_fn(m),)](*args, **meta)


# --------------------------------------------------------------------------------------------
# Argument checks
# --------------------------------------------------------------------------------------------


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


def _rowmajor(t):
    # The kernels take arbitrary strides but need unit stride along the head dim.
    return t if t.stride(-1) == 1 else t.contiguous()


def _mask_args(q, k, causal, window_left, window_right, q_lens, kv_lens):
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
    q_lens, kv_lens, win_left, win_right, has_lens = _mask_args(q, k, causal, *mask)
    out = torch.empty_like(q)
    lse = torch.empty((B, H, Nq), device=q.device, dtype=torch.float32)
    if jvp:
        tq, tk, tv = _rowmajor(tq), _rowmajor(tk), _rowmajor(tv)
        n_probes = tq.shape[0]
        tout = torch.empty(tq.shape, device=q.device, dtype=q.dtype)
    else:
        n_probes = 1
        tq, tk, tv, tout = q[None], k[None], v[None], out[None]  # placeholders, never touched
    meta = _common_meta(d)
    ppp = _probes_per_program(q.element_size(), meta["BLOCK_D"], jvp, n_probes)
    meta.update(CAUSAL=causal, HAS_LENS=has_lens, JVP=jvp, PROBES_PER_PROGRAM=ppp)
    args = (q, k, v, out, lse, tq, tk, tv, tout, q_lens, kv_lens,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            out.stride(0), out.stride(1), out.stride(2),
            lse.stride(0), lse.stride(1),
            *tq.stride()[:4], *tk.stride()[:4], *tv.stride()[:4], *tout.stride()[:4],
            H, Nq, Nk, n_probes, H // Hkv, float(scale) * _LOG2E, float(scale), win_left, win_right,
            _bucket(Nq), _bucket(Nk))

    def grid(m):
        return triton.cdiv(Nq, m["BLOCK_M"]) * triton.cdiv(n_probes, ppp) * B * H

    _launch("jvp" if jvp else "fwd", grid, args, meta)
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
    out, lse, tout = _forward(q, k, v, causal, scale, (window_left, window_right, q_lens, kv_lens), tq, tk, tv)
    return out, (tout[0] if single else tout), lse


def _row_sums(out, dout, q_lens, has_lens, block_d):
    """rowsum(dO o O) in fp32 ``[B, H, Nq]`` (0 past Lq)."""
    B, H, Nq, d = out.shape
    delta = torch.empty((B, H, Nq), device=out.device, dtype=torch.float32)
    pre_block = _INTERPRET_CONFIG["BLOCK_M"] if _interpret() else max(16, min(128, 8192 // block_d))
    _attn_bwd_preprocess_kernel[(triton.cdiv(Nq, pre_block) * B * H,)](
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
    q, k, v, dout, out = (_rowmajor(t) for t in (q, k, v, dout, out))
    lse = lse.contiguous()
    B, H, Nq, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    q_lens, kv_lens, win_left, win_right, has_lens = _mask_args(q, k, causal, window_left, window_right,
                                                                 q_lens, kv_lens)
    meta = _common_meta(d)
    delta = _row_sums(out, dout, q_lens, has_lens, meta["BLOCK_D"])

    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    meta.update(CAUSAL=causal, HAS_LENS=has_lens)
    tail = (float(scale) * _LOG2E, float(scale), win_left, win_right, _bucket(Nq), _bucket(Nk))
    _launch("dkdv", lambda m: triton.cdiv(Nk, m["BLOCK_N"]) * B * Hkv,
            (q, k, v, dout, lse, delta, dk, dv, q_lens, kv_lens,
             q.stride(0), q.stride(1), q.stride(2),
             k.stride(0), k.stride(1), k.stride(2),
             v.stride(0), v.stride(1), v.stride(2),
             dout.stride(0), dout.stride(1), dout.stride(2),
             dk.stride(0), dk.stride(1), dk.stride(2),
             dv.stride(0), dv.stride(1), dv.stride(2),
             Hkv, Nq, Nk, H // Hkv, *tail), meta)
    _launch("dq", lambda m: triton.cdiv(Nq, m["BLOCK_M"]) * B * H,
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
    q, k, v, gout, out, tq, tk, tv, tout, gtout = (
        _rowmajor(t) for t in (q, k, v, gout, out, tq, tk, tv, tout, gtout))
    lse = lse.contiguous()
    B, H, Nq, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    n_probes = tq.shape[0]
    q_lens, kv_lens, win_left, win_right, has_lens = _mask_args(q, k, causal, window_left, window_right,
                                                                 q_lens, kv_lens)
    meta = _common_meta(d)
    meta.update(CAUSAL=causal, HAS_LENS=has_lens)
    tail = (n_probes, H // Hkv, float(scale) * _LOG2E, float(scale), win_left, win_right,
            _bucket(Nq), _bucket(Nk))
    strides = [*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *tq.stride()[:4], *tk.stride()[:4],
               *tv.stride()[:4]]

    r = torch.empty((n_probes, B, H, Nq), device=q.device, dtype=torch.float32)
    delta_t = torch.empty_like(r)
    d_row = torch.empty((B, H, Nq), device=q.device, dtype=torch.float32)
    _launch("jvp_bwd_rows", lambda m: triton.cdiv(Nq, m["BLOCK_M"]) * B * H,
            (q, k, tq, tk, out, tout, gout, gtout, lse, q_lens, kv_lens, r, delta_t, d_row,
             *q.stride()[:3], *k.stride()[:3], *tq.stride()[:4], *tk.stride()[:4],
             *out.stride()[:3], *tout.stride()[:4], *gout.stride()[:3], *gtout.stride()[:4],
             H, Nq, Nk, *tail), meta)

    new = lambda x: torch.empty(x.shape, device=q.device, dtype=q.dtype)  # noqa: E731  (contiguous)
    dq, dtq = new(q), new(tq)
    _launch("jvp_bwd_dq", lambda m: triton.cdiv(Nq, m["BLOCK_M"]) * B * H,
            (q, k, v, tq, tk, tv, gout, gtout, lse, d_row, r, delta_t, q_lens, kv_lens, dq, dtq,
             *strides, *gout.stride()[:3], *gtout.stride()[:4], *dq.stride()[:3], *dtq.stride()[:4],
             H, Nq, Nk, *tail), meta)

    dk, dv, dtk, dtv = new(k), new(v), new(tk), new(tv)
    _launch("jvp_bwd_dkdv", lambda m: triton.cdiv(Nk, m["BLOCK_N"]) * B * Hkv,
            (q, k, v, tq, tk, tv, gout, gtout, lse, d_row, r, delta_t, q_lens, kv_lens, dk, dv, dtk, dtv,
             *strides, *gout.stride()[:3], *gtout.stride()[:4], *dk.stride()[:3], *dv.stride()[:3],
             *dtk.stride()[:4], *dtv.stride()[:4],
             Hkv, Nq, Nk, *tail), meta)
    if single:
        dtq, dtk, dtv = dtq[0], dtk[0], dtv[0]
    return dq, dk, dv, dtq, dtk, dtv
