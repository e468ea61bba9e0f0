"""``condinit init``: build a model on the meta device, condition its attention, write safetensors.

    condinit init --preset tiny-llama --out tiny.safetensors
    condinit init --config config.json --dtype bf16 --seed 7 --out model.safetensors
    condinit init --config config.json --strict --out model.safetensors
    condinit init --config config.json --adapter mypkg.adapters:my_attention --out model.safetensors
    condinit init --config llama-8b.json --dtype bf16 --out llama-8b/ --max-shard-size 5GB
    condinit init --config llama-8b.json --dtype bf16 --out llama-8b/ --resume      # after an interruption
    condinit init --config llama-8b.json --dtype bf16 --out llama-8b/ --dry-run     # the plan, nothing written
    condinit init --config llama-8b.json --dtype bf16 --out llama-8b/ --nproc 2     # two processes on this machine
    torchrun --nproc-per-node 8 -m condinit init --config llama-70b.json --dtype bf16 --out llama-70b/
    condinit init --config llama-405b.json --dtype bf16 --out llama-405b/ --dry-run --nproc 512 --rank-rate 800MB
    condinit init --format dcp --torchtitan llama3:8B --dtype bf16 --out seed_ckpt/ --nproc 8   # torchtitan seed checkpoint

The model (a preset of :mod:`condinit.models.presets`, or a Hugging Face ``config.json`` of any
``model_type`` that ``transformers.AutoConfig`` knows; decoder language models are built as
``AutoModelForCausalLM``, everything else as ``AutoModel``, see
:func:`condinit.models.presets.model_class_for`) is built on the meta device and written streamed
(:mod:`condinit.models.stream`): tensor by tensor, computed on ``--device`` (Q/K/V conditioned as by
:func:`condinit.apply`, everything else by the model's own init rule) and written by a second
thread, in memory bounded by about one layer, whatever the model's size. ``--out FILE.safetensors``
writes one file; ``--out DIR/`` (ending in a separator, or an existing directory) a
``from_pretrained``-ready directory: ``config.json``, shards of ``--max-shard-size`` and their index.
Both hold the same tensors bit for bit. Files are written atomically (nothing partial is left
behind on error, Ctrl-C or SIGTERM) with a ``condinit`` header entry (family, head counts, where
each layer's Q/K/V live, their row layout, the modules left unconditioned) that ``condinit
inspect`` reads. ``--seed`` (default 0, not drawn: the same command writes the same bytes) seeds
every random draw, so the whole checkpoint is reproducible.

A directory that holds another model is refused unless ``--overwrite``; ``--resume`` keeps the
shards of an interrupted run that are complete and writes the rest; the free disk space is checked
first. ``--dry-run`` prints the plan (files, sizes, peak memory, the generation time estimated from
a short measurement on this machine) and writes nothing; it plans even where the write would be
refused for lack of disk space or because the directory's parent does not exist yet, and prints the
refusal the write would give (the same message, the same numbers).

**Ranks.** Started by ``torchrun`` among several processes (``WORLD_SIZE`` > 1), every rank writes
its own shards of the directory and rank 0 the configs and, once every rank's shards are durable,
the index (:mod:`condinit.models.stream.ranks`: gloo on the CPU, NCCL with ``--device cuda``, each
rank on its ``LOCAL_RANK``'s GPU); the directory has the bytes one process writes, and ``--resume``
finishes an interrupted run with any number of ranks. ``--nproc N`` launches the N processes itself
(torch.distributed's launcher, as ``torchrun --standalone``); with ``--dry-run`` it plans for N ranks
instead: the shards and bytes each rank writes and each rank's expected time (from the rates
measured now, or from ``--rank-rate``, the bytes per second one rank writes). A progress bar (bytes written, rate, ETA)
is shown on a terminal, never with ``--quiet`` or when stderr is not a terminal.

Attention-like modules that nothing covers are printed after the table (and warned about);
``--strict`` refuses such a model before anything is written. A model with no attention layer
condinit can read fails with the list of attention-like modules found. ``--adapter
module:function`` (repeatable) imports ``function(module) -> AttentionSpec | None`` and tries it on
every module before the built-in adapters (None: not this module), so a custom attention class
needs no code change here.

**torchtitan seed checkpoints.** ``--format dcp --torchtitan MODEL:FLAVOR`` (torchtitan's own
registry entry, ``torchtitan.models.MODEL``'s ``model_registry(FLAVOR)``: ``llama3:8B``) writes a
model-only torch.distributed.checkpoint directory instead, every rank its own rows of every tensor
(:func:`condinit.models.engines.dcp.write_torchtitan_seed`: FSDP2 over all ranks, torchtitan's
``init_states()`` drawn rank-invariantly, :func:`condinit.apply`, ``dcp.save``; the same bytes for
any number of ranks), on the CPU. ``--out`` must be empty or absent. ``--dry-run`` prints the
bytes each rank would hold and write. The flags of the safetensors writer (``--config``,
``--preset``, ``--max-shard-size``, ``--resume``, ``--overwrite``, ``--rank-rate``, ``--adapter``,
``--mla factors``, ``--device cuda``) are refused with it.
"""
from __future__ import annotations

