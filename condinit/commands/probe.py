"""``condinit probe``: per-layer conditioning of the attention Jacobian of a checkpoint.

    condinit probe llama-1b.safetensors --preset llama-1b [--layers 4] [--seq-len 64] [--batch 2]
                   [--steps S] [--time-budget SECONDS] [--plot kappa.png] [--json probe.json]

The checkpoint (a .safetensors file, or a Hugging Face directory of shards with its index; never
unpickled) is read as the probe needs it, never whole. The preset's model is built on the meta
device and checked against the file's header (every tensor's name and shape); rotary frequencies
and other buffers the file does not hold are computed by the model's own init. The model then runs
once on a seeded synthetic batch (random token ids, or random pixels for ViT) to capture each
attention layer's input, with each block of the layer stack (a decoder layer, say) read from the
file when it runs and dropped when it returns, every other module's own weights likewise, and an
embedding reading only the rows of the batch's tokens; the forward stops once the input of the last
probed layer is captured. Each attention layer's weights are then read again, one layer at a time,
for its estimates. Peak memory is one block's weights plus the activations and the estimators'
Krylov vectors (BENCHMARKS.md).

Per layer it prints sigma_max and sigma_min of the weight Jacobian and kappa(J) with its bracket
``[kappa_lo, kappa_hi]``, as :func:`condinit.probe.lanczos_svd` gives them (``--steps`` and
``--time-budget`` cap its work per layer, by default 300 steps or 10 s, whichever comes first; it
stops earlier when the bracket is tight; where an exact estimate is cheap, the dense SVD or
Lanczos to the end of ``range(J)``, the layer is estimated in float64, else in float32),
``||J||_F`` (Hutchinson, with its 95 % interval) and the upper bound on kappa(J) of
:func:`condinit.probe.condition_number_bound`. A vacuous bound prints as ``-`` with a footnote
letter; the footnotes under the table say which term is infinite or undefined and why. Decoder
presets use the causal mask. ``--plot`` and ``--json`` are written atomically. A progress bar goes
to stderr when it is a terminal.

A layer whose weights or captured input hold NaN or Inf (a diverged checkpoint: the NaN also
reaches every later layer's input) is listed with the reason instead of values; the other layers
are probed as usual. Values that overflow float32 print as ``nan`` with the reason in the JSON
``notes``. One token (``--seq-len 1``) is fine: the bound is then vacuous (one key per query,
the softmax Jacobian is 0).
"""
from __future__ import annotations

import contextlib
import json
import textwrap

# seconds of Lanczos steps per layer unless --time-budget says otherwise (BENCHMARKS.md: what a
# Llama-1B layer reaches in 10 / 30 / 60 s)
DEFAULT_TIME_BUDGET = 10.0

NAME = "probe"
HELP = "attention-Jacobian conditioning per layer of a .safetensors checkpoint (sigma, kappa and its bound)"


def add_arguments(p):
    p.add_argument("file", metavar="FILE.safetensors", help="checkpoint: a .safetensors file or a directory of "
                   "shards with its index (safetensors only)")
    p.add_argument("--preset", required=True, metavar="NAME", help="model preset the checkpoint belongs to")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (default 64; ViT: fixed)")
    p.add_argument("--batch", type=int, default=2, help="sequences in the synthetic batch (default 2)")
    p.add_argument("--steps", type=int, default=None,
                   help="at most this many Golub-Kahan-Lanczos steps per layer (default: lanczos_svd's)")
    p.add_argument("--time-budget", type=float, default=DEFAULT_TIME_BUDGET, metavar="SECONDS",
                   help=f"at most this many seconds of Lanczos steps per layer (default {DEFAULT_TIME_BUDGET:g}: "
                        f"a billion-parameter layer's bracket stays open for minutes, so a layer is not left "
                        f"running for that long by default; 0: no limit)")
    p.add_argument("--samples", type=int, default=16, help="Hutchinson probes per layer (default 16)")
    p.add_argument("--seed", type=int, default=0, help="seed of the batch and the estimators (default 0)")
    p.add_argument("--wrt", choices=("weights", "input", "qkv"), default="weights",
                   help="Jacobian variables (default weights: the paper's J)")
    p.add_argument("--layers", type=int, default=None, metavar="K", help="probe only the first K layers")
    p.add_argument("--plot", metavar="OUT.png", default=None, help="figure of sigma/kappa per layer")
    p.add_argument("--json", metavar="OUT.json", default=None, help="write the results as JSON")


