"""Data for ``condinit demo``: two small tasks whose data ship with the dependencies (no downloads).

* ``vision``: scikit-learn's digits (1797 grey 8x8 images of 0-9, from the UCI optical digits set,
  shipped inside scikit-learn), pixels scaled to [0, 1], a fixed random 80/20 split drawn
  with a fixed generator (the split never depends on the run's seed, so seeds differ only in
  init and data order).
* ``text``: multi-query associative recall (MQAR; Arora et al. 2023, "Zoology"). A sequence lists
  ``num_pairs`` key-value pairs ``k_1 v_1 ... k_n v_n`` (distinct keys drawn from ``num_keys``
  key tokens, values from ``num_values`` value tokens), then asks every key again in a random
  order, each followed by its value: ``q_1 v(q_1) ... q_n v(q_n)``. A causal LM is scored on the
  ``n`` positions holding a query key (predict its value), where only recall from the context can
  help: chance is ``1 / num_values``. Defaults: 4 pairs, 16 key and 16 value tokens (15 input
  tokens). Generated from a fixed seed (same torch RNG stream on every machine).

Both tasks hand out batches through a :class:`torch.Generator` owned by the run, so the data order
is a function of the run's seed alone.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Task", "DigitsTask", "MQARTask", "make_task", "TASKS"]

TASKS = ("vision", "text")
# The split / the synthetic data set never change with the run's seed.
DATA_SEED = 20260609


@dataclass
class Task:
    """A supervised task: fixed train and test tensors, and which positions count.

    ``x_*``: model inputs; ``y_*``: targets; for sequence tasks ``y`` is ``[n, L]`` with ``-100``
    at positions that are not scored (``torch.nn.functional.cross_entropy``'s ignore_index).
    """

    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int
    metric: str = "accuracy"

    def batch(self, batch_size: int, generator: torch.Generator):
        """A batch of training examples drawn without replacement within the batch."""
        idx = torch.randperm(self.x_train.shape[0], generator=generator)[:batch_size]
        return self.x_train[idx], self.y_train[idx]


class DigitsTask(Task):
    pass


class MQARTask(Task):
    pass


def _require_sklearn():
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:  # a missing optional dependency is the user's to fix: say how
        raise ValueError("task 'vision' needs scikit-learn for the digits data set "
                         "(pip install 'condinit[demo]', or run with --task text)") from exc
    return load_digits


def load_digits_task(test_fraction: float = 0.2) -> DigitsTask:
    """scikit-learn's digits as ``[n, 1, 8, 8]`` float32 images in [0, 1] and int64 labels."""
    load_digits = _require_sklearn()
    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(DATA_SEED))
    n_test = int(round(test_fraction * x.shape[0]))
    test, train = perm[:n_test], perm[n_test:]
    return DigitsTask("vision", x[train], y[train], x[test], y[test], num_classes=10)


def mqar_sequences(n: int, *, num_pairs: int, num_keys: int, num_values: int, generator: torch.Generator):
    """``n`` MQAR sequences: inputs ``[n, 4 * num_pairs - 1]`` and targets (``-100`` off the queries).

    Token ids: keys ``0 .. num_keys - 1``, values ``num_keys .. num_keys + num_values - 1``.
    Full sequence ``k_1 v_1 .. k_n v_n q_1 v(q_1) .. q_n v(q_n)``; the model reads all but the last
    token and at each query key position must predict the value that follows.
    """
    if num_pairs > num_keys:
        raise ValueError(f"num_pairs must be <= num_keys ({num_keys}), got {num_pairs}")
    keys = torch.argsort(torch.rand(n, num_keys, generator=generator), dim=1)[:, :num_pairs]
    values = torch.randint(num_keys, num_keys + num_values, (n, num_pairs), generator=generator)
    order = torch.argsort(torch.rand(n, num_pairs, generator=generator), dim=1)
    q_keys, q_values = keys.gather(1, order), values.gather(1, order)
    context = torch.stack([keys, values], dim=2).reshape(n, 2 * num_pairs)
    queries = torch.stack([q_keys, q_values], dim=2).reshape(n, 2 * num_pairs)
    seq = torch.cat([context, queries], dim=1)
    x, nxt = seq[:, :-1], seq[:, 1:]
    y = torch.full_like(nxt, -100)
    qpos = torch.arange(2 * num_pairs, 4 * num_pairs, 2)   # positions of the query keys in x
    y[:, qpos] = nxt[:, qpos]
    return x.contiguous(), y


def load_mqar_task(*, num_train: int = 8192, num_test: int = 512, num_pairs: int = 4, num_keys: int = 16,
                   num_values: int = 16) -> MQARTask:
    g = torch.Generator().manual_seed(DATA_SEED)
    kw = dict(num_pairs=num_pairs, num_keys=num_keys, num_values=num_values, generator=g)
    x_tr, y_tr = mqar_sequences(num_train, **kw)
    x_te, y_te = mqar_sequences(num_test, **kw)
    return MQARTask("text", x_tr, y_tr, x_te, y_te, num_classes=num_keys + num_values)


def make_task(name: str, **kwargs) -> Task:
    """``"vision"`` (digits) or ``"text"`` (MQAR)."""
    if name == "vision":
        return load_digits_task(**kwargs)
    if name == "text":
        return load_mqar_task(**kwargs)
    raise ValueError(f"task must be one of {TASKS}, got {name!r}")
