"""The ``condinit`` command line: one module per subcommand in ``condinit.commands``.

Each command module defines ``NAME``, ``HELP``, ``add_arguments(parser)`` and ``run(args) -> int``.
Bad input exits non-zero with a one-line message (no traceback); ``--debug`` shows the traceback.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# Subcommand modules, in the order `condinit --help` lists them.
COMMANDS = ("init", "inspect", "probe", "plot", "demo", "info", "bench")


class CLIError(Exception):
    """Bad input from the command line: printed as one line, exit status 2."""


def _load_commands():
    mods = []
    for name in COMMANDS:
        try:
            mods.append(importlib.import_module(f"condinit.commands.{name}"))
        except ModuleNotFoundError as exc:
            if exc.name != f"condinit.commands.{name}":
                raise
    return mods


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
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
    if getattr(args, "_run", None) is None:
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except (CLIError, ValueError, TypeError, FileNotFoundError, PermissionError, IsADirectoryError,
            NotADirectoryError) as exc:
        if args.debug:
            raise
        print(f"condinit {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
