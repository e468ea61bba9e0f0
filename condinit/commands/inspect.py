"""``condinit inspect``: per-head condition numbers of the attention weights in a safetensors file.

    condinit inspect model.safetensors [--plot cond.png]
    condinit inspect llama-8b/            # a model directory: its shards, through the index
    condinit inspect other.safetensors --num-heads 12 [--head-dim 64] [--num-kv-heads 4]
    condinit inspect neox.safetensors --num-heads 16 --layout per_head

Reads with safetensors only (never unpickles: a ``torch.save`` / pickle file is refused). A
directory is read as a Hugging Face model directory, through ``model.safetensors.index.json`` (or its
one ``model.safetensors``), tensor by tensor, so memory stays at one tensor whatever the model's
size (:class:`condinit.models.checkpoint.ShardedCheckpoint`). Attention
weights are located from the ``condinit`` header entry that ``condinit init`` writes (tensors, row
ranges and, for interleaved fused weights such as GPT-NeoX's ``[H, 3, d]``, their groups: each head
is read from its own rows), or else by the parameter names of the supported families
(``q_proj/k_proj/v_proj``, ``query/key/value``, GPT-2's fused transposed ``c_attn``, timm's ``qkv``,
``in_proj_weight``, ``query_key_value``, ``Wqkv``, ``qkv_proj``), with head counts from the options.
A fused weight is read as ``[Q; K; V]`` unless ``--layout`` says otherwise
(:func:`condinit.models.spec.fused_layout`); ``query_key_value`` has no default (GPT-NeoX,
BLOOM, Persimmon and Falcon-RW interleave it per head, ``per_head``; Falcon's new decoder
architecture per group, ``per_group``). The modules that ``condinit init`` left unconditioned are
listed after the table.
For every layer and Q/K/V it prints the min / median / max over heads of ``kappa = sigma_max /
sigma_min`` of each head's ``[head_dim, in]`` block (float64, :func:`condinit.init.spectrum`);
``--plot`` draws them per layer (matplotlib, Agg) into an image written atomically.
"""
from __future__ import annotations

import math
import os
import re
from typing import Optional

NAME = "inspect"
HELP = "per-layer / per-head condition numbers of Q/K/V in a .safetensors file or model directory"


def add_arguments(p):
    p.add_argument("file", metavar="FILE.safetensors|DIR", help="checkpoint to read (safetensors only): a file, or "
                   "a model directory (sharded through model.safetensors.index.json, or one model.safetensors)")
    p.add_argument("--plot", metavar="OUT.png", default=None, help="write a figure of kappa per layer")
    p.add_argument("--num-heads", type=int, default=None, help="heads of Q (needed without condinit metadata)")
    p.add_argument("--num-kv-heads", type=int, default=None, help="heads of K/V (default: inferred)")
    p.add_argument("--head-dim", type=int, default=None, help="head dimension (default: rows / heads)")
    p.add_argument("--layout", choices=("contiguous", "per_head", "per_group"), default=None,
                   help="row layout of fused Q/K/V weights in a file without condinit metadata (default "
                        "contiguous [Q; K; V]; required for query_key_value)")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")


