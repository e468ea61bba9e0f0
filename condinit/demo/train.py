"""Training loop and attention-Jacobian probe for ``condinit demo``.

Each run trains one small Transformer (:mod:`condinit.demo.models`) on one task
(:mod:`condinit.demo.tasks`) from one init (:mod:`condinit.demo.inits`) and one seed, with AdamW,
linear warmup then cosine decay, gradient clipping at 1. It records per step the training loss and
accuracy, every ``eval_every`` steps the test loss and accuracy, and every ``probe_every`` steps
the condition number of each attention layer's Jacobian with respect to its weights,

    J = [dA/dW_Q, dA/dW_K, dA/dW_V],   A(X) = softmax(X W_Q W_K^T X^T / sqrt(d) + M) X W_V

(per head, concatenated; ``M`` the causal mask for the LM; biases held fixed), evaluated at the
layer's actual input ``X`` (the LayerNorm'd residual stream) for fixed test examples: exactly the
function the ``nn.MultiheadAttention`` computes before ``W_O``. ``kappa(J) = sigma_max / sigma_min``
with ``sigma_min`` the smallest of the ``N * H * d`` singular values (``J`` is wide: ``N * d`` rows
per head against ``3 * d * D`` columns). ``J`` is :class:`condinit.probe.JacobianOperator`
(``wrt="weights"``, float64) made dense with its ``dense()``; the singular values are exact. With
several probe examples the per-layer kappa is their geometric mean.

Reproducibility: every random draw comes from ``torch.manual_seed(seed)`` (model) or a
:class:`torch.Generator` seeded from ``seed`` (data order); :func:`run_demo` fixes the thread count
and turns on ``torch.use_deterministic_algorithms`` for its duration.
"""
from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from condinit._validate import SEED_MAX, check_bool, check_choice, check_int, check_seed, check_tensor
from condinit.probe import InputCapture, JacobianOperator
from condinit.probe.estimators import default_rank_rtol

from .inits import INITS, _initialize
from .models import TinyCausalLM, TinyViT, attention_modules
from .tasks import TASKS, Task, make_task

__all__ = ["TaskConfig", "DEFAULT_CONFIGS", "QUICK_CONFIGS", "task_config", "build_model", "attention_jacobian_sigma",
           "probe_kappa", "train_run", "run_demo"]


@dataclass(frozen=True)
class TaskConfig:
    """Hyper-parameters of one task's runs (identical for every init)."""

    task: str
    steps: int
    batch_size: int
    lr: float
    weight_decay: float = 0.05
    warmup_frac: float = 0.05
    min_lr_frac: float = 0.1
    eval_every: int = 25
    probe_every: int = 50
    probe_examples: int = 2
    model: dict = field(default_factory=dict)


DEFAULT_CONFIGS = {
    "vision": TaskConfig("vision", steps=600, batch_size=64, lr=2e-3, eval_every=20, probe_every=50,
                         model=dict(dim=32, depth=2, num_heads=2, mlp_ratio=2)),
    "text": TaskConfig("text", steps=1200, batch_size=64, lr=1e-3, eval_every=25, probe_every=100,
                       model=dict(dim=32, depth=2, num_heads=2, mlp_ratio=2)),
}
QUICK_CONFIGS = {
    "vision": replace(DEFAULT_CONFIGS["vision"], steps=40, eval_every=10, probe_every=20, probe_examples=1),
    "text": replace(DEFAULT_CONFIGS["text"], steps=40, eval_every=10, probe_every=20, probe_examples=1),
}


def task_config(task: str, *, quick: bool = False, steps: Optional[int] = None) -> TaskConfig:
    """The hyper-parameters of ``task``'s runs (``quick``: the smoke-run ones; ``steps`` overrides
    the step count)."""
    check_choice("task", task, TASKS)
    check_bool("quick", quick)
    steps = check_int("steps", steps, min=1, allow_none=True)
    cfg = (QUICK_CONFIGS if quick else DEFAULT_CONFIGS)[task]
    if steps is not None:
        cfg = replace(cfg, steps=steps, eval_every=min(cfg.eval_every, steps),
                      probe_every=min(cfg.probe_every, steps))
    return cfg


def build_model(task: Task, cfg: TaskConfig) -> nn.Module:
    if task.name == "vision":
        return TinyViT(num_classes=task.num_classes, **cfg.model)
    return TinyCausalLM(vocab_size=task.num_classes, max_len=task.x_train.shape[1], **cfg.model)


# ------------------------------------------------------------------------------------------------
# attention Jacobian probe

