"""One writer per output directory: an exclusive ``fcntl.flock`` on the file ``.condinit.lock``
inside it, held across a write.

* The kernel releases the lock when its holder's process ends, however it ends; the holder removes
  the file when it is done (and on SIGTERM, under :func:`condinit.io.atomic.removing_temps_on_sigterm`),
  so a finished write leaves no lock file. A file left behind (SIGKILL) is not a lock: the next
  writer takes it over.
* The file holds its holder's PID and host (one JSON line), for the refusal's message
  (:class:`DirectoryLocked`). A lock still held while the file names a process that is gone from
  this host (a child that inherited the descriptor) is stale: the file is removed and the lock
  taken anew.
* The lock file is opened with ``O_NOFOLLOW``: a symlink in its place is refused, never followed.
  Readers of the directory ignore the file (it is neither a weights file nor named by an index).
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import stat
import time
from typing import NamedTuple, Optional

from .atomic import open_nofollow, process_alive, removed_on_sigterm

try:
    import fcntl
except ImportError:  # not POSIX: no locking
    fcntl = None

__all__ = ["LOCK_NAME", "LockHolder", "DirectoryLock", "DirectoryLocked", "directory_lock"]

LOCK_NAME = ".condinit.lock"
_ATTEMPTS = 5   # a lock file removed or replaced between our open and our lock: open it again


class LockHolder(NamedTuple):
    """Who holds a directory lock, as its lock file says (None where it says nothing yet)."""

    pid: Optional[int]
    host: Optional[str]
    since: Optional[float]

    def describe(self) -> str:
        if self.pid is None:
            return "another process (it has not written its PID yet)"
        when = "" if self.since is None else f", since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.since))}"
        return f"PID {self.pid} on host {self.host}{when}"


class DirectoryLock(NamedTuple):
    """A held lock: the directory, its lock file, and the open descriptor the lock is on."""

    directory: str
    path: str
    fd: int


class DirectoryLocked(ValueError):
    """Another process is writing the directory: refused, nothing written."""

    def __init__(self, directory: str, holder: LockHolder):
        self.directory, self.holder = directory, holder
        super().__init__(f"out_dir {directory} is being written by {holder.describe()} (lock file "
                         f"{os.path.join(directory, LOCK_NAME)}); wait for it to finish, or choose another directory")


def _read_holder(fd: int) -> LockHolder:
    try:
        raw = os.pread(fd, 4096, 0)
        entry = json.loads(raw.decode("utf-8"))
        pid, host, since = entry.get("pid"), entry.get("host"), entry.get("since")
    except (OSError, ValueError, AttributeError):
        return LockHolder(None, None, None)
    return LockHolder(pid if isinstance(pid, int) else None, host if isinstance(host, str) else None,
                      since if isinstance(since, (int, float)) else None)


def _same_file(fd: int, path: str) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        a, b = os.fstat(fd), os.lstat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _open_lock_file(directory: str, path: str) -> int:
    try:
        fd = open_nofollow(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            target = os.path.normpath(os.path.join(directory, os.readlink(path)))
            raise ValueError(f"out_dir {directory}: {path} is a symlink to {target}; condinit never follows a link "
                             f"in the directory it writes: remove the link") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError(f"out_dir {directory}: {path} is not a regular file; remove it")
    return fd


def _lock(directory: str, path: str) -> int:
    """The descriptor of ``path``, exclusively locked, or :class:`DirectoryLocked`."""
    for _ in range(_ATTEMPTS):
        fd = _open_lock_file(directory, path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            stale = holder.pid is not None and holder.host == socket.gethostname() and not process_alive(holder.pid)
            if stale and _same_file(fd, path):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            os.close(fd)
            if stale:
                continue
            raise DirectoryLocked(directory, holder) from None
        except BaseException:
            os.close(fd)
            raise
        if _same_file(fd, path):   # not removed by a holder that finished after our open
            return fd
        os.close(fd)
    raise DirectoryLocked(directory, LockHolder(None, None, None))


@contextlib.contextmanager
def directory_lock(directory):
    """Hold the writers' lock of the existing directory ``directory`` while inside; yields a
    :class:`DirectoryLock`. Raises :class:`DirectoryLocked` (a ValueError naming the holder's PID and
    host) when another live process holds it. Without ``fcntl`` (not POSIX) nothing is locked.

    Examples:
        >>> with directory_lock("llama-8b-cond/"):
        ...     write_the_files()
    """
    directory = os.path.abspath(os.fspath(directory))
    path = os.path.join(directory, LOCK_NAME)
    if fcntl is None:
        yield DirectoryLock(directory, path, -1)
        return
    fd = _lock(directory, path)
    try:
        entry = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": round(time.time(), 3)})
        os.ftruncate(fd, 0)
        os.pwrite(fd, (entry + "\n").encode("utf-8"), 0)
        with removed_on_sigterm(path):
            yield DirectoryLock(directory, path, fd)
    finally:
        if _same_file(fd, path):   # removed while still held: the next writer never locks a removed file
            with contextlib.suppress(OSError):
                os.unlink(path)
        os.close(fd)
