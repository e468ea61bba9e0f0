"""``condinit info``: versions, the native build, and for each op which backends are compiled in
and which are usable on this machine, and why not. The table is :data:`WIDTH` columns wide whatever
the terminal, piped or not."""
from __future__ import annotations

import importlib
import json
import platform

NAME = "info"
HELP = ("show versions and, per op, which backends (cuda, triton, cpp-cpu, torch) are compiled in and "
        "which are usable on this machine, and why not")

# Modules whose import defines the ops' backend tables (condinit._backends.Op).
OP_MODULES = ("condinit.init", "condinit.ops.attention")
WIDTH = 120
NO_GPU = "no CUDA device visible"
# The device type whose availability check tells whether a backend's code is installed and built,
# independently of the devices present (torch: always).
BUILD_DEVICE = {"cuda": "cuda", "triton": "cuda", "cpp-cpu": "cpu"}


def add_arguments(p):
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")


def _compiled_in(op: str, backend: str) -> tuple[bool, str]:
    """(compiled in, why not): the backend's code for ``op`` is installed and built (the extension
    with this op's kernel, triton importable), whatever devices this machine has."""
    from condinit import _backends
    if backend == "torch":
        return True, "compiled in"
    impl = _backends.get(op).impls[backend]
    return _backends.available(backend, BUILD_DEVICE[backend], impl.native_op, impl.native_fn)


def _with_usability(row: dict, cuda_ok: bool) -> dict:
    """``row`` of ``condinit._backends.report`` with ``compiled_in`` and ``usable`` (on this
    machine), each with its reason when not."""
    compiled, why_not_compiled = _compiled_in(row["op"], row["backend"])
    if not compiled:
        usable, why = False, why_not_compiled
    elif row["device"] == "cuda" and not cuda_ok:
        usable, why = False, NO_GPU
    else:
        usable, why = row["available"], "" if row["available"] else row["reason"]
    return {**row, "compiled_in": compiled, "compiled_in_reason": "" if compiled else why_not_compiled,
            "usable": usable, "usable_reason": why}


def collect() -> dict:
    import torch

    from condinit import __version__, _backends, _ext

    errors = {}
    for mod in OP_MODULES:
        try:
            importlib.import_module(mod)
        except Exception as exc:  # an op module that fails to import is itself news for `info`
            errors[mod] = f"{type(exc).__name__}: {exc}"
    ext_ok, ext_why = _ext.status()
    try:
        import triton
        triton_version = triton.__version__
    except Exception as exc:
        triton_version = f"unavailable ({type(exc).__name__}: {exc})"
    cuda_ok = torch.cuda.is_available()  # `info` is the one place allowed to ask
    return {
        "condinit": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "triton": triton_version,
        "cuda_available": cuda_ok,
        "gpu": torch.cuda.get_device_name(0) if cuda_ok else None,
        "native_extension": {"loaded": ext_ok, "status": ext_why, **_ext.build_info()},
        "backends": [_with_usability(r, cuda_ok) for r in _backends.report()],
        "import_errors": errors,
    }


def _backends_env() -> str:
    from condinit import _backends
    return _backends.ENV_VAR


def run(args) -> int:
    data = collect()
    if args.json:
        print(json.dumps(data, indent=2, default=str))
        return 0
    from rich import box
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    con = Console(width=WIDTH, highlight=False)
    say = lambda text, style=None: con.print(Text(text, style=style))  # noqa: E731  (no markup in the text)
    say(f"condinit {data['condinit']}  python {data['python']}  torch {data['torch']} "
        f"(CUDA {data['torch_cuda'] or 'none'})  triton {data['triton']}")
    say(f"GPU: {data['gpu']}" if data["gpu"] else f"GPU: none visible ({NO_GPU}: the rows on cuda are not usable here)")
    ext = data["native_extension"]
    say(f"native extension condinit._C: {ext['status']}"
        + (f" (built for torch {ext.get('torch_version')}, with{'' if ext.get('with_cuda') else 'out'} CUDA kernels)"
           if ext["loaded"] else ""))
    for mod, err in data["import_errors"].items():
        say(f"{mod} failed to import: {err}", "red")
    say(f"Backends per op, in the order the automatic choice tries them: the first usable, deterministic row that "
        f"supports the call runs (force one with backend= or {_backends_env()}). Compiled in: its code is installed "
        "and built; usable: it runs on this machine.")
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    table.add_column("op", no_wrap=True)
    table.add_column("device", no_wrap=True)
    table.add_column("backend", no_wrap=True)
    table.add_column("compiled in", no_wrap=True)
    table.add_column("usable", no_wrap=True)
    table.add_column("why not usable / what it supports")
    yes_no = lambda ok: Text("yes", "green") if ok else Text("no", "red")  # noqa: E731
    for row in data["backends"]:
        table.add_row(row["op"], row["device"], row["backend"], yes_no(row["compiled_in"]), yes_no(row["usable"]),
                      Text(row["usable_reason"] if not row["usable"] else f"supports {row['supports']}"))
    con.print(table)
    return 0
