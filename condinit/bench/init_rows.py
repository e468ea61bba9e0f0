"""The ``init`` rows of ``condinit bench``: conditioned initialization of an attention stack (Q/K
per-head semi-orthogonal, V the rectangular identity) against what a user would otherwise run.

The batched ``conditioned_init_layers_``; ``semi_orthogonal_`` called once per weight (as
``torch.nn.init`` users and model ``init_weights`` loops call it); the floor (Gaussians by
``normal_``, one Gram, a float64 Cholesky and a triangular solve, per chunk, at torch's rates: one
CholeskyQR pass, the least any exact method does); the per-head ``torch.nn.init.orthogonal_``
loop; one batched ``torch.linalg.qr`` with its Gaussians; ``torch.randn`` of as many elements; and
condinit's own Gaussians (``block_randn``) alone.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from .ceilings import matmul_library
from .config import BenchConfig, InitShape
from .measure import Row, Section, Timer, add_ratio, set_aim

__all__ = ["make_stack", "init_backend", "init_batched", "init_per_tensor", "per_head_orthogonal", "batched_qr",
           "init_floor", "condinit_gaussians", "init_rows"]


def make_stack(shape: InitShape, device, dtype=torch.float32):
    """Empty Q/K/V weights of ``shape``: a list of ``{"q", "k", "v"}`` dicts, one per layer."""
    return [{"q": torch.empty(shape.heads * shape.head_dim, shape.hidden, device=device, dtype=dtype),
             "k": torch.empty(shape.kv_heads * shape.head_dim, shape.hidden, device=device, dtype=dtype),
             "v": torch.empty(shape.kv_heads * shape.head_dim, shape.hidden, device=device, dtype=dtype)}
            for _ in range(shape.layers)]


def init_backend(device, backend=None, block_shape=(64, 2048), method: str = "auto") -> str:
    """``orthogonalize=<backend> (<method>), randn=<backend>``: what condinit's tables choose."""
    from condinit.ops.orthogonalize.op import ORTHOGONALIZE, resolve_method
    from condinit.ops.random.op import RANDN
    concrete = resolve_method(*block_shape, method)
    orth = ORTHOGONALIZE.choose(device, backend, method=concrete)
    return f"orthogonalize={orth} ({concrete}), randn={RANDN.choose(device)}"


def init_batched(stack, shape: InitShape, seed: int = 0, **kw) -> None:
    """condinit's batched path: one ``conditioned_init_layers_`` call over the stack."""
    from condinit.init import conditioned_init_layers_
    conditioned_init_layers_(stack, num_heads=shape.heads, num_kv_heads=shape.kv_heads, seed=seed, **kw)


def init_per_tensor(stack, shape: InitShape, seed: int = 0, method: str = "auto") -> None:
    """One ``semi_orthogonal_`` call per Q and K weight (its heads as blocks) and ``rect_identity_``
    for V: how ``torch.nn.init`` users and model ``init_weights`` loops initialize."""
    from condinit.init import rect_identity_, semi_orthogonal_
    d = shape.head_dim
    for i, layer in enumerate(stack):
        semi_orthogonal_(layer["q"], head_dim=d, seed=seed, stream=2 * i, method=method)
        semi_orthogonal_(layer["k"], head_dim=d, seed=seed, stream=2 * i + 1, method=method)
        rect_identity_(layer["v"])


