"""``condinit probe``: per-layer conditioning of the attention Jacobian of a checkpoint.

    condinit probe tiny.safetensors --preset tiny-llama [--seq-len 64] [--batch 2] [--steps 20]
                   [--plot kappa.png] [--json probe.json]

Loads the safetensors checkpoint (never unpickles) into a preset model of
:mod:`condinit.models.presets`, runs it once on a seeded synthetic batch (random token ids, or random
pixels for ViT) to capture each attention layer's input, and prints per layer: sigma_max and
sigma_min of the weight Jacobian (sigma_min on the complement of its known null directions:
:mod:`condinit.probe.estimators`), kappa(J), ``||J||_F`` (Hutchinson, with its 95 % interval) and the
upper bound on kappa(J) of :func:`condinit.probe.condition_number_bound`. Decoder presets use the
causal mask.
``--plot`` and ``--json`` are written atomically.

A layer whose weights or captured input hold NaN or Inf (a diverged checkpoint: the NaN also
reaches every later layer's input) is listed with the reason instead of values; the other layers
are probed as usual. Values that overflow float32 print as ``nan`` with the reason in the JSON
``notes``. One token (``--seq-len 1``) is fine: the bound is then vacuous (one key per query,
the softmax Jacobian is 0), printed as ``-``.
"""
from __future__ import annotations

import json
import math

NAME = "probe"
HELP = "attention-Jacobian conditioning per layer of a .safetensors checkpoint (sigma, kappa and its bound)"


def add_arguments(p):
    p.add_argument("file", metavar="FILE.safetensors", help="checkpoint (safetensors only)")
    p.add_argument("--preset", required=True, metavar="NAME", help="model preset the checkpoint belongs to")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (default 64; ViT: fixed)")
    p.add_argument("--batch", type=int, default=2, help="sequences in the synthetic batch (default 2)")
    p.add_argument("--steps", type=int, default=20, help="Golub-Kahan-Lanczos steps per layer (default 20)")
    p.add_argument("--samples", type=int, default=16, help="Hutchinson probes per layer (default 16)")
    p.add_argument("--seed", type=int, default=0, help="seed of the batch and the estimators (default 0)")
    p.add_argument("--wrt", choices=("weights", "input", "qkv"), default="weights",
                   help="Jacobian variables (default weights: the paper's J)")
    p.add_argument("--layers", type=int, default=None, metavar="K", help="probe only the first K layers")
    p.add_argument("--plot", metavar="OUT.png", default=None, help="figure of sigma/kappa per layer")
    p.add_argument("--json", metavar="OUT.json", default=None, help="write the results as JSON")


def _fmt(v, spec=".3e"):
    return "-" if v is None else format(v, spec)


