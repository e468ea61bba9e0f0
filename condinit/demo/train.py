"""Training loop, learning-rate sweep and attention-Jacobian probe for ``condinit demo``.

Each run trains one small Transformer (:mod:`condinit.demo.models`) on one task
(:mod:`condinit.demo.tasks`) from one init (:mod:`condinit.demo.inits`), one learning rate and one
seed, with AdamW, linear warmup then cosine decay, gradient clipping at 1. Every init is run at
each of the task's learning rates (``base_lr`` times ``lr_multipliers``), so the report can judge
each init at its own best rate. A run records per step the training loss, every ``eval_every``
steps the validation loss and accuracy (and, for MQAR, the accuracy per query), and at step 0,
every ``probe_every`` steps and at the end, per attention layer:

* ``kappa(J) = sigma_max / sigma_min`` of the layer's Jacobian with respect to its weights,

      J = [dA/dW_Q, dA/dW_K, dA/dW_V],   A(X) = softmax(X W_Q W_K^T X^T / sqrt(d) + M) X W_V

  per head (``M`` the causal mask for causal tasks; biases held fixed) at the layer's actual input
  ``X`` (the LayerNorm'd residual stream of a fixed validation example, its first ``probe_len``
  positions), exactly the function ``nn.MultiheadAttention`` computes before ``W_O``. ``J``'s rows
  come from :class:`condinit.probe.JacobianOperator` (``wrt="weights"``, float64, ``rmatmat``);
  every row of a head's block lies in ``R^d (x) row(X)`` (``W`` enters only through ``W x_j``), so
  the block is projected onto an orthonormal basis of ``row(X)`` first, which leaves its singular
  values unchanged and makes the SVD small. ``sigma_min`` is the smallest of the ``N d`` singular
  values per head (``J`` is wide), over the heads.
* ``sigma_min(P X)``: the value path alone. ``dA/dW_V = (P X) (x) I_d`` with ``P`` the head's
  attention probabilities, so ``J J^T >= (P X)(P X)^T (x) I_d`` and ``sigma_min(J) >=
  sigma_min(P X)`` (for ``N <= D``). ``value_share``: the fraction of ``sigma_min(J)^2`` that
  the ``W_V`` columns carry along ``J``'s smallest left singular direction. Near 1 (and
  ``sigma_min(J)`` near ``sigma_min(P X)``), the value path sets kappa, not ``W_Q`` / ``W_K``:
  a near-uniform ``P`` makes ``P X`` almost rank one, a causal mask makes the first rows of
  ``P X`` copies of single inputs.

With several probe examples the per-layer numbers are geometric means (``value_share``:
arithmetic mean).

Reproducibility: every random draw comes from ``torch.manual_seed(seed)`` (model) or a
:class:`torch.Generator` seeded from ``seed`` (data order); every run is single-threaded with
deterministic algorithms, so results do not depend on ``jobs``.
"""
from __future__ import annotations

import math
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from condinit._validate import SEED_MAX, check_bool, check_choice, check_int, check_real, check_seed, check_tensor
from condinit.probe import InputCapture, JacobianOperator
from condinit.probe.estimators import default_rank_rtol

from .inits import INITS, initialize_
from .models import TinyLM, TinyViT, attention_modules
from .tasks import TASKS, SequenceTask, Task, make_task

__all__ = ["TaskConfig", "DEFAULT_CONFIGS", "QUICK_CONFIGS", "QUICK_INITS", "task_config", "build_model",
           "attention_jacobian_sigma", "head_probe", "probe_kappa", "train_run", "run_demo", "run_key",
           "deterministic"]


@dataclass(frozen=True)
class TaskConfig:
    """Hyper-parameters of one task's runs (identical for every init)."""

    task: str
    steps: int
    batch_size: int
    lr: float                                   # base learning rate (the 1x of the sweep)
    lr_multipliers: tuple = (0.3, 1.0, 3.0)
    weight_decay: float = 0.05
    warmup_frac: float = 0.05
    min_lr_frac: float = 0.1
    eval_every: int = 25
    probe_every: int = 0                        # 0: probe at step 0 and at the end only
    probe_examples: int = 1
    probe_len: Optional[int] = None             # positions of the layer input the probe uses
    model: dict = field(default_factory=dict)