import os
import sys
import textwrap

NAME = "init"
HELP = "build a model (preset or HF config.json) on meta, apply conditioned init, write .safetensors"


def add_arguments(p):
    from condinit.ops.orthogonalize.op import METHODS
    from condinit.models.presets import PRESETS

    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", metavar="NAME", default=None,
                     help="built-in model: " + ", ".join(f"{k} ({v.description})" for k, v in PRESETS.items())
                     + " (default tiny-llama)")
    src.add_argument("--config", metavar="CONFIG.json", help="a Hugging Face config.json (needs model_type)")
    src.add_argument("--torchtitan", metavar="MODEL:FLAVOR", default=None,
                     help="with --format dcp: a torchtitan model by its registry entry, e.g. llama3:8B")
    p.add_argument("--format", choices=("safetensors", "dcp"), default="safetensors",
                   help="safetensors (default) or dcp: a torchtitan seed checkpoint (torch.distributed.checkpoint "
                        "directory) written by every rank in parallel; needs --torchtitan")
    # an explicit default, unlike condinit.apply's seed=None (drawn): the output is reproducible
    p.add_argument("--seed", type=int, default=0, help="seed, 0 <= seed < 2**64 (default 0)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32", help="storage dtype (default fp32)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where tensors are computed (default cpu); files are written from the CPU")
    p.add_argument("--method", choices=METHODS, default="auto", help="orthogonalization method (default auto)")
    p.add_argument("--v-mode", choices=("identity", "identity_per_head"), default="identity",
                   help="W_V: identity over the whole matrix (default) or per head")
    p.add_argument("--qk-gain", type=float, default=1.0, metavar="G",
                   help="every Q/K head block's singular values (default 1, the paper's method)")
    p.add_argument("--v-gain", type=float, default=1.0, metavar="G",
                   help="W_V = G times the rectangular identity (default 1, the paper's method)")
    p.add_argument("--out", required=True, metavar="FILE.safetensors", help="output file (written atomically); a "
                   "directory (ending in / or existing) gets a from_pretrained-ready sharded checkpoint, streamed")
    p.add_argument("--max-shard-size", default=None, metavar="SIZE",
                   help="with a directory --out: bytes per weights file, e.g. 500MB (default 5GB)")
    p.add_argument("--resume", action="store_true",
                   help="with a directory --out: keep the complete shards of an interrupted run, write the rest")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a model (a directory's, or the --out file) that is already there (refused otherwise)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan (files, sizes, peak memory, expected time) and write nothing")
    p.add_argument("--nproc", type=int, default=None, metavar="N",
                   help="with a directory --out: write it from N processes on this machine (launched as torchrun "
                        "does); with --dry-run: plan for N ranks (bytes, shards and expected time per rank)")
    p.add_argument("--rank-rate", default=None, metavar="RATE",
                   help="with --dry-run: the bytes per second one rank writes (e.g. 800MB, measured by a real "
                        "write), for the expected time per rank instead of the generation rates measured now")
    p.add_argument("--mla", choices=("refuse", "factors"), default="refuse",
                   help="multi-head latent attention (DeepSeek-V2/V3): refuse it (default) or condition its "
                        "low-rank factors, each head's map semi-orthogonal up to the latent norm's per-token scale")
    p.add_argument("--strict", action="store_true",
                   help="fail (and write nothing) if any attention-like module cannot be conditioned")
    p.add_argument("--adapter", action="append", default=[], metavar="MODULE:FUNCTION",
                   help="import FUNCTION(module) -> AttentionSpec or None from MODULE and try it on every module "
                        "before the built-in adapters (repeatable)")
    p.add_argument("--max-rows", type=int, default=None, metavar="N", help="print at most N layers of the table")
    p.add_argument("--quiet", action="store_true", help="print only the output path")


def run(args) -> int:
    import torch

    from condinit._validate import check_int, check_real, check_seed
    from condinit.cli import CLIError
    from condinit.io.atomic import check_output_dir
    from condinit.io.atomic import check_output_path
    from condinit.models.presets import PRESETS, load_config_dict
    from condinit.models.stream import parse_shard_size
    from condinit.models.stream.ranks import launched_world_size

    if args.format == "dcp":
        return _run_dcp(args)
    if args.torchtitan is not None:
        raise CLIError("--torchtitan: only with --format dcp (a torchtitan seed checkpoint)")
    # every check on the input happens before any work
    to_directory = args.out.endswith(("/", os.sep)) or os.path.isdir(args.out)
    # a missing parent directory: refused by the write (the dry run plans past it), with the same message
    out = check_output_dir(args.out, missing_parent_ok=True) if to_directory else check_output_path(args.out)
    if args.preset is not None and args.preset not in PRESETS:
        raise CLIError(f"unknown preset {args.preset!r}; choose one of {', '.join(PRESETS)}")
    check_seed("--seed", args.seed)
    for flag, gain in (("--qk-gain", args.qk_gain), ("--v-gain", args.v_gain)):
        check_real(flag, gain, min=0.0, min_open=True)
    check_int("--max-rows", args.max_rows, min=0, allow_none=True)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise CLIError("--device cuda: no CUDA device is available")
    if not to_directory:
        for flag, given in (("--max-shard-size", args.max_shard_size is not None), ("--resume", args.resume)):
            if given:
                raise CLIError(f"{flag}: only with a directory --out (ending in {os.sep}); {args.out} is a file")
    shard = parse_shard_size(args.max_shard_size if args.max_shard_size is not None else "5GB", "--max-shard-size")
    launched = launched_world_size()
    check_int("--nproc", args.nproc, min=1, allow_none=True)
    if args.rank_rate is not None and not args.dry_run:
        raise CLIError("--rank-rate: only with --dry-run (it predicts the time of a write)")
    rank_rate = parse_shard_size(args.rank_rate, "--rank-rate") if args.rank_rate is not None else None
    if (args.nproc is not None or launched is not None and launched > 1) and not to_directory:
        raise CLIError(f"--out {args.out}: one .safetensors file is written by one process; several ranks write a "
                       f"directory (--out DIR{os.sep})")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", launched or 1))
    if launched is not None and args.nproc is not None and args.nproc != local and not args.dry_run:
        raise CLIError(f"--nproc {args.nproc}: this process was launched among {local} process(es) on this machine "
                       f"(LOCAL_WORLD_SIZE): leave --nproc out under torchrun")
    try:
        config = load_config_dict(args.config) if args.config else None
    except RecursionError:
        raise CLIError(f"config {args.config} is not readable JSON: nested too deeply") from None
    preset = None if config is not None else (args.preset or "tiny-llama")
    adapters = [_load_adapter(ref) for ref in args.adapter]
    if not to_directory and os.path.lexists(out) and not args.overwrite and not args.dry_run:
        raise CLIError(f"--out {out} exists: pass --overwrite to replace it (as for a directory that holds a model)")
    target = args.out if to_directory else out
    if args.nproc is not None and args.nproc > 1 and launched is None and not args.dry_run:
        return _launch(args)
    if args.dry_run and launched is not None and int(os.environ["RANK"]) != 0:
        return 0   # the plan is rank 0's; nothing is written
    try:
        if launched is None or launched == 1 or args.dry_run:
            world = (args.nproc or launched) if args.dry_run else None
            return _write(args, preset, config, adapters, target, to_directory, shard, args.device, world, rank_rate)
        from condinit.models.stream.ranks import RankFailed, launched_group

        with launched_group(args.device) as device:
            try:
                return _write(args, preset, config, adapters, target, to_directory, shard, device, None, None)
            except RankFailed as exc:
                raise CLIError(str(exc)) from exc
    except OSError as exc:
        if exc.filename is not None or exc.errno is None:
            raise
        named = OSError(exc.errno, exc.strerror, out)   # the output the failed write was for
        for note in getattr(exc, "__notes__", ()):
            named.add_note(note)
        raise named from exc


def _launch(args, left="no index written (complete shards stay: --resume writes the rest)") -> int:
    """``--nproc N`` (a real write): this same command run as N processes on this machine by
    torch.distributed's launcher (what ``torchrun --standalone --nproc-per-node N -m condinit``
    does), each with ``OMP_NUM_THREADS`` = this machine's cores / N unless set; the exit status is
    that of the ranks (the first failure named)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from condinit.cli import CLIError

    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc)))
    try:
        run(parse_args(["--standalone", "--nproc-per-node", str(args.nproc), "--module", "--", "condinit"]
                       + list(args._argv)))
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        raise CLIError(f"--nproc {args.nproc}: rank {rank} exited with status {failure.exitcode} (its error is "
                       f"printed above); {left}") from None
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

        from condinit.models.registry import register_adapter, registered_adapters

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

        from condinit.models.registry import register_adapter, unregister_adapter

        if self.adapters:
            unregister_adapter(nn.Module)
            if self.previous is not None:
                register_adapter(nn.Module, self.previous)
        return False


def _write(args, preset, config, adapters, out, to_directory: bool, shard: int, device: str,
           world, rank_rate) -> int:
    """The streamed writer: :func:`condinit.models.stream.write_pretrained` for ``--out DIR/`` (this
    process's share of it under torchrun; ``world``: the ranks a dry run plans for),
    :func:`condinit.models.stream.write_checkpoint` for one file."""
    import torch.distributed as dist

    from condinit.models.presets import DTYPES, build_model
    from condinit.models.stream import write_checkpoint, write_pretrained

    source = f"--config {args.config}" if args.config else f"--preset {preset}"
    model, family = build_model(preset, config, dtype=DTYPES[args.dtype], device="meta", source=source)
    common = dict(seed=args.seed, method=args.method, v_mode=args.v_mode, qk_gain=args.qk_gain, v_gain=args.v_gain,
                  strict=args.strict, family=family, extra_metadata={"preset": preset, "dtype": args.dtype},
                  progress=not args.quiet and sys.stderr.isatty(), device=device, dry_run=args.dry_run)
    from condinit.models.families.mla import latent_attention

    with _adapters_registered(adapters), latent_attention(args.mla):
        if to_directory:
            rep = write_pretrained(model, out, max_shard_size=shard, resume=args.resume, overwrite=args.overwrite,
                                   world_size=world, **common)
        else:
            rep = write_checkpoint(model, out, **common)
    where = rep.out_dir if to_directory else rep.files[0]
    if args.dry_run:
        _print_plan(rep, where, args.quiet, rank_rate)
        return 0
    if dist.is_initialized() and dist.get_rank() != 0:
        return 0   # rank 0 prints the write
    if args.quiet:
        print(where)
        return 0
    from condinit.models.report import wide_console

    con = wide_console()
    rep.apply.print(con, max_rows=args.max_rows)
    kept = f", {len(rep.kept)} complete shard(s) kept" if rep.kept else ""
    con.print(f"wrote {where}: {preset or os.path.basename(args.config)} ({family}), "
              f"{rep.num_parameters / 1e6:.1f}M parameters, {args.dtype}, {len(rep.files)} file(s){kept}, "
              f"{rep.total_size / 2 ** 20:.1f} MiB, seed {rep.seed}, {rep.time_s:.2f} s"
              + (f"; {len(rep.uncovered)} attention-like module(s) not conditioned (listed above)"
                 if rep.uncovered else ""))
    if len(rep.written) > 1:
        con.print(_ranks_line(rep.written))
    return 0


def _ranks_line(written) -> str:
    """What each rank of a multi-rank write wrote, in one line."""
    from condinit._util import format_bytes

    busy = [w for w in written if w.files]
    total = sum(w.bytes for w in written)
    slowest = max((w.seconds for w in busy), default=0.0)
    rates = [w.bytes / max(w.seconds, 1e-9) for w in busy]
    return (f"{len(written)} ranks wrote {format_bytes(total)} in {slowest:.2f} s (the slowest rank's time from its "
            f"first shard to its last): " + ", ".join(
                f"rank {w.rank} {len(w.files)} shard(s) {format_bytes(w.bytes)} in {w.seconds:.2f} s" for w in written)
            + (f"; per rank {min(rates) / 1e6:.0f}-{max(rates) / 1e6:.0f} MB/s, together "
               f"{total / max(slowest, 1e-9) / 1e6:.0f} MB/s" if busy else ""))


def _print_plan(rep, where: str, quiet: bool, rank_rate) -> None:
    """``--dry-run``: what the write would do (and, with ranks, what each rank would do)."""
    from condinit._util import format_bytes

    plan = rep.plan
    lines = [f"dry run, nothing written: {where}"]
    if not quiet:
        keep = {os.path.basename(f) for f in rep.kept}
        for f in plan.files:
            lines.append(f"  {f.name}  {format_bytes(f.size)}  {f.tensors} tensors"
                         + ("  (complete: kept)" if f.name in keep else ""))
    lines.append(f"{len(plan.files)} file(s), {format_bytes(plan.total_size)} of tensors, "
                 f"{rep.num_parameters / 1e6:.1f}M parameters; to write {format_bytes(plan.write_bytes)}, "
                 f"{format_bytes(plan.free_bytes)} free")
    for why in plan.refusals:
        lines.append(f"the write would be refused: {why}")
    largest = plan.largest_unit
    whole = (f"largest unit computed whole {largest.name}, {format_bytes(largest.bytes)}"
             if largest.name is not None else "no unit computed whole")
    lines.append(f"peak memory about {format_bytes(plan.peak_memory_bytes)} ({whole}; {plan.replayed_units} of "
                 f"{plan.units} units drawn in pieces of at most {format_bytes(plan.piece_bytes)})")
    for name, why in list(plan.whole_modules.items())[:10]:
        lines.append(f"  computed whole: {name or '(the model itself)'}: {why}")
    if len(plan.whole_modules) > 10:
        lines.append(f"  ... and {len(plan.whole_modules) - 10} more modules computed whole")
    if len(plan.ranks) > 1:
        lines.extend(_rank_lines(plan, rank_rate, quiet))
    elif rank_rate is not None:
        lines.append(f"expected time at {format_bytes(rank_rate)}/s (given): about "
                     f"{plan.write_bytes / rank_rate:.0f} s")
    if plan.rates is not None:
        r = plan.rates
        who = "the slowest rank, " if len(plan.ranks) > 1 else ""
        lines.append(f"expected time on this machine: about {plan.estimated_seconds:.0f} s to generate ({who}own init "
                     f"{r.own_elements_per_s / 1e6:.0f}M {r.dtype} elements/s, {r.layer_s:.2f} s per "
                     f"attention layer, measured now in one process); writing overlaps it, so the run takes the longer "
                     f"of that and {format_bytes(max(s.bytes for s in plan.ranks))} at the disk's write speed "
                     f"(not measured: nothing is written)")
    # the long explanations wrapped to 120 columns (a refusal stays one line: it is the write's own message)
    print("\n".join(line if line.startswith("the write would be refused") else
                    textwrap.fill(line, width=120, subsequent_indent=" " * (len(line) - len(line.lstrip()) + 2))
                    for line in lines))


def _rank_lines(plan, rank_rate, quiet: bool) -> list:
    """The ranks of a dry run: shards, bytes and expected time per rank."""
    from condinit._util import format_bytes

    shares = plan.ranks
    counts = [len(s.files) for s in shares]
    idle = sum(1 for c in counts if c == 0)
    largest = max(shares, key=lambda s: s.bytes)
    lines = [f"{len(shares)} ranks: {min(counts)}-{max(counts)} shard(s) per rank, "
             f"{format_bytes(min(s.bytes for s in shares))}-{format_bytes(largest.bytes)} per rank "
             f"(rank {largest.rank} the most)"]
    if idle:
        todo = sum(s.bytes for s in shares)
        lines.append(f"  {idle} of the {len(shares)} ranks have no shard: {sum(counts)} to write; a --max-shard-size "
                     f"of at most {format_bytes(max(1, todo // len(shares)))} gives every rank one")
    if rank_rate is not None:
        lines.append(f"expected time at {format_bytes(rank_rate)}/s per rank (given): about "
                     f"{largest.bytes / rank_rate:.0f} s (rank {largest.rank}'s {format_bytes(largest.bytes)}), "
                     f"{format_bytes((len(shares) - idle) * rank_rate)}/s together")
    if not quiet:
        for s in shares[:8]:
            eta = "" if s.estimated_seconds is None else f", about {s.estimated_seconds:.0f} s to generate"
            lines.append(f"  rank {s.rank}: {len(s.files)} shard(s), {format_bytes(s.bytes)}{eta}")
        if len(shares) > 8:
            lines.append(f"  ... and {len(shares) - 8} more ranks")
    return lines


def _run_dcp(args) -> int:
    """``--format dcp``: a torchtitan seed checkpoint (:func:`condinit.models.engines.dcp.
    write_torchtitan_seed`), every check made before any work; under ``--nproc N`` or torchrun every
    rank writes its share."""
    from condinit._validate import check_int, check_real, check_seed
    from condinit.cli import CLIError
    from condinit.models.engines import dcp as engine
    from condinit.models.presets import DTYPES
    from condinit.models.stream.ranks import launched_group, launched_world_size

    for flag, given in (("--config", args.config is not None), ("--preset", args.preset is not None)):
        if given:
            raise CLIError(f"{flag}: --format dcp writes a torchtitan model: name its flavor with --torchtitan "
                           f"MODEL:FLAVOR (e.g. llama3:8B) instead")
    if args.torchtitan is None:
        raise CLIError("--format dcp: name the model with --torchtitan MODEL:FLAVOR (e.g. llama3:8B)")
    for flag, given in (("--max-shard-size", args.max_shard_size is not None), ("--resume", args.resume),
                        ("--overwrite", args.overwrite), ("--rank-rate", args.rank_rate is not None),
                        ("--adapter", bool(args.adapter)), ("--mla factors", args.mla != "refuse"),
                        ("--device cuda", args.device != "cpu")):
        if given:
            raise CLIError(f"{flag}: not with --format dcp (a DCP seed checkpoint is computed on the CPU and "
                           f"written whole into an empty directory)")
    check_seed("--seed", args.seed)
    for flag, gain in (("--qk-gain", args.qk_gain), ("--v-gain", args.v_gain)):
        check_real(flag, gain, min=0.0, min_open=True)
    check_int("--nproc", args.nproc, min=1, allow_none=True)
    launched = launched_world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", launched or 1))
    if launched is not None and args.nproc is not None and args.nproc != local and not args.dry_run:
        raise CLIError(f"--nproc {args.nproc}: this process was launched among {local} process(es) on this machine "
                       f"(LOCAL_WORLD_SIZE): leave --nproc out under torchrun")
    try:
        engine.torchtitan_model(args.torchtitan)
        out = engine.check_empty_dir(args.out)
    except ImportError as exc:
        raise CLIError(f"--torchtitan {args.torchtitan}: {exc}") from None
    except ValueError as exc:
        raise CLIError(f"--{'torchtitan' if 'torchtitan model' in str(exc) else 'out'}: {exc}") from None
    dtype = DTYPES[args.dtype]
    if args.dry_run:
        if launched is not None and int(os.environ["RANK"]) != 0:
            return 0   # the plan is rank 0's; nothing is written
        plan = engine.plan_torchtitan_seed(args.torchtitan, args.nproc or launched or 1, dtype=dtype)
        print(_dcp_plan_text(plan, out, args.quiet))
        return 0
    if args.nproc is not None and args.nproc > 1 and launched is None:
        return _launch(args, left="no .metadata written: nothing under --out (the ranks' temporary directory "
                                  "beside it is removed by rank 0)")
    common = dict(seed=args.seed, dtype=dtype, method=args.method, v_mode=args.v_mode, qk_gain=args.qk_gain,
                  v_gain=args.v_gain, strict=args.strict, report=False)
    if launched is None or launched == 1:
        rep = engine.write_torchtitan_seed(args.torchtitan, out, **common)
    else:
        with launched_group("cpu"):
            rep = engine.write_torchtitan_seed(args.torchtitan, out, **common)
        if int(os.environ["RANK"]) != 0:
            return 0   # rank 0 prints the write
    if args.quiet:
        print(rep.out_dir)
        return 0
    from condinit._util import format_bytes
    from condinit.models.report import wide_console

    con = wide_console()
    if rep.apply.uncovered:
        con.print(rep.apply.uncovered_table())
    plan = rep.plan
    con.print(f"conditioned {len(rep.apply.layers)} attention layer(s) (adapter "
              f"{', '.join(sorted({l.adapter for l in rep.apply.layers}))}): every Q/K head semi-orthogonal, V the "
              f"identity; everything else torchtitan's init_states()"
              + (f"; {len(rep.apply.uncovered)} attention-like module(s) not conditioned (listed above)"
                 if rep.apply.uncovered else ""))
    con.print(f"wrote {rep.out_dir}: torchtitan {plan.model.name}, {plan.num_parameters / 1e6:.1f}M parameters, "
              f"{args.dtype}, {format_bytes(plan.total_bytes)} of tensors by {len(plan.ranks)} rank(s) (at most "
              f"{format_bytes(max(s.bytes for s in plan.ranks))} per rank), seed {args.seed}, {rep.time_s:.2f} s; "
              f"peak resident memory per rank {format_bytes(max(rep.peak_rss))}")
    return 0


def _dcp_plan_text(plan, out: str, quiet: bool) -> str:
    """``--format dcp --dry-run``: the bytes each rank would hold and write."""
    from condinit._util import format_bytes

    shares = plan.ranks
    lines = [f"dry run, nothing written: {out}",
             f"torchtitan {plan.model.name}: {plan.num_parameters / 1e6:.1f}M parameters, "
             f"{str(plan.dtype).removeprefix('torch.')}, {format_bytes(plan.total_bytes)} of tensors; {len(shares)} "
             f"rank(s), each holding and writing its rows of every tensor (FSDP2): "
             f"{format_bytes(min(s.bytes for s in shares))}-{format_bytes(max(s.bytes for s in shares))} per rank"]
    if not quiet:
        name, whole = plan.drawn_whole
        lines.append(f"peak memory per rank: its share, plus the largest tensor whose init is drawn whole on every "
                     f"rank ({name}, {format_bytes(whole)} float32)" if name else
                     "peak memory per rank: its share, plus one row block of the init")
        for s in shares[:8]:
            lines.append(f"  rank {s.rank}: {format_bytes(s.bytes)}")
        if len(shares) > 8:
            lines.append(f"  ... and {len(shares) - 8} more ranks")
    return "\n".join(lines)