def _finite_or_none(v):
    """``v`` with every NaN / inf float replaced by None (JSON has no NaN)."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: _finite_or_none(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite_or_none(x) for x in v]
    return v


def _load(path, preset):
    import torch

    from condinit.models.checkpoint import open_checkpoint
    from condinit.models.presets import build_model

    with open_checkpoint(path) as fh:
        state = {k: fh.get_tensor(k) for k in fh.keys()}
    model, family = build_model(preset, dtype=None, device="meta")
    # tied parameters (e.g. embeddings / lm_head) are stored once: give every name of a tie the tensor
    groups = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(n)
    for names in groups.values():
        src = next((n for n in names if n in state), None)
        for n in names:
            if src is not None and n not in state:
                state[n] = state[src]
    try:
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as exc:
        raise ValueError(f"{path} does not fit preset {preset!r}: {str(exc).splitlines()[0]}") from None
    if unexpected:
        raise ValueError(f"{path} does not fit preset {preset!r}: unexpected tensors {unexpected[:3]}")
    still_meta = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.is_meta]
    if still_meta:
        # buffers such as rotary inverse frequencies are not saved: rebuild them on CPU
        fresh, _ = build_model(preset, dtype=None, device="cpu")
        fresh_state = dict(fresh.named_parameters())
        fresh_state.update(dict(fresh.named_buffers()))
        params = [n for n in still_meta if n in dict(model.named_parameters())]
        if params:
            raise ValueError(f"{path} does not fit preset {preset!r}: missing tensors {params[:3]}")
        for n in still_meta:
            mod_name, _, attr = n.rpartition(".")
            mod = model.get_submodule(mod_name)
            mod._buffers[attr] = fresh_state[n].to(torch.float32 if fresh_state[n].is_floating_point() else
                                                   fresh_state[n].dtype)
    model.eval()
    return model.float(), family


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


def probe_model(model, inputs, *, steps=20, samples=16, seed=0, wrt="weights", max_layers=None):
    """One record per attention layer: Lanczos sigma/kappa, Hutchinson Frobenius, the kappa bound.

    Layer ``i``'s estimators are seeded with ``(seed + i) mod 2**64``. A layer whose weights or
    input are not finite gets a record with ``skipped`` set to the reason (and None values).
    """
    import time

    import torch

    from condinit._validate import SEED_MAX
    from condinit.models import find_attention
    from condinit.probe import (InputCapture, JacobianOperator, condition_number_bound, frobenius_hutchinson,
                                lanczos_svd)
    from condinit.probe.capture import layer_position_embeddings
    from condinit.probe import NonFiniteError

    layers = find_attention(model)
    if not layers:
        raise ValueError(f"no attention layer found in {type(model).__name__}")
    if max_layers is not None:
        layers = layers[:max_layers]
    captured: dict = {}

    def keep_first(i, module, x, call):
        # the layer's input and the rotary (cos, sin) it is called with, so the operator is the
        # attention the layer computes (RoPE included)
        if i not in captured and x is not None:
            pe = layer_position_embeddings(module, *call)
            captured[i] = (x.clone(), None if pe is None else tuple(t.clone() for t in pe))

    with InputCapture([l.module for l in layers], on_input=keep_first, call_info=True), torch.no_grad():
        model(**inputs)
    rows = []
    for i, l in enumerate(layers):
        x, pe = captured.get(i, (None, None))
        if x is None:
            raise ValueError(f"layer {l.name}: no [B, N, D] input captured (the model's forward did not run it, "
                             f"or its input is not a 2-D or 3-D tensor)")
        causal = bool(getattr(l.module, "is_causal", False))
        t0 = time.perf_counter()
        layer_seed = (seed + i) % SEED_MAX
        try:
            op = JacobianOperator(l.module, x, wrt=wrt, causal=causal, dtype=torch.float32,
                                  position_embeddings=pe, spec=l.spec)
        except NonFiniteError as exc:
            # a diverged layer (or one fed by one): reported in its row, the others are still probed
            rows.append({"layer": l.index, "name": l.name, "causal": causal, "skipped": f"not probed: {exc}",
                         **{k: None for k in _VALUE_KEYS}})
            continue
        est = lanczos_svd(op, steps=steps, seed=layer_seed)
        fro = frobenius_hutchinson(op, samples=samples, seed=layer_seed)
        bnd = condition_number_bound(l.module, x, causal=causal, measure=False)
        rows.append({"layer": l.index, "name": l.name, "causal": causal, "skipped": None, "shape": list(op.shape),
                     "sigma_max": est.sigma_max, "sigma_min": est.sigma_min, "kappa": est.kappa,
                     "rank_deficient": est.rank_deficient, "converged": est.converged,
                     "residual_max": est.residual_max, "residual_min": est.residual_min,
                     "frobenius": fro.frobenius, "frobenius_ci": [fro.ci_low, fro.ci_high],
                     "bound": bnd.bound, "bound_terms": {k: getattr(bnd, k) for k in (
                         "kappa_X", "kappa_WQ", "kappa_WK", "kappa_WV", "kappa_Lambda", "kappa_softmax")},
                     "bound_notes": bnd.notes, "notes": "; ".join(n for n in (est.notes, fro.notes) if n),
                     "subspace": est.subspace, "time_s": time.perf_counter() - t0})
    return rows


# the value fields of a probed row (None in a skipped one)
_VALUE_KEYS = ("shape", "sigma_max", "sigma_min", "kappa", "rank_deficient", "converged", "residual_max",
               "residual_min", "frobenius", "frobenius_ci", "bound", "bound_terms", "bound_notes", "notes",
               "subspace", "time_s")


def _plot(rows, out, title):
    from condinit.io.atomic import atomic_output

    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    idx = [r["layer"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label in (("sigma_max", "sigma_max"), ("sigma_min", "sigma_min (complement)"), ("kappa", "kappa(J)"),
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


def run(args) -> int:
    from condinit._validate import check_int, check_seed
    from condinit.io.atomic import atomic_output, check_output_path
    from condinit.models.presets import PRESETS

    # every check before any work or write
    if args.preset not in PRESETS:
        raise ValueError(f"unknown preset {args.preset!r}; choose one of {', '.join(PRESETS)}")
    for name, val in (("--seq-len", args.seq_len), ("--batch", args.batch), ("--steps", args.steps)):
        check_int(name, val, min=1)
    check_int("--samples", args.samples, min=2)
    check_int("--layers", args.layers, min=1, allow_none=True)
    check_seed("--seed", args.seed)
    plot = check_output_path(args.plot) if args.plot else None
    out_json = check_output_path(args.json) if args.json else None
    if plot and not plot.lower().endswith(".png"):
        raise ValueError(f"--plot must name a .png file, got {args.plot}")
    from condinit.models.checkpoint import open_checkpoint
    open_checkpoint(args.file).__exit__(None, None, None)   # safetensors? (before building the model)

    model, family = _load(args.file, args.preset)
    inputs = _batch(model, family, args.batch, args.seq_len, args.seed)
    rows = probe_model(model, inputs, steps=args.steps, samples=args.samples, seed=args.seed, wrt=args.wrt,
                       max_layers=args.layers)
    head = f"{'layer':>5}  {'name':<34} {'sigma_max':>10} {'sigma_min*':>10} {'kappa(J)':>10} {'||J||_F':>10} " \
           f"{'bound':>10}"
    print(f"{args.file}: preset {args.preset}, wrt={args.wrt}, batch {args.batch} x "
          f"{inputs['input_ids'].shape[1] if 'input_ids' in inputs else 'image'} tokens, {args.steps} Lanczos steps")
    print(head)
    for r in rows:
        if r["skipped"] is not None:
            print(f"{r['layer']:>5}  {r['name'][-34:]:<34} {r['skipped']}")
            continue
        kappa = "rank-def." if r["rank_deficient"] else _fmt(r["kappa"])
        flag = "" if r["converged"] else " (not converged: sigma_min is an upper bound, kappa a lower bound)"
        print(f"{r['layer']:>5}  {r['name'][-34:]:<34} {_fmt(r['sigma_max']):>10} {_fmt(r['sigma_min']):>10} "
              f"{kappa:>10} {_fmt(r['frobenius']):>10} {_fmt(r['bound']):>10}{flag}")
    print("bound: upper bound on kappa(J) of each head and sequence, the largest shown "
          "(condinit.probe.condition_number_bound)")
    probed = [r for r in rows if r["skipped"] is None]
    if any(r["bound"] is None for r in probed):
        print("bound '-': vacuous for that layer (a term is infinite: e.g. repeated tokens give a rank-deficient "
              "X, one token a zero softmax Jacobian; the JSON's bound_notes says which)")
    if probed:
        print("* sigma_min on the orthogonal complement of the known null directions: " + probed[0]["subspace"])
    if out_json:
        with atomic_output(out_json) as tmp:
            with open(tmp, "w", encoding="utf-8") as fh:
                json.dump(_finite_or_none({"file": args.file, "preset": args.preset, "wrt": args.wrt,
                                           "batch": args.batch, "seq_len": args.seq_len, "steps": args.steps,
                                           "seed": args.seed, "layers": rows}),
                          fh, indent=1, allow_nan=False, default=str)
        print(f"wrote {out_json}")
    if plot:
        _plot(rows, plot, f"{args.preset}: attention Jacobian ({args.wrt})")
        print(f"wrote {plot}")
    return 0