def attention_jacobian_sigma(mha: nn.MultiheadAttention, x: torch.Tensor, *, causal: bool = False):
    """``(sigma_max, sigma_min)`` of ``J = [dA/dW_Q, dA/dW_K, dA/dW_V]`` at input ``x`` (``[N, D]``).

    ``J`` is the dense float64 Jacobian of :class:`condinit.probe.JacobianOperator` (see module
    doc); ``sigma_min`` is the smallest of its ``H N d`` singular values.
    """
    check_tensor("x", x, floating=True, dim=2)
    op = JacobianOperator(mha, x, wrt="weights", causal=causal, dtype=torch.float64)
    J = op.dense()                                  # [H N d, 3 E D] (one sequence)
    d = op.d
    rows = J.reshape(op.H, -1, op.n)                # head h's outputs: [H, N d, n]
    # dW_Q, dW_K, dW_V columns, [H, N d, H d, D] each (nn.MultiheadAttention: as many K/V heads as Q heads)
    per_head_cols = op.split_input(rows)
    sig = []
    for h in range(op.H):
        # Head h's outputs depend only on head h's rows of W_Q, W_K, W_V: J is block diagonal over
        # heads and its singular values are the union of the blocks'. A block is wide ([N d, 3 d D]);
        # the R of a QR of its transpose has its singular values, at a fraction of an SVD's cost
        # (and without squaring the condition number, as J J^T would).
        block = torch.cat([w[h, :, h * d:(h + 1) * d].reshape(rows.shape[1], -1) for w in per_head_cols], dim=1)
        sig.append(torch.linalg.svdvals(torch.linalg.qr(block.T, mode="r")[1]))
    s = torch.cat(sig)
    return float(s.max()), float(s.min())


RANK_RTOL = default_rank_rtol(torch.float64)   # sigma_min / sigma_max at or below this: rank-deficient


@torch.no_grad()
def probe_kappa(model: nn.Module, x_probe: torch.Tensor, *, causal: bool) -> list[dict]:
    """Per attention layer: sigma_max, sigma_min and kappa of its weight Jacobian, geometric means
    over the examples in ``x_probe``. ``kappa`` is ``inf`` (and ``rank_deficient`` True) when
    ``sigma_min <= RANK_RTOL sigma_max`` for some example: ``J`` then has a null direction (e.g. two
    identical input rows), where ``condinit.probe`` reports ``kappa=None``."""
    mhas = attention_modules(model)
    with InputCapture(mhas) as cap:
        model(x_probe)
    out = []
    for i, m in enumerate(mhas):
        lmax, lmin, deficient = 0.0, 0.0, False
        for ex in range(x_probe.shape[0]):
            smax, smin = attention_jacobian_sigma(m, cap.inputs[i][ex], causal=causal)
            deficient |= not smin > RANK_RTOL * smax
            lmax += math.log(smax) / x_probe.shape[0]
            lmin += (math.log(smin) if smin > 0 else -745.0) / x_probe.shape[0]
        out.append({"layer": i, "sigma_max": math.exp(lmax), "sigma_min": math.exp(lmin),
                    "kappa": math.inf if deficient else math.exp(lmax - lmin), "rank_deficient": deficient})
    return out


# ------------------------------------------------------------------------------------------------
# training

def _loss_acc(task: Task, logits: torch.Tensor, y: torch.Tensor):
    if logits.dim() == 3:
        logits, y = logits.reshape(-1, logits.shape[-1]), y.reshape(-1)
        keep = y != -100
        logits, y = logits[keep], y[keep]
    loss = F.cross_entropy(logits, y)
    acc = (logits.argmax(-1) == y).float().mean()
    return loss, acc


@torch.no_grad()
def evaluate(model: nn.Module, task: Task, batch: int = 512):
    model.eval()
    tot_loss, tot_acc, n = 0.0, 0.0, 0
    for i in range(0, task.x_test.shape[0], batch):
        x, y = task.x_test[i:i + batch], task.y_test[i:i + batch]
        logits = model(x)
        loss, acc = _loss_acc(task, logits, y)
        k = int((y != -100).sum()) if y.dim() == 2 else y.shape[0]
        tot_loss, tot_acc, n = tot_loss + float(loss) * k, tot_acc + float(acc) * k, n + k
    model.train()
    return tot_loss / n, tot_acc / n


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


