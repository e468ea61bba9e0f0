"""Atomic output files: write to a temporary file beside the destination, then rename it over the
destination; never a partial file, on any error, Ctrl-C or SIGTERM.

* Atomic: a temporary file in the destination's directory, ``fsync``, ``os.replace``, then
  ``fsync`` of the directory. The old file stays intact until the rename: on any error, on
  Ctrl-C and on SIGTERM the temporary file is removed and nothing is left behind. SIGKILL cannot
  be caught: the next write to the same destination removes the temporary files of writers that
  are gone (their names carry a host tag and the writer's PID; see :func:`atomic_output`).
* Modes: a new file gets ``0o666 & ~umask`` (what ``open(path, "w")`` gives); an overwritten file
  keeps its mode. The file is owned by the writer (the rename makes a new inode).
* Symlinks are written through: a destination that is a symlink keeps the link, and the file it
  points to is replaced atomically in that file's own directory (a dangling link creates its
  target, as a shell redirection does). With ``follow_symlinks=False`` (the files of an output
  directory) the link itself is replaced by a regular file and its target is never touched.
  Destinations that are not regular files (devices, FIFOs, sockets) are refused before any work
  (:func:`check_output_path`).
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import signal
import socket
import stat
import tempfile
import threading
import time

__all__ = ["atomic_output", "fsync_dir", "check_output_path", "removing_temps_on_sigterm", "removed_on_sigterm",
           "process_alive", "open_nofollow", "special_file", "STALE_TEMP_AGE_S", "HOST_TAG"]

_FILE_KINDS = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
               (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"))


def _special_kind(mode: int) -> str:
    return next((name for test, name in _FILE_KINDS if test(mode)), "not a regular file")


def special_file(path):
    """What the entry ``path`` is when it exists and is neither a regular file nor a symlink (the
    link itself is looked at): ``"a directory"``, ``"a FIFO (named pipe)"``, ...; else None. Never
    opens it (opening a FIFO would wait for a writer)."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return None
    if stat.S_ISREG(mode) or stat.S_ISLNK(mode):
        return None
    return "a directory" if stat.S_ISDIR(mode) else _special_kind(mode)


def _resolve_output(path, follow_symlinks: bool = True) -> tuple[str, str]:
    """``(shown, dest)``: the absolute path as given, and the file that will be replaced (symlinks
    followed, or with ``follow_symlinks=False`` only those of its directory), after every check of
    :func:`check_output_path`."""
    shown = os.path.abspath(os.fspath(path))
    if follow_symlinks:
        dest = os.path.realpath(shown)
    else:
        dest = os.path.join(os.path.realpath(os.path.dirname(shown)), os.path.basename(shown))
    via = f" (the target of symlink {shown})" if dest != shown else ""
    try:
        st = os.stat(dest) if follow_symlinks else os.lstat(dest)
    except (FileNotFoundError, NotADirectoryError):  # the directory checks below say which
        st = None
    except OSError as exc:  # ELOOP: a symlink cycle
        raise ValueError(f"output {shown} cannot be used: {exc.strerror or exc}") from None
    if st is not None and not stat.S_ISLNK(st.st_mode):
        if stat.S_ISDIR(st.st_mode):
            raise ValueError(f"output {dest}{via} is a directory, expected a file path")
        if not stat.S_ISREG(st.st_mode):
            kind = _special_kind(st.st_mode)
            raise ValueError(f"output {dest}{via} is {kind}; condinit writes only regular files (it replaces the "
                             f"file atomically)")
    d = os.path.dirname(dest)
    if not os.path.exists(d):
        raise ValueError(f"output directory {d}{via} does not exist")
    if not os.path.isdir(d):
        raise ValueError(f"output directory {d}{via} is not a directory")
    why = _not_writable(d)
    if why is not None:
        raise ValueError(f"output directory {d}{via} is not writable: {why}")
    return shown, dest


def _not_writable(d: str):
    """Why no file can be created in the existing directory ``d``, or None. Writes nothing (the
    directory's modification time stays as it was): its permissions, and a read-only mount, which
    ``os.access`` does not see for root."""
    if not os.access(d, os.W_OK | os.X_OK):
        return "permission denied (EACCES)"
    if os.statvfs(d).f_flag & os.ST_RDONLY:
        return "read-only file system (EROFS)"
    return None


def check_output_path(path, follow_symlinks: bool = True) -> str:
    """Validate an output path before any work; returns it as an absolute path (symlinks kept).

    Checked: the file that will be written (a symlink's target: writes go through links; with
    ``follow_symlinks=False`` the link itself, which is replaced) is a regular file or does not
    exist yet, and its directory exists and is writable. A directory, a
    device node such as ``/dev/null``, a FIFO or a socket is refused with a ValueError naming the
    path and what it is.

    Examples:
        >>> out = check_output_path("model.safetensors")
        >>> check_output_path("/dev/null")
        Traceback (most recent call last):
        ValueError: output /dev/null is a character device; condinit writes only regular files ...
    """
    return _resolve_output(path, follow_symlinks)[0]


