"""Triton kernels of condinit's fused attention: forward, multi-probe JVP, and flash backward (VJP).

Per head (the math: docs/design.md, "Attention"), with ``s`` the softmax scale::

    S = s Q K^T (+ causal mask),  P = softmax(S),  O = P V,  lse = log rowsum(exp(S))

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

Conventions: q ``[B, H, Nq, d]``, k/v ``[B, Hkv, Nk, d]``, query head ``h`` reads KV head
``h // (H // Hkv)``; causal means key ``j`` is visible to query ``i`` iff ``j <= i + Nk - Nq``
(bottom-right aligned). A query row that sees no key gets ``O = 0``, ``O' = 0``,
``lse = -inf`` and zero gradients. Exponentials run in base 2 (``exp2``, the scale folded with
``log2 e``), ``lse`` is returned in natural log. Loads are upcast to fp32 for elementwise math;
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
causal flag, the JVP flag and the probes per program, and the tensors' dtypes.
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

__all__ = ["attention_fwd", "attention_bwd", "attention_jvp"]

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
def _attn_fwd_loop(acc, m_i, l_i, acc_t0, r_0, acc_t1, r_1, q, tq0, tq1,
                   k_ptrs, v_ptrs, tk0_ptrs, tv0_ptrs, tk1_ptrs, tv1_ptrs,
                   stride_kn, stride_vn, stride_tkn, stride_tvn,
                   lo, hi, rows_m, offs_n, offs_d, n_k, causal_shift, qk_scale, sm_scale,
                   HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                   CAUSAL: tl.constexpr, EVEN_D: tl.constexpr, JVP: tl.constexpr,
                   TWO_PROBES: tl.constexpr, DTYPE: tl.constexpr, INTERPRETER: tl.constexpr,
                   DOT_PRECISION: tl.constexpr):
    """Key tiles [lo, hi): online softmax (+ tangent accumulators). MASKED applies the key bound
    and, when CAUSAL, the diagonal; unmasked tiles are fully visible and in bounds."""
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        rows64 = cols.to(tl.int64)[:, None]
        k = _load_rows(k_ptrs + rows64 * stride_kn + offs_d[None, :], cols, n_k, offs_d, HEAD_DIM, MASKED, EVEN_D)
        v = _load_rows(v_ptrs + rows64 * stride_vn + offs_d[None, :], cols, n_k, offs_d, HEAD_DIM, MASKED, EVEN_D)
        k = _dot_operand(k, DTYPE, INTERPRETER)
        v = _dot_operand(v, DTYPE, INTERPRETER)
        kt = tl.trans(k)
        s = tl.dot(q, kt, input_precision=DOT_PRECISION) * qk_scale  # log2 units
        if MASKED:
            visible = cols[None, :] < n_k
            if CAUSAL:
                visible = visible & (cols[None, :] <= rows_m[:, None] + causal_shift)
            s = tl.where(visible, s, float("-inf"))
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
            tk = _load_rows(tk0_ptrs + rows64 * stride_tkn + offs_d[None, :], cols, n_k, offs_d, HEAD_DIM,
                            MASKED, EVEN_D)
            tv = _load_rows(tv0_ptrs + rows64 * stride_tvn + offs_d[None, :], cols, n_k, offs_d, HEAD_DIM,
                            MASKED, EVEN_D)
            tk = _dot_operand(tk, DTYPE, INTERPRETER)
            tv = _dot_operand(tv, DTYPE, INTERPRETER)
            sd = tl.dot(q, tl.trans(tk), input_precision=DOT_PRECISION)
            sd = tl.dot(tq0, kt, sd, input_precision=DOT_PRECISION)
            # P~ o S' from the rounded P~ (the fp32 P~ is dead by now: fewer live registers);
            # masked entries have P~ = 0.
            ps = p_mma.to(tl.float32) * (sd * sm_scale)
            r_0 = r_0 * alpha + tl.sum(ps, 1)
            acc_t0 = tl.dot(p_mma, tv, acc_t0 * alpha[:, None], input_precision=DOT_PRECISION)
            acc_t0 = tl.dot(_dot_operand(ps, DTYPE, INTERPRETER), v, acc_t0, input_precision=DOT_PRECISION)
            if TWO_PROBES:
                tk = _load_rows(tk1_ptrs + rows64 * stride_tkn + offs_d[None, :], cols, n_k, offs_d, HEAD_DIM,
                                MASKED, EVEN_D)
                tv = _load_rows(tv1_ptrs + rows64 * stride_tvn + offs_d[None, :], cols, n_k, offs_d, HEAD_DIM,
                                MASKED, EVEN_D)
                tk = _dot_operand(tk, DTYPE, INTERPRETER)
                tv = _dot_operand(tv, DTYPE, INTERPRETER)
                sd = tl.dot(q, tl.trans(tk), input_precision=DOT_PRECISION)
                sd = tl.dot(tq1, kt, sd, input_precision=DOT_PRECISION)
                ps = p_mma.to(tl.float32) * (sd * sm_scale)
                r_1 = r_1 * alpha + tl.sum(ps, 1)
                acc_t1 = tl.dot(p_mma, tv, acc_t1 * alpha[:, None], input_precision=DOT_PRECISION)
                acc_t1 = tl.dot(_dot_operand(ps, DTYPE, INTERPRETER), v, acc_t1, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i, acc_t0, r_0, acc_t1, r_1


@triton.jit
def _attn_fwd_kernel(
    Q, K, V, Out, Lse, TQ, TK, TV, TOut,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    stride_lb, stride_lh,
    stride_tqp, stride_tqb, stride_tqh, stride_tqm,
    stride_tkp, stride_tkb, stride_tkh, stride_tkn,
    stride_tvp, stride_tvb, stride_tvh, stride_tvn,
    stride_top, stride_tob, stride_toh, stride_tom,
    n_heads, n_q, n_k, n_probes, kv_group, qk_scale, sm_scale, tune_q, tune_k,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
    CAUSAL: tl.constexpr, JVP: tl.constexpr, INTERPRETER: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PROBES_PER_PROGRAM: tl.constexpr,
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
    q = _dot_operand(_load_rows(q_ptrs, rows_m, n_q, offs_d, HEAD_DIM, True, EVEN_D), DTYPE, INTERPRETER)

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
                              rows_m, n_q, offs_d, HEAD_DIM, True, EVEN_D), DTYPE, INTERPRETER)
        tk0_ptrs = TK + p0_off * stride_tkp + off_b * stride_tkb + off_hkv * stride_tkh
        tv0_ptrs = TV + p0_off * stride_tvp + off_b * stride_tvb + off_hkv * stride_tvh
        if TWO_PROBES:
            # An odd P: the last group's second probe repeats probe P-1 and is not stored.
            p1 = tl.minimum(p0 + 1, n_probes - 1)
            p1_off = p1.to(tl.int64)
            tq1 = _dot_operand(_load_rows(TQ + p1_off * stride_tqp + off_b * stride_tqb + off_h * stride_tqh
                                  + row_off[:, None] * stride_tqm + offs_d[None, :],
                                  rows_m, n_q, offs_d, HEAD_DIM, True, EVEN_D), DTYPE, INTERPRETER)
            tk1_ptrs = TK + p1_off * stride_tkp + off_b * stride_tkb + off_hkv * stride_tkh
            tv1_ptrs = TV + p1_off * stride_tvp + off_b * stride_tvb + off_hkv * stride_tvh

    # Key range. Causal: row i sees keys j <= i + shift. Tiles ending at or before the tile's
    # first row's limit are fully visible (no mask); the rest up to the last row's limit straddle
    # the diagonal. Non-causal: only a ragged last tile needs the bound mask.
    causal_shift = n_k - n_q
    if CAUSAL:
        hi = tl.minimum(tl.maximum(start_m + BLOCK_M + causal_shift, 0), n_k)
        full = (tl.maximum(start_m + causal_shift + 1, 0) // BLOCK_N) * BLOCK_N
        full = tl.minimum(full, hi)
    else:
        hi = n_k
        full = (n_k // BLOCK_N) * BLOCK_N
    acc, m_i, l_i, acc_t0, r_0, acc_t1, r_1 = _attn_fwd_loop(
        acc, m_i, l_i, acc_t0, r_0, acc_t1, r_1, q, tq0, tq1,
        k_ptrs, v_ptrs, tk0_ptrs, tv0_ptrs, tk1_ptrs, tv1_ptrs,
        stride_kn, stride_vn, stride_tkn, stride_tvn,
        0, full, rows_m, offs_n, offs_d, n_k, causal_shift, qk_scale, sm_scale,
        HEAD_DIM, BLOCK_N, False, CAUSAL, EVEN_D, JVP, TWO_PROBES, DTYPE, INTERPRETER, DOT_PRECISION)
    acc, m_i, l_i, acc_t0, r_0, acc_t1, r_1 = _attn_fwd_loop(
        acc, m_i, l_i, acc_t0, r_0, acc_t1, r_1, q, tq0, tq1,
        k_ptrs, v_ptrs, tk0_ptrs, tv0_ptrs, tk1_ptrs, tv1_ptrs,
        stride_kn, stride_vn, stride_tkn, stride_tvn,
        full, hi, rows_m, offs_n, offs_d, n_k, causal_shift, qk_scale, sm_scale,
        HEAD_DIM, BLOCK_N, True, CAUSAL, EVEN_D, JVP, TWO_PROBES, DTYPE, INTERPRETER, DOT_PRECISION)

    # Epilogue. l = 0 exactly when the row saw no key (otherwise its max contributes exp2(0) = 1).
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
def _attn_bwd_preprocess_kernel(Out, DOut, Delta, stride_ob, stride_oh, stride_om,
                                stride_db, stride_dh, stride_dm, n_heads, n_q,
                                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """Delta = rowsum(dO o O) in fp32, [B, H, Nq] contiguous."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(n_q, BLOCK_M)
    pid_m = pid % num_m
    pid_bh = pid // num_m
    off_b = (pid_bh // n_heads).to(tl.int64)
    off_h = (pid_bh % n_heads).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < n_q) & (offs_d[None, :] < HEAD_DIM)
    row_off = rows.to(tl.int64)[:, None]
    o = tl.load(Out + off_b * stride_ob + off_h * stride_oh + row_off * stride_om + offs_d[None, :],
                mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DOut + off_b * stride_db + off_h * stride_dh + row_off * stride_dm + offs_d[None, :],
                 mask=mask, other=0.0).to(tl.float32)
    tl.store(Delta + pid_bh.to(tl.int64) * n_q + rows, tl.sum(o * do, 1), mask=rows < n_q)


