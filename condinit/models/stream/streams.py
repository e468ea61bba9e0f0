"""Own-init random streams: the model's own ``normal_`` draws as named Philox streams, and the
per-unit seeds of torch's generator for its other draws.

Every ``normal_`` that the model's init makes on a state-dict tensor is drawn from condinit's
counter-based generator (:func:`condinit.ops.random.op.block_randn`) in the tensor's own stream:
element ``e`` (row-major) of tensor ``name`` is lane ``e % 2**16`` of block
``(h31(name) << 32) + e // 2**16`` of stream ``s(name)``, with ``s`` and ``h31`` the first 4 bytes
and the next 31 bits of BLAKE2b(``"condinit own init\\0" + name``) (:func:`own_init_stream`), then
``mean + std * z`` rounded once to the tensor's dtype (the ``normal`` table of
:mod:`condinit.ops.random.op`: on the CPU one pass of the C++ kernel, straight into the tensor's
dtype; elsewhere the float32 normals scaled in a buffer and copied, with the same bits). So these
weights are bit-identical whatever the shard size, the chunking, the order of writing or the device
(``docs/design.md``, "Random streams").

Any other random draw of an init (``uniform_``, ``trunc_normal_``, a tensor's own ``.normal_()``
method as transformers 4 models call it) comes from torch's generator, seeded per unit from
``seed`` and the module's qualified name (:func:`unit_seed`, :func:`seeded`): still a function of
``seed`` and the name only, but device dependent.
"""
from __future__ import annotations

import contextlib
import hashlib

import torch

from condinit._validate import check_int, check_seed
from condinit.ops.random.op import NORMAL

__all__ = ["OWN_INIT_BLOCK", "own_init_stream", "own_normal_", "unit_seed", "seeded"]

# Own-init normals: elements per Philox block (the block id's low word counts blocks)
OWN_INIT_BLOCK = 1 << 16


def own_init_stream(name: str) -> tuple[int, int]:
    """``(stream, first block id)`` of the own-init normals of the state-dict tensor ``name``
    (see the module doc): BLAKE2b of ``"condinit own init\\0" + name``, first 4 bytes the stream,
    the next 31 bits the high word of the block id.

    Examples:
        >>> stream, first = own_init_stream("model.embed_tokens.weight")
        >>> first % 2 ** 32, 0 <= stream < 2 ** 32
        (0, True)
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    d = hashlib.blake2b(f"condinit own init\0{name}".encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(d[:4], "little"), (int.from_bytes(d[4:], "little") & 0x7FFFFFFF) << 32


def own_normal_(tensor: torch.Tensor, seed: int, name: str, mean: float = 0.0, std: float = 1.0, *,
                offset: int = 0) -> torch.Tensor:
    """Fill ``tensor`` (floating, any device and layout) with ``mean + std * z``, ``z`` the
    own-init normals of ``name`` under ``seed`` (see the module doc), each rounded once to the
    tensor's dtype: the same bits on every device and for every chunking. ``offset`` (a multiple
    of ``2**16``) starts at that element of the stream: ``tensor`` gets elements ``offset,
    offset + 1, ...`` of the tensor ``name``, so a big tensor can be drawn piece by piece.

    Examples:
        >>> w = torch.empty(4096, 2048, dtype=torch.bfloat16)
        >>> _ = own_normal_(w, 0, "model.layers.0.mlp.up_proj.weight", std=0.02)
        >>> torch.equal(w[:1], own_normal_(torch.empty(1, 2048, dtype=torch.bfloat16), 0,
        ...                                "model.layers.0.mlp.up_proj.weight", std=0.02))
        True
        >>> torch.equal(w[1024:], own_normal_(torch.empty(3072, 2048, dtype=torch.bfloat16), 0,
        ...                                   "model.layers.0.mlp.up_proj.weight", std=0.02, offset=1024 * 2048))
        True
    """
    seed = check_seed("seed", seed)
    if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
        raise TypeError(f"tensor must be a floating torch.Tensor, got {getattr(tensor, 'dtype', type(tensor))}")
    offset = check_int("offset", offset, min=0)
    if offset % OWN_INIT_BLOCK:
        raise ValueError(f"offset must be a multiple of {OWN_INIT_BLOCK}, got {offset}")
    stream, first = own_init_stream(name)
    first += offset // OWN_INIT_BLOCK
    mean, std = float(mean), float(std)
    n = tensor.numel()
    blocks = -(-(offset + n) // OWN_INIT_BLOCK)
    if blocks >= 1 << 32:
        raise ValueError(f"{name}: {offset + n} elements are more than own_normal_ draws for one tensor (2**48)")
    blocks -= offset // OWN_INIT_BLOCK
    if n == 0:
        return tensor
    with torch.no_grad():
        dest = tensor if tensor.is_contiguous() else torch.empty(tensor.shape, dtype=tensor.dtype,
                                                                 device=tensor.device)
        backend = NORMAL.choose(dest.device, dtype=dest.dtype)
        ids = torch.arange(first, first + blocks, dtype=torch.int64, device=dest.device)
        NORMAL(backend, seed, stream, ids, 1, OWN_INIT_BLOCK, mean, std, dest)
        if dest is not tensor:
            tensor.copy_(dest)
    return tensor


def unit_seed(seed: int, name: str) -> int:
    """The seed of torch's generator while the unit (module) ``name`` is initialized under ``seed``."""
    digest = hashlib.blake2b(f"condinit own init\0{seed}\0{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1   # torch.manual_seed takes [0, 2**63)


@contextlib.contextmanager
def seeded(device: torch.device, seed: int):
    """torch's generator of the CPU (and of ``device`` if it is a GPU) seeded with ``seed`` for the
    duration, their states restored after."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.default_generator.manual_seed(seed)
        if devices:
            with torch.cuda.device(device):
                torch.cuda.manual_seed(seed)
        yield
