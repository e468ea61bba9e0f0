"""Counter-based Gaussian generator for the conditioned-initialization engine.

Every random block is drawn from its own Philox stream, so a model's initialization does not depend
on batch size, chunking, device count, sharding, device or backend (docs/design.md, "Random
streams").

**Generator.** Philox4x32-10 (Salmon, Moraes, Dror, Shaw, "Parallel random numbers: as easy as
1, 2, 3", SC 2011), the generator of cuRAND's ``curand_Philox4_32_10`` and of PyTorch's CUDA RNG:

    key     = (lo32(seed), hi32(seed))
    counter = (q, stream, lo32(g), hi32(g))      q: quad index inside block g
    round:  (c0, c1, c2, c3) <- (hi(M1 c2) ^ c1 ^ k0,  lo(M1 c2),  hi(M0 c0) ^ c3 ^ k1,  lo(M0 c0))
            M0 = 0xD2511F53, M1 = 0xCD9E8D57; key bump k0 += 0x9E3779B9, k1 += 0xBB67AE85 between rounds

Each counter gives 4 uint32 ``x0..x3`` and 4 normals; element ``e = i*n + j`` of block ``g``
(an ``m x n`` block) is lane ``e % 4`` of quad ``q = e // 4``.

**Box-Muller**, two pairs per quad: ``(x0, x1) -> (r0 cos t1, r0 sin t1)``, ``(x2, x3) -> (r2 cos t3,
r2 sin t3)`` with ``r = sqrt(-2 ln u)`` and ``t = 2 pi v``:

* ``u = RN(x + 1/2) * 2^-32`` in ``(0, 1]`` (computed exactly as ``float(x >> 8) + (float(x & 255) *
  2^-8 + 2^-9)``, one rounding, then an exact scaling), so ``ln`` never sees 0; the smallest ``u`` is
  ``2^-33``, so ``|z| <= r <= 6.77`` (a normal exceeds that with probability 1.3e-11).
* ``v = y / 2^24`` with ``y = x >> 8``: the angle is split exactly in integers into a quadrant
  ``k = ((y + 2^21) >> 22) & 3`` and a remainder ``rem = y - k 2^22`` (mod 2^24) in ``[-2^21, 2^21)``,
  so ``t = k pi/2 + a``, ``a = rem * fl(2 pi / 2^24)``, ``|a| <= pi/4``.
* ``ln`` (Cephes ``logf``: ``u = 2^e m``, ``m`` in ``[sqrt(1/2), sqrt 2)``, a 9-coefficient polynomial
  in ``f = m - 1``, ``e ln 2`` in two parts), ``sin``/``cos`` of ``a`` (Cephes ``sinf``/``cosf``
  polynomials on ``[-pi/4, pi/4]``): a few ulp.

All of it is a fixed sequence of float32 multiplications, additions, one square root and exact
integer/bit operations, each rounded to nearest, without fused multiply-add and without denormal
intermediates. The C++ CPU kernel (``csrc/random/philox.h``, compiled with ``fp-contract=off``), the
CUDA kernel (``__fmul_rn``/``__fadd_rn``/``__fsqrt_rn``, which nvcc never contracts) and the PyTorch
reference below (one IEEE-rounded elementwise op at a time; its square root in float64, rounded once,
because ``torch.sqrt`` of float32 on CPU is not always correctly rounded) therefore produce bitwise
identical output. Against a float64 Box-Muller of the same words the error is below 2 ulp of ``r``.

Native op (``condinit._C``, CPU and CUDA kernels under one schema)::

    condinit_C::philox_randn(int seed_lo, int seed_hi, int stream, Tensor block_ids, int m, int n,
                             Tensor(a!) out) -> ()

writes the normals into ``out`` (float32, contiguous ``[len(block_ids), m, n]``, same device as the
int64 ``block_ids``); ``seed_lo``/``seed_hi``/``stream`` are in ``[0, 2^32)``.

**Scaled normals in the destination dtype** (the ``NORMAL`` table below, what
:func:`condinit.models.stream.own_normal_` runs): ``out`` (contiguous, any shape) gets
``mean + std * z``, element ``k`` of ``out`` being element ``k % (m n)`` of block
``block_ids[k // (m n)]`` (the last block may be cut short). The value is defined by the torch
composite: ``z * std`` then ``+ mean`` (when ``mean != 0``) in float32, then one rounding to
``out``'s dtype by torch's conversion. The C++ CPU kernel (float32, float64, bfloat16, float16)
gives the same bits in one pass over ``out``::

    condinit_C::philox_normal(int seed_lo, int seed_hi, int stream, Tensor block_ids, int m, int n,
                              float mean, float std, Tensor(a!) out) -> ()
"""
from __future__ import annotations