def check_output_dir(path, missing_parent_ok: bool = False) -> str:
    """Raise ValueError unless ``path`` is a writable directory or can be created as one in an existing
    writable directory (its parent; ``missing_parent_ok``: in any existing writable ancestor, for a
    caller that refuses a missing parent itself, later). Writes nothing."""
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise ValueError(f"out must be a directory path, got {path!r}")
    path = os.path.abspath(os.fspath(path))
    probe = path
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        what = "is" if probe == path else f"cannot be created: {probe!r} is"
        raise ValueError(f"out directory {path!r} {what} not a directory")
    if probe not in (path, os.path.dirname(path)) and not missing_parent_ok:
        raise ValueError(f"out directory {path!r}: its parent directory {os.path.dirname(path)!r} does not exist")
    why = _not_writable(probe)
    if why is not None:
        raise ValueError(f"out directory {path!r} is not writable ({probe!r}: {why})")
    return path


def open_nofollow(path, flags: int, mode: int = 0o666) -> int:
    """``os.open`` that refuses a symlink as the last component (``O_NOFOLLOW``: ELOOP); usable as
    the ``opener`` of :func:`open`."""
    return os.open(path, flags | getattr(os, "O_NOFOLLOW", 0), mode)


# Temporary files: ".{base}.{host tag}.{pid}.{random}.tmp" in the destination's directory. The host
# tag and PID let a later write tell a temporary file whose writer is gone (SIGKILL, power loss)
# from one that is being written right now, which it must never delete.
HOST_TAG = hashlib.blake2s(socket.gethostname().encode("utf-8", "surrogateescape"), digest_size=4).hexdigest()
_BASE_CHARS = 180  # keeps the temporary name under the usual 255-byte limit for long destinations
# A temporary file whose writer cannot be checked (another host, or a PID now used by another
# process) is stale once it has not been modified for this long; a live writer modifies its file
# until the rename.
STALE_TEMP_AGE_S = 3600.0

_ACTIVE_TEMPS: set = set()         # temporary files being written by this process
# creation + registration vs. the sweep and the SIGTERM handler (which keeps it: no temporary file is
# made after it); reentrant, as the handler runs in the main thread, possibly inside a holder
_TEMPS_LOCK = threading.RLock()
_TEMP_DIRS: set = set()             # (directory, temporary-name prefix) of every temporary file made
_SIGTERM_FILES: set = set()         # other files of this process that SIGTERM removes (directory locks,
                                   # temporary directories: removed whole)
_sigterm_depth = 0                 # nesting of main-thread writes that installed the handler
_sigterm_previous = None


def _temp_pattern(base: str):
    return re.compile(rf"^\.{re.escape(base[:_BASE_CHARS])}\.([0-9a-f]{{8}})\.([0-9]+)\.[a-z0-9_]+\.tmp$")


def process_alive(pid: int) -> bool:
    """Whether a process with this PID exists on this host (owned by anyone)."""
    if pid <= 0 or os.name == "nt":  # os.kill(pid, 0) terminates the process on Windows
        return pid > 0
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except OSError:  # EPERM: it exists, owned by another user
        return True
    return True


def _sweep_stale_temps(d: str, base: str) -> None:
    """Remove this destination's temporary files left by writers that are gone."""
    pattern = _temp_pattern(base)
    try:
        names = os.listdir(d)
    except OSError:
        return
    now = time.time()
    for name in names:
        m = pattern.match(name)
        if m is None:
            continue
        tmp = os.path.join(d, name)
        host, pid = m[1], int(m[2])
        with _TEMPS_LOCK:
            if tmp in _ACTIVE_TEMPS:
                continue
            try:
                age = now - os.lstat(tmp).st_mtime
            except OSError:
                continue
            if host == HOST_TAG and pid == os.getpid():
                stale = True  # ours, not being written: left by an earlier process with this PID
            elif host == HOST_TAG and not process_alive(pid):
                stale = True
            else:
                stale = age > STALE_TEMP_AGE_S
            if stale:
                # best effort: a leftover we may not remove (another user's, a read-only
                # directory entry) must not stop this write
                with contextlib.suppress(OSError):
                    os.unlink(tmp)


def _temp_prefix(base: str) -> str:
    return f".{base[:_BASE_CHARS]}.{HOST_TAG}.{os.getpid()}."


def _new_temp(d: str, base: str) -> str:
    with _TEMPS_LOCK:
        _TEMP_DIRS.add((d, _temp_prefix(base)))
        fd, tmp = tempfile.mkstemp(dir=d, prefix=_temp_prefix(base), suffix=".tmp")
        _ACTIVE_TEMPS.add(tmp)
    os.close(fd)
    return tmp