def train_run(task: Task, cfg: TaskConfig, init: str, seed: int, *,
              on_step: Optional[Callable[[], None]] = None) -> dict:
    """Train one model from ``init`` and ``seed`` (in ``[0, 2**64)``); returns its curves (plain
    lists, JSON-ready)."""
    check_choice("init", init, INITS)
    seed = check_seed("seed", seed)
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    model = build_model(task, cfg)
    _initialize(model, init, seed=seed)
    opt = torch.optim.AdamW(_param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(s, cfg))
    data_gen = torch.Generator().manual_seed((1_000_003 * seed + 17) % SEED_MAX)
    causal = task.name == "text"
    x_probe = task.x_test[: cfg.probe_examples]
    rec = {"task": task.name, "init": init, "seed": seed, "train_step": [], "train_loss": [], "train_acc": [],
           "eval_step": [], "eval_loss": [], "eval_acc": [], "probe_step": [], "kappa": [], "sigma_max": [],
           "sigma_min": []}

    def record_eval(step):
        loss, acc = evaluate(model, task)
        rec["eval_step"].append(step)
        rec["eval_loss"].append(loss)
        rec["eval_acc"].append(acc)

    def record_probe(step):
        layers = probe_kappa(model, x_probe, causal=causal)
        rec["probe_step"].append(step)
        for key in ("kappa", "sigma_max", "sigma_min"):
            rec[key].append([lay[key] for lay in layers])

    model.train()
    record_eval(0)
    record_probe(0)
    for step in range(1, cfg.steps + 1):
        x, y = task.batch(cfg.batch_size, data_gen)
        loss, acc = _loss_acc(task, model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        rec["train_step"].append(step)
        rec["train_loss"].append(float(loss.detach()))
        rec["train_acc"].append(float(acc))
        if step % cfg.eval_every == 0 or step == cfg.steps:
            record_eval(step)
        if step % cfg.probe_every == 0 or step == cfg.steps:
            record_probe(step)
        if on_step is not None:
            on_step()
    rec["seconds"] = time.perf_counter() - t0
    return rec


@contextmanager
def _deterministic(threads: int = 1):
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


def _worker_init(counter):
    global _COUNTER
    _COUNTER = counter


def _count_step():
    with _COUNTER.get_lock():
        _COUNTER.value += 1


def _one_run(task_name: str, cfg: TaskConfig, init: str, seed: int, count: bool = False) -> dict:
    # One single-threaded run: its numbers do not depend on how many runs go on in parallel.
    if task_name not in _TASK_CACHE:
        _TASK_CACHE[task_name] = make_task(task_name)
    with _deterministic(1):
        return train_run(_TASK_CACHE[task_name], cfg, init, seed, on_step=_count_step if count else None)


def run_demo(tasks=TASKS, *, seeds: int = 3, steps: Optional[int] = None, quick: bool = False,
             inits=INITS, jobs: int = 1, progress: bool = True) -> dict:
    """Train every (task, init, seed); returns ``{"tasks": {task: {"config", "runs"}}, "meta"}``.

    Seeds are ``0 .. seeds - 1``; ``steps`` overrides the per-task step count. Every run is
    single-threaded (``torch.set_num_threads(1)``, deterministic algorithms), and ``jobs > 1`` runs
    that many in separate (spawned) processes, so the numbers do not depend on ``jobs``.
    """
    for t in tasks:
        check_choice("task", t, TASKS)
    for i in inits:
        check_choice("init", i, INITS)
    seeds = check_int("seeds", seeds, min=1)
    jobs = check_int("jobs", jobs, min=1)
    check_bool("progress", progress)
    configs = {t: task_config(t, quick=quick, steps=steps) for t in tasks}
    for t in tasks:   # fails early (e.g. scikit-learn missing); also warms the in-process cache
        _TASK_CACHE.setdefault(t, make_task(t))
    work = [(t, init, seed) for t in tasks for seed in range(seeds) for init in inits]
    total = sum(configs[t].steps for t, _, _ in work)
    from tqdm.auto import tqdm

    bar = tqdm(total=total, desc="condinit demo", unit="step", disable=None if progress else True,
               dynamic_ncols=True)
    t0 = time.perf_counter()
    done = {}
    try:
        if jobs == 1 or len(work) == 1:
            for t, init, seed in work:
                bar.set_postfix_str(f"{t} {init} seed {seed}")
                with _deterministic(1):
                    done[(t, init, seed)] = train_run(_TASK_CACHE[t], configs[t], init, seed, on_step=bar.update)
        else:
            import concurrent.futures as cf
            import multiprocessing as mp

            ctx = mp.get_context("spawn")   # no fork of a process that may hold threads
            counter = ctx.Value("q", 0)
            with cf.ProcessPoolExecutor(max_workers=min(jobs, len(work)), mp_context=ctx,
                                        initializer=_worker_init, initargs=(counter,)) as pool:
                futs = {pool.submit(_one_run, t, configs[t], init, seed, True): (t, init, seed)
                        for t, init, seed in work}
                pending = set(futs)
                while pending:
                    finished, pending = cf.wait(pending, timeout=0.25, return_when=cf.FIRST_COMPLETED)
                    for f in finished:
                        done[futs[f]] = f.result()
                    bar.update(counter.value - bar.n)
                    bar.set_postfix_str(f"{len(done)}/{len(work)} runs")
    finally:
        bar.close()
    out = {"tasks": {t: {"config": asdict(configs[t]),
                         "runs": [done[(tt, i, s)] for tt, i, s in work if tt == t]} for t in tasks}}
    out["meta"] = {"seeds": list(range(seeds)), "inits": list(inits), "jobs": jobs, "threads_per_run": 1,
                   "quick": quick, "torch": torch.__version__, "seconds": time.perf_counter() - t0}
    return out
