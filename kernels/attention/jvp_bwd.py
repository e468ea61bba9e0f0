"""The tangent backward kernels of the Triton attention (the backward through the JVP's tangent
output): row statistics, dQ with every dtQ, dK / dV with every dtK / dtV.

**Backward through the tangent output** (:func:`attention_jvp_bwd`; formulas in docs/design.md,
"Attention"), three launches, deterministic: per query tile the row statistics ``r_p =
rowsum(P o S'_p)`` (a sweep over the keys: ``r`` is not saved by the JVP), ``d'_p = rowsum(gO'_p o
O)`` and ``D``; per query tile ``dQ`` and every ``dtQ_p``; per key tile ``dK``, ``dV`` and every
``dtK_p``, ``dtV_p``, summed over the GQA group. ``gS = P o (gP - D)`` is linear in the probes'
terms of ``gP``, so each program first runs the flash loop with ``D`` for delta (the primal part)
and then one sweep per probe: the live accumulators (two per query tile, four per key tile) do
not grow with P. Products per (query tile, key tile): ``1 + 2P`` (statistics) + ``3 + 8P`` (dQ) +
``3 + 10P`` (dK, dV); memory O(N): ``(2P + 1) B H Nq`` fp32 statistics.
"""
import triton
import triton.language as tl

from condinit.kernels.attention.bwd import attn_bwd_dkdv_loop, attn_bwd_dq_loop
from condinit.kernels.attention.tiles import (allowed_pairs, allowed_pairs_t, dot_operand,
                                              load_rows, seq_lens, tile_range, tile_start)


