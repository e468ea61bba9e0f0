"""One model directory written by several processes (``torchrun ... -m condinit init --out DIR/``):
which rank writes which shard, and the collectives that order the write.

* **The bytes do not depend on the ranks.** The shard plan is ``save_pretrained``'s
  (:func:`condinit.models.stream.shards.plan_files`), made from ``max_shard_size`` alone, and every
  tensor comes from streams named by the seed and the tensor's or the unit's name
  (:mod:`condinit.models.stream.streams`): a shard has the same bytes whichever rank computes it.
* **Who writes what** (:func:`assign`): the shards still to write go to the ranks by bytes, the
  largest first, each to the rank with the fewest bytes so far (the lower rank on a tie); each rank
  writes its shards in file order. Deterministic: every rank computes the same assignment.
* **Order** (:func:`condinit.models.stream.write.write_pretrained`): rank 0 takes the directory's
  lock, makes every check (another model there, symlinks, disk space for the whole write), decides
  what a ``resume`` keeps and writes ``config.json``; then it broadcasts the outcome (what is kept,
  or its refusal, which every rank then raises: :func:`decided`). Each rank writes its shards
  (fsynced, renamed, the directory fsynced) and reports to all ranks (:func:`reported`, an
  ``all_gather_object``). Only when every rank reports success does rank 0 write the index, so a
  directory loads only once every shard is durable; a failed rank's error names it on every other
  rank (:class:`RankFailed`), and rank 0 removes the configs it created. A rank that dies without
  reporting closes its connections: the collective fails on the others, which raise
  :class:`RankFailed` too (and torchrun stops the remaining ranks with SIGTERM, which removes their
  temporary files). Every shard is written atomically, so no final-named file is ever partial.
* **One writer per directory**: the lock is rank 0's and held from its checks to the index; the
  other ranks write under it. A second run into the same directory, however many ranks it has, is
  refused by its rank 0 (the lock is taken), and every rank of it raises that refusal.

The collectives are torch.distributed's, on the default process group unless one is given: gloo
on the CPU, NCCL when the tensors are computed on CUDA (:func:`launched_group`).
"""
from __future__ import annotations

import contextlib
import datetime
import os
from typing import NamedTuple, Optional

import torch

__all__ = ["Ranks", "RankFailed", "RankWritten", "assign", "ranks_of", "launched_world_size", "launched_group",
           "decided", "reported"]

# a rank may wait this long for another's shards (or rank 0's checks); a rank that dies is seen at
# once, by its closed connections, not by this timeout
_TIMEOUT = datetime.timedelta(hours=24)


class RankFailed(RuntimeError):
    """Another rank of a multi-rank write failed (or ended without reporting): nothing indexed."""


class Ranks(NamedTuple):
    """This process's place in a write: its rank, the number of ranks, the process group (None: one
    process, no collective)."""

    rank: int
    size: int
    group: object = None


class RankWritten(NamedTuple):
    """What one rank wrote: its shards (names), their bytes, and its seconds from its first shard to
    its last one's rename."""

    rank: int
    files: list
    bytes: int
    seconds: float