_MQAR_MODEL = dict(depth=2, mlp_ratio=2)
DEFAULT_CONFIGS = {
    "mqar-32": TaskConfig("mqar-32", steps=1000, batch_size=64, lr=1e-3, eval_every=25,
                          model=dict(dim=32, num_heads=2, **_MQAR_MODEL)),
    "mqar-128": TaskConfig("mqar-128", steps=300, batch_size=32, lr=1e-3, eval_every=15,
                           model=dict(dim=128, num_heads=4, **_MQAR_MODEL)),
    "lm-causal": TaskConfig("lm-causal", steps=300, batch_size=16, lr=2e-3, eval_every=15, probe_len=16,
                            model=dict(dim=64, depth=2, num_heads=4, mlp_ratio=2)),
    "lm-masked": TaskConfig("lm-masked", steps=300, batch_size=16, lr=2e-3, eval_every=15, probe_len=16,
                            model=dict(dim=64, depth=2, num_heads=4, mlp_ratio=2)),
    "vision": TaskConfig("vision", steps=300, batch_size=64, lr=2e-3, eval_every=15,
                         model=dict(dim=32, depth=2, num_heads=2, mlp_ratio=2)),
}
QUICK_CONFIGS = {t: replace(c, steps=20, eval_every=5, lr_multipliers=(1.0, 3.0), probe_len=min(c.probe_len or 16, 16))
                 for t, c in DEFAULT_CONFIGS.items()}
QUICK_INITS = ("default", "conditioned")


