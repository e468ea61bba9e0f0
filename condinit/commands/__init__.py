"""Subcommands of the ``condinit`` CLI (see ``condinit.cli``)."""


def check_png_output(flag: str, path: str) -> str:
    """The absolute path of a figure output (``--plot``): a ``.png`` name, checked as every output path
    is (:func:`condinit.io.atomic.check_output_path`), before any work."""
    from condinit.io.atomic import check_output_path

    if not str(path).lower().endswith(".png"):
        raise ValueError(f"{flag} must name a .png file, got {path}")
    return check_output_path(path)