@triton.jit
def _attn_bwd_dkdv_loop(dk, dv, k, v, q_ptrs, do_ptrs, lse_ptrs, delta_ptrs, stride_qm, stride_dom,
                        lo, hi, cols_n, offs_m, offs_d, n_q, causal_shift, qk_scale,
                        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, MASKED: tl.constexpr,
                        CAUSAL: tl.constexpr, EVEN_D: tl.constexpr, DTYPE: tl.constexpr,
                        INTERPRETER: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Query tiles [lo, hi) of one head against one key tile, transposed orientation [BN, BM]."""
    for start_m in range(lo, hi, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        rows = start_m + offs_m
        m_off = start_m.to(tl.int64)
        q = _dot_operand(_load_rows(q_ptrs + m_off * stride_qm, rows, n_q, offs_d, HEAD_DIM, MASKED, EVEN_D),
                 DTYPE, INTERPRETER)
        do = _dot_operand(_load_rows(do_ptrs + m_off * stride_dom, rows, n_q, offs_d, HEAD_DIM, MASKED, EVEN_D),
                  DTYPE, INTERPRETER)
        if MASKED:
            lse = tl.load(lse_ptrs + start_m + offs_m, mask=rows < n_q, other=float("inf"))
            delta = tl.load(delta_ptrs + start_m + offs_m, mask=rows < n_q, other=0.0)
        else:
            lse = tl.load(lse_ptrs + start_m + offs_m)
            delta = tl.load(delta_ptrs + start_m + offs_m)
        # lse = -inf marks a row that sees no key: its P is 0, not exp(s + inf).
        lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
        pt = tl.exp2(tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale - lse2[None, :])
        if MASKED:
            if CAUSAL:
                pt = tl.where(cols_n[:, None] <= rows[None, :] + causal_shift, pt, 0.0)
        dv = tl.dot(_dot_operand(pt, DTYPE, INTERPRETER), do, dv, input_precision=DOT_PRECISION)
        dpt = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        dst = pt * (dpt - delta[None, :])
        dk = tl.dot(_dot_operand(dst, DTYPE, INTERPRETER), q, dk, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv_kernel(
    Q, K, V, DOut, Lse, Delta, DK, DV,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    n_heads_kv, n_q, n_k, kv_group, qk_scale, sm_scale, tune_q, tune_k,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, CAUSAL: tl.constexpr,
    INTERPRETER: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program: one key tile of one KV head; dK, dV summed over the group's query heads."""
    DTYPE: tl.constexpr = Q.dtype.element_ty
    pid = tl.program_id(0)
    num_n = tl.cdiv(n_k, BLOCK_N)
    pid_n = pid % num_n
    pid_bh = pid // num_n
    off_b = (pid_bh // n_heads_kv).to(tl.int64)
    off_hkv = (pid_bh % n_heads_kv).to(tl.int64)
    start_n = pid_n * BLOCK_N
    cols_n = start_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    col_off = cols_n.to(tl.int64)

    k = _dot_operand(_load_rows(K + off_b * stride_kb + off_hkv * stride_kh + col_off[:, None] * stride_kn
                        + offs_d[None, :], cols_n, n_k, offs_d, HEAD_DIM, True, EVEN_D), DTYPE, INTERPRETER)
    v = _dot_operand(_load_rows(V + off_b * stride_vb + off_hkv * stride_vh + col_off[:, None] * stride_vn
                        + offs_d[None, :], cols_n, n_k, offs_d, HEAD_DIM, True, EVEN_D), DTYPE, INTERPRETER)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    # Query range. Causal: key j is seen by rows i >= j - shift. Query tiles from the first row
    # that sees the tile's first key up to the first tile whose first row sees its last key
    # straddle the diagonal (masked); later tiles are fully visible; a ragged last tile is masked.
    causal_shift = n_k - n_q
    if CAUSAL:
        lo = (tl.maximum(start_n - causal_shift, 0) // BLOCK_M) * BLOCK_M
        full = tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - causal_shift, 0), BLOCK_M) * BLOCK_M
    else:
        lo = 0
        full = 0
    n_q_even = (n_q // BLOCK_M) * BLOCK_M
    mid_hi = tl.maximum(n_q_even, full)
    for g in range(0, kv_group):
        off_h = off_hkv * kv_group + g
        q_ptrs = Q + off_b * stride_qb + off_h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :]
        do_ptrs = DOut + off_b * stride_dob + off_h * stride_doh + offs_m[:, None] * stride_dom + offs_d[None, :]
        row_base = (off_b * n_heads_kv * kv_group + off_h) * n_q
        lse_ptrs = Lse + row_base
        delta_ptrs = Delta + row_base
        dk, dv = _attn_bwd_dkdv_loop(
            dk, dv, k, v, q_ptrs, do_ptrs, lse_ptrs, delta_ptrs, stride_qm, stride_dom,
            lo, tl.minimum(full, n_q), cols_n, offs_m, offs_d, n_q, causal_shift, qk_scale,
            HEAD_DIM, BLOCK_M, True, CAUSAL, EVEN_D, DTYPE, INTERPRETER, DOT_PRECISION)
        dk, dv = _attn_bwd_dkdv_loop(
            dk, dv, k, v, q_ptrs, do_ptrs, lse_ptrs, delta_ptrs, stride_qm, stride_dom,
            full, n_q_even, cols_n, offs_m, offs_d, n_q, causal_shift, qk_scale,
            HEAD_DIM, BLOCK_M, False, CAUSAL, EVEN_D, DTYPE, INTERPRETER, DOT_PRECISION)
        dk, dv = _attn_bwd_dkdv_loop(
            dk, dv, k, v, q_ptrs, do_ptrs, lse_ptrs, delta_ptrs, stride_qm, stride_dom,
            mid_hi, n_q, cols_n, offs_m, offs_d, n_q, causal_shift, qk_scale,
            HEAD_DIM, BLOCK_M, True, CAUSAL, EVEN_D, DTYPE, INTERPRETER, DOT_PRECISION)

    mask = (cols_n[:, None] < n_k) & (offs_d[None, :] < HEAD_DIM)
    tl.store(DK + off_b * stride_dkb + off_hkv * stride_dkh + col_off[:, None] * stride_dkn + offs_d[None, :],
             (dk * sm_scale).to(DTYPE), mask=mask)
    tl.store(DV + off_b * stride_dvb + off_hkv * stride_dvh + col_off[:, None] * stride_dvn + offs_d[None, :],
             dv.to(DTYPE), mask=mask)


@triton.jit
def _attn_bwd_dq_loop(dq, q, do, lse2, delta, k_ptrs, v_ptrs, stride_kn, stride_vn,
                      lo, hi, rows_m, offs_n, offs_d, n_k, causal_shift, qk_scale,
                      HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                      CAUSAL: tl.constexpr, EVEN_D: tl.constexpr, DTYPE: tl.constexpr,
                      INTERPRETER: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Key tiles [lo, hi) for one query tile: dQ += dS K (keys past n_k read as 0 add nothing)."""
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        kv_off = start_n.to(tl.int64)
        k = _dot_operand(_load_rows(k_ptrs + kv_off * stride_kn, cols, n_k, offs_d, HEAD_DIM, MASKED, EVEN_D),
                 DTYPE, INTERPRETER)
        v = _dot_operand(_load_rows(v_ptrs + kv_off * stride_vn, cols, n_k, offs_d, HEAD_DIM, MASKED, EVEN_D),
                 DTYPE, INTERPRETER)
        p = tl.exp2(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale - lse2[:, None])
        if MASKED:
            visible = cols[None, :] < n_k
            if CAUSAL:
                visible = visible & (cols[None, :] <= rows_m[:, None] + causal_shift)
            p = tl.where(visible, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(_dot_operand(ds, DTYPE, INTERPRETER), k, dq, input_precision=DOT_PRECISION)
    return dq


@triton.jit
def _attn_bwd_dq_kernel(
    Q, K, V, DOut, Lse, Delta, DQ,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    stride_dqb, stride_dqh, stride_dqm,
    n_heads, n_q, n_k, kv_group, qk_scale, sm_scale, tune_q, tune_k,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, CAUSAL: tl.constexpr,
    INTERPRETER: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
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
    start_m = pid_m * BLOCK_M
    rows_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_off = rows_m.to(tl.int64)

    q = _dot_operand(_load_rows(Q + off_b * stride_qb + off_h * stride_qh + row_off[:, None] * stride_qm + offs_d[None, :],
                        rows_m, n_q, offs_d, HEAD_DIM, True, EVEN_D), DTYPE, INTERPRETER)
    do = _dot_operand(_load_rows(DOut + off_b * stride_dob + off_h * stride_doh + row_off[:, None] * stride_dom
                         + offs_d[None, :], rows_m, n_q, offs_d, HEAD_DIM, True, EVEN_D), DTYPE, INTERPRETER)
    row_base = pid_bh.to(tl.int64) * n_q
    lse = tl.load(Lse + row_base + rows_m, mask=rows_m < n_q, other=float("inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    delta = tl.load(Delta + row_base + rows_m, mask=rows_m < n_q, other=0.0)
    k_ptrs = K + off_b * stride_kb + off_hkv * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :]
    v_ptrs = V + off_b * stride_vb + off_hkv * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :]
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    causal_shift = n_k - n_q
    if CAUSAL:
        hi = tl.minimum(tl.maximum(start_m + BLOCK_M + causal_shift, 0), n_k)
        full = tl.minimum((tl.maximum(start_m + causal_shift + 1, 0) // BLOCK_N) * BLOCK_N, hi)
    else:
        hi = n_k
        full = (n_k // BLOCK_N) * BLOCK_N
    dq = _attn_bwd_dq_loop(dq, q, do, lse2, delta, k_ptrs, v_ptrs, stride_kn, stride_vn,
                           0, full, rows_m, offs_n, offs_d, n_k, causal_shift, qk_scale,
                           HEAD_DIM, BLOCK_N, False, CAUSAL, EVEN_D, DTYPE, INTERPRETER, DOT_PRECISION)
    dq = _attn_bwd_dq_loop(dq, q, do, lse2, delta, k_ptrs, v_ptrs, stride_kn, stride_vn,
                           full, hi, rows_m, offs_n, offs_d, n_k, causal_shift, qk_scale,
                           HEAD_DIM, BLOCK_N, True, CAUSAL, EVEN_D, DTYPE, INTERPRETER, DOT_PRECISION)
    tl.store(DQ + off_b * stride_dqb + off_h * stride_dqh + row_off[:, None] * stride_dqm + offs_d[None, :],
             (dq * sm_scale).to(DTYPE), mask=(rows_m[:, None] < n_q) & (offs_d[None, :] < HEAD_DIM))


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
}


def _head_dim_bucket(block_d: int) -> int:
    return 64 if block_d <= 64 else block_d


def _spill_limit(kind: str, elem_bytes: int, block_d: int) -> int:
    """Largest stack frame (spilled registers, bytes per thread) an entry of _CONFIGS may need on
    sm_80 or sm_90 (checked by tests/test_gpu_resources.py). One exception: the fp32 JVP at
    d = 256 holds two fp32 BLOCK_M x 256 accumulators and Q, tQ as FMA operands, and spills
    about 4.5 KB per thread with every tile tl.dot allows (16 x 16 and up); for fp32 at that size
    the CUDA kernels (no spills) are the better backend."""
    if (kind, elem_bytes, _head_dim_bucket(block_d)) == ("jvp", 4, 256):
        return 5 * 1024
    return 512


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
            "dq": _attn_bwd_dq_kernel}
# Autotune key: bucketed sequence lengths, the padded head dim, the causal flag and, for the
# forward kernel, the JVP flag and the probes per program; the autotuner appends the tensors'
# dtypes itself.
_TUNE_KEY = {"fwd": ["tune_q", "tune_k", "BLOCK_D", "CAUSAL", "JVP", "PROBES_PER_PROGRAM"],
             "dkdv": ["tune_q", "tune_k", "BLOCK_D", "CAUSAL"], "dq": ["tune_q", "tune_k", "BLOCK_D", "CAUSAL"]}
_TUNE_KEY["jvp"] = _TUNE_KEY["fwd"]


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


def _rowmajor(t):
    # The kernels take arbitrary strides but need unit stride along the head dim.
    return t if t.stride(-1) == 1 else t.contiguous()


# --------------------------------------------------------------------------------------------
# Host functions
# --------------------------------------------------------------------------------------------


def _forward(q, k, v, causal, scale, tq=None, tk=None, tv=None):
    q, k, v = _rowmajor(q), _rowmajor(k), _rowmajor(v)
    B, H, Nq, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    jvp = tq is not None
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
    meta.update(CAUSAL=causal, JVP=jvp, PROBES_PER_PROGRAM=ppp)
    args = (q, k, v, out, lse, tq, tk, tv, tout,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            out.stride(0), out.stride(1), out.stride(2),
            lse.stride(0), lse.stride(1),
            *tq.stride()[:4], *tk.stride()[:4], *tv.stride()[:4], *tout.stride()[:4],
            H, Nq, Nk, n_probes, H // Hkv, float(scale) * _LOG2E, float(scale), _bucket(Nq), _bucket(Nk))

    def grid(m):
        return triton.cdiv(Nq, m["BLOCK_M"]) * triton.cdiv(n_probes, ppp) * B * H

    _launch("jvp" if jvp else "fwd", grid, args, meta)
    return out, lse, (tout if jvp else None)


def attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float):
    """Flash-attention forward: ``(out, lse)``.

    ``out = softmax(scale q k^T + mask) v`` in q's dtype, ``[B, H, Nq, d]``; ``lse`` float32
    ``[B, H, Nq]``, the natural log of ``sum_j exp(scale q_i . k_j)`` over visible keys (``-inf``
    for a row that sees none, whose output is 0). q ``[B, H, Nq, d]``, k/v ``[B, Hkv, Nk, d]``.
    """
    _check_layout(q, k, v)
    out, lse, _ = _forward(q, k, v, causal, scale)
    return out, lse


def attention_jvp(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tq: torch.Tensor, tk: torch.Tensor,
                  tv: torch.Tensor, causal: bool, scale: float):
    """Forward plus P Jacobian-vector products in one fused launch: ``(out, tout, lse)``.

    Tangents ``tq [P, B, H, Nq, d]``, ``tk, tv [P, B, Hkv, Nk, d]`` (4-D tangents are one probe
    and give a 4-D ``tout``); ``tout[p] = P' V + P tV[p]`` with ``P' = P o (S' - rowsum(P o S'))``,
    ``S' = scale (tQ K^T + Q tK^T)``, in q's dtype.
    """
    single = tq.dim() == 4
    if single:
        tq, tk, tv = tq[None], tk[None], tv[None]
    _check_layout(q, k, v, *tq)
    if not (tq.shape[0] == tk.shape[0] == tv.shape[0]) or tk.shape[1:] != k.shape or tv.shape[1:] != v.shape:
        raise ValueError(f"attention kernel: bad tangent layout tq {tuple(tq.shape)}, "
                         f"tk {tuple(tk.shape)}, tv {tuple(tv.shape)}")
    out, lse, tout = _forward(q, k, v, causal, scale, tq, tk, tv)
    return out, (tout[0] if single else tout), lse


def attention_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, causal: bool, scale: float):
    """Flash-attention backward (the VJP): ``(dq, dk, dv)`` in q's dtype.

    ``D = rowsum(dO o O)``, ``P = exp(scale q k^T - lse)``, ``dS = P o (dO v^T - D)``,
    ``dq = scale dS k``, ``dk = scale dS^T q``, ``dv = P^T dO``; dk, dv ``[B, Hkv, Nk, d]`` are
    summed over the query heads of each KV group. ``out`` and ``lse`` come from
    :func:`attention_fwd` with the same arguments.
    """
    _check_layout(q, k, v, dout, out)
    if tuple(lse.shape) != tuple(q.shape[:3]) or lse.dtype != torch.float32:
        raise ValueError(f"attention kernel: lse must be float32 {tuple(q.shape[:3])}, got "
                         f"{lse.dtype} {tuple(lse.shape)}")
    q, k, v, dout, out = (_rowmajor(t) for t in (q, k, v, dout, out))
    lse = lse.contiguous()
    B, H, Nq, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    meta = _common_meta(d)

    delta = torch.empty((B, H, Nq), device=q.device, dtype=torch.float32)
    pre_block = _INTERPRET_CONFIG["BLOCK_M"] if _interpret() else max(16, min(128, 8192 // meta["BLOCK_D"]))
    _attn_bwd_preprocess_kernel[(triton.cdiv(Nq, pre_block) * B * H,)](
        out, dout, delta, out.stride(0), out.stride(1), out.stride(2),
        dout.stride(0), dout.stride(1), dout.stride(2), H, Nq,
        HEAD_DIM=d, BLOCK_D=meta["BLOCK_D"], BLOCK_M=pre_block)

    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    meta.update(CAUSAL=causal)
    qk_scale, tune = float(scale) * _LOG2E, (_bucket(Nq), _bucket(Nk))
    _launch("dkdv", lambda m: triton.cdiv(Nk, m["BLOCK_N"]) * B * Hkv,
            (q, k, v, dout, lse, delta, dk, dv,
             q.stride(0), q.stride(1), q.stride(2),
             k.stride(0), k.stride(1), k.stride(2),
             v.stride(0), v.stride(1), v.stride(2),
             dout.stride(0), dout.stride(1), dout.stride(2),
             dk.stride(0), dk.stride(1), dk.stride(2),
             dv.stride(0), dv.stride(1), dv.stride(2),
             Hkv, Nq, Nk, H // Hkv, qk_scale, float(scale), *tune), meta)
    _launch("dq", lambda m: triton.cdiv(Nq, m["BLOCK_M"]) * B * H,
            (q, k, v, dout, lse, delta, dq,
             q.stride(0), q.stride(1), q.stride(2),
             k.stride(0), k.stride(1), k.stride(2),
             v.stride(0), v.stride(1), v.stride(2),
             dout.stride(0), dout.stride(1), dout.stride(2),
             dq.stride(0), dq.stride(1), dq.stride(2),
             H, Nq, Nk, H // Hkv, qk_scale, float(scale), *tune), meta)
    return dq, dk, dv