def task_config(task: str, *, quick: bool = False, steps: Optional[int] = None,
                lr_multipliers: Optional[tuple] = None) -> TaskConfig:
    """The hyper-parameters of ``task``'s runs (``quick``: the smoke-run ones; ``steps`` overrides
    the step count, ``lr_multipliers`` the sweep)."""
    check_choice("task", task, TASKS)
    check_bool("quick", quick)
    steps = check_int("steps", steps, min=1, allow_none=True)
    cfg = (QUICK_CONFIGS if quick else DEFAULT_CONFIGS)[task]
    if steps is not None:
        cfg = replace(cfg, steps=steps, eval_every=max(1, min(cfg.eval_every, steps // 20 or 1)),
                      probe_every=0 if cfg.probe_every == 0 else min(cfg.probe_every, steps))
    if lr_multipliers is not None:
        mults = tuple(check_real("lr_multipliers", m, min=0.0, min_open=True) for m in lr_multipliers)
        if not mults or len(set(mults)) != len(mults):
            raise ValueError(f"lr_multipliers must be distinct positive numbers, got {lr_multipliers!r}")
        cfg = replace(cfg, lr_multipliers=mults)
    return cfg


def build_model(task: Task, cfg: TaskConfig) -> nn.Module:
    if task.name == "vision":
        return TinyViT(num_classes=task.num_classes, **cfg.model)
    return TinyLM(vocab_size=task.num_classes, max_len=task.x_test.shape[1], causal=task.causal, **cfg.model)


def run_key(run: dict) -> tuple:
    return run["task"], run["init"], run["lr_mult"], run["seed"]


# ------------------------------------------------------------------------------------------------
# attention Jacobian probe

def _head_probs(mha: nn.MultiheadAttention, x: torch.Tensor, causal: bool) -> torch.Tensor:
    """Attention probabilities ``[H, N, N]`` of ``mha`` at input ``x`` ``[N, D]`` (float64)."""
    e, h, d = mha.embed_dim, mha.num_heads, mha.head_dim
    w = mha.in_proj_weight.detach().double()
    b = mha.in_proj_bias.detach().double() if mha.in_proj_bias is not None else torch.zeros(3 * e, dtype=torch.float64)
    q = (x @ w[:e].T + b[:e]).reshape(-1, h, d).transpose(0, 1)
    k = (x @ w[e:2 * e].T + b[e:2 * e]).reshape(-1, h, d).transpose(0, 1)
    s = q @ k.transpose(1, 2) / math.sqrt(d)
    if causal:
        n = x.shape[0]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu_(1), float("-inf"))
    return torch.softmax(s, dim=-1)


def _smallest_left_vector(rmat: torch.Tensor, s: torch.Tensor, iters: int = 30) -> torch.Tensor:
    """The smallest eigenvector of ``rmat^T rmat`` (``block block^T``; ``rmat`` upper triangular,
    ``s`` its singular values): inverse iteration with two triangular solves per step, from a fixed
    start (no random draws); a dense eigendecomposition when ``rmat`` is singular to working precision."""
    if not s[-1] > 1e-12 * s[0]:
        return torch.linalg.eigh(rmat.T @ rmat)[1][:, 0]
    u = torch.ones(rmat.shape[0], 1, dtype=rmat.dtype)
    for _ in range(iters):
        y = torch.linalg.solve_triangular(rmat.T, u, upper=False)    # rmat^T y = u
        u = torch.linalg.solve_triangular(rmat, y, upper=True)       # rmat u' = y
        u = u / u.norm()
    return u[:, 0]


def head_probe(mha: nn.MultiheadAttention, x: torch.Tensor, *, causal: bool = False) -> list[dict]:
    """Per head: ``sigma_max``, ``sigma_min`` of ``J_h = [dA_h/dW_Q, dA_h/dW_K, dA_h/dW_V]`` at input
    ``x`` (``[N, D]``), ``sigma_min_px`` (of ``P_h X``) and ``value_share`` (see module doc).

    Examples:
        >>> mha = torch.nn.MultiheadAttention(16, 2, batch_first=True)
        >>> heads = head_probe(mha, torch.randn(6, 16), causal=True)
        >>> all(h["sigma_min"] >= h["sigma_min_px"] for h in heads)
        True
    """
    check_tensor("x", x, floating=True, dim=2)
    # J wrt the weights is J_qkv (the operator wrt (Q, K, V)) composed with dW -> X dW^T. Heads are
    # independent (J is block diagonal over heads), so each head gets its own single-head operator.
    # A head's rows lie in R^d (x) row(X): on an orthonormal basis B of row(X) (any basis of a space
    # containing it keeps the singular values) its block is [d r] per projection, dW B = dQ^T (X B).
    xd = x.detach().double()
    N, D = xd.shape
    e, H, d = mha.embed_dim, mha.num_heads, mha.head_dim
    if D != e:
        raise ValueError(f"x must be [N, {e}] (the layer's width), got {tuple(x.shape)}")
    w = mha.in_proj_weight.detach().double()
    b = mha.in_proj_bias.detach().double() if mha.in_proj_bias is not None else torch.zeros(3 * e, dtype=torch.float64)
    basis = torch.linalg.qr(xd.T, mode="reduced")[0] if N < D else torch.eye(D, dtype=torch.float64)
    xb = xd @ basis                                                 # [N, r]
    r = basis.shape[1]
    probs = _head_probs(mha, xd, causal)
    out = []
    for h in range(H):
        qkv = [(xd @ w[p * e + h * d:p * e + (h + 1) * d].T + b[p * e + h * d:p * e + (h + 1) * d])[None, None]
               for p in range(3)]                                   # [1, 1, N, d] each
        op = JacobianOperator(tuple(qkv), wrt="qkv", causal=causal, scale=1.0 / math.sqrt(d), dtype=torch.float64)
        pieces = op.split_input(op.rmatmat(torch.eye(op.m, dtype=torch.float64)).T)  # rows of J_qkv: [N d, 1, 1, N, d]
        block = torch.cat([torch.einsum("pja,js->pas", p[:, 0, 0], xb).reshape(op.m, -1) for p in pieces],
                          dim=1)                                    # [N d, 3 d r]
        rmat = torch.linalg.qr(block.T, mode="r")[1]                # block = rmat^T Q^T: same singular values
        s = torch.linalg.svdvals(rmat)
        u_min = _smallest_left_vector(rmat, s)
        v_cols = block[:, 2 * d * r:]
        share = float((v_cols.T @ u_min).square().sum() / (block.T @ u_min).square().sum())
        spx = torch.linalg.svdvals(probs[h] @ xd)
        out.append({"sigma_max": float(s[0]), "sigma_min": float(s[-1]), "sigma_min_px": float(spx.min()),
                    "value_share": share})
    return out


def attention_jacobian_sigma(mha: nn.MultiheadAttention, x: torch.Tensor, *, causal: bool = False):
    """``(sigma_max, sigma_min)`` of ``J = [dA/dW_Q, dA/dW_K, dA/dW_V]`` at input ``x`` (``[N, D]``),
    over all heads (``J`` is block diagonal over heads)."""
    heads = head_probe(mha, x, causal=causal)
    return max(h["sigma_max"] for h in heads), min(h["sigma_min"] for h in heads)


RANK_RTOL = default_rank_rtol(torch.float64)   # sigma_min / sigma_max at or below this: rank-deficient


@torch.no_grad()
def probe_kappa(model: nn.Module, x_probe: torch.Tensor, *, causal: bool, probe_len: Optional[int] = None) -> list[dict]:
    """Per attention layer: ``sigma_max``, ``sigma_min``, ``kappa``, ``sigma_min_px`` and
    ``value_share`` (at the head holding ``sigma_min``), geometric means over the examples in
    ``x_probe``. ``kappa`` is ``inf`` (and ``rank_deficient`` True) when ``sigma_min <= RANK_RTOL
    sigma_max`` for some example."""
    mhas = attention_modules(model)
    with InputCapture(mhas) as cap:
        model(x_probe)
    out = []
    n_ex = x_probe.shape[0]
    for i, m in enumerate(mhas):
        acc = {"sigma_max": 0.0, "sigma_min": 0.0, "sigma_min_px": 0.0}
        share, deficient = 0.0, False
        for ex in range(n_ex):
            x = cap.inputs[i][ex]
            if probe_len is not None:
                x = x[:probe_len]
            heads = head_probe(m, x, causal=causal)
            smax = max(h["sigma_max"] for h in heads)
            low = min(heads, key=lambda h: h["sigma_min"])
            deficient |= not low["sigma_min"] > RANK_RTOL * smax
            for key, v in (("sigma_max", smax), ("sigma_min", low["sigma_min"]),
                           ("sigma_min_px", min(h["sigma_min_px"] for h in heads))):
                acc[key] += (math.log(v) if v > 0 else -745.0) / n_ex
            share += low["value_share"] / n_ex
        rec = {k: math.exp(v) for k, v in acc.items()}
        rec.update({"layer": i, "kappa": math.inf if deficient else rec["sigma_max"] / rec["sigma_min"],
                    "rank_deficient": deficient, "value_share": share})
        out.append(rec)
    return out


# ------------------------------------------------------------------------------------------------
# training

def _scored(logits: torch.Tensor, y: torch.Tensor):
    if logits.dim() == 3:
        logits, y = logits.reshape(-1, logits.shape[-1]), y.reshape(-1)
        keep = y != -100
        logits, y = logits[keep], y[keep]
    return logits, y


def _loss_acc(logits: torch.Tensor, y: torch.Tensor):
    logits, y = _scored(logits, y)
    loss = F.cross_entropy(logits, y)
    acc = (logits.argmax(-1) == y).float().mean()
    return loss, acc


@torch.no_grad()
def evaluate(model: nn.Module, task: Task, batch: int = 512):
    """``(loss, accuracy, per-query accuracy or None)`` on the task's validation set."""
    model.eval()
    tot_loss, tot_acc, n = 0.0, 0.0, 0
    per_query = None
    if isinstance(task, SequenceTask):
        per_query = torch.zeros(len(task.query_positions), dtype=torch.float64)
    for i in range(0, task.x_test.shape[0], batch):
        x, y = task.x_test[i:i + batch], task.y_test[i:i + batch]
        logits = model(x)
        loss, acc = _loss_acc(logits, y)
        k = int((y != -100).sum()) if y.dim() == 2 else y.shape[0]
        tot_loss, tot_acc, n = tot_loss + float(loss) * k, tot_acc + float(acc) * k, n + k
        if per_query is not None:
            qp = list(task.query_positions)
            per_query += (logits[:, qp].argmax(-1) == y[:, qp]).double().sum(0)
    model.train()
    pq = None if per_query is None else (per_query / task.x_test.shape[0]).tolist()
    return tot_loss / n, tot_acc / n, pq


def _param_groups(model: nn.Module, weight_decay: float):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 and "pos_embed" not in name and "cls_token" not in name else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _lr_factor(step: int, cfg: TaskConfig) -> float:
    warm = max(1, int(cfg.warmup_frac * cfg.steps))
    if step < warm:
        return (step + 1) / warm
    t = (step - warm) / max(1, cfg.steps - warm)
    return cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * t))