def _fmt(v, spec=".3e"):
    return "-" if v is None else format(v, spec)


# ------------------------------------------------------------------------------------------------
# the checkpoint, read as the model runs

class _AllCaptured(Exception):
    """Raised by the capture hook once every probed layer's input is held: the rest of the forward is skipped."""


def _floating(t):
    import torch
    return t.to(torch.float32) if t.is_floating_point() else t


class _Weights:
    """The meta-device parameters of ``model`` read from the checkpoint at ``path`` (a .safetensors
    file or a directory of shards: :func:`condinit.models.checkpoint.open_checkpoint`) while a module
    needs them, in float32; parameters already in memory are used as they are. A parameter is read
    under its own name, or under another name of the same tensor (tied embeddings are stored once).

    Each read opens the checkpoint and closes it once the module is done: safetensors memory-maps the
    file, and the pages a read touches stay resident until the mapping is closed."""

    def __init__(self, model, path):
        from condinit.models.checkpoint import open_checkpoint

        self.path = path
        self.key = {}          # id(meta parameter) -> its name in the checkpoint
        groups = {}
        for n, p in model.named_parameters(remove_duplicate=False):
            if p.is_meta:
                groups.setdefault(id(p), []).append(n)
        with open_checkpoint(path) as fh:
            names = set(fh.keys())
        for pid, ns in groups.items():
            key = next((n for n in ns if n in names), None)
            if key is None:
                raise ValueError(f"{path} has no tensor {ns[0]!r} (nor any name tied to it)")
            self.key[pid] = key

    def _open(self):
        from condinit.models.checkpoint import open_checkpoint
        return open_checkpoint(self.path)

    def rows(self, fh, p, ids):
        """Rows ``ids`` (sorted, distinct) of parameter ``p`` from the open ``fh``, read run by run of
        consecutive ids."""
        import torch

        sl, parts, i = fh.get_slice(self.key[id(p)]), [], 0
        while i < len(ids):
            j = i
            while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
                j += 1
            parts.append(sl[ids[i]:ids[j] + 1])
            i = j + 1
        return _floating(torch.cat(parts))

    @contextlib.contextmanager
    def loaded(self, module, recurse: bool = True):
        """``module``'s meta parameters (with ``recurse``, those of its submodules too) read for the
        duration, then the meta ones put back."""
        from torch import nn

        todo = [(mod, attr, p) for mod in (module.modules() if recurse else (module,))
                for attr, p in mod._parameters.items() if p is not None and p.is_meta]
        if not todo:
            yield
            return
        swapped = []
        with self._open() as fh:
            try:
                for mod, attr, p in todo:
                    mod._parameters[attr] = nn.Parameter(_floating(fh.get_tensor(self.key[id(p)])),
                                                         requires_grad=False)
                    swapped.append((mod, attr, p))
                yield
            finally:
                for mod, attr, p in reversed(swapped):
                    mod._parameters[attr] = p

    @contextlib.contextmanager
    def _embedding_rows(self, module, ids):
        """An ``nn.Embedding`` holding only the rows ``ids`` reads (its output unchanged when called on the
        inverse indices ``torch.unique`` gives); yields those indices."""
        import torch
        from torch import nn

        uniq, inv = torch.unique(ids, return_inverse=True)
        if uniq.numel() and (int(uniq[0]) < 0 or int(uniq[-1]) >= module.num_embeddings):
            raise IndexError(f"token id {int(uniq[-1]) if int(uniq[0]) >= 0 else int(uniq[0])} is out of range "
                             f"for an embedding of {module.num_embeddings} rows")
        old, pad = module._parameters["weight"], module.padding_idx
        with self._open() as fh:
            weight = self.rows(fh, old, uniq.tolist())     # torch.cat: a copy, the mapping can close
        module._parameters["weight"] = nn.Parameter(weight, requires_grad=False)
        module.padding_idx = None       # it only shapes the gradient; an index into the full table
        try:
            yield inv
        finally:
            module._parameters["weight"], module.padding_idx = old, pad

    @contextlib.contextmanager
    def streamed(self, model, blocks):
        """Forward hooks on ``model``: each module of ``blocks`` reads its whole subtree's meta weights when
        it runs, every other module its own (an ``nn.Embedding`` only the rows it looks up); they are
        dropped when the module returns."""
        from torch import nn

        block_ids = {id(b) for b in blocks}
        live: dict = {}        # id(module) -> ExitStacks of the calls in progress

        def pre(module, args, kwargs):
            stack = contextlib.ExitStack()
            live.setdefault(id(module), []).append(stack)
            w = module._parameters.get("weight") if isinstance(module, nn.Embedding) else None
            if w is not None and w.is_meta and id(module) not in block_ids:
                ids = args[0] if args else kwargs["input"]
                inv = stack.enter_context(self._embedding_rows(module, ids))
                if args:
                    args = (inv,) + tuple(args[1:])
                else:
                    kwargs = dict(kwargs, input=inv)
            stack.enter_context(self.loaded(module, recurse=id(module) in block_ids))
            return args, kwargs

        def post(module, args, kwargs, output):
            live[id(module)].pop().close()

        handles = []
        for m in model.modules():
            if id(m) in block_ids or any(p.is_meta for p in m.parameters(recurse=False)):
                handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
                handles.append(m.register_forward_hook(post, with_kwargs=True, always_call=True))
        try:
            yield
        finally:
            for h in handles:
                h.remove()
            for stacks in live.values():
                for s in reversed(stacks):
                    s.close()