import hashlib
from typing import Sequence, Union

import torch

from condinit import _backends
from condinit._validate import check_choice, check_int, check_seed, check_tensor

__all__ = ["block_randn", "seed_from", "stream_id", "philox4x32_10", "philox_normals", "NORMAL_DTYPES"]

_MASK32 = 0xFFFFFFFF
PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9
PHILOX_W1 = 0xBB67AE85
PHILOX_ROUNDS = 10

# float32 constants, written as the exact float32 values (the hex floats of csrc/random/philox.h)
_f = float.fromhex
LOG_P = tuple(_f(h) for h in (  # Cephes logf, highest degree first
    "0x1.204376p-4", "-0x1.d7a37p-4", "0x1.de4a34p-4", "-0x1.fcba9ep-4", "0x1.23d37ep-3",
    "-0x1.555ca0p-3", "0x1.999d58p-3", "-0x1.fffff8p-3", "0x1.555554p-2"))
LN2_HI = _f("0x1.63p-1")         # ln 2 = LN2_HI + LN2_LO (Cephes): e * LN2_HI is exact for |e| < 2**15
LN2_LO = _f("-0x1.bd0106p-13")
SIN_P = tuple(_f(h) for h in ("-0x1.9943f2p-13", "0x1.11073cp-7", "-0x1.555546p-3"))
COS_P = tuple(_f(h) for h in ("0x1.99eb9cp-16", "-0x1.6c0c34p-10", "0x1.55554ap-5"))
ANGLE_STEP = _f("0x1.921fb6p-22")  # fl(2 pi / 2^24)
SQRT2_BITS = 0x3FB504F3            # float32 bits of fl(sqrt 2)

# Largest number of Philox quads the torch backend expands at once (int64 temporaries ~ 8 B each).
_TORCH_CHUNK_QUADS = 1 << 20


# ---------------------------------------------------------------------------------------------------
# public helpers

