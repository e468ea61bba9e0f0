"""The writer thread: files written tensor by tensor while the next tensors are computed, with
progress, early writeback and reused buffers.

Written data goes to the page cache (not the process's resident memory); the writer starts its
writeback to disk as it goes and drops what is on disk from the cache (:class:`Writeback`), so the
disk works while tensors are computed and the cache holds only ~128 MB of the file being written
(a big tensor is written in 64 MB pieces for that). Each file is written atomically
(:func:`condinit.io.atomic.atomic_output`) and ``fsync``\\ ed before its rename; the files of a
directory replace a symlink in their place instead of writing through it.
"""
from __future__ import annotations

import collections
import math
import os
import sys
import threading
import time
from typing import NamedTuple, Optional, Union

import torch

from condinit._util import format_bytes, tensor_bytes
from condinit.io.atomic import atomic_output, open_nofollow

from .tuning import tuning

__all__ = ["BufferPool", "Progress", "Writeback", "Writer", "write_text"]


class BufferPool:
    """CPU buffers of tensors already written, handed out again for tensors of the same byte size.

    A fresh allocation of a big tensor costs a page fault per 4 KB page on its first write, about
    as much as drawing its normals; the tensors of one layer recur in every layer, so their buffers
    are reused instead. Holds at most ``max_bytes`` (buffers of at least ``min_bytes``); thread safe
    (the writer thread gives, the generating thread takes)."""

    def __init__(self, max_bytes: int = 128 * 2 ** 20, min_bytes: int = 2 ** 20):
        self.max_bytes, self.min_bytes = max_bytes, min_bytes
        self._free: dict = {}
        self._held = 0
        self._lock = threading.Lock()

    def take(self, shape, dtype: torch.dtype) -> torch.Tensor:
        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        with self._lock:
            bufs = self._free.get(n)
            if bufs:
                self._held -= n
                return bufs.pop().view(dtype).view(shape)
        return torch.empty(shape, dtype=dtype)

    def give(self, t: torch.Tensor) -> None:
        n = tensor_bytes(t)
        if (t.device.type != "cpu" or n < self.min_bytes or t.storage_offset() != 0 or not t.is_contiguous()
                or t.untyped_storage().nbytes() != n):
            return
        with self._lock:
            if self._held + n <= self.max_bytes:
                self._free.setdefault(n, []).append(t.detach().reshape(-1).view(torch.uint8))
                self._held += n