def analyze(path, *, num_heads=None, num_kv_heads=None, head_dim=None, layout=None):
    """``(metadata, rows)``: one row per attention layer with per-head kappa of Q, K, V.

    ``layout``: how fused Q/K/V weights of a file without condinit metadata interleave
    (``"contiguous"``, ``"per_head"``, ``"per_group"``; see
    :func:`condinit.models.spec.fused_layout`).

    Examples:
        >>> meta, rows = analyze("tiny.safetensors")                       # condinit init --preset tiny-llama
        >>> len(rows), rows[0]["layout"]
        (4, 'separate')
        >>> meta, rows = analyze("neox.safetensors", num_heads=16, layout="per_head")   # no metadata
    """
    from condinit._validate import check_choice, check_int
    from condinit.init.spectrum import spectrum
    from condinit.models.checkpoint import open_checkpoint, read_metadata

    for name, val in (("--num-heads", num_heads), ("--num-kv-heads", num_kv_heads), ("--head-dim", head_dim)):
        check_int(name, val, min=1, allow_none=True)
    check_choice("--layout", layout, ("contiguous", "per_head", "per_group"), allow_none=True)
    with open_checkpoint(path) as fh:        # the headers only: metadata, names and shapes
        meta = read_metadata(fh)
        if meta is not None and layout is not None:
            raise ValueError(f"{path}: --layout is for files without condinit metadata; this file's metadata gives "
                             f"every projection's rows")
        shapes = {k: tuple(fh.get_slice(k).get_shape()) for k in fh.keys()}
    layers = locate_attention(shapes, meta, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
    if meta is None:
        layers = [_relayout(loc, shapes, layout, path) for loc in layers]
    if not layers:
        raise ValueError(f"{path}: no attention weights found (looked for q_proj/k_proj/v_proj, query/key/value, "
                         f"c_attn, qkv, in_proj_weight, wq/wk/wv)")
    rows = []
    for i, loc in enumerate(layers):
        row = {"layer": loc.get("index", i), "name": loc["name"], "num_heads": loc["num_heads"],
               "num_kv_heads": loc["num_kv_heads"], "head_dim": loc["head_dim"],
               "layout": loc.get("layout") or _layout_of(loc)}
        # one layer's tensors mapped at a time, in file order (a shard after the other): closing the
        # file unmaps what was read, so memory stays at one layer whatever the model's size
        with open_checkpoint(path) as fh:
            cache: dict = {}
            for p in ("q", "k", "v"):
                smax, smin, cond = spectrum(projection_blocks(fh, loc, p, cache))
                row[p] = {"cond_per_head": cond.tolist(), "sigma_max": float(smax.max()),
                          "sigma_min": float(smin.min())}
            cache.clear()
        rows.append(row)
    return meta, rows


# ------------------------------------------------------------------------------------------------
# where the attention weights are in a checkpoint

# Name patterns of the supported families, for checkpoints without condinit metadata.
#   separate:  (prefix, {q: name, k: name, v: name})
#   fused:     one tensor holding q, k, v (transposed for GPT-2 Conv1D)
_SEPARATE = [
    re.compile(r"^(?P<prefix>.*)\.(?P<p>q|k|v)_proj\.weight$"),          # llama, mistral, qwen2, ViT (transformers 5)
    re.compile(r"^(?P<prefix>.*)\.(?P<p>query|key|value)\.weight$"),     # BERT, RoBERTa, ViT (transformers 4)
    re.compile(r"^(?P<prefix>.*)\.(?P<p>q|k|v)_proj_weight$"),            # nn.MultiheadAttention, kdim != embed_dim
    re.compile(r"^(?P<prefix>.*)\.(?P<p>wq|wk|wv)\.weight$"),             # Meta llama reference, torchtitan
]
_FUSED = [
    (re.compile(r"^(?P<prefix>.*)\.c_attn\.weight$"), True),              # GPT-2 Conv1D [in, 3E]
    (re.compile(r"^(?P<prefix>.*)\.qkv\.weight$"), False),                # timm [3E, E]
    (re.compile(r"^(?P<prefix>.*)\.in_proj_weight$"), False),             # nn.MultiheadAttention [3E, E]
    (re.compile(r"^(?P<prefix>.*)\.(?:query_key_value|Wqkv|qkv_proj)\.weight$"), False),
]
_CANON = {"q": "q", "k": "k", "v": "v", "query": "q", "key": "k", "value": "v", "wq": "q", "wk": "k", "wv": "v"}


def _layer_sort_key(name: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def locate_attention(shapes: dict, metadata: Optional[dict] = None, *, num_heads: Optional[int] = None,
                     num_kv_heads: Optional[int] = None, head_dim: Optional[int] = None,
                     source: Optional[str] = None) -> list[dict]:
    """Attention layers of a checkpoint: ``[{name, num_heads, num_kv_heads, head_dim, q: {tensor, start,
    stop, transposed}, k, v}]``.

    ``shapes``: tensor name -> shape. The ``condinit`` metadata gives everything; otherwise layers
    are found by the name patterns of the supported families and head counts come from
    ``num_heads`` (required), ``head_dim`` (default ``q rows / num_heads``) and ``num_kv_heads``
    (default ``k rows / head_dim``). Options given explicitly override the metadata's head counts.
    ``source`` (the file's name) starts every error message. Metadata that does not fit the tensors
    (a field of the wrong type, a missing or 1-D tensor, rows out of range) is a ValueError.

    Examples:
        >>> with open_checkpoint("tiny.safetensors") as fh:
        ...     shapes = {k: tuple(fh.get_slice(k).get_shape()) for k in fh.keys()}
        ...     layers = locate_attention(shapes, read_metadata(fh), source="tiny.safetensors")
        >>> locate_attention({"h.0.attn.c_attn.weight": (48, 144)}, num_heads=4)[0]["k"]
        {'tensor': 'h.0.attn.c_attn.weight', 'start': 48, 'stop': 96, 'transposed': True}
    """
    from condinit._validate import check_int
    from condinit.models.checkpoint import check_metadata, check_metadata_tensors

    for name, val in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
        check_int(name, val, min=1, allow_none=True)
    where = source or "checkpoint"
    pre = f"{source}: " if source else ""
    if metadata is not None:
        check_metadata(metadata, where)
        check_metadata_tensors(metadata, shapes, where)
    if metadata and metadata.get("layers"):
        out = []
        for ent in metadata["layers"]:
            ent = dict(ent)
            if num_heads is not None:
                ent["num_heads"] = num_heads
            if num_kv_heads is not None:
                ent["num_kv_heads"] = num_kv_heads
            if head_dim is not None:
                ent["head_dim"] = head_dim
            out.append(ent)
        return out
    layers: dict[str, dict] = {}
    for name in shapes:
        for pat in _SEPARATE:
            m = pat.match(name)
            if m and len(shapes[name]) == 2:
                layers.setdefault(m["prefix"], {})[_CANON[m["p"]]] = (name, shapes[name])
                break
        else:
            for pat, transposed in _FUSED:
                m = pat.match(name)
                if m and len(shapes[name]) == 2:
                    layers.setdefault(m["prefix"], {})["fused"] = (name, shapes[name], transposed)
                    break
    found = []
    for prefix in sorted(layers, key=_layer_sort_key):
        ent = layers[prefix]
        if "fused" not in ent and not all(p in ent for p in "qkv"):
            continue
        if num_heads is None:
            raise ValueError(f"{pre}the checkpoint has no condinit metadata: pass --num-heads (and --head-dim / "
                             "--num-kv-heads when they cannot be inferred) to split its attention weights into heads")
        rec = {"name": prefix}
        if "fused" in ent:
            tname, shape, transposed = ent["fused"]
            total = shape[1] if transposed else shape[0]
            kv = num_kv_heads if num_kv_heads is not None else num_heads
            d = head_dim if head_dim is not None else total // (num_heads + 2 * kv)
            if (num_heads + 2 * kv) * d != total:
                raise ValueError(f"{pre}{tname}: {total} fused output rows do not split into {num_heads} + 2 x {kv} "
                                 f"heads of {d}")
            at = 0
            for p, rows in (("q", num_heads * d), ("k", kv * d), ("v", kv * d)):
                rec[p] = {"tensor": tname, "start": at, "stop": at + rows, "transposed": transposed}
                at += rows
        else:
            qrows = ent["q"][1][0]
            d = head_dim if head_dim is not None else qrows // num_heads
            if d < 1 or num_heads * d != qrows:
                raise ValueError(f"{pre}{ent['q'][0]}: {qrows} rows do not split into {num_heads} heads"
                                 + (f" of {head_dim}" if head_dim else ""))
            kv = num_kv_heads if num_kv_heads is not None else ent["k"][1][0] // d
            for p in "qkv":
                rows = ent[p][1][0]
                rec[p] = {"tensor": ent[p][0], "start": 0, "stop": rows, "transposed": False}
            if ent["k"][1][0] != kv * d:
                raise ValueError(f"{pre}{ent['k'][0]}: {ent['k'][1][0]} rows do not split into {kv} heads of {d}")
        rec.update(num_heads=num_heads, num_kv_heads=kv, head_dim=d)
        found.append(rec)
    return found


def projection_blocks(fh, loc: dict, p: str, cache: dict) -> torch.Tensor:
    """Per-head blocks ``[heads, head_dim, in]`` (nn.Linear layout; in the stored floating dtype, other
    dtypes as float32) of projection ``p`` of layer ``loc`` (from :func:`locate_attention`) from an
    open checkpoint; ``cache`` keeps the last tensor read (fused layers read it once). A tensor that is not a 2-D weight with those rows is a
    ValueError naming the file and the tensor.

    Examples:
        >>> with open_checkpoint("tiny.safetensors") as fh:
        ...     loc = locate_attention(shapes, read_metadata(fh))[0]
        ...     projection_blocks(fh, loc, "q", {}).shape
        torch.Size([8, 32, 256])
    """
    import torch

    from condinit.models.checkpoint import entry_rows, entry_stop

    where = getattr(fh, "path", "checkpoint")
    ent = loc[p]
    name = ent["tensor"]
    if cache.get("name") != name:
        cache["name"], cache["tensor"] = name, fh.get_tensor(name)
    w = cache["tensor"]
    what = f"tensor {name!r} ({loc['name']}.{p})"
    if "matrix_shape" in ent and w.numel() == math.prod(ent["matrix_shape"]):
        w = w.reshape(ent["matrix_shape"])
    if w.dim() != 2:
        raise ValueError(f"{where}: {what} is {w.dim()}-D with shape {list(w.shape)}, expected a 2-D projection "
                         f"weight")
    rows = w.shape[1] if ent["transposed"] else w.shape[0]
    if not 0 <= ent["start"] < ent["stop"] <= entry_stop(ent) <= rows:
        raise ValueError(f"{where}: {what}: rows {ent['start']}:{entry_stop(ent)} are out of range, it has {rows}")
    parts = [w[:, lo:hi].t() if ent["transposed"] else w[lo:hi] for lo, hi in entry_rows(ent)]
    w = parts[0] if len(parts) == 1 else torch.cat(parts)
    heads = loc["num_heads"] if p == "q" else loc["num_kv_heads"]
    d = ent.get("head_dim", loc["head_dim"])     # latent attention: its K and V heads have their own width
    if w.shape[0] != heads * d:
        raise ValueError(f"{where}: {what} has {w.shape[0]} rows, expected {heads} heads x {d}")
    if w.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        w = w.float()          # spectrum() reads the others as they are stored, in float64
    return w.reshape(heads, d, w.shape[1])


def _layout_of(loc) -> str:
    if len({loc[p]["tensor"] for p in "qkv"}) == 3:
        return "separate"
    g = loc["q"].get("groups", 1)
    return "contiguous" if g == 1 else ("per_head" if g == loc["num_heads"] else "per_group")


def _relayout(loc: dict, shapes: dict, layout, path) -> dict:
    """A layer located by name in a file without metadata, its fused weight re-read with ``layout``."""
    from condinit.models.spec import fused_layout

    tensors = {loc[p]["tensor"] for p in "qkv"}
    if len(tensors) != 1:
        return loc
    (name,) = tensors
    if layout is None:
        if name.endswith("query_key_value.weight"):
            raise ValueError(f"{path}: {name} is a fused query_key_value weight and the file has no condinit metadata "
                             f"saying how its rows alternate: pass --layout per_head (GPT-NeoX, BLOOM, Persimmon, "
                             f"Falcon-RW), per_group (Falcon's new decoder architecture) or contiguous")
        return loc
    transposed = loc["q"]["transposed"]
    total = shapes[name][1 if transposed else 0]
    parts = fused_layout(total, num_heads=loc["num_heads"], num_kv_heads=loc["num_kv_heads"], head_dim=loc["head_dim"],
                         layout=layout)
    out = dict(loc, layout=layout)
    for p in "qkv":
        start, stop, groups, stride = parts[p]
        out[p] = {"tensor": name, "start": start, "stop": stop, "transposed": transposed}
        if groups > 1:
            out[p].update(groups=groups, stride=stride)
    return out


def _stats(vals):
    s = sorted(vals)
    n = len(s)
    med = s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])
    return s[0], med, s[-1]


