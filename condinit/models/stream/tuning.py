"""The streamed writer's sizes and switches: how big a piece, a queue, a writeback step is.

None of them changes a written byte: they decide only when each byte is computed and written.
Benchmarks and tests change them for the duration of a block with :func:`tuned`; every stage reads
:func:`tuning` when it starts its work.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

__all__ = ["Tuning", "tuning", "tuned"]


@dataclass(frozen=True)
class Tuning:
    """Sizes (bytes) and switches of the streamed writer.

    * ``piece_bytes``: a tensor replayed from its recorded init is drawn in pieces of at most this
      many bytes (whole ``2**16``-element blocks, at least one); the writer writes one while the
      next is drawn, and the pieces' buffers are reused.
    * ``max_queued_bytes``: bytes of computed tensors waiting for the writer thread before the
      generator waits for it: enough to keep the disk busy while the next unit is computed, small
      next to a shard.
    * ``writeback_step``: the writer starts the disk writeback (and drops what is on disk from the
      page cache) every this many bytes, and writes a big tensor in pieces of this size.
    * ``cpu_layer_budget``: the orthogonalization's scratch per buffer on the CPU when
      ``memory_budget`` is None: one layer at a time is as fast in 4 MiB chunks as in apply's
      16 MiB (and the result is the same for any budget).
    * ``overlap_writes``: False: each tensor is written before the next one is computed (no
      overlap; benchmarks compare).
    * ``replay_units``: False: every module unit is computed whole (the model's init run on real
      tensors, then checked) instead of drawn in pieces; the reference the pieces are checked
      against.
    """

    piece_bytes: int = 8 * 2 ** 20
    max_queued_bytes: int = 32 * 2 ** 20
    writeback_step: int = 64 * 2 ** 20
    cpu_layer_budget: int = 4 * 2 ** 20
    overlap_writes: bool = True
    replay_units: bool = True


_current = Tuning()


def tuning() -> Tuning:
    """The sizes and switches in force."""
    return _current


@contextlib.contextmanager
def tuned(**changes):
    """The writer's :class:`Tuning` with ``changes`` for the duration of the block.

    Examples:
        >>> with tuned(piece_bytes=1):          # one 2**16-element block per piece
        ...     write_pretrained(config, "out/")
    """
    global _current
    previous = _current
    _current = dataclasses.replace(previous, **changes)
    try:
        yield _current
    finally:
        _current = previous
