"""Subcommands of the ``condinit`` CLI (see ``condinit.cli``)."""