def _blocks(model, layers):
    """The block of each attention layer: its nearest ancestor (or itself) held in an ``nn.ModuleList`` /
    ``nn.Sequential`` (a decoder layer of the layer stack), else the attention module itself."""
    from torch import nn

    mods = dict(model.named_modules())
    out = []
    for l in layers:
        parts = l.name.split(".") if l.name else []
        block = l.module
        for k in range(len(parts), 0, -1):
            if isinstance(mods[".".join(parts[:k - 1])], (nn.ModuleList, nn.Sequential)):
                block = mods[".".join(parts[:k])]
                break
        out.append(block)
    return out


def _load(fh, preset):
    """The preset's model on the meta device, checked against the open checkpoint ``fh`` (its tensors'
    names and shapes), with the buffers computed (read from ``fh`` where it holds them, else the
    model's own init: rotary frequencies); its parameters stay on meta, for :class:`_Weights`."""
    import torch

    from condinit.models.presets import build_model
    from condinit.models.stream.materialize import Materializer

    model, family = build_model(preset, dtype=None, device="meta")
    shapes = {k: tuple(fh.get_slice(k).get_shape()) for k in fh.keys()}
    where = f"{fh.path} does not fit preset {preset!r}"
    known = set()
    params = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        known.add(n)
        params.setdefault(id(p), (p, []))[1].append(n)
    for p, names in params.values():
        key = next((n for n in names if n in shapes), None)
        if key is None:
            raise ValueError(f"{where}: missing tensors {names[:3]}")
        if shapes[key] != tuple(p.shape):
            raise ValueError(f"{where}: tensor {key!r} has shape {list(shapes[key])}, the model's is {list(p.shape)}")
    computed = {}
    for n, b in model.named_buffers(remove_duplicate=False):
        known.add(n)
        if b is None or n in computed:
            continue
        if n in shapes and shapes[n] != tuple(b.shape):
            raise ValueError(f"{where}: tensor {n!r} has shape {list(shapes[n])}, the model's is {list(b.shape)}")
        computed[n] = b
    unexpected = [k for k in shapes if k not in known]
    if unexpected:
        raise ValueError(f"{where}: unexpected tensors {unexpected[:3]}")
    # buffers: from the file when it holds them, else the model's own init, module by module
    missing = {n: b for n, b in computed.items() if n not in shapes}
    fresh = {}
    if missing:
        engine = Materializer(model, missing, 0, torch.device("cpu"))
        for mname in dict.fromkeys(n.rpartition(".")[0] for n in missing):
            res = engine.own_init(mname)
            if res.uninitialized:
                raise ValueError(f"{where}: the model's own init does not compute buffer(s) {res.uninitialized[:3]}")
            prefix = f"{mname}." if mname else ""
            fresh.update({prefix + attr: t for attr, t in res.tensors.items()})
    mods = dict(model.named_modules())
    for n in computed:
        mname, _, attr = n.rpartition(".")
        value = fh.get_tensor(n) if n in shapes else fresh[n]
        mods[mname]._buffers[attr] = _floating(value)
    model.eval()
    return model, family


def _batch(model, family, batch, seq_len, seed):
    import torch

    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    if family == "vit":
        size = cfg.image_size
        return {"pixel_values": torch.randn(batch, getattr(cfg, "num_channels", 3), size, size, generator=g)}
    limit = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
    if limit is not None and seq_len > limit:
        raise ValueError(f"--seq-len {seq_len} is above the preset's maximum of {limit} positions")
    return {"input_ids": torch.randint(0, cfg.vocab_size, (batch, seq_len), generator=g)}