def _on_sigterm(signum, frame):
    # The default action would end the process here and leave full-size temporary files behind:
    # remove them, then terminate the way the default action does (killed by the signal). The lock
    # is taken and kept: a writer thread finishes making (and registering) a temporary file first,
    # and makes none after. The directories are swept too, for a file this thread made but had not
    # registered when the signal came.
    _TEMPS_LOCK.acquire()
    for tmp in tuple(_ACTIVE_TEMPS) + tuple(_SIGTERM_FILES):
        if os.path.isdir(tmp) and not os.path.islink(tmp):   # a temporary directory (a DCP write's)
            shutil.rmtree(tmp, ignore_errors=True)
            continue
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    for d, prefix in tuple(_TEMP_DIRS):
        with contextlib.suppress(OSError):
            for name in os.listdir(d):
                if name.startswith(prefix) and name.endswith(".tmp"):
                    with contextlib.suppress(OSError):
                        os.unlink(os.path.join(d, name))
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    raise SystemExit(128 + signum)  # not reached: the signal's default action ends the process


@contextlib.contextmanager
def removing_temps_on_sigterm():
    """For the duration of a write, make SIGTERM remove every temporary file of :func:`atomic_output`
    in this process (those of writer threads too) before the process dies of the signal. Installed
    where SIGTERM would otherwise end the process without cleanup: only over the default action
    (an application's own handler or SIG_IGN decides for itself), and only in the main thread
    (``signal.signal`` works nowhere else; writes from other threads rely on the sweep)."""
    global _sigterm_depth, _sigterm_previous
    installed = False
    if threading.current_thread() is threading.main_thread():
        if _sigterm_depth > 0:
            installed = True
            _sigterm_depth += 1
        elif signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            try:
                _sigterm_previous = signal.signal(signal.SIGTERM, _on_sigterm)
            except ValueError:  # not the main interpreter
                pass
            else:
                installed = True
                _sigterm_depth = 1
    try:
        yield
    finally:
        if installed:
            _sigterm_depth -= 1
            if _sigterm_depth == 0 and signal.getsignal(signal.SIGTERM) is _on_sigterm:
                signal.signal(signal.SIGTERM, _sigterm_previous)


@contextlib.contextmanager
def removed_on_sigterm(path):
    """While inside, SIGTERM under :func:`removing_temps_on_sigterm` removes ``path`` too (a file, or
    a directory with everything in it), with the temporary files."""
    with _TEMPS_LOCK:
        _SIGTERM_FILES.add(path)
    try:
        yield
    finally:
        with _TEMPS_LOCK:
            _SIGTERM_FILES.discard(path)


def _current_umask() -> int:
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # no /proc: read it by setting it (briefly), then put it back
    os.umask(mask)
    return mask


def _final_mode(dest: str, follow_symlinks: bool) -> int:
    try:
        st = os.stat(dest) if follow_symlinks else os.lstat(dest)
    except FileNotFoundError:
        st = None
    if st is None or stat.S_ISLNK(st.st_mode):
        return 0o666 & ~_current_umask()
    return stat.S_IMODE(st.st_mode)


@contextlib.contextmanager
def atomic_output(path, follow_symlinks: bool = True):
    """Yield a temporary path next to ``path``'s file; on success fsync it and rename it over the file,
    on error (or SIGTERM) remove it. The old file is untouched until the rename.

    ``path`` is checked first (:func:`check_output_path`). A symlink is written through: the file it
    points to is replaced, in that file's directory, and the link stays; with
    ``follow_symlinks=False`` the link itself is replaced by the new file (its target untouched).
    The temporary file is created with ``O_EXCL`` and reopened only with ``O_NOFOLLOW``
    (:func:`open_nofollow`). The result has the mode of the file it replaces, or
    ``0o666 & ~umask`` when new (or replacing a link). The temporary file is
    ``.{name}.{host tag}.{pid}.{random}.tmp``; each write first removes this destination's temporary
    files whose writer on this host is gone (SIGKILL) or that nobody has modified for an hour,
    never those of a live writer.

    Examples:
        >>> with atomic_output("curves.csv") as tmp:
        ...     with open(tmp, "w") as fh:
        ...         fh.write("step,loss\\n")
    """
    _, dest = _resolve_output(path, follow_symlinks)
    d, base = os.path.split(dest)
    _sweep_stale_temps(d, base)
    with removing_temps_on_sigterm():
        tmp = _new_temp(d, base)
        try:
            yield tmp
            os.chmod(tmp, _final_mode(dest, follow_symlinks))
            with open(tmp, "rb+", opener=open_nofollow) as fh:
                os.fsync(fh.fileno())
            os.replace(tmp, dest)
        except BaseException as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            if isinstance(exc, OSError) and exc.filename == tmp:
                # the temporary file is an internal detail: the error names the output it was for
                named = OSError(exc.errno, exc.strerror, dest)
                for note in getattr(exc, "__notes__", ()):
                    named.add_note(note)
                raise named from exc
            raise
        finally:
            with _TEMPS_LOCK:
                _ACTIVE_TEMPS.discard(tmp)
    fsync_dir(d)  # make the rename durable


def fsync_dir(path) -> None:
    """Make the renames into directory ``path`` durable (an fsync of the directory); a filesystem
    that cannot sync a directory is left as it is."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
