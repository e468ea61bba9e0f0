"""The flash backward kernels of the Triton attention (the VJP): ``rowsum(dO o O)``, dK/dV and dQ.

**Backward** (flash attention 2, deterministic, no atomics): ``D = rowsum(dO o O)``; one kernel per
key tile of each KV head accumulates ``dV = P^T dO`` and ``dK = s dS^T Q`` with
``dS = P o (dO V^T - D)`` over the query heads of its GQA group (so dK, dV come out with Hkv heads
and no extra [B, H, Nk, d] buffer); a separate kernel per query tile computes ``dQ = s dS K``.
"""
import triton
import triton.language as tl

from condinit.kernels.attention.tiles import (allowed_pairs, allowed_pairs_t, dot_operand,
                                              load_rows, seq_lens, tile_range, tile_start)


@triton.jit
def attn_bwd_preprocess_kernel(Out, DOut, Delta, QLens, stride_ob, stride_oh, stride_om,
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
    len_q, _ = seq_lens(QLens, QLens, off_b, n_q, n_q, HAS_LENS)
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
def attn_bwd_dkdv_loop(dk, dv, k, v, q_ptrs, do_ptrs, lse_ptrs, delta_ptrs, stride_qm, stride_dom,
                        base, n_tiles, n_left, gap, cols_n, offs_m, offs_d, len_q, len_k, lo_off, hi_off,
                        qk_scale,
                        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, MASKED: tl.constexpr,
                        EVEN_D: tl.constexpr, DTYPE: tl.constexpr,
                        INTERPRETER: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Query tiles of one head against one key tile, transposed orientation [BN, BM]:
    dV += P^T dO, dK += dS^T Q with dS = P o (dO V^T - delta)."""
    for t in range(0, n_tiles):
        start_m = tile_start(base, t, n_left, gap, BLOCK_M)
        rows = start_m + offs_m
        m_off = start_m.to(tl.int64)
        q = dot_operand(load_rows(q_ptrs + m_off * stride_qm, rows, len_q, offs_d, HEAD_DIM, MASKED, EVEN_D),
                         DTYPE, INTERPRETER)
        do = dot_operand(load_rows(do_ptrs + m_off * stride_dom, rows, len_q, offs_d, HEAD_DIM, MASKED, EVEN_D),
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
            visible = allowed_pairs_t(cols_n, rows, len_q, len_k, lo_off, hi_off)
            pt = tl.where(visible, pt, 0.0)
            dst = tl.where(visible, dst, 0.0)
        dv = tl.dot(dot_operand(pt, DTYPE, INTERPRETER), do, dv, input_precision=DOT_PRECISION)
        dk = tl.dot(dot_operand(dst, DTYPE, INTERPRETER), q, dk, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def attn_bwd_dkdv_kernel(
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
    len_q, len_k = seq_lens(QLens, KLens, off_b, n_q, n_k, HAS_LENS)
    lo_off = len_k - len_q - win_left
    hi_off = len_k - len_q + win_right
    start_n = pid_n * BLOCK_N
    cols_n = start_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    col_off = cols_n.to(tl.int64)

    k = dot_operand(load_rows(K + off_b * stride_kb + off_hkv * stride_kh + col_off[:, None] * stride_kn
                                + offs_d[None, :], cols_n, len_k, offs_d, HEAD_DIM, True, EVEN_D), DTYPE, INTERPRETER)
    v = dot_operand(load_rows(V + off_b * stride_vb + off_hkv * stride_vh + col_off[:, None] * stride_vn
                                + offs_d[None, :], cols_n, len_k, offs_d, HEAD_DIM, True, EVEN_D), DTYPE, INTERPRETER)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    # The query rows that see key j: j - hi_off <= i <= j - lo_off.
    lo, n_masked, n_left, gap, full_lo, n_full = tile_range(
        start_n, n_k, len_k, len_q, -hi_off, -lo_off, BLOCK_N, BLOCK_M)
    for g in range(0, kv_group):
        off_h = off_hkv * kv_group + g
        q_ptrs = Q + off_b * stride_qb + off_h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :]
        do_ptrs = DOut + off_b * stride_dob + off_h * stride_doh + offs_m[:, None] * stride_dom + offs_d[None, :]
        row_base = (off_b * n_heads_kv * kv_group + off_h) * n_q
        lse_ptrs = Lse + row_base
        delta_ptrs = Delta + row_base
        dk, dv = attn_bwd_dkdv_loop(
            dk, dv, k, v, q_ptrs, do_ptrs, lse_ptrs, delta_ptrs, stride_qm, stride_dom,
            full_lo, n_full, n_full, 0, cols_n, offs_m, offs_d, len_q, len_k, lo_off, hi_off, qk_scale,
            HEAD_DIM, BLOCK_M, False, EVEN_D, DTYPE, INTERPRETER, DOT_PRECISION)
        dk, dv = attn_bwd_dkdv_loop(
            dk, dv, k, v, q_ptrs, do_ptrs, lse_ptrs, delta_ptrs, stride_qm, stride_dom,
            lo, n_masked, n_left, gap, cols_n, offs_m, offs_d, len_q, len_k, lo_off, hi_off, qk_scale,
            HEAD_DIM, BLOCK_M, True, EVEN_D, DTYPE, INTERPRETER, DOT_PRECISION)

    mask = (cols_n[:, None] < n_k) & (offs_d[None, :] < HEAD_DIM)
    tl.store(DK + off_b * stride_dkb + off_hkv * stride_dkh + col_off[:, None] * stride_dkn + offs_d[None, :],
             (dk * sm_scale).to(DTYPE), mask=mask)
    tl.store(DV + off_b * stride_dvb + off_hkv * stride_dvh + col_off[:, None] * stride_dvn + offs_d[None, :],
             dv.to(DTYPE), mask=mask)


@triton.jit
def attn_bwd_dq_loop(dq, q, do, lse2, delta, k_ptrs, v_ptrs, stride_kn, stride_vn,
                      base, n_tiles, n_left, gap, rows_m, offs_n, offs_d, len_q, len_k, lo_off, hi_off,
                      qk_scale,
                      HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                      EVEN_D: tl.constexpr, DTYPE: tl.constexpr,
                      INTERPRETER: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Key tiles of one query tile: dQ += dS K with dS = P o (dO V^T - delta)."""
    for t in range(0, n_tiles):
        start_n = tile_start(base, t, n_left, gap, BLOCK_N)
        cols = start_n + offs_n
        kv_off = start_n.to(tl.int64)
        k = dot_operand(load_rows(k_ptrs + kv_off * stride_kn, cols, len_k, offs_d, HEAD_DIM, MASKED, EVEN_D),
                         DTYPE, INTERPRETER)
        v = dot_operand(load_rows(v_ptrs + kv_off * stride_vn, cols, len_k, offs_d, HEAD_DIM, MASKED, EVEN_D),
                         DTYPE, INTERPRETER)
        p = tl.exp2(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale - lse2[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        if MASKED:
            ds = tl.where(allowed_pairs(rows_m, cols, len_q, len_k, lo_off, hi_off), ds, 0.0)
        dq = tl.dot(dot_operand(ds, DTYPE, INTERPRETER), k, dq, input_precision=DOT_PRECISION)
    return dq


@triton.jit
def attn_bwd_dq_kernel(
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
    len_q, len_k = seq_lens(QLens, KLens, off_b, n_q, n_k, HAS_LENS)
    lo_off = len_k - len_q - win_left
    hi_off = len_k - len_q + win_right
    start_m = pid_m * BLOCK_M
    rows_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_off = rows_m.to(tl.int64)

    q = dot_operand(load_rows(Q + off_b * stride_qb + off_h * stride_qh + row_off[:, None] * stride_qm
                                + offs_d[None, :], rows_m, len_q, offs_d, HEAD_DIM, True, EVEN_D), DTYPE, INTERPRETER)
    do = dot_operand(load_rows(DOut + off_b * stride_dob + off_h * stride_doh + row_off[:, None] * stride_dom
                                 + offs_d[None, :], rows_m, len_q, offs_d, HEAD_DIM, True, EVEN_D), DTYPE, INTERPRETER)
    row_base = pid_bh.to(tl.int64) * n_q
    lse = tl.load(Lse + row_base + rows_m, mask=rows_m < len_q, other=float("inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    delta = tl.load(Delta + row_base + rows_m, mask=rows_m < len_q, other=0.0)
    k_ptrs = K + off_b * stride_kb + off_hkv * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :]
    v_ptrs = V + off_b * stride_vb + off_hkv * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :]
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    lo, n_masked, n_left, gap, full_lo, n_full = tile_range(
        start_m, n_q, len_q, len_k, lo_off, hi_off, BLOCK_M, BLOCK_N)
    dq = attn_bwd_dq_loop(dq, q, do, lse2, delta, k_ptrs, v_ptrs, stride_kn, stride_vn,
                           full_lo, n_full, n_full, 0, rows_m, offs_n, offs_d, len_q, len_k, lo_off, hi_off,
                           qk_scale, HEAD_DIM, BLOCK_N, False, EVEN_D, DTYPE, INTERPRETER, DOT_PRECISION)
    dq = attn_bwd_dq_loop(dq, q, do, lse2, delta, k_ptrs, v_ptrs, stride_kn, stride_vn,
                           lo, n_masked, n_left, gap, rows_m, offs_n, offs_d, len_q, len_k, lo_off, hi_off,
                           qk_scale, HEAD_DIM, BLOCK_N, True, EVEN_D, DTYPE, INTERPRETER, DOT_PRECISION)
    tl.store(DQ + off_b * stride_dqb + off_h * stride_dqh + row_off[:, None] * stride_dqm + offs_d[None, :],
             (dq * sm_scale).to(DTYPE), mask=(rows_m[:, None] < n_q) & (offs_d[None, :] < HEAD_DIM))