def stream_id(name: str) -> int:
    """A stable 32-bit tensor id for ``name``: the first 4 bytes (little endian) of its BLAKE2b hash.

    Same on every machine and Python run (unlike ``hash()``).

    Examples:
        >>> stream_id("layer3.q")
        800798309
        >>> stream_id("layers.3.q_proj") == stream_id("layers.3.q_proj")
        True
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__} {name!r}")
    return int.from_bytes(hashlib.blake2b(name.encode("utf-8"), digest_size=4).digest(), "little")


def seed_from(generator: torch.Generator | None = None, seed: int | None = None) -> int:
    """The 64-bit seed to use: ``seed`` if given (validated), else one drawn from ``generator``.

    The draw is one ``torch.randint(0, 2**32, (2,))`` call on ``generator`` (torch's default CPU
    generator when None), ``seed = lo + 2**32 hi``: ``torch.manual_seed`` controls condinit the way it
    controls ``torch.nn.init``, and the generator advances like after any other draw.

    Examples:
        >>> seed_from(seed=1234)
        1234
        >>> _ = torch.manual_seed(0); a = seed_from()
        >>> _ = torch.manual_seed(0); a == seed_from()
        True
    """
    if seed is not None:
        if generator is not None:
            raise ValueError("give either generator or seed, not both")
        return check_seed("seed", seed)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    device = generator.device if generator is not None else "cpu"
    lo, hi = torch.randint(0, 1 << 32, (2,), generator=generator, dtype=torch.int64, device=device).tolist()
    return lo | (hi << 32)


# ---------------------------------------------------------------------------------------------------
# validation

BlockIds = Union[torch.Tensor, range, Sequence[int]]


_MAX_BLOCK_ID = (1 << 63) - 1


def _check_block_ids(block_ids, device) -> torch.Tensor:
    if isinstance(block_ids, torch.Tensor):
        if block_ids.dtype != torch.int64:
            raise TypeError(f"block_ids must be an int64 tensor (or a range / sequence of ints), got "
                            f"dtype {block_ids.dtype}")
        ids = check_tensor("block_ids", block_ids, dim=1)
        if ids.numel() and bool((ids < 0).any()):
            raise ValueError("block_ids must be >= 0, got a negative id")
    elif isinstance(block_ids, range):
        if len(block_ids):
            for end in (block_ids[0], block_ids[-1]):
                check_int("block_ids entries", end, min=0, max=_MAX_BLOCK_ID)
        ids = torch.arange(block_ids.start, block_ids.stop, block_ids.step, dtype=torch.int64)
    else:
        if isinstance(block_ids, (str, bytes)) or not hasattr(block_ids, "__len__"):
            raise TypeError(f"block_ids must be a 1-D int64 tensor, a range or a sequence of ints, got "
                            f"{type(block_ids).__name__}")
        vals = [check_int("block_ids entries", v, min=0, max=_MAX_BLOCK_ID) for v in block_ids]
        ids = torch.tensor(vals, dtype=torch.int64).reshape(-1)
    return ids.to(device).contiguous()


def _check_shape(block_shape) -> tuple[int, int]:
    if not isinstance(block_shape, (tuple, list, torch.Size)) or len(block_shape) != 2:
        raise ValueError(f"block_shape must be a tuple (m, n), got {block_shape!r}")
    m, n = (check_int(f"block_shape[{i}]", v, min=1) for i, v in enumerate(block_shape))
    if (m * n + 3) // 4 > _MASK32 + 1:
        raise ValueError(f"block_shape {(m, n)}: a block holds at most 2**34 elements (2**32 Philox quads)")
    return m, n


def block_randn(seed: int, stream: int, block_ids: BlockIds, block_shape: tuple[int, int], *,
                device=None, out: torch.Tensor | None = None, backend: str | None = None) -> torch.Tensor:
    """float32 standard normals, shape ``[len(block_ids), m, n]``.

    Element ``(i, j)`` of block ``g`` is a pure function of ``(seed, stream, g, i*n + j)`` (see the
    module docstring): independent of which or how many other blocks are drawn in the same call, of
    chunking, of device and of backend (all backends agree bit for bit).

    Args:
        seed: ``0 <= seed < 2**64`` (see :func:`seed_from`).
        stream: ``0 <= stream < 2**32``, a tensor id (see :func:`stream_id`).
        block_ids: 1-D int64 tensor, ``range`` or sequence of ints ``>= 0``.
        block_shape: ``(m, n)``.
        device: where to generate; default ``out``'s device, else ``block_ids``' device, else CPU.
        out: optional float32 contiguous ``[len(block_ids), m, n]`` tensor to write into.
        backend: force ``"cuda"``, ``"cpp-cpu"`` or ``"torch"`` (default: automatic, see
            :mod:`condinit._backends`).

    Examples:
        >>> z = block_randn(1234, stream_id("q"), range(4), (64, 2048))   # 4 blocks 64 x 2048
        >>> z.shape, z.dtype
        (torch.Size([4, 64, 2048]), torch.float32)
        >>> torch.equal(block_randn(1234, stream_id("q"), [2], (64, 2048))[0], z[2])
        True
    """
    seed = check_seed("seed", seed)
    stream = check_int("stream", stream, min=0, max=_MASK32)
    m, n = _check_shape(block_shape)
    check_tensor("out", out, allow_none=True)
    check_choice("backend", backend, _backends.BACKENDS + ("auto",), allow_none=True)
    if device is not None:
        device = torch.device(device)
        if out is not None and out.device != device:
            raise ValueError(f"out is on {out.device} but device={device}")
    elif out is not None:
        device = out.device
    elif isinstance(block_ids, torch.Tensor):
        device = block_ids.device
    else:
        device = torch.device("cpu")
    ids = _check_block_ids(block_ids, device)
    shape = (ids.numel(), m, n)
    if out is not None:
        if out.dtype != torch.float32:
            raise TypeError(f"out must be float32, got {out.dtype}")
        if tuple(out.shape) != shape:
            raise ValueError(f"out must have shape {shape}, got {tuple(out.shape)}")
        if not out.is_contiguous():
            raise ValueError("out must be contiguous")
    else:
        out = torch.empty(shape, dtype=torch.float32, device=device)
    name = RANDN.choose(device, backend)
    if out.numel() == 0:
        return out
    with torch.no_grad():  # `out` may be a view of a parameter
        RANDN(name, seed, stream, ids, m, n, out)
    return out


# ---------------------------------------------------------------------------------------------------
# PyTorch reference backend

def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit halves of the 64-bit product of the constant ``a`` and uint32 values ``b``
    (int64 tensors); ``b`` is split in 16-bit halves so no product overflows int64."""
    p_lo = b & 0xFFFF
    p_lo.mul_(a)                      # < 2**48
    t = b >> 16
    t.mul_(a).add_(p_lo >> 16)        # < 2**48 + 2**32
    hi = t >> 16
    lo = ((t & 0xFFFF) << 16).bitwise_or_(p_lo & 0xFFFF)
    return hi, lo


