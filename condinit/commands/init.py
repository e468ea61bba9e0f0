"""``condinit init``: build a model on the meta device, condition its attention, write safetensors.

    condinit init --preset tiny-llama --out tiny.safetensors
    condinit init --config config.json --dtype bf16 --seed 7 --out model.safetensors
    condinit init --config config.json --strict --out model.safetensors
    condinit init --config config.json --adapter mypkg.adapters:my_attention --out model.safetensors

The model (a preset of :mod:`condinit.models.presets`, or a Hugging Face ``config.json`` of any
``model_type`` that ``transformers.AutoConfig`` knows; decoder language models are built as
``AutoModelForCausalLM``, everything else as ``AutoModel``, see
:func:`condinit.models.presets.model_class_for`) is built on the meta device, materialized on ``--device`` with its own init for everything but Q/K/V, and
conditioned by :func:`condinit.apply` (no second full-size copy). The output is written atomically
(nothing is left behind on error) with a ``condinit`` header entry (family, head counts, where each
layer's Q/K/V live, their row layout, the modules left unconditioned) that ``condinit inspect``
reads. ``--seed`` (default 0, not drawn: the same command writes the same file) seeds both
condinit's counter-based generator and torch's (the model's own init of the other weights), so the
whole file is reproducible.

Attention-like modules that nothing covers are printed after the table (and warned about);
``--strict`` refuses such a model before anything is written. A model with no attention layer
condinit can read fails with the list of attention-like modules found. ``--adapter
module:function`` (repeatable) imports ``function(module) -> AttentionSpec | None`` and tries it on
every module before the built-in adapters (None: not this module), so a custom attention class
needs no code change here.
"""
from __future__ import annotations

import os
import sys
import time

NAME = "init"
HELP = "build a model (preset or HF config.json) on meta, apply conditioned init, write .safetensors"


def add_arguments(p):
    from condinit.init.orthogonalize import METHODS
    from condinit.models.presets import PRESETS

    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", metavar="NAME", default=None,
                     help="built-in model: " + ", ".join(f"{k} ({v.description})" for k, v in PRESETS.items())
                     + " (default tiny-llama)")
    src.add_argument("--config", metavar="CONFIG.json", help="a Hugging Face config.json (needs model_type)")
    # an explicit default, unlike condinit.apply's seed=None (drawn): the output is reproducible
    p.add_argument("--seed", type=int, default=0, help="seed, 0 <= seed < 2**64 (default 0)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32", help="storage dtype (default fp32)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where to materialize (default cpu)")
    p.add_argument("--method", choices=METHODS, default="auto", help="orthogonalization method (default auto)")
    p.add_argument("--v-mode", choices=("identity", "identity_per_head"), default="identity",
                   help="W_V: identity over the whole matrix (default) or per head")
    p.add_argument("--qk-gain", type=float, default=1.0, metavar="G",
                   help="every Q/K head block's singular values (default 1, the paper's method)")
    p.add_argument("--v-gain", type=float, default=1.0, metavar="G",
                   help="W_V = G times the rectangular identity (default 1, the paper's method)")
    p.add_argument("--out", required=True, metavar="FILE.safetensors", help="output file (written atomically); a "
                   "directory (ending in / or existing) gets a from_pretrained-ready sharded checkpoint, streamed")
    p.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                   help="with a directory --out: bytes per weights file, e.g. 500MB (default 5GB)")
    p.add_argument("--strict", action="store_true",
                   help="fail (and write nothing) if any attention-like module cannot be conditioned")
    p.add_argument("--adapter", action="append", default=[], metavar="MODULE:FUNCTION",
                   help="import FUNCTION(module) -> AttentionSpec or None from MODULE and try it on every module "
                        "before the built-in adapters (repeatable)")
    p.add_argument("--max-rows", type=int, default=None, metavar="N", help="print at most N layers of the table")
    p.add_argument("--quiet", action="store_true", help="print only the output path")


