"""``condinit bench``: time condinit's kernels on this machine against its measured ceilings and
against what a user would otherwise run, side by side, in tables at most 120 columns wide (the
library: :mod:`condinit.bench`). ``--json PATH`` is checked before anything runs and written
atomically; ``--json -`` (or ``--json`` alone) writes the JSON to stdout and the tables to stderr."""
from __future__ import annotations

import sys

NAME = "bench"
HELP = ("time condinit's kernels against this machine's matrix rate and copy bandwidth and against "
        "the PyTorch code they replace (orthogonal_, linalg.qr, randn, SDPA, torch.func.jvp)")

DTYPES = ("fp32", "bf16", "fp16")
SECTIONS = ("ceilings", "init", "attention")


def add_arguments(p):
    p.add_argument("--device", default=None,
                   help="cpu or cuda[:N] (default: cuda when a GPU is visible, else cpu)")
    p.add_argument("--dtype", choices=DTYPES, default=None,
                   help="attention dtype and init storage dtype (default: fp32 on cpu, bf16 on cuda)")
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help=f"comma-separated subset of {','.join(SECTIONS)} (default: all)")
    p.add_argument("--init-shape", default=None,
                   help="attention stack to initialize: a preset (llama-1b, llama-3-8b, llama-3-70b, vit-ti, "
                        "vit-b) or LAYERS,D,HEADS,KV_HEADS,HEAD_DIM (default: llama-1b on cpu, llama-3-70b on cuda)")
    p.add_argument("--attention-shape", default=None,
                   help="B,H,HKV,N,d of the attention rows (default 1,8,8,1024,64 on cpu, 1,16,16,8192,128 on cuda)")
    p.add_argument("--non-causal", action="store_true", help="attention without the causal mask")
    p.add_argument("--probes", type=int, default=None, help="tangents of the multi-probe JVP row (default 4)")
    p.add_argument("--backend", default=None,
                   help="force condinit's backend (cuda, triton, cpp-cpu, torch); a row whose op cannot run "
                        "on it fails, it never falls back (default: the automatic choice)")
    p.add_argument("--repeats", type=int, default=None, help="timed calls per row (median; default 3, 2 with --quick)")
    p.add_argument("--baseline-blocks", type=int, default=None,
                   help="time the per-head orthogonal_ loop (and, on GPUs, the batched QR) on this many blocks "
                        "and scale (default: all on cpu, 256 on cuda)")
    p.add_argument("--skip", default="", help="comma-separated row keys not to run, e.g. math_jvp,math_jvp_bwd "
                                              "(an unknown key is refused, naming the keys)")
    p.add_argument("--quick", action="store_true", help="small shapes and 2 repeats: seconds, for a smoke test")
    p.add_argument("--json", metavar="PATH", nargs="?", const="-",
                   help="also write machine, versions, FLOP conventions and every row to PATH; '-' or no PATH: "
                        "the JSON on stdout (and nothing else), the tables on stderr")
    p.add_argument("--no-progress", action="store_true", help="no progress bar or progress lines")


def _config(args):
    import torch

    from condinit import bench
    from condinit._validate import check_choice
    from condinit.cli import CLIError

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise CLIError(f"--device: {exc}") from None
    if dev.type not in ("cpu", "cuda"):
        raise CLIError(f"--device must be cpu or cuda[:N], got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise CLIError("--device cuda: no CUDA GPU is visible")
    sections = tuple(s.strip() for s in args.sections.split(",") if s.strip())
    for s in sections:
        check_choice("--sections entries", s, SECTIONS)
    if not sections:
        raise CLIError(f"--sections must name at least one of {','.join(SECTIONS)}")
    for name in ("repeats", "baseline_blocks", "probes"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise CLIError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.backend is not None:
        from condinit import _backends
        check_choice("--backend", args.backend, _backends.BACKENDS + ("auto",))
    from condinit.bench.config import SKIPPABLE
    skip = tuple(s.strip() for s in args.skip.split(",") if s.strip())
    for key in skip:
        check_choice("--skip entries", key, SKIPPABLE)
    overrides = dict(
        sections=sections, repeats=args.repeats, baseline_blocks=args.baseline_blocks, probes=args.probes,
        backend=None if args.backend == "auto" else args.backend,
        dtype={"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}.get(args.dtype),
        init_shape=bench.parse_shape(args.init_shape, "init") if args.init_shape else None,
        attention_shape=bench.parse_shape(args.attention_shape, "attention") if args.attention_shape else None,
        skip=skip or None,
    )
    cfg = bench.default_config(str(dev), quick=args.quick, **overrides)
    cfg.causal = not args.non_causal
    return cfg


class _Progress:
    """A tqdm bar on stderr when tqdm is installed and stderr is a terminal, else one line per row."""

    def __init__(self, total: int, enabled: bool):
        self.bar, self.enabled, self.count, self.total = None, enabled, 0, total
        if not enabled:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        if sys.stderr.isatty():
            self.bar = tqdm(total=total, file=sys.stderr, unit="row", leave=False)

    def __call__(self, what: str) -> None:
        if not self.enabled:
            return
        self.count += 1
        if self.bar is not None:
            if self.count > 1:
                self.bar.update(1)
            self.bar.set_description_str(what[:60])
        else:
            print(f"[{self.count}/{self.total}] {what}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.update(1)
            self.bar.close()


def run(args) -> int:
    import torch

    from condinit import bench
    from condinit.io.atomic import atomic_output, check_output_path

    to_stdout = args.json == "-"
    json_out = check_output_path(args.json) if args.json and not to_stdout else None   # before any work
    cfg = _config(args)
    progress = _Progress(bench.planned_rows(cfg), enabled=not args.no_progress)
    try:
        rows = bench.run(cfg, progress)
    finally:
        progress.close()
    machine = bench.machine_info(cfg.device)
    where = machine.get("gpu") or f"{machine['processor']}, {machine['cpu_count']} CPUs"
    load = f", load {machine['load_average_1min']:.1f}" if "load_average_1min" in machine else ""
    header = (f"condinit bench on {cfg.device} ({where}{load}); torch {torch.__version__}, "
              f"{torch.get_num_threads()} threads; {bench.dtype_name(cfg.dtype)}; each time the median of "
              f"{cfg.repeats} calls after a warm-up call")
    titles = bench.section_titles(cfg, bench.section_ceilings(rows, cfg))
    table = bench.format_table(rows, header, titles)
    if to_stdout:
        print(table, file=sys.stderr)
        sys.stdout.write(bench.json_text(rows, cfg))
        sys.stdout.flush()
    else:
        print(table)
    if json_out:
        with atomic_output(json_out) as tmp:
            bench.write_json(tmp, rows, cfg)
        print(f"wrote {args.json}")
    failed = [r for r in rows if not r.ok]
    if failed:
        print(f"{len(failed)} of {len(rows)} rows failed: {', '.join(r.key for r in failed)}", file=sys.stderr)
    return 1 if failed else 0
