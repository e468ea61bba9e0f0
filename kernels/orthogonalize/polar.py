"""Triton kernels of the polar iteration (``orthogonalize(..., method="polar")`` on CUDA).

One step of the iteration on a batch of wide blocks ``X`` [B, m, n] (m <= n) is

    G = X X^T                        (_gram_kernel: one program per (block, m-tile, m-tile))
    Y = alpha_b X + beta_b G X       (_step_kernel: one program per (block, m-tile, n-tile),
                                      the axpy fused into the GEMM's epilogue)

with per-block scalars ``alpha_b``, ``beta_b`` (a converged block gets ``alpha = 1``, ``beta = 0``:
``Y = X`` exactly). Both accumulate in fp32 with IEEE fp32 products (no TF32: the iteration must
reach ``max|X X^T - I| <= 1e-6``). Program ids are cast to int64 before offset arithmetic.
Host functions check nothing beyond what the engine guarantees (contiguous fp32, same device).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["gram", "step"]


@triton.jit
def _gram_kernel(X_ptr, G_ptr, M, N, stride_xb, stride_xm, stride_gb, stride_gm,
                 BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_b = tl.program_id(0).to(tl.int64)
    pid_i = tl.program_id(1)
    pid_j = tl.program_id(2)
    rows_i = pid_i * BLOCK_M + tl.arange(0, BLOCK_M)
    rows_j = pid_j * BLOCK_M + tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    x_base = X_ptr + pid_b * stride_xb
    acc = tl.zeros((BLOCK_M, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, N, BLOCK_K):
        cols = k0 + ks
        a = tl.load(x_base + rows_i[:, None].to(tl.int64) * stride_xm + cols[None, :],
                    mask=(rows_i[:, None] < M) & (cols[None, :] < N), other=0.0)
        bt = tl.load(x_base + rows_j[None, :].to(tl.int64) * stride_xm + cols[:, None],
                     mask=(rows_j[None, :] < M) & (cols[:, None] < N), other=0.0)
        acc += tl.dot(a, bt, input_precision="ieee")
    g_ptrs = G_ptr + pid_b * stride_gb + rows_i[:, None].to(tl.int64) * stride_gm + rows_j[None, :]
    tl.store(g_ptrs, acc, mask=(rows_i[:, None] < M) & (rows_j[None, :] < M))


@triton.jit
def _step_kernel(X_ptr, G_ptr, Y_ptr, alpha_ptr, beta_ptr, M, N, stride_xb, stride_xm,
                 stride_gb, stride_gm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    pid_b = tl.program_id(0).to(tl.int64)
    pid_i = tl.program_id(1)
    pid_j = tl.program_id(2)
    rows = pid_i * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_j * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    x_base = X_ptr + pid_b * stride_xb
    g_base = G_ptr + pid_b * stride_gb
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, M, BLOCK_K):
        kk = k0 + ks
        g = tl.load(g_base + rows[:, None].to(tl.int64) * stride_gm + kk[None, :],
                    mask=(rows[:, None] < M) & (kk[None, :] < M), other=0.0)
        x = tl.load(x_base + kk[:, None].to(tl.int64) * stride_xm + cols[None, :],
                    mask=(kk[:, None] < M) & (cols[None, :] < N), other=0.0)
        acc += tl.dot(g, x, input_precision="ieee")
    alpha = tl.load(alpha_ptr + pid_b)
    beta = tl.load(beta_ptr + pid_b)
    offs = rows[:, None].to(tl.int64) * stride_xm + cols[None, :]
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    x_own = tl.load(x_base + offs, mask=mask, other=0.0)
    tl.store(Y_ptr + pid_b * stride_xb + offs, alpha * x_own + beta * acc, mask=mask)


def _tile(m: int, cap: int) -> int:
    return max(16, min(cap, triton.next_power_of_2(m)))


def gram(X: torch.Tensor) -> torch.Tensor:
    """``X X^T`` for contiguous fp32 ``X`` [B, m, n] -> fp32 [B, m, m]."""
    B, M, N = X.shape
    G = torch.empty((B, M, M), dtype=torch.float32, device=X.device)
    BLOCK_M = _tile(M, 64)
    BLOCK_K = 32 if X.device.type == "cuda" else 64
    grid = (B, triton.cdiv(M, BLOCK_M), triton.cdiv(M, BLOCK_M))
    _gram_kernel[grid](X, G, M, N, X.stride(0), X.stride(1), G.stride(0), G.stride(1),
                       BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K)
    return G


def step(X: torch.Tensor, G: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor, Y: torch.Tensor) -> torch.Tensor:
    """``Y = alpha_b X + beta_b G X`` per block (``alpha``, ``beta``: fp32 [B]); ``Y`` must not alias ``X``."""
    B, M, N = X.shape
    G = G.contiguous()
    alpha = alpha.to(torch.float32).contiguous()
    beta = beta.to(torch.float32).contiguous()
    BLOCK_M = _tile(M, 64)
    BLOCK_N = 64
    BLOCK_K = _tile(M, 32)
    grid = (B, triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
    _step_kernel[grid](X, G, Y, alpha, beta, M, N, X.stride(0), X.stride(1), G.stride(0), G.stride(1),
                       BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return Y