def ranks_of(process_group=None) -> Ranks:
    """This process's :class:`Ranks`: those of ``process_group`` (or of the default group) when
    torch.distributed is initialized, else one process."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        if process_group is not None:
            raise ValueError("process_group: torch.distributed is not initialized")
        return Ranks(0, 1, None)
    size = dist.get_world_size(process_group)
    if size == 1:
        return Ranks(0, 1, None)
    return Ranks(dist.get_rank(process_group), size, process_group)


def assign(sizes: dict, world: int) -> list:
    """``[[file names] for each rank]``: the files of ``sizes`` (``{name: bytes}``, in file order)
    given to ``world`` ranks by bytes, the largest first, each to the rank with the fewest bytes so
    far (the lower rank on a tie); each rank's files in file order.

    Examples:
        >>> assign({"a": 5, "b": 5, "c": 2, "d": 1}, 2)
        [['a', 'c'], ['b', 'd']]
    """
    order = {name: i for i, name in enumerate(sizes)}
    loads, shares = [0] * world, [[] for _ in range(world)]
    for name in sorted(sizes, key=lambda n: (-sizes[n], order[n])):
        r = min(range(world), key=lambda i: (loads[i], i))
        loads[r] += sizes[name]
        shares[r].append(name)
    return [sorted(s, key=order.__getitem__) for s in shares]


def launched_world_size() -> Optional[int]:
    """The number of ranks a launcher (torchrun) started this process among (``WORLD_SIZE``), or
    None when none did."""
    raw = os.environ.get("WORLD_SIZE")
    if raw is None or "RANK" not in os.environ:
        return None
    try:
        size = int(raw)
    except ValueError:
        raise ValueError(f"WORLD_SIZE={raw!r} in the environment is not a number of ranks") from None
    if size < 1:
        raise ValueError(f"WORLD_SIZE={raw!r} in the environment is not a number of ranks")
    return size


@contextlib.contextmanager
def launched_group(device: str):
    """For a process started by torchrun among more than one rank: the default process group
    initialized from its environment (gloo when tensors are computed on the CPU, NCCL on CUDA, this
    process's GPU being ``LOCAL_RANK``'s) while inside, destroyed after. Yields the device to
    compute on (``"cuda:LOCAL_RANK"`` for CUDA)."""
    import torch.distributed as dist

    if device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", timeout=_TIMEOUT)
    try:
        yield device
        dist.barrier()      # no rank tears the group down while a peer still has collectives in flight
    finally:
        dist.destroy_process_group()


def _src(ranks: Ranks) -> int:
    import torch.distributed as dist

    return 0 if ranks.group is None else dist.get_global_rank(ranks.group, 0)


def _outcome(exc: BaseException) -> tuple:
    return (type(exc).__name__, " ".join(str(exc).split()) or type(exc).__name__,
            "value" if isinstance(exc, ValueError) else "type" if isinstance(exc, TypeError) else "other")


def _lost(ranks: Ranks, exc: BaseException) -> RankFailed:
    line = " ".join(str(exc).split())
    return RankFailed(f"rank {ranks.rank} of {ranks.size}: another rank ended without reporting "
                      f"({type(exc).__name__}: {line[:200]}); no index written")


def decided(ranks: Ranks, value=None, error: Optional[BaseException] = None):
    """Rank 0's decision before any shard is written, on every rank: rank 0 passes ``value`` (what
    the others need) or the ``error`` it raises, the others get ``value`` back, or raise rank 0's
    refusal (a ValueError or TypeError stays one, with the same message)."""
    if ranks.group is None and ranks.size == 1:
        if error is not None:
            raise error
        return value
    import torch.distributed as dist

    box = [None if ranks.rank else (("ok", value) if error is None else ("error", _outcome(error)))]
    try:
        dist.broadcast_object_list(box, src=_src(ranks), group=ranks.group)
    except RuntimeError as exc:
        if error is not None:
            raise error from None
        raise _lost(ranks, exc) from exc
    if error is not None:
        raise error
    kind, payload = box[0]
    if kind == "ok":
        return payload
    name, line, family = payload
    text = f"rank 0 refused the write: {line}"
    raise ValueError(text) if family == "value" else TypeError(text) if family == "type" else RankFailed(text)


def reported(ranks: Ranks, mine: RankWritten, error: Optional[BaseException], shard: Optional[str]) -> list:
    """Every rank's :class:`RankWritten`, in rank order, once every rank has written its shards; on
    every rank. A rank whose write failed (``error``, in ``shard``) raises its own error; the others
    raise :class:`RankFailed` naming it; a rank that ended without reporting makes the others raise
    :class:`RankFailed` too."""
    if ranks.group is None and ranks.size == 1:
        if error is not None:
            raise error
        return [mine]
    import torch.distributed as dist

    entry = (mine, None if error is None else (*_outcome(error), shard))
    got = [None] * ranks.size
    try:
        dist.all_gather_object(got, entry, group=ranks.group)
    except RuntimeError as exc:
        if error is not None:
            raise error from None
        raise _lost(ranks, exc) from exc
    if error is not None:
        raise error
    failed = [(w.rank, e) for w, e in got if e is not None]
    if failed:
        rank, (name, line, _, where) = failed[0]
        more = f" (and {len(failed) - 1} other rank(s))" if len(failed) > 1 else ""
        raise RankFailed(f"rank {rank} of {ranks.size} failed{' writing ' + where if where else ''}: {name}: "
                         f"{line[:300]}{more}; no index written (complete shards stay: --resume writes the rest)")
    return [w for w, _ in got]
