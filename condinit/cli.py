"""The ``condinit`` command line: one module per subcommand in ``condinit.commands``.

Each command module defines ``NAME``, ``HELP``, ``add_arguments(parser)`` and ``run(args) -> int``,
and checks its output paths before any work. Bad input, a malformed input file and every ``OSError``
(a full disk, a file-size limit, a permission, a name too long, ...) exit with status 2 and one
line on stderr naming the file and what went wrong (:func:`error_line`); ``--debug`` shows the
traceback instead.

The console script (``condinit``, ``python -m condinit``) is :func:`run`: :func:`main`, then
:func:`finish`, which ends the process without the interpreter's teardown of the libraries' objects
once every exit handler has run and the standard streams are flushed. That teardown does nothing a
finished command needs, and with torch and transformers imported it takes 1.4 s and pages in
another ~130 MB here (measured with ``import torch, transformers.models.llama.modeling_llama``
alone: 5.7 s and 0.91 GB peak RSS to a normal exit, 4.2 s and 0.78 GB without the teardown).
"""
from __future__ import annotations

import argparse
import atexit
import errno
import importlib
import os
import shutil
import sys
import threading

# Subcommand modules, in the order `condinit --help` lists them.
COMMANDS = ("init", "inspect", "probe", "plot", "demo", "info", "bench")


class CLIError(Exception):
    """Bad input from the command line: printed as one line, exit status 2."""


def _os_error_line(exc: OSError) -> str:
    """``FILE: what went wrong (ERRNO)`` of an ``OSError``, with what is known of the bytes that did not
    fit for a full disk (the space left) or a file-size limit (the limit); the exception's notes
    follow. An ``OSError`` raised with a message only is that message."""
    if exc.errno is None or exc.strerror is None:
        return str(exc)
    where = [os.fsdecode(f) if isinstance(f, (str, bytes, os.PathLike)) else str(f)
             for f in (exc.filename, exc.filename2) if f is not None]
    code = errno.errorcode.get(exc.errno, str(exc.errno))
    detail = ""
    if exc.errno == errno.ENOSPC and where:
        try:
            free = shutil.disk_usage(os.path.dirname(os.path.abspath(where[0]))).free
            detail = f"; {free} bytes left on its filesystem"
        except OSError:
            pass
    elif exc.errno == errno.EFBIG:
        import resource   # POSIX only, like the limit itself

        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if limit != resource.RLIM_INFINITY:
            detail = f"; the file-size limit, ulimit -f, is {limit} bytes"
    line = f"{' -> '.join(where)}: " if where else ""
    return line + f"{exc.strerror} ({code}{detail})"


def error_line(exc: BaseException) -> str:
    """The one line :func:`main` prints for ``exc`` (after ``condinit COMMAND: error:``)."""
    text = _os_error_line(exc) if isinstance(exc, OSError) else str(exc)
    notes = [str(n) for n in getattr(exc, "__notes__", ())]
    return " ".join(part.strip() for part in "; ".join([text] + notes).splitlines() if part.strip())


def _load_commands():
    mods = []
    for name in COMMANDS:
        try:
            mods.append(importlib.import_module(f"condinit.commands.{name}"))
        except ModuleNotFoundError as exc:
            if exc.name != f"condinit.commands.{name}":
                raise
    return mods


class _Parser(argparse.ArgumentParser):
    """argparse with its errors as every other refusal: one line, exit status 2 (no usage block)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="condinit",
        description="Conditioned initialization for attention, and attention Jacobian probes.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for mod in _load_commands():
        p = sub.add_parser(mod.NAME, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args._argv = list(sys.argv[1:] if argv is None else argv)   # what a launcher (init --nproc) runs again
    if getattr(args, "_run", None) is None:
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except (CLIError, ValueError, TypeError, OSError) as exc:
        if args.debug:
            raise
        print(f"condinit {args.command}: error: {error_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def finish(code: int):
    """End the process with exit status ``code`` as a normal exit would, less the interpreter's
    teardown: other non-daemon threads are joined, the exit handlers run (``atexit``: logging,
    ``weakref.finalize`` / temporary directories, multiprocessing), stdout and stderr are flushed
    (a failed flush gives status 120, as Python's own exit does), then ``os._exit``."""
    me = threading.current_thread()
    for t in threading.enumerate():
        if t is not me and not t.daemon:
            t.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            code = code or 120
    os._exit(code)


def run(argv=None):
    """The console entry point: :func:`main`, then :func:`finish` with its status. An exception
    (``--debug``) propagates, and the interpreter exits as usual."""
    finish(main(argv))


if __name__ == "__main__":
    run()