def run(args) -> int:
    import torch

    from condinit._validate import check_int, check_seed
    from condinit.cli import CLIError
    from condinit.models import apply
    from condinit.models.checkpoint import check_output_path, condinit_metadata, save_model_atomic
    from condinit.models.presets import DTYPES, PRESETS, build_model, load_config_dict

    # every check on the input happens before any work
    to_directory = args.out.endswith(("/", os.sep)) or os.path.isdir(args.out)
    out = None if to_directory else check_output_path(args.out)
    if args.preset is not None and args.preset not in PRESETS:
        raise CLIError(f"unknown preset {args.preset!r}; choose one of {', '.join(PRESETS)}")
    check_seed("--seed", args.seed)
    check_int("--max-rows", args.max_rows, min=0, allow_none=True)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise CLIError("--device cuda: no CUDA device is available")
    config = load_config_dict(args.config) if args.config else None
    preset = None if config is not None else (args.preset or "tiny-llama")
    adapters = [_load_adapter(ref) for ref in args.adapter]
    if to_directory:
        return _write_directory(args, preset, config, adapters)

    t0 = time.perf_counter()
    # --seed also seeds torch's generator, which the model's own init of the other weights draws
    # from: the whole file is reproducible, not only the attention weights.
    torch.manual_seed(args.seed % 2 ** 63)
    model, family = build_model(preset, config, dtype=DTYPES[args.dtype], device="meta")
    with _adapters_registered(adapters):
        report = apply(model, seed=args.seed, method=args.method, v_mode=args.v_mode, qk_gain=args.qk_gain,
                       v_gain=args.v_gain, device=args.device,
                       progress=not args.quiet and sys.stderr.isatty(), strict=args.strict)
        meta = condinit_metadata(model, report, family, extra={"preset": preset, "dtype": args.dtype})
    save_model_atomic(model, out, meta)
    dt = time.perf_counter() - t0
    if args.quiet:
        print(out)
        return 0
    from condinit.models.apply import wide_console

    con = wide_console()
    report.print(con, max_rows=args.max_rows)
    n = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    con.print(f"wrote {out}: {preset or os.path.basename(args.config)} ({family}), {n / 1e6:.1f}M parameters, "
              f"{args.dtype}, {os.path.getsize(out) / 2 ** 20:.1f} MiB, seed {report.seed}, {dt:.2f} s "
              f"(own init {report.init_time_s:.2f} s, conditioned init {report.total_time_s - report.init_time_s:.2f} s)"
              + (f"; {len(report.uncovered)} attention-like module(s) not conditioned (listed above)"
                 if report.uncovered else ""))
    return 0


def _load_adapter(ref: str):
    """``(ref, callable)`` for ``--adapter module.path:function`` (checked before any work)."""
    import importlib

    from condinit.cli import CLIError

    mod_name, sep, attr = ref.partition(":")
    if not sep or not mod_name or not attr:
        raise CLIError(f"--adapter {ref!r}: expected MODULE:FUNCTION, e.g. mypkg.adapters:my_attention")
    try:
        obj = importlib.import_module(mod_name)
    except ImportError as exc:
        raise CLIError(f"--adapter {ref!r}: cannot import {mod_name}: {exc}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise CLIError(f"--adapter {ref!r}: {mod_name} has no attribute {attr}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise CLIError(f"--adapter {ref!r}: {attr} is a {type(obj).__name__}, expected a function "
                       f"module -> AttentionSpec or None")
    return ref, obj


class _adapters_registered:
    """Registers the ``--adapter`` functions as one adapter for every module (``nn.Module``), tried
    in the order given, for the duration of the command; the previous registration comes back."""

    def __init__(self, adapters):
        self.adapters = adapters

    def __enter__(self):
        from torch import nn

        from condinit.models.adapters import register_adapter, registered_adapters

        self.previous = registered_adapters().get(nn.Module)
        if self.adapters:
            fns = list(self.adapters)

            def first_match(module):
                for _, fn in fns:
                    spec = fn(module)
                    if spec is not None:
                        return spec
                return None

            register_adapter(nn.Module, first_match, name="--adapter " + ",".join(ref for ref, _ in fns))
        return self

    def __exit__(self, *exc_info):
        from torch import nn

        from condinit.models.adapters import register_adapter, unregister_adapter

        if self.adapters:
            unregister_adapter(nn.Module)
            if self.previous is not None:
                register_adapter(nn.Module, self.previous)
        return False


def _write_directory(args, preset, config, adapters) -> int:
    """``--out DIR/``: the streamed, sharded writer (:func:`condinit.models.stream.write_pretrained`)."""
    from condinit.cli import CLIError
    from condinit.models.presets import DTYPES, build_model
    from condinit.models.stream import parse_shard_size, write_pretrained

    if args.device != "cpu":
        raise CLIError("--device: a directory --out is written from the CPU, one shard at a time")
    if args.qk_gain != 1.0 or args.v_gain != 1.0:   # the streamed writer writes gain 1 only: refuse, never drop
        raise CLIError("--qk-gain/--v-gain: a directory --out is written with the default gains only; "
                       "write a single .safetensors file instead")
    try:
        shard = parse_shard_size(args.max_shard_size)
    except ValueError as exc:
        raise CLIError(f"--max-shard-size: {exc}") from None
    model, family = build_model(preset, config, dtype=DTYPES[args.dtype], device="meta")
    with _adapters_registered(adapters):
        rep = write_pretrained(model, args.out, seed=args.seed, method=args.method, v_mode=args.v_mode,
                               max_shard_size=shard, strict=args.strict, family=family,
                               extra_metadata={"preset": preset, "dtype": args.dtype},
                               progress=not args.quiet and sys.stderr.isatty())
    if args.quiet:
        print(rep.out_dir)
        return 0
    from condinit.models.apply import wide_console

    con = wide_console()
    rep.apply.print(con, max_rows=args.max_rows)
    con.print(f"wrote {rep.out_dir}: {preset or os.path.basename(args.config)} ({family}), "
              f"{rep.num_parameters / 1e6:.1f}M parameters, {args.dtype}, {len(rep.files)} file(s), "
              f"{rep.total_size / 2 ** 20:.1f} MiB, seed {rep.seed}, {rep.time_s:.2f} s"
              + (f"; {len(rep.uncovered)} attention-like module(s) not conditioned (listed above)"
                 if rep.uncovered else ""))
    return 0