class Progress:
    """Bytes written: a tqdm bar (rate, ETA) when tqdm is installed, else a line on stderr every
    ``every_s`` seconds. Updated from the writer thread."""

    def __init__(self, total: int, desc: str, every_s: float = 10.0):
        self.total, self.desc, self.every_s = total, desc, every_s
        self.done, self.t0, self.last = 0, time.perf_counter(), time.perf_counter()
        try:
            from tqdm.auto import tqdm
        except ImportError:
            self.bar = None
        else:
            self.bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1000, desc=desc, leave=False,
                            smoothing=0.1)

    def update(self, n: int) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
            return
        now = time.perf_counter()
        if now - self.last >= self.every_s:
            self.last = now
            rate = self.done / max(now - self.t0, 1e-9)
            eta = (self.total - self.done) / rate if rate > 0 else float("inf")
            print(f"{self.desc}: {format_bytes(self.done)} of {format_bytes(self.total)} "
                  f"({100 * self.done / max(self.total, 1):.0f}%), {rate / 1e6:.0f} MB/s, ETA {eta:.0f} s",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class Writeback:
    """Starts the disk writing of a file's data as it is written, instead of at its final ``fsync``.

    The kernel writes dirty pages back only past a threshold (``dirty_background_ratio``, ~10 % of
    memory) or after ~30 s: a shard smaller than that would sit in the page cache, the disk idle,
    until the ``fsync`` at its end, and the run would take generation time plus disk time.
    ``posix_fadvise(DONTNEED)`` on a written range starts its writeback without waiting (Linux) and
    drops the range written before it, already on disk, from the cache: the disk works while the
    next tensors are computed, and the page cache holds about ``2 * step`` bytes of the file
    (``step``: :attr:`Tuning.writeback_step`). A hint only; the ``fsync`` before the rename is what
    makes the file durable."""

    def __init__(self, fh, at: int, step: int):
        self.fh, self.at, self.step = fh, at, step
        self.started = self.dropped = at   # offsets: writeback asked up to, cache dropped up to
        self.enabled = hasattr(os, "posix_fadvise")

    def wrote(self, n: int) -> None:
        self.at += n
        if not self.enabled or self.at - self.started < self.step:
            return
        self.fh.flush()
        fd = self.fh.fileno()
        os.posix_fadvise(fd, self.dropped, self.at - self.dropped, os.POSIX_FADV_DONTNEED)
        self.dropped, self.started = self.started, self.at


# what the generating thread hands the writer thread, in order
class _Begin(NamedTuple):
    path: str
    head: bytes
    follow_symlinks: bool


class _Data(NamedTuple):
    tensor: torch.Tensor
    buffer: torch.Tensor    # the tensor's buffer (the tensor is a part of it), for the pool


class _End(NamedTuple):
    """The file being written is complete."""


class _Stop(NamedTuple):
    """No more files."""


class _Abort(NamedTuple):
    """Drop the file being written."""


_Item = Union[_Begin, _Data, _End, _Stop, _Abort]


class _Aborted(Exception):
    """The generating side gave up: the writer drops the file it is writing."""


class Writer:
    """Writes files on a thread of its own, so the disk works while the next tensors are computed:
    ``begin(path, head)``, ``put(tensor)`` for each tensor in order, ``end()``; then ``finish()``
    (waits, raises the writer's error) or ``abort()`` (drops the file being written). Each file goes
    through :func:`atomic_output` and is fsynced before its rename. ``put`` waits while more than
    ``max_queued`` bytes (default :attr:`Tuning.max_queued_bytes`) are queued and not yet written
    (one bigger tensor is let through alone)."""

    def __init__(self, progress: Optional[Progress], max_queued: Optional[int] = None,
                 pool: Optional[BufferPool] = None):
        knobs = tuning()
        self._pool = pool
        self._items: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._queued, self._max_queued = 0, knobs.max_queued_bytes if max_queued is None else max_queued
        self._overlap, self._step = knobs.overlap_writes, knobs.writeback_step
        self.error: Optional[BaseException] = None
        self.written: list = []
        self._progress = progress
        self._thread = threading.Thread(target=self._run, name="condinit-writer", daemon=True)
        self._thread.start()

    def _push(self, item: _Item, nbytes: int = 0) -> None:
        with self._cond:
            while self.error is None and self._queued > 0 and self._queued + nbytes > self._max_queued:
                self._cond.wait()
            if self.error is not None:
                raise self.error
            self._items.append(item)
            self._queued += nbytes
            self._cond.notify_all()

    def _pop(self) -> _Item:
        with self._cond:
            while not self._items:
                self._cond.wait()
            return self._items.popleft()

    def begin(self, path: str, head: bytes, follow_symlinks: bool = True) -> None:
        """Start the file ``path`` with the bytes ``head``; ``follow_symlinks=False``: a symlink at
        ``path`` is replaced, not written through (:func:`atomic_output`)."""
        self._push(_Begin(path, head, follow_symlinks))

    def put(self, tensor: torch.Tensor, buffer: Optional[torch.Tensor] = None) -> None:
        """Queue ``tensor`` for writing; then its buffer (``buffer``, of which ``tensor`` is a part,
        else ``tensor``) goes to the buffer pool."""
        self._push(_Data(tensor, tensor if buffer is None else buffer), tensor_bytes(tensor))
        if not self._overlap:
            with self._cond:
                while self.error is None and self._queued > 0:
                    self._cond.wait()

    def end(self) -> None:
        self._push(_End())

    def _run(self) -> None:
        path = None
        try:
            while True:
                item = self._pop()
                if not isinstance(item, _Begin):
                    return
                path = item.path
                with atomic_output(path, item.follow_symlinks) as tmp:
                    with open(tmp, "wb", opener=open_nofollow) as fh:
                        fh.write(item.head)
                        flush = Writeback(fh, len(item.head), self._step)
                        while True:
                            item = self._pop()
                            if isinstance(item, _End):
                                break
                            if not isinstance(item, _Data):
                                raise _Aborted()
                            t, buf = item.tensor, item.buffer
                            del item
                            self._write(fh, flush, t)
                            del t
                            if self._pool is not None:
                                self._pool.give(buf)
                            del buf
                        fh.flush()
                        os.fsync(fh.fileno())
                self.written.append(path)
        except BaseException as exc:   # handed to the generating thread, which raises it
            if isinstance(exc, OSError) and exc.filename is None and path is not None:
                named = OSError(exc.errno, exc.strerror, path)   # the shard the error happened in
                named.__cause__ = exc
                exc = named
            with self._cond:
                self.error = exc
                self._cond.notify_all()

    def _write(self, fh, flush: Writeback, t: torch.Tensor) -> None:
        """``t``'s bytes into ``fh``, in pieces, writeback started after each: one big write (the
        525 MB embedding) would leave it to the kernel's dirty throttling (~300 MB/s here instead of
        the disk's ~2.5 GB/s). Each piece written leaves the queue, so the generator goes on before
        the end of a big tensor."""
        n = tensor_bytes(t)
        data = memoryview(t.reshape(-1).view(torch.uint8).numpy()) if n else None
        piece = None
        for at in range(0, n, flush.step):
            piece = data[at:at + flush.step]
            fh.write(piece)
            flush.wrote(len(piece))
            with self._cond:
                self._queued -= len(piece)
                self._cond.notify_all()
            if self._progress is not None:
                self._progress.update(len(piece))
        del data, piece

    def finish(self) -> None:
        self._push(_Stop())
        self._thread.join()
        if self.error is not None:
            raise self.error

    def abort(self) -> None:
        with self._cond:
            self._items.clear()
            self._queued = 0
            self._items.append(_Abort())
            self._cond.notify_all()
        self._thread.join()


def write_text(path: str, text: str, follow_symlinks: bool = True) -> None:
    """``text`` (UTF-8) as the file ``path``, atomically; ``follow_symlinks=False``: a symlink at
    ``path`` is replaced, not written through."""
    with atomic_output(path, follow_symlinks) as tmp:
        with open(tmp, "w", encoding="utf-8", opener=open_nofollow) as fh:
            fh.write(text)