def per_head_orthogonal(stack, shape: InitShape, max_blocks: Optional[int] = None) -> None:
    """``torch.nn.init.orthogonal_`` on every Q/K head block and ``eye_`` for V (the same semantics,
    written without condinit); the first ``max_blocks`` blocks only when given."""
    d, done = shape.head_dim, 0
    with torch.no_grad():
        for layer in stack:
            for w in (layer["q"], layer["k"]):
                for h in range(w.shape[0] // d):
                    if max_blocks is not None and done >= max_blocks:
                        return
                    torch.nn.init.orthogonal_(w[h * d:(h + 1) * d])
                    done += 1
            torch.nn.init.eye_(layer["v"])


def batched_qr(shape: InitShape, device, blocks: Optional[int] = None) -> torch.Tensor:
    """``torch.randn`` of the Q/K blocks and one batched ``torch.linalg.qr`` with the sign fix."""
    n = blocks if blocks is not None else shape.blocks
    W = torch.randn(n, shape.hidden, shape.head_dim, device=device)
    Q, R = torch.linalg.qr(W)
    return Q * torch.sign(R.diagonal(dim1=-2, dim2=-1)).unsqueeze(-2)


def init_floor(stack, shape: InitShape, device, chunk: int) -> None:
    """The floor of any exact method, at torch's rates: per chunk of ``chunk`` Q/K blocks, Gaussians
    by ``normal_``, one Gram (``bmm``), a float64 Cholesky and a triangular solve written into the
    weights; V by ``eye_``. One CholeskyQR pass (CholeskyQR2 does a second, cheaper one)."""
    d, D = shape.head_dim, shape.hidden
    buf = torch.empty(chunk, d, D, device=device)
    with torch.no_grad():
        for layer in stack:
            for w in (layer["q"], layer["k"]):
                blocks = w.view(-1, d, D)
                for s in range(0, blocks.shape[0], chunk):
                    k = min(chunk, blocks.shape[0] - s)
                    A = buf[:k].normal_()
                    G = torch.bmm(A, A.transpose(1, 2))
                    L = torch.linalg.cholesky(G.double()).float()
                    blocks[s:s + k].copy_(torch.linalg.solve_triangular(L, A, upper=False))
            torch.nn.init.eye_(layer["v"])


def condinit_gaussians(shape: InitShape, device, chunk: int) -> None:
    """The Gaussians of the batched path alone: ``block_randn`` of every Q/K block, by chunks."""
    from condinit.ops.random.op import block_randn, stream_id
    buf = torch.empty(chunk, shape.head_dim, shape.hidden, device=device)
    for s in range(0, shape.blocks, chunk):
        k = min(chunk, shape.blocks - s)
        block_randn(0, stream_id("q"), range(s, s + k), (shape.head_dim, shape.hidden), out=buf[:k])


def _randn_backend(device) -> str:
    from condinit.ops.random.op import RANDN
    return RANDN.choose(device)


def init_rows(cfg: BenchConfig, progress=lambda s: None, on_row=None) -> list[Row]:
    from condinit.ops.orthogonalize.op import chunk_blocks, gemm_dtype
    dev = torch.device(cfg.device)
    shape = cfg.init_shape
    sec = Section("init", Timer(dev, cfg.repeats), progress, on_row)
    storage = cfg.dtype
    stack = make_stack(shape, dev, storage)
    nb = shape.blocks
    d, D = shape.head_dim, shape.hidden
    elements = shape.layers * (shape.heads + 2 * shape.kv_heads) * d * D
    gemm_flops = 4 * 2.0 * d * d * D * nb
    written = elements * torch.empty((), dtype=storage).element_size()
    kw = {"backend": cfg.backend} if cfg.backend else {}
    backend = lambda: init_backend(dev, cfg.backend, (d, D))  # noqa: E731
    batched = sec.measure("batched", "condinit conditioned_init_layers_", backend,
                          lambda: init_batched(stack, shape, **kw), flops=gemm_flops)
    per = sec.measure("per_tensor", "semi_orthogonal_ per weight + rect_identity_",
                      lambda: init_backend(dev, None, (d, D)), lambda: init_per_tensor(stack, shape),
                      flops=gemm_flops, note=f"{2 * shape.layers} calls")
    set_aim(per, "init.batched", 1.2, "<= 1.2x batched")
    chunk = chunk_blocks(d, D, dev.type, None, gemm_dtype(dev.type))
    floor = sec.measure("floor", "floor: normal_ + Gram + Cholesky + solve",
                        "torch " + ("cuBLAS/cuSOLVER" if dev.type == "cuda" else matmul_library(dev, torch.float32)),
                        lambda: init_floor(stack, shape, dev, chunk), flops=3.0 * d * d * D * nb,
                        note=f"chunks of {chunk} blocks, one CholeskyQR pass")
    set_aim(batched, "init.floor", 1.3, "<= 1.3x floor")
    limit = cfg.baseline_blocks
    loop_blocks = min(nb, limit) if limit else nb
    if "orthogonal_loop" not in cfg.skip:
        def loop_setup():
            if storage in (torch.float32, torch.float64):
                loop_stack = stack
            else:  # orthogonal_'s QR has no bf16/fp16 kernel: the loop runs on fp32 weights
                layers = min(shape.layers, -(-loop_blocks // (shape.heads + shape.kv_heads)))
                loop_stack = make_stack(dataclasses.replace(shape, layers=layers), dev, torch.float32)
            return lambda: per_head_orthogonal(loop_stack, shape, loop_blocks)
        sec.measure("orthogonal_loop", "per-head nn.init.orthogonal_ loop + eye_", "torch (LAPACK)" if
                    dev.type == "cpu" else "torch (cuSOLVER)", None, setup=loop_setup, scale=nb / loop_blocks,
                    note=_scaled(loop_blocks, nb))
    qr_blocks = min(nb, limit) if (limit and dev.type == "cuda") else nb
    if "batched_qr" not in cfg.skip:
        sec.measure("batched_qr", f"randn + batched linalg.qr [{nb}, {D}, {d}]",
                    "torch (LAPACK)" if dev.type == "cpu" else "torch (cuSOLVER)",
                    lambda: batched_qr(shape, dev, qr_blocks), scale=nb / qr_blocks, note=_scaled(qr_blocks, nb))
    sec.measure("randn", f"torch.randn of the stack's {elements / 1e6:.1f}M elements", "torch",
                lambda: torch.randn(elements, device=dev, dtype=storage))
    sec.measure("block_randn", "  of which block_randn of the Q/K blocks",
                lambda: _randn_backend(dev), lambda: condinit_gaussians(shape, dev, chunk),
                note="part of the batched row")
    for r in (batched, per, floor, sec.get("init.randn")):
        if r is not None and r.ok:
            r.bytes = written   # the weights (or numbers) written once: a bandwidth view
    add_ratio(per, batched)
    add_ratio(batched, floor)
    for key in ("orthogonal_loop", "batched_qr", "randn"):
        other = sec.get(f"init.{key}")
        add_ratio(batched, other)
    return sec.rows


def _scaled(timed: int, total: int) -> str:
    return "" if timed == total else f"timed on {timed} of {total} blocks, scaled x{total / timed:.1f}"
