"""The forward kernel of the Triton attention, and the same kernel with tangents: the multi-probe
JVP (``JVP=True``), one fused pass.

**Forward** (flash attention 2): one program per query tile walks the key tiles with an online
softmax, ``P~ = exp(S - m)``, ``l = rowsum(P~)``, ``acc = P~ V``, all rescaled by
``alpha = exp(m_old - m_new)``; ``O = acc / l``.

**JVP** with tangents ``(tQ, tK, tV)``: ``S' = s (tQ K^T + Q tK^T)``,
``P' = P o (S' - rowsum(P o S'))``, ``O' = P' V + P tV``. Fused into the same pass: per probe
carry ``acc_t = P~ tV + (P~ o S') V`` (the paper's ``accA + accB``: both are divided by the same
``l``, so one accumulator holds their sum) and ``r = rowsum(P~ o S')``, rescaled by the same
``alpha``; at the end ``O' = (acc_t - r O) / l``. All accumulators are fp32 (the ``r O``
subtraction cancels). Per key tile: ``S``, the softmax and ``P~``, then each probe's ``S'`` and
``acc_t`` (each two products into one accumulator: one product over a doubled reduction dim),
then ``P~ V`` last, so that the rescaled ``acc`` is not live across the tangent products: at
d = 128 this is what lets 128 x 64 tiles fit sm_90's 255 registers (8 B of spills against 120 B
with ``P~ V`` first; stacking the operands with ``tl.join`` instead costs layout conversions and
spills 888 B).

**Several probes.** Tangents carry a leading probe axis ``[P, B, H, N, d]``. One launch serves all
P probes: the grid holds ``ceil(P / PROBES_PER_PROGRAM)`` probe groups per query tile, and a
program computes the primal work of its tile (``S = s Q K^T``, ``P~``, ``P~ V``: 2 of the 6 matrix
products and every exponential) once for the ``PROBES_PER_PROGRAM`` (1 or 2) probes it owns, each
probe adding its own 4 products. A pair of probes costs 10 products instead of 12, and the
programs of one query tile (all its probe groups) are adjacent in the launch order, so their K and
V tiles are read from L2 rather than HBM. Two probes per program, not more, because every probe
adds a ``BLOCK_M x d`` fp32 accumulator to the register file (three at two probes); the host takes
2 whenever a two-probe list exists for the dtype and head dim (see ``configs.CONFIGS``).
"""
import triton
import triton.language as tl

from condinit.kernels.attention.tiles import (allowed_pairs, dot_operand, load_rows, seq_lens,
                                              tile_range, tile_start)