def train_run(task: Task, cfg: TaskConfig, init: str, seed: int, *, lr_mult: float = 1.0,
              on_step: Optional[Callable[[], None]] = None) -> dict:
    """Train one model from ``init``, ``seed`` (in ``[0, 2**64)``) and learning rate ``lr_mult *
    cfg.lr``; returns its curves (plain lists, JSON-ready)."""
    check_choice("init", init, INITS)
    seed = check_seed("seed", seed)
    lr_mult = check_real("lr_mult", lr_mult, min=0.0, min_open=True)
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    model = build_model(task, cfg)
    initialize_(model, init, seed=seed)
    opt = torch.optim.AdamW(_param_groups(model, cfg.weight_decay), lr=lr_mult * cfg.lr, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(s, cfg))
    data_gen = torch.Generator().manual_seed((1_000_003 * seed + 17) % SEED_MAX)
    x_probe = task.x_test[: cfg.probe_examples]
    rec = {"task": task.name, "init": init, "seed": seed, "lr_mult": lr_mult, "lr": lr_mult * cfg.lr,
           "train_step": [], "train_loss": [], "eval_step": [], "eval_loss": [], "eval_acc": [],
           "eval_query_acc": [], "probe_step": [], "kappa": [], "sigma_max": [], "sigma_min": [],
           "sigma_min_px": [], "value_share": []}

    def record_eval(step):
        loss, acc, pq = evaluate(model, task)
        rec["eval_step"].append(step)
        rec["eval_loss"].append(loss)
        rec["eval_acc"].append(acc)
        if pq is not None:
            rec["eval_query_acc"].append(pq)

    def record_probe(step):
        rec["probe_step"].append(step)
        if not all(bool(torch.isfinite(p).all()) for p in model.parameters()):   # a diverged run: no J
            n = len(attention_modules(model))
            for key in ("kappa", "sigma_max", "sigma_min", "sigma_min_px", "value_share"):
                rec[key].append([math.nan] * n)
            return
        layers = probe_kappa(model, x_probe, causal=task.causal, probe_len=cfg.probe_len)
        for key in ("kappa", "sigma_max", "sigma_min", "sigma_min_px", "value_share"):
            rec[key].append([lay[key] for lay in layers])

    model.train()
    record_eval(0)
    record_probe(0)
    for step in range(1, cfg.steps + 1):
        x, y = task.batch(cfg.batch_size, data_gen)
        loss, _ = _loss_acc(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        rec["train_step"].append(step)
        rec["train_loss"].append(float(loss.detach()))
        if step % cfg.eval_every == 0 or step == cfg.steps:
            record_eval(step)
        if (cfg.probe_every and step % cfg.probe_every == 0) or step == cfg.steps:
            record_probe(step)
        if on_step is not None:
            on_step()
    rec["seconds"] = time.perf_counter() - t0
    return rec


@contextmanager
def deterministic(threads: int = 1):
    """Run the block on ``threads`` CPU threads with torch's deterministic algorithms; both restored after."""
    prev_threads = torch.get_num_threads()
    prev_det = torch.are_deterministic_algorithms_enabled()
    prev_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(prev_det, warn_only=prev_warn)
        torch.set_num_threads(prev_threads)


_TASK_CACHE: dict = {}
_COUNTER = None


def _task(name: str) -> Task:
    if name not in _TASK_CACHE:
        _TASK_CACHE[name] = make_task(name)
    return _TASK_CACHE[name]


def _worker_init(counter):
    global _COUNTER
    _COUNTER = counter
    torch.set_num_threads(1)


def _count_step():
    with _COUNTER.get_lock():
        _COUNTER.value += 1


def _one_run(cfg: TaskConfig, init: str, lr_mult: float, seed: int, count: bool = False) -> dict:
    # One single-threaded run: its numbers do not depend on how many runs go on in parallel.
    with deterministic(1):
        return train_run(_task(cfg.task), cfg, init, seed, lr_mult=lr_mult, on_step=_count_step if count else None)


class _Progress:
    """A tqdm bar on a terminal (when tqdm is installed), else a plain line every 5 %."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.n, self.enabled, self._bar, self._shown = total, 0, enabled, None, -1
        self._t0 = time.perf_counter()
        if enabled and sys.stderr.isatty():       # a log file gets the plain lines
            try:
                from tqdm.auto import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(total=total, desc="condinit demo", unit="step", dynamic_ncols=True)

    def update_to(self, n: int, note: str = ""):
        if not self.enabled or n == self.n:
            return
        if self._bar is not None:
            self._bar.update(n - self._bar.n)
            if note:
                self._bar.set_postfix_str(note)
        else:
            pct = int(100 * n / max(1, self.total)) // 5 * 5
            if pct > self._shown:
                self._shown = pct
                print(f"condinit demo: {pct:3d} % ({n}/{self.total} steps, "
                      f"{time.perf_counter() - self._t0:.0f} s) {note}", file=sys.stderr, flush=True)
        self.n = n

    def close(self):
        if self._bar is not None:
            self._bar.close()


def run_demo(tasks=TASKS, *, seeds: int = 2, steps: Optional[int] = None, quick: bool = False,
             inits=None, lr_multipliers=None, jobs: int = 1, progress: bool = True) -> dict:
    """Train every (task, init, learning rate, seed); returns ``{"tasks": {task: {"config",
    "info", "runs"}}, "meta"}``.

    Seeds are ``0 .. seeds - 1``; ``steps`` overrides the per-task step count, ``lr_multipliers``
    the sweep; ``inits`` defaults to all (``quick``: :data:`QUICK_INITS`). Every run is
    single-threaded (``torch.set_num_threads(1)``, deterministic algorithms), and ``jobs > 1`` runs
    that many in separate (spawned) processes, so the numbers do not depend on ``jobs``.

    Examples:
        >>> results = run_demo(("mqar-32",), seeds=1, quick=True, progress=False)
        >>> len(results["tasks"]["mqar-32"]["runs"])      # 2 inits x 2 learning rates x 1 seed
        4
    """
    for t in tasks:
        check_choice("task", t, TASKS)
    inits = tuple(inits) if inits is not None else (QUICK_INITS if quick else INITS)
    for i in inits:
        check_choice("init", i, INITS)
    seeds = check_int("seeds", seeds, min=1)
    jobs = check_int("jobs", jobs, min=1)
    check_bool("progress", progress)
    configs = {t: task_config(t, quick=quick, steps=steps, lr_multipliers=lr_multipliers) for t in tasks}
    for t in tasks:   # fails early (e.g. scikit-learn missing); also warms the in-process cache
        _task(t)
    work = [(t, init, mult, seed) for t in tasks for seed in range(seeds) for init in inits
            for mult in configs[t].lr_multipliers]
    # longest runs first, so the pool ends with short ones
    cost = {t: configs[t].steps * (configs[t].model["dim"] ** 2) * configs[t].batch_size for t in tasks}
    order = sorted(range(len(work)), key=lambda i: -cost[work[i][0]])
    total = sum(configs[t].steps for t, _, _, _ in work)
    bar = _Progress(total, progress)
    t0 = time.perf_counter()
    done = {}
    try:
        if jobs == 1 or len(work) == 1:
            steps_done = 0

            def tick():
                nonlocal steps_done
                steps_done += 1
                bar.update_to(steps_done, f"{len(done)}/{len(work)} runs")

            for i in order:
                t, init, mult, seed = work[i]
                with deterministic(1):
                    done[work[i]] = train_run(_task(t), configs[t], init, seed, lr_mult=mult, on_step=tick)
        else:
            import concurrent.futures as cf
            import multiprocessing as mp

            ctx = mp.get_context("spawn")   # no fork of a process that may hold threads
            counter = ctx.Value("q", 0)
            with cf.ProcessPoolExecutor(max_workers=min(jobs, len(work)), mp_context=ctx,
                                        initializer=_worker_init, initargs=(counter,)) as pool:
                futs = {pool.submit(_one_run, configs[work[i][0]], work[i][1], work[i][2], work[i][3], True): work[i]
                        for i in order}
                pending = set(futs)
                while pending:
                    finished, pending = cf.wait(pending, timeout=0.5, return_when=cf.FIRST_COMPLETED)
                    for f in finished:
                        done[futs[f]] = f.result()
                    bar.update_to(counter.value, f"{len(done)}/{len(work)} runs")
    finally:
        bar.close()
    out = {"tasks": {t: {"config": asdict(configs[t]), "info": _task(t).info, "metric": _task(t).metric,
                         "runs": [done[w] for w in work if w[0] == t]} for t in tasks}}
    out["meta"] = {"seeds": list(range(seeds)), "inits": list(inits), "jobs": jobs, "threads_per_run": 1,
                   "quick": quick, "torch": torch.__version__, "seconds": time.perf_counter() - t0}
    return out