def plot(rows, out, title):
    from condinit.io.atomic import atomic_output

    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    ext = os.path.splitext(out)[1].lstrip(".").lower() or "png"
    fig, ax = plt.subplots(figsize=(8, 4.5))
    x = list(range(len(rows)))
    # kappa - 1 on a symlog axis: a conditioned init sits at 0 .. 1e-6, a trained or default-init
    # checkpoint at 1 .. 1e3, and both stay readable (a log axis of kappa itself is not)
    for p, color in (("q", "tab:blue"), ("k", "tab:orange"), ("v", "tab:green")):
        st = [_stats([min(c, 1e12) - 1 for c in r[p]["cond_per_head"]]) for r in rows]
        ax.plot(x, [s[1] for s in st], marker="o", ms=3, color=color, label=f"W_{p.upper()} median")
        ax.fill_between(x, [s[0] for s in st], [s[2] for s in st], color=color, alpha=0.2)
    ax.set_yscale("symlog", linthresh=1e-8)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("attention layer")
    ax.set_ylabel("κ − 1 per head (band: min–max over heads)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    try:
        with atomic_output(out) as tmp:
            fig.savefig(tmp, format=ext)
    finally:
        plt.close(fig)


def run(args) -> int:
    from condinit.commands import check_png_output
    from condinit.io.safetensors_format import PICKLE_SUFFIXES

    if args.plot is not None:
        check_png_output("--plot", args.plot)
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ValueError("--plot needs matplotlib: pip install 'condinit[plot]'") from None
    if args.file.lower().endswith(PICKLE_SUFFIXES) and not os.path.isdir(args.file):
        raise ValueError(f"{args.file}: pickle-based checkpoints ({', '.join(PICKLE_SUFFIXES)}) are refused; condinit "
                         f"reads only safetensors files and never unpickles (convert with safetensors first)")
    meta, rows = analyze(args.file, num_heads=args.num_heads, num_kv_heads=args.num_kv_heads, head_dim=args.head_dim,
                         layout=args.layout)
    if args.plot is not None:
        plot(rows, args.plot, os.path.basename(os.path.normpath(args.file)))
    if args.json:
        import json

        print(json.dumps({"file": args.file, "metadata": meta, "layers": rows}, indent=1))
        return 0
    from condinit.models.report import wide_console
    from rich.table import Table

    t = Table(title=f"{args.file}: κ = σmax/σmin per head, min / median / max over heads"
                    + (f" (condinit {meta.get('family')}, seed {meta.get('seed')})" if meta else ""))
    for col in ("layer", "name", "heads", "layout", "Q κ", "K κ", "V κ"):
        t.add_column(col, overflow="fold")
    for r in rows:
        t.add_row(str(r["layer"]), r["name"], f"{r['num_heads']}/{r['num_kv_heads']}x{r['head_dim']}", r["layout"],
                  *("/".join(f"{v:.7g}" for v in _stats(r[p]["cond_per_head"])) for p in ("q", "k", "v")))
    con = wide_console()
    con.print(t)
    uncovered = (meta or {}).get("uncovered") or []
    if uncovered:
        from condinit.models.apply import Uncovered
        from condinit.models.report import uncovered_table

        con.print(uncovered_table([Uncovered(u["name"], u["class"], u["reason"]) for u in uncovered],
                                  title=f"not conditioned when the file was written: {len(uncovered)} attention-like "
                                        f"module(s), left as the model made them"))
    if args.plot is not None:
        con.print(f"wrote {os.path.abspath(args.plot)}")
    return 0
