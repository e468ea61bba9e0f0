"""``condinit info``: versions, the native build, and which backend each op can use, and why not."""
from __future__ import annotations

import importlib
import json
import platform

NAME = "info"
HELP = "show versions and which backends (cuda, triton, cpp-cpu, torch) each op can use, and why not"

# Modules whose import defines the ops' backend tables (condinit._backends.Op).
OP_MODULES = ("condinit.init", "condinit.ops.attention")


def add_arguments(p):
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")


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
        "backends": _backends.report(),
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
    from rich.console import Console
    from rich.table import Table

    con = Console()
    con.print(f"condinit {data['condinit']}  python {data['python']}  torch {data['torch']} "
              f"(CUDA {data['torch_cuda']})  triton {data['triton']}")
    con.print(f"GPU: {data['gpu'] or 'none visible'}")
    ext = data["native_extension"]
    con.print(f"native extension condinit._C: {ext['status']}"
              + (f" (built for torch {ext.get('torch_version')}, CUDA {'yes' if ext.get('with_cuda') else 'no'})"
                 if ext["loaded"] else ""))
    for mod, err in data["import_errors"].items():
        con.print(f"[red]{mod} failed to import: {err}[/red]")
    table = Table(title="backends per op, in the order the automatic choice tries them: the first "
                        "available, deterministic row that supports the call runs "
                        f"(force one with backend= or {_backends_env()})")
    for col in ("op", "device", "backend", "available", "supports", "why not"):
        table.add_column(col)
    for row in data["backends"]:
        table.add_row(row["op"], row["device"], row["backend"],
                      "[green]yes[/green]" if row["available"] else "[red]no[/red]", row["supports"],
                      "" if row["available"] else row["reason"])
    con.print(table)
    return 0