def philox4x32_10(counter: Sequence[torch.Tensor], key: tuple[int, int]) -> list[torch.Tensor]:
    """Philox4x32-10 on int64 tensors holding uint32 values: counter (c0, c1, c2, c3) (tensors,
    broadcastable), key (k0, k1) ints. Returns the four output words as int64 tensors.

    Examples:
        >>> zero = torch.zeros(1, dtype=torch.int64)
        >>> [hex(int(w)) for w in philox4x32_10([zero] * 4, (0, 0))]   # Random123 known answer
        ['0x6627e8d5', '0xe169c58d', '0xbc57ac4c', '0x9b00dbd8']
    """
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for r in range(PHILOX_ROUNDS):
        hi0, lo0 = _mulhilo(PHILOX_M0, c0)
        hi1, lo1 = _mulhilo(PHILOX_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = (k0 + PHILOX_W0) & _MASK32
        k1 = (k1 + PHILOX_W1) & _MASK32
    return [c0, c1, c2, c3]


def _horner(coeffs, x: torch.Tensor) -> torch.Tensor:
    y = x * coeffs[0]
    for c in coeffs[1:-1]:
        y = (y + c) * x
    return y + coeffs[-1]


def _log_open01(x: torch.Tensor) -> torch.Tensor:
    """ln(u) for u = RN(x + 1/2) 2^-32, x: uint32 values in an int64 tensor; float32."""
    hi = (x >> 8).to(torch.float32)
    lo = (x & 255).to(torch.float32) * _f("0x1p-8") + _f("0x1p-9")
    u = (hi + lo) * _f("0x1p-24")
    bits = u.view(torch.int32)
    e = (bits >> 23) - 127
    mb = (bits & 0x7FFFFF) | 0x3F800000
    big = mb > SQRT2_BITS                    # m > sqrt 2: use m/2 and e + 1
    m = mb.view(torch.float32)
    f = torch.where(big, m * 0.5 - 1.0, m - 1.0)
    fe = (e + big.to(torch.int32)).to(torch.float32)
    z = f * f
    y = _horner(LOG_P, f) * f * z
    y = y + fe * LN2_LO
    y = y - z * 0.5
    return (f + y) + fe * LN2_HI


def _sincos_turn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos t, sin t) for t = 2 pi (x >> 8) / 2^24, float32."""
    y = (x >> 8) + (1 << 21)
    k = (y >> 22) & 3
    a = ((y & ((1 << 22) - 1)) - (1 << 21)).to(torch.float32) * ANGLE_STEP
    z = a * a
    s = _horner(SIN_P, z) * z * a + a
    c = (_horner(COS_P, z) * z * z - z * 0.5) + 1.0
    odd = (k & 1).bool()
    cos_t = torch.where(odd, s, c)
    sin_t = torch.where(odd, c, s)
    cos_t = torch.where(((k + 1) & 2).bool(), -cos_t, cos_t)
    sin_t = torch.where((k & 2).bool(), -sin_t, sin_t)
    return cos_t, sin_t


def philox_normals(x: Sequence[torch.Tensor]) -> torch.Tensor:
    """Box-Muller of one Philox output quad (x0, x1, x2, x3) -> normals [..., 4] float32.

    Examples:
        >>> q = torch.arange(3, dtype=torch.int64)           # quads 0, 1, 2 of block 0, stream 0
        >>> words = philox4x32_10([q, 0 * q, 0 * q, 0 * q], (1234, 0))
        >>> torch.equal(philox_normals(words).reshape(-1),
        ...             block_randn(1234, 0, [0], (1, 12), backend="torch").reshape(-1))
        True
    """
    x0, x1, x2, x3 = x
    out = []
    for xr, xa in ((x0, x1), (x2, x3)):
        # torch.sqrt of float32 is not correctly rounded on every CPU build (MKL VML: ~1 % of values
        # 1 ulp off); the float64 square root rounded to float32 is (53 >= 2 * 24 + 2 bits).
        r = torch.sqrt((_log_open01(xr) * -2.0).double()).float()
        cos_t, sin_t = _sincos_turn(xa)
        out += [r * cos_t, r * sin_t]
    return torch.stack(out, dim=-1)


# What each backend runs (one table: the choice above and `condinit info` read it). All three give
# the same bits.
RANDN = _backends.Op("randn")


@RANDN.register("torch", devices=(_backends.ANY_DEVICE,))
def _randn_torch(seed: int, stream: int, block_ids: torch.Tensor, m: int, n: int, out: torch.Tensor):
    key = (seed & _MASK32, seed >> 32)
    device = out.device
    B = block_ids.numel()
    mn = m * n
    Q = (mn + 3) // 4
    flat_out = out.view(B, mn)
    g_lo = block_ids & _MASK32
    g_hi = block_ids >> 32
    total = B * Q
    for start in range(0, total, _TORCH_CHUNK_QUADS):
        stop = min(total, start + _TORCH_CHUNK_QUADS)
        flat = torch.arange(start, stop, dtype=torch.int64, device=device)
        b = flat // Q
        q = flat - b * Q
        c1 = torch.full_like(q, stream)
        x = philox4x32_10((q, c1, g_lo[b], g_hi[b]), key)
        vals = philox_normals(x)                          # [L, 4]
        if mn % 4 == 0:
            out.view(-1)[start * 4:stop * 4] = vals.view(-1)
        else:
            e = (q * 4).unsqueeze(1) + torch.arange(4, device=device)
            keep = e < mn
            flat_out[b.unsqueeze(1).expand(-1, 4)[keep], e[keep]] = vals[keep]
    return out


# ---------------------------------------------------------------------------------------------------
# native backends (condinit._C): one schema, CPU and CUDA kernels

def _native_args(seed, stream, block_ids, m, n, out):
    return (seed & _MASK32, seed >> 32, stream, block_ids, m, n, out)


@RANDN.register("cpp-cpu", devices=("cpu",), native_op="philox_randn")
def _randn_cpp(seed: int, stream: int, block_ids: torch.Tensor, m: int, n: int, out: torch.Tensor):
    torch.ops.condinit_C.philox_randn(*_native_args(seed, stream, block_ids, m, n, out))
    return out


@RANDN.register("cuda", devices=("cuda",), native_op="philox_randn")
def _randn_cuda(seed: int, stream: int, block_ids: torch.Tensor, m: int, n: int, out: torch.Tensor):
    torch.ops.condinit_C.philox_randn(*_native_args(seed, stream, block_ids, m, n, out))
    return out


# ---------------------------------------------------------------------------------------------------
# mean + std * z rounded once to the destination's dtype (module doc, "Scaled normals"). Arguments
# are validated by the caller (condinit.models.stream.own_normal_): ``block_ids`` a contiguous int64
# tensor on ``out``'s device, ``out`` contiguous with (B - 1) m n < numel <= B m n elements.
NORMAL = _backends.Op("normal")
# destination dtypes of the fused C++ kernel
NORMAL_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
# normals the composite draws per RANDN call (16 MiB of float32 scratch)
NORMAL_CHUNK = 1 << 22


@NORMAL.register("torch", devices=(_backends.ANY_DEVICE,))
def _normal_composite(seed: int, stream: int, block_ids: torch.Tensor, m: int, n: int, mean: float, std: float,
                      out: torch.Tensor):
    """The definition: the float32 normals drawn into a buffer (RANDN's choice for the device),
    scaled and shifted there by torch, then copied (rounded) into ``out``."""
    mn = m * n
    flat = out.view(-1)
    total, B = flat.numel(), block_ids.numel()
    per = max(1, NORMAL_CHUNK // mn)      # blocks per draw
    randn = RANDN.choose(out.device)
    buf = torch.empty((min(per, B), m, n), dtype=torch.float32, device=out.device)
    for b0 in range(0, B, per):
        b1 = min(B, b0 + per)
        z = buf[:b1 - b0]
        RANDN(randn, seed, stream, block_ids[b0:b1], m, n, z)
        lo, hi = b0 * mn, min(total, b1 * mn)
        z = z.view(-1)[:hi - lo]
        z.mul_(std)
        if mean != 0.0:
            z.add_(mean)
        flat[lo:hi].copy_(z)
    return out


@NORMAL.register("cpp-cpu", devices=("cpu",), limits={"dtype": NORMAL_DTYPES}, native_op="philox_normal")
def _normal_cpp(seed: int, stream: int, block_ids: torch.Tensor, m: int, n: int, mean: float, std: float,
                out: torch.Tensor):
    torch.ops.condinit_C.philox_normal(seed & _MASK32, seed >> 32, stream, block_ids, m, n, mean, std, out)
    return out