@triton.jit
def _attn_rows_loop(r, q, tq, lse2, k_ptrs, tk_ptrs, stride_kn, stride_tkn,
                    base, n_tiles, n_left, gap, rows_m, offs_n, offs_d, len_q, len_k, lo_off, hi_off,
                    qk_scale,
                    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                    EVEN_D: tl.constexpr, DTYPE: tl.constexpr,
                    INTERPRETER: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Key tiles of one query tile: r += rowsum(P o (tQ K^T + Q tK^T)) (unscaled)."""
    for t in range(0, n_tiles):
        start_n = tile_start(base, t, n_left, gap, BLOCK_N)
        cols = start_n + offs_n
        kv_off = start_n.to(tl.int64)
        k = dot_operand(load_rows(k_ptrs + kv_off * stride_kn, cols, len_k, offs_d, HEAD_DIM, MASKED, EVEN_D),
                         DTYPE, INTERPRETER)
        tk = dot_operand(load_rows(tk_ptrs + kv_off * stride_tkn, cols, len_k, offs_d, HEAD_DIM, MASKED, EVEN_D),
                          DTYPE, INTERPRETER)
        kt = tl.trans(k)
        p = tl.exp2(tl.dot(q, kt, input_precision=DOT_PRECISION) * qk_scale - lse2[:, None])
        sd = tl.dot(tq, kt, tl.dot(q, tl.trans(tk), input_precision=DOT_PRECISION), input_precision=DOT_PRECISION)
        ps = p * sd
        if MASKED:
            ps = tl.where(allowed_pairs(rows_m, cols, len_q, len_k, lo_off, hi_off), ps, 0.0)
        r += tl.sum(ps, 1)
    return r


@triton.jit
def attn_jvp_bwd_rows_kernel(
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
    len_q, len_k = seq_lens(QLens, KLens, off_b, n_q, n_k, HAS_LENS)
    lo_off = len_k - len_q - win_left
    hi_off = len_k - len_q + win_right
    start_m = pid_m * BLOCK_M
    rows_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_off = rows_m.to(tl.int64)[:, None]

    q = dot_operand(load_rows(Q + off_b * stride_qb + off_h * stride_qh + row_off * stride_qm + offs_d[None, :],
                                rows_m, len_q, offs_d, HEAD_DIM, True, EVEN_D), DTYPE, INTERPRETER)
    o = load_rows(Out + off_b * stride_ob + off_h * stride_oh + row_off * stride_om + offs_d[None, :],
                   rows_m, len_q, offs_d, HEAD_DIM, True, EVEN_D).to(tl.float32)
    go = load_rows(GOut + off_b * stride_gob + off_h * stride_goh + row_off * stride_gom + offs_d[None, :],
                    rows_m, len_q, offs_d, HEAD_DIM, True, EVEN_D).to(tl.float32)
    row_base = pid_bh.to(tl.int64) * n_q
    lse = tl.load(Lse + row_base + rows_m, mask=rows_m < len_q, other=float("-inf"))
    seen = lse != float("-inf")  # NaN stays NaN
    lse2 = tl.where(seen, lse * 1.4426950408889634, float("inf"))
    d_row = tl.sum(go * o, 1)
    k_ptrs = K + off_b * stride_kb + off_hkv * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :]
    lo, n_masked, n_left, gap, full_lo, n_full = tile_range(
        start_m, n_q, len_q, len_k, lo_off, hi_off, BLOCK_M, BLOCK_N)
    stat_mask = rows_m < n_q
    for p in range(0, n_probes):
        p_off = p + off_b * 0  # int64 offsets
        tq = dot_operand(load_rows(TQ + p_off * stride_tqp + off_b * stride_tqb + off_h * stride_tqh
                                     + row_off * stride_tqm + offs_d[None, :],
                                     rows_m, len_q, offs_d, HEAD_DIM, True, EVEN_D), DTYPE, INTERPRETER)
        tk_ptrs = (TK + p_off * stride_tkp + off_b * stride_tkb + off_hkv * stride_tkh
                   + offs_n[:, None] * stride_tkn + offs_d[None, :])
        gto = load_rows(GTOut + p_off * stride_gtop + off_b * stride_gtob + off_h * stride_gtoh
                         + row_off * stride_gtom + offs_d[None, :],
                         rows_m, len_q, offs_d, HEAD_DIM, True, EVEN_D).to(tl.float32)
        to = load_rows(TOut + p_off * stride_top + off_b * stride_tob + off_h * stride_toh
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
        start_n = tile_start(base, t, n_left, gap, BLOCK_N)
        cols = start_n + offs_n
        kv_off = start_n.to(tl.int64)
        k = dot_operand(load_rows(k_ptrs + kv_off * stride_kn, cols, len_k, offs_d, HEAD_DIM, MASKED, EVEN_D),
                         DTYPE, INTERPRETER)
        v = dot_operand(load_rows(v_ptrs + kv_off * stride_vn, cols, len_k, offs_d, HEAD_DIM, MASKED, EVEN_D),
                         DTYPE, INTERPRETER)
        tk = dot_operand(load_rows(tk_ptrs + kv_off * stride_tkn, cols, len_k, offs_d, HEAD_DIM, MASKED, EVEN_D),
                          DTYPE, INTERPRETER)
        tv = dot_operand(load_rows(tv_ptrs + kv_off * stride_tvn, cols, len_k, offs_d, HEAD_DIM, MASKED, EVEN_D),
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
            visible = allowed_pairs(rows_m, cols, len_q, len_k, lo_off, hi_off)
            gs = tl.where(visible, gs, 0.0)
            gst = tl.where(visible, gst, 0.0)
        gst = dot_operand(gst, DTYPE, INTERPRETER)
        dq = tl.dot(dot_operand(gs, DTYPE, INTERPRETER), k, dq, input_precision=DOT_PRECISION)
        dq = tl.dot(gst, tk, dq, input_precision=DOT_PRECISION)
        dtq = tl.dot(gst, k, dtq, input_precision=DOT_PRECISION)
    return dq, dtq


@triton.jit
def attn_jvp_bwd_dq_kernel(
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
    len_q, len_k = seq_lens(QLens, KLens, off_b, n_q, n_k, HAS_LENS)
    lo_off = len_k - len_q - win_left
    hi_off = len_k - len_q + win_right
    start_m = pid_m * BLOCK_M
    rows_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_off = rows_m.to(tl.int64)[:, None]

    q = dot_operand(load_rows(Q + off_b * stride_qb + off_h * stride_qh + row_off * stride_qm + offs_d[None, :],
                                rows_m, len_q, offs_d, HEAD_DIM, True, EVEN_D), DTYPE, INTERPRETER)
    go = dot_operand(load_rows(GOut + off_b * stride_gob + off_h * stride_goh + row_off * stride_gom
                                 + offs_d[None, :], rows_m, len_q, offs_d, HEAD_DIM, True, EVEN_D),
                      DTYPE, INTERPRETER)
    row_base = pid_bh.to(tl.int64) * n_q
    lse = tl.load(Lse + row_base + rows_m, mask=rows_m < len_q, other=float("inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    d_row = tl.load(D + row_base + rows_m, mask=rows_m < len_q, other=0.0)
    k_ptrs = K + off_b * stride_kb + off_hkv * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :]
    v_ptrs = V + off_b * stride_vb + off_hkv * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :]
    lo, n_masked, n_left, gap, full_lo, n_full = tile_range(
        start_m, n_q, len_q, len_k, lo_off, hi_off, BLOCK_M, BLOCK_N)
    store_mask = (rows_m[:, None] < n_q) & (offs_d[None, :] < HEAD_DIM)

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    dq = attn_bwd_dq_loop(dq, q, go, lse2, d_row, k_ptrs, v_ptrs, stride_kn, stride_vn,
                           full_lo, n_full, n_full, 0, rows_m, offs_n, offs_d, len_q, len_k, lo_off, hi_off,
                           qk_scale, HEAD_DIM, BLOCK_N, False, EVEN_D, DTYPE, INTERPRETER, DOT_PRECISION)
    dq = attn_bwd_dq_loop(dq, q, go, lse2, d_row, k_ptrs, v_ptrs, stride_kn, stride_vn,
                           lo, n_masked, n_left, gap, rows_m, offs_n, offs_d, len_q, len_k, lo_off, hi_off,
                           qk_scale, HEAD_DIM, BLOCK_N, True, EVEN_D, DTYPE, INTERPRETER, DOT_PRECISION)
    for p in range(0, n_probes):
        p_off = p + off_b * 0  # int64 offsets
        tq = dot_operand(load_rows(TQ + p_off * stride_tqp + off_b * stride_tqb + off_h * stride_tqh
                                     + row_off * stride_tqm + offs_d[None, :],
                                     rows_m, len_q, offs_d, HEAD_DIM, True, EVEN_D), DTYPE, INTERPRETER)
        gto = dot_operand(load_rows(GTOut + p_off * stride_gtop + off_b * stride_gtob + off_h * stride_gtoh
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
        start_m = tile_start(base, t, n_left, gap, BLOCK_M)
        rows = start_m + offs_m
        m_off = start_m.to(tl.int64)
        q = dot_operand(load_rows(q_ptrs + m_off * stride_qm, rows, len_q, offs_d, HEAD_DIM, MASKED, EVEN_D),
                         DTYPE, INTERPRETER)
        tq = dot_operand(load_rows(tq_ptrs + m_off * stride_tqm, rows, len_q, offs_d, HEAD_DIM, MASKED, EVEN_D),
                          DTYPE, INTERPRETER)
        gto = dot_operand(load_rows(gto_ptrs + m_off * stride_gtom, rows, len_q, offs_d, HEAD_DIM, MASKED,
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
            visible = allowed_pairs_t(cols_n, rows, len_q, len_k, lo_off, hi_off)
            pt = tl.where(visible, pt, 0.0)
            gst = tl.where(visible, gst, 0.0)
            gs = tl.where(visible, gs, 0.0)
            ppt = tl.where(visible, ppt, 0.0)
        gst = dot_operand(gst, DTYPE, INTERPRETER)
        dk = tl.dot(dot_operand(gs, DTYPE, INTERPRETER), q, dk, input_precision=DOT_PRECISION)
        dk = tl.dot(gst, tq, dk, input_precision=DOT_PRECISION)
        dv = tl.dot(dot_operand(ppt, DTYPE, INTERPRETER), gto, dv, input_precision=DOT_PRECISION)
        dtk = tl.dot(gst, q, dtk, input_precision=DOT_PRECISION)
        dtv = tl.dot(dot_operand(pt, DTYPE, INTERPRETER), gto, dtv, input_precision=DOT_PRECISION)
    return dk, dv, dtk, dtv


@triton.jit
def attn_jvp_bwd_dkdv_kernel(
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
    len_q, len_k = seq_lens(QLens, KLens, off_b, n_q, n_k, HAS_LENS)
    lo_off = len_k - len_q - win_left
    hi_off = len_k - len_q + win_right
    start_n = pid_n * BLOCK_N
    cols_n = start_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    col_off = cols_n.to(tl.int64)[:, None]

    k = dot_operand(load_rows(K + off_b * stride_kb + off_hkv * stride_kh + col_off * stride_kn + offs_d[None, :],
                                cols_n, len_k, offs_d, HEAD_DIM, True, EVEN_D), DTYPE, INTERPRETER)
    v = dot_operand(load_rows(V + off_b * stride_vb + off_hkv * stride_vh + col_off * stride_vn + offs_d[None, :],
                                cols_n, len_k, offs_d, HEAD_DIM, True, EVEN_D), DTYPE, INTERPRETER)
    lo, n_masked, n_left, gap, full_lo, n_full = tile_range(
        start_n, n_k, len_k, len_q, -hi_off, -lo_off, BLOCK_N, BLOCK_M)
    store_mask = (cols_n[:, None] < n_k) & (offs_d[None, :] < HEAD_DIM)

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    for g in range(0, kv_group):
        off_h = off_hkv * kv_group + g
        q_ptrs = Q + off_b * stride_qb + off_h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :]
        go_ptrs = GOut + off_b * stride_gob + off_h * stride_goh + offs_m[:, None] * stride_gom + offs_d[None, :]
        row_base = (off_b * n_heads_kv * kv_group + off_h) * n_q
        dk, dv = attn_bwd_dkdv_loop(
            dk, dv, k, v, q_ptrs, go_ptrs, Lse + row_base, D + row_base, stride_qm, stride_gom,
            full_lo, n_full, n_full, 0, cols_n, offs_m, offs_d, len_q, len_k, lo_off, hi_off, qk_scale,
            HEAD_DIM, BLOCK_M, False, EVEN_D, DTYPE, INTERPRETER, DOT_PRECISION)
        dk, dv = attn_bwd_dkdv_loop(
            dk, dv, k, v, q_ptrs, go_ptrs, Lse + row_base, D + row_base, stride_qm, stride_gom,
            lo, n_masked, n_left, gap, cols_n, offs_m, offs_d, len_q, len_k, lo_off, hi_off, qk_scale,
            HEAD_DIM, BLOCK_M, True, EVEN_D, DTYPE, INTERPRETER, DOT_PRECISION)
    for p in range(0, n_probes):
        p_off = p + off_b * 0  # int64 offsets
        tk = dot_operand(load_rows(TK + p_off * stride_tkp + off_b * stride_tkb + off_hkv * stride_tkh
                                     + col_off * stride_tkn + offs_d[None, :],
                                     cols_n, len_k, offs_d, HEAD_DIM, True, EVEN_D), DTYPE, INTERPRETER)
        tv = dot_operand(load_rows(TV + p_off * stride_tvp + off_b * stride_tvb + off_hkv * stride_tvh
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