# the estimate's bracket fields a row carries when lanczos_svd gives them
_BRACKET_KEYS = ("sigma_max_lo", "sigma_max_hi", "sigma_min_lo", "sigma_min_hi", "kappa_lo", "kappa_hi", "bracket",
                 "tol", "rank")


def probe_model(model, inputs, *, steps=None, time_budget=None, samples=16, seed=0, wrt="weights", max_layers=None,
                checkpoint=None, progress=False):
    """One record per attention layer: Lanczos sigma/kappa (with the bracket fields
    :func:`~condinit.probe.lanczos_svd` gives), Hutchinson Frobenius, the kappa bound.

    ``model`` runs once on ``inputs`` to capture the layers' inputs. Its parameters on the meta
    device are read from ``checkpoint`` (the path of a .safetensors file or directory of shards)
    block by block as it runs, then layer by layer for the estimates (see the module doc); None: the
    model is in memory. ``steps`` / ``time_budget``: :func:`~condinit.probe.lanczos_svd`'s budget per
    layer (None: its default). Layer ``i``'s estimators are seeded with ``(seed + i) mod 2**64``. A
    layer whose weights or input are not finite gets a record with ``skipped`` set to the reason (and
    None values). ``progress``: a tqdm bar on stderr (shown when it is a terminal).
    """
    import time

    import torch
    from tqdm.auto import tqdm

    from condinit._util import release_memory
    from condinit._validate import SEED_MAX
    from condinit.models import find_attention
    from condinit.probe import (InputCapture, JacobianOperator, NonFiniteError, condition_number_bound,
                                frobenius_hutchinson, lanczos_svd)
    from condinit.probe.capture import layer_position_embeddings
    from condinit.probe.estimators import exact_in_reach

    layers = find_attention(model)
    if not layers:
        raise ValueError(f"no attention layer found in {type(model).__name__}")
    if max_layers is not None:
        layers = layers[:max_layers]
    weights = _Weights(model, checkpoint) if checkpoint is not None else None
    if weights is None and any(p.is_meta for p in model.parameters()):
        raise ValueError("the model's parameters are on the meta device: give the checkpoint to read them from")
    budget = {k: v for k, v in (("steps", steps), ("time_budget", time_budget)) if v is not None}
    captured: dict = {}
    bar = tqdm(total=len(layers), desc="inputs", unit="layer", disable=None if progress else True, leave=False)

    def keep_first(i, module, x, call):
        # the layer's input and the rotary (cos, sin) it is called with, so the operator is the
        # attention the layer computes (RoPE included)
        if i not in captured and x is not None:
            pe = layer_position_embeddings(module, *call)
            captured[i] = (x.clone(), None if pe is None else tuple(t.clone() for t in pe))
            bar.update(1)
            if len(captured) == len(layers):
                raise _AllCaptured

    streamed = weights.streamed(model, _blocks(model, layers)) if weights is not None else contextlib.nullcontext()
    try:
        with InputCapture([l.module for l in layers], on_input=keep_first, call_info=True), torch.no_grad(), \
                streamed:
            model(**inputs)
    except _AllCaptured:
        pass
    rows = []
    bar.reset()
    bar.set_description("probe")
    for i, l in enumerate(layers):
        x, pe = captured.get(i, (None, None))
        if x is None:
            bar.close()
            raise ValueError(f"layer {l.name}: no [B, N, D] input captured (the model's forward did not run it, "
                             f"or its input is not a 2-D or 3-D tensor)")
        bar.set_postfix_str(l.name)
        causal = bool(getattr(l.module, "is_causal", False))
        t0 = time.perf_counter()
        layer_seed = (seed + i) % SEED_MAX
        try:
            with weights.loaded(l.module) if weights is not None else contextlib.nullcontext():
                op = JacobianOperator(l.module, x, wrt=wrt, causal=causal, dtype=torch.float32,
                                      position_embeddings=pe, spec=l.spec)
                if exact_in_reach(op, steps):          # then in float64 (exact_in_reach says why)
                    op = JacobianOperator(l.module, x, wrt=wrt, causal=causal, dtype=torch.float64,
                                          position_embeddings=pe, spec=l.spec)
                bnd = condition_number_bound(l.module, x, causal=causal, measure=False)
        except NonFiniteError as exc:
            # a diverged layer (or one fed by one): reported in its row, the others are still probed
            rows.append({"layer": l.index, "name": l.name, "causal": causal, "skipped": f"not probed: {exc}",
                         **{k: None for k in _VALUE_KEYS}})
            bar.update(1)
            continue
        est = lanczos_svd(op, seed=layer_seed, dense="auto", **budget)
        fro = frobenius_hutchinson(op, samples=samples, seed=layer_seed)
        op_dtype = op.dtype
        del op
        found = est.to_dict()
        rows.append({"layer": l.index, "name": l.name, "causal": causal, "skipped": None, "shape": list(est.shape),
                     "sigma_max": est.sigma_max, "sigma_min": est.sigma_min, "kappa": est.kappa,
                     **{k: found[k] for k in _BRACKET_KEYS if k in found},
                     "rank_deficient": est.rank_deficient, "converged": est.converged,
                     "method": est.method, "dtype": str(op_dtype).removeprefix("torch."), "exact": est.exact,
                     "lanczos_steps": est.iterations,
                     "residual_max": est.residual_max, "residual_min": est.residual_min,
                     "frobenius": fro.frobenius, "frobenius_ci": [fro.ci_low, fro.ci_high],
                     "bound": bnd.bound, "bound_terms": {k: getattr(bnd, k) for k in (
                         "kappa_X", "kappa_WQ", "kappa_WK", "kappa_WV", "kappa_Lambda", "kappa_softmax")},
                     "bound_notes": bnd.notes, "notes": "; ".join(n for n in (est.notes, fro.notes) if n),
                     "subspace": est.subspace, "time_s": time.perf_counter() - t0})
        del est, fro
        release_memory()    # one layer's working set back to the system before the next one's
        bar.update(1)
    bar.close()
    return rows


