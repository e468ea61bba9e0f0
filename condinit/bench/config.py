"""What ``condinit bench`` measures: the shapes and their presets, the run's configuration and its
defaults per device, and the FLOP conventions the rates are counted by.

FLOP conventions (those of FlashAttention's benchmarks and Triton's fused-attention tutorial):
attention forward ``4 B H Nq Nk d``, halved when causal with ``Nq = Nk``; backward 2.5x the
forward; JVP 3x for one probe, ``(1 + 2P)``x for ``P`` probes in one call (the primal's two
products are done once, each probe adds four: ``Q' K^T``, ``Q K'^T``, ``(P o S') V``, ``P V'``);
backward through the tangent output 7.5x. Each count is at most the products the kernels do, so a
rate over it never overstates the work. Init: the matrix products of CholeskyQR2 (4 of
``2 d^2 D`` per block), and the bytes of the weights written once.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

__all__ = ["FLOP_CONVENTIONS", "ATTENTION_FLOP_FACTOR", "jvp_flop_factor", "InitShape", "AttentionShape",
           "INIT_PRESETS", "ATTENTION_PRESETS", "parse_shape", "BenchConfig", "default_config", "dtype_name"]


FLOP_CONVENTIONS = {
    "matmul": "2 n^3 per n x n x n GEMM",
    "copy": "bytes read + bytes written",
    "attention_fwd": "4 B H Nq Nk d, halved for causal with Nq = Nk",
    "attention_bwd": "2.5 x attention_fwd",
    "attention_jvp": "3 x attention_fwd for one probe; (1 + 2P) x for P probes in one call",
    "attention_jvp_bwd": "7.5 x attention_fwd (backward through the tangent output)",
    "init": "CholeskyQR2: 4 GEMMs of 2 d^2 D per d x D block (the floor: a Gram 2 d^2 D + a triangular "
            "solve d^2 D); bytes: the weights written once",
}
ATTENTION_FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "jvp": 3.0, "jvp_bwd": 7.5}


def jvp_flop_factor(probes: int) -> float:
    """FLOPs of a JVP with ``probes`` tangents in one call, in units of the forward's."""
    return 1.0 + 2.0 * probes


@dataclasses.dataclass(frozen=True)
class InitShape:
    """An attention stack: ``layers`` x (Q ``[heads*head_dim, hidden]``, K and V ``[kv_heads*head_dim,
    hidden]``)."""
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int

    @property
    def blocks(self) -> int:
        return self.layers * (self.heads + self.kv_heads)

    def label(self) -> str:
        return (f"{self.layers} layers, D={self.hidden}, {self.heads}/{self.kv_heads} heads of "
                f"{self.head_dim}")


@dataclasses.dataclass(frozen=True)
class AttentionShape:
    batch: int
    heads: int
    kv_heads: int
    seq: int
    head_dim: int

    def label(self) -> str:
        kv = f"/{self.kv_heads}" if self.kv_heads != self.heads else ""
        return f"B={self.batch} H={self.heads}{kv} N={self.seq} d={self.head_dim}"


INIT_PRESETS = {
    "llama-1b": InitShape(16, 2048, 32, 8, 64),
    "llama-3-8b": InitShape(32, 4096, 32, 8, 128),
    "llama-3-70b": InitShape(80, 8192, 64, 8, 128),
    "vit-ti": InitShape(12, 192, 3, 3, 64),
    "vit-b": InitShape(12, 768, 12, 12, 64),
    "quick": InitShape(2, 512, 8, 2, 64),
}
ATTENTION_PRESETS = {
    "cpu": AttentionShape(1, 8, 8, 1024, 64),
    "gpu": AttentionShape(1, 16, 16, 8192, 128),
    "quick": AttentionShape(1, 2, 2, 128, 64),
}


def parse_shape(text: str, kind: str):
    """An :class:`InitShape` / :class:`AttentionShape` from a preset name or comma-separated ints
    (init: ``LAYERS,D,HEADS,KV_HEADS,HEAD_DIM``; attention: ``B,H,HKV,N,d``)."""
    presets, cls = (INIT_PRESETS, InitShape) if kind == "init" else (ATTENTION_PRESETS, AttentionShape)
    if text in presets:
        return presets[text]
    fields = [f.name for f in dataclasses.fields(cls)]
    parts = text.split(",")
    try:
        values = [int(p) for p in parts]
    except ValueError:
        values = None
    if values is None or len(values) != len(fields) or any(v < 1 for v in values):
        raise ValueError(f"{kind} shape must be a preset ({', '.join(presets)}) or {len(fields)} "
                         f"positive ints {','.join(f.upper() for f in fields)}, got {text!r}")
    shape = cls(*values)
    if shape.heads % shape.kv_heads:
        raise ValueError(f"{kind} shape: kv_heads={shape.kv_heads} must divide heads={shape.heads}")
    return shape


# the rows ``skip`` can leave out (the slow baselines)
SKIPPABLE = ("orthogonal_loop", "batched_qr", "math_jvp", "math_jvp_bwd", "jvp_probes")


@dataclasses.dataclass
class BenchConfig:
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    sections: tuple[str, ...] = ("ceilings", "init", "attention")
    init_shape: InitShape = INIT_PRESETS["llama-1b"]
    attention_shape: AttentionShape = ATTENTION_PRESETS["cpu"]
    causal: bool = True
    repeats: int = 3
    backend: Optional[str] = None        # force condinit's backend (attention and orthogonalize)
    baseline_blocks: Optional[int] = None  # time block-loop baselines on at most this many blocks
    matmul_size: int = 2048
    copy_bytes: int = 256 << 20
    skip: tuple[str, ...] = ()           # row keys not to run (e.g. "math_jvp" on a small GPU)
    probes: int = 4                      # the multi-probe JVP row: this many probes in one call


def default_config(device: str = "cpu", quick: bool = False, **overrides) -> BenchConfig:
    """The defaults of ``condinit bench`` for ``device`` (``quick``: a small run, seconds)."""
    gpu = torch.device(device).type == "cuda"
    cfg = BenchConfig(device=device, dtype=torch.bfloat16 if gpu else torch.float32)
    if gpu:
        cfg.init_shape = INIT_PRESETS["llama-3-70b"]
        cfg.attention_shape = ATTENTION_PRESETS["gpu"]
        cfg.matmul_size, cfg.copy_bytes, cfg.baseline_blocks = 8192, 2 << 30, 256
    if quick:
        cfg.init_shape = INIT_PRESETS["quick"] if not gpu else InitShape(8, 8192, 64, 8, 128)
        cfg.attention_shape = ATTENTION_PRESETS["quick"] if not gpu else AttentionShape(1, 16, 16, 2048, 128)
        cfg.repeats = 2
        cfg.matmul_size = 512 if not gpu else 4096
        cfg.copy_bytes = 32 << 20 if not gpu else 512 << 20
    for key, value in overrides.items():
        if value is not None:
            setattr(cfg, key, value)
    return cfg


def dtype_name(dtype) -> str:
    """The short name of ``dtype`` in row names, keys and headers (``fp32``, ``bf16``, ``fp16``, ``fp64``)."""
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
            torch.float64: "fp64"}.get(dtype, str(dtype).replace("torch.", ""))