@triton.jit
def _tangent_tile(acc_t, r, alpha, p_mma, q, tq, kt, v, tk_ptrs, tv_ptrs, rows64, stride_tkn, stride_tvn,
                  cols, len_k, offs_d, visible, sm_scale,
                  HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, EVEN_D: tl.constexpr, DTYPE: tl.constexpr,
                  INTERPRETER: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One probe on one key tile: ``S' / s = Q tK^T + tQ K^T`` and ``acc_t = alpha acc_t + P~ tV +
    (P~ o S') V`` as two products each into one fp32 accumulator (a product over the doubled
    reduction dim, ``[Q | tQ] [tK | K]^T`` and ``[P~ | P~ o S'] [tV ; V]``, without forming the
    stacked operands), and ``r = alpha r + rowsum(P~ o S')``."""
    tk = load_rows(tk_ptrs + rows64 * stride_tkn + offs_d[None, :], cols, len_k, offs_d, HEAD_DIM, MASKED, EVEN_D)
    tv = load_rows(tv_ptrs + rows64 * stride_tvn + offs_d[None, :], cols, len_k, offs_d, HEAD_DIM, MASKED, EVEN_D)
    tk = dot_operand(tk, DTYPE, INTERPRETER)
    tv = dot_operand(tv, DTYPE, INTERPRETER)
    sd = tl.dot(q, tl.trans(tk), input_precision=DOT_PRECISION)
    sd = tl.dot(tq, kt, sd, input_precision=DOT_PRECISION)
    # P~ o S' from the rounded P~ (the fp32 P~ is dead by now: fewer live registers); masked
    # entries have P~ = 0 (and a non-finite S' there must not reach r).
    ps = p_mma.to(tl.float32) * (sd * sm_scale)
    if MASKED:
        ps = tl.where(visible, ps, 0.0)
    r = r * alpha + tl.sum(ps, 1)
    acc_t = tl.dot(p_mma, tv, acc_t * alpha[:, None], input_precision=DOT_PRECISION)
    acc_t = tl.dot(dot_operand(ps, DTYPE, INTERPRETER), v, acc_t, input_precision=DOT_PRECISION)
    return acc_t, r


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
        start_n = tile_start(base, t, n_left, gap, BLOCK_N)
        cols = start_n + offs_n
        rows64 = cols.to(tl.int64)[:, None]
        k = load_rows(k_ptrs + rows64 * stride_kn + offs_d[None, :], cols, len_k, offs_d, HEAD_DIM, MASKED, EVEN_D)
        v = load_rows(v_ptrs + rows64 * stride_vn + offs_d[None, :], cols, len_k, offs_d, HEAD_DIM, MASKED, EVEN_D)
        k = dot_operand(k, DTYPE, INTERPRETER)
        v = dot_operand(v, DTYPE, INTERPRETER)
        kt = tl.trans(k)
        s = tl.dot(q, kt, input_precision=DOT_PRECISION) * qk_scale  # log2 units
        visible = s == s  # placeholder (never read unless MASKED)
        if MASKED:
            visible = allowed_pairs(rows_m, cols, len_q, len_k, lo_off, hi_off)
            s = tl.where(visible, s, float("-inf"))
        # A NaN score is kept (tl.max / tl.maximum may drop it, but exp2(NaN - m) is NaN anyway).
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen only masked keys keeps m = -inf: shift by 0 so that no
        # exp(-inf - -inf) = NaN appears (its p and alpha are then exactly 0).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        p_mma = dot_operand(p, DTYPE, INTERPRETER)
        if JVP:
            acc_t0, r_0 = _tangent_tile(acc_t0, r_0, alpha, p_mma, q, tq0, kt, v, tk0_ptrs, tv0_ptrs, rows64,
                                        stride_tkn, stride_tvn, cols, len_k, offs_d, visible, sm_scale,
                                        HEAD_DIM, MASKED, EVEN_D, DTYPE, INTERPRETER, DOT_PRECISION)
            if TWO_PROBES:
                acc_t1, r_1 = _tangent_tile(acc_t1, r_1, alpha, p_mma, q, tq1, kt, v, tk1_ptrs, tv1_ptrs, rows64,
                                            stride_tkn, stride_tvn, cols, len_k, offs_d, visible, sm_scale,
                                            HEAD_DIM, MASKED, EVEN_D, DTYPE, INTERPRETER, DOT_PRECISION)
        # P~ V last: its fp32 accumulator is rescaled and updated after the tangent products, so
        # the old and new acc are not live across them (fewer registers at wide key tiles).
        acc = tl.dot(p_mma, v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i, acc_t0, r_0, acc_t1, r_1


@triton.jit
def attn_fwd_kernel(
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
    len_q, len_k = seq_lens(QLens, KLens, off_b, n_q, n_k, HAS_LENS)
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
    q = dot_operand(load_rows(q_ptrs, rows_m, len_q, offs_d, HEAD_DIM, True, EVEN_D), DTYPE, INTERPRETER)

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
        tq0 = dot_operand(load_rows(TQ + p0_off * stride_tqp + off_b * stride_tqb + off_h * stride_tqh
                                      + row_off[:, None] * stride_tqm + offs_d[None, :],
                                      rows_m, len_q, offs_d, HEAD_DIM, True, EVEN_D), DTYPE, INTERPRETER)
        tk0_ptrs = TK + p0_off * stride_tkp + off_b * stride_tkb + off_hkv * stride_tkh
        tv0_ptrs = TV + p0_off * stride_tvp + off_b * stride_tvb + off_hkv * stride_tvh
        if TWO_PROBES:
            # An odd P: the last group's second probe repeats probe P-1 and is not stored.
            p1 = tl.minimum(p0 + 1, n_probes - 1)
            p1_off = p1.to(tl.int64)
            tq1 = dot_operand(load_rows(TQ + p1_off * stride_tqp + off_b * stride_tqb + off_h * stride_tqh
                                          + row_off[:, None] * stride_tqm + offs_d[None, :],
                                          rows_m, len_q, offs_d, HEAD_DIM, True, EVEN_D), DTYPE, INTERPRETER)
            tk1_ptrs = TK + p1_off * stride_tkp + off_b * stride_tkb + off_hkv * stride_tkh
            tv1_ptrs = TV + p1_off * stride_tvp + off_b * stride_tvb + off_hkv * stride_tvh

    lo, n_masked, n_left, gap, full_lo, n_full = tile_range(
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