# the value fields of a probed row (None in a skipped one)
_VALUE_KEYS = ("shape", "sigma_max", "sigma_min", "kappa", "kappa_lo", "kappa_hi", "rank_deficient", "converged",
               "method", "dtype", "exact", "lanczos_steps", "residual_max", "residual_min", "frobenius", "frobenius_ci", "bound", "bound_terms",
               "bound_notes", "notes", "subspace", "time_s")


def _plot(rows, out, title):
    from condinit.io.atomic import atomic_output

    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    idx = [r["layer"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label in (("sigma_max", "sigma_max"), ("sigma_min", "sigma_min (nonzero)"), ("kappa", "kappa(J)"),
                       ("bound", "bound on kappa(J)")):
        ys = [r[key] if r[key] is not None and r[key] > 0 else float("nan") for r in rows]
        ax.semilogy(idx, ys, marker="o", label=label)
    from matplotlib.ticker import MaxNLocator
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("layer")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic_output(out) as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    plt.close(fig)


def _bound_cells(rows) -> tuple[dict, list]:
    """The bound column per probed row (``-(a)`` when vacuous) and the footnotes: each distinct reason
    (``bound_notes``) once, with a letter."""
    cells, notes = {}, {}
    for r in rows:
        if r["skipped"] is not None:
            continue
        if r["bound"] is not None:
            cells[r["layer"]] = _fmt(r["bound"])
            continue
        why = (r["bound_notes"] or "bound vacuous").removeprefix("bound vacuous: ")
        letter = notes.setdefault(why, chr(ord("a") + len(notes)) if len(notes) < 26 else "*")
        cells[r["layer"]] = f"-({letter})"
    return cells, [f"({letter}) bound vacuous: {why}" for why, letter in notes.items()]


def _steps_cell(r) -> str:
    """The Lanczos steps of a row, or how its dense SVD ran."""
    if r["method"] == "dense-svd":
        return "dense64" if r["dtype"] == "float64" else "dense"
    return str(r["lanczos_steps"])


def _print_table(args, inputs, rows) -> None:
    """The per-layer table, at most 120 columns wide, and its footnotes wrapped to that width."""
    say = lambda text: print(textwrap.fill(text, width=120, subsequent_indent="  "))  # noqa: E731
    tokens = inputs["input_ids"].shape[1] if "input_ids" in inputs else "image"
    budget = ", ".join(f"{name} {v:g}" for name, v in (("at most Lanczos steps", args.steps),
                                                       ("time budget (s)", args.time_budget)) if v is not None)
    say(f"{args.file}: preset {args.preset}, wrt={args.wrt}, batch {args.batch} x {tokens} tokens"
        + (f", {budget} per layer" if budget else ""))
    cells, footnotes = _bound_cells(rows)
    print(f"{'layer':>5}  {'name':<24} {'sigma_max':>9} {'sigma_min*':>10} {'kappa(J)':>9} "
          f"{'[kappa_lo, kappa_hi]':>21} {'steps':>7} {'||J||_F':>9} {'bound':>9} conv")
    for r in rows:
        if r["skipped"] is not None:
            say(f"{r['layer']:>5}  {r['name'][-24:]:<24} {r['skipped']}")
            continue
        kappa = "rank-def." if r["rank_deficient"] else _fmt(r["kappa"])
        lo, hi = r.get("kappa_lo"), r.get("kappa_hi")
        bracket = f"[{_fmt(lo, '.3g')}, {_fmt(hi, '.3g')}]" if lo is not None or hi is not None else "-"
        print(f"{r['layer']:>5}  {r['name'][-24:]:<24} {_fmt(r['sigma_max']):>9} {_fmt(r['sigma_min']):>10} "
              f"{kappa:>9} {bracket:>21} {_steps_cell(r):>7} {_fmt(r['frobenius']):>9} "
              f"{cells[r['layer']]:>9} {'yes' if r['converged'] else 'no':>4}")
    probed = [r for r in rows if r["skipped"] is None]
    if args.layers is not None and len(rows) < args.layers:
        say(f"--layers {args.layers}: the model has {len(rows)} attention layer{'s' * (len(rows) != 1)}; all are listed")
    if any(r.get("kappa_lo") is not None for r in probed):
        say("[kappa_lo, kappa_hi]: the bracket of kappa(J) (condinit.probe.lanczos_svd; the JSON's 'bracket' "
            "says how each side is obtained)")
    if any(r["method"] == "dense-svd" for r in probed):
        say("steps 'dense64' ('dense'): the exact dense SVD in float64 (float32), block by block where J is block "
            "diagonal over its key/value heads; cheaper here than Lanczos run to exactness")
    if any(not r["converged"] for r in probed):
        say("conv 'no': the bracket is wider than the estimator's tolerance (raise --steps or --time-budget; "
            "the JSON's notes say which budget ended it)")
    say("bound: upper bound on kappa(J) of each head and sequence, the largest shown "
        "(condinit.probe.condition_number_bound)")
    for line in footnotes:
        say(line)
    if probed:
        say("* sigma_min: " + probed[0]["subspace"])


def run(args) -> int:
    from condinit._validate import check_int, check_real, check_seed
    from condinit.io.atomic import atomic_output, check_output_path
    from condinit.commands import check_png_output
    from condinit.models.checkpoint import open_checkpoint
    from condinit.models.presets import PRESETS
    from condinit.probe.records import finite_or_none

    # every check before any work or write
    if args.preset not in PRESETS:
        raise ValueError(f"unknown preset {args.preset!r}; choose one of {', '.join(PRESETS)}")
    for name, val in (("--seq-len", args.seq_len), ("--batch", args.batch)):
        check_int(name, val, min=1)
    check_int("--steps", args.steps, min=1, allow_none=True)
    check_real("--time-budget", args.time_budget, min=0.0, allow_none=True)
    if args.time_budget == 0:
        args.time_budget = None         # no limit
    check_int("--samples", args.samples, min=2)
    check_int("--layers", args.layers, min=1, allow_none=True)
    check_seed("--seed", args.seed)
    plot = check_png_output("--plot", args.plot) if args.plot else None
    out_json = check_output_path(args.json) if args.json else None

    with open_checkpoint(args.file) as fh:      # a safetensors file or directory (before building the model)
        model, family = _load(fh, args.preset)
    inputs = _batch(model, family, args.batch, args.seq_len, args.seed)
    rows = probe_model(model, inputs, steps=args.steps, time_budget=args.time_budget, samples=args.samples,
                       seed=args.seed, wrt=args.wrt, max_layers=args.layers, checkpoint=args.file, progress=True)
    _print_table(args, inputs, rows)
    if out_json:
        with atomic_output(out_json) as tmp:
            with open(tmp, "w", encoding="utf-8") as fh:
                json.dump(finite_or_none({"file": args.file, "preset": args.preset, "wrt": args.wrt,
                                           "batch": args.batch, "seq_len": args.seq_len, "steps": args.steps,
                                           "time_budget": args.time_budget, "seed": args.seed, "layers": rows}),
                          fh, indent=1, allow_nan=False, default=str)
        print(f"wrote {out_json}")
    if plot:
        _plot(rows, plot, f"{args.preset}: attention Jacobian ({args.wrt})")
        print(f"wrote {plot}")
    return 0
