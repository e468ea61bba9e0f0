"""Data for ``condinit demo``: five tasks whose data ship with Python or the dependencies (no downloads).

Every task's data are a function of fixed seeds alone: the data sets are generated (or split) with a
``torch.Generator`` seeded by ``DATA_SEED`` and the training batches are drawn with a generator the
run owns and seeds from its own seed, never from torch's global RNG, so the same seed gives the same
batches and the same split on any machine and with any thread count.

* ``mqar-32`` and ``mqar-128``: multi-query associative recall (MQAR; Arora et al. 2023, "Zoology")
  for causal LMs of width 32 and 128 (same data). A sequence lists ``num_pairs`` key-value pairs
  ``k_1 v_1 ... k_n v_n`` (distinct keys drawn from ``num_keys`` key tokens, values from
  ``num_values`` value tokens), then asks every key again in a random order, each followed by its
  value: ``q_1 v(q_1) ... q_n v(q_n)``. Scored on the ``n`` query positions (predict the value).
  Defaults: 4 pairs, 16 key and 16 value tokens. A model that never matches keys can still score
  well above chance (:func:`mqar_shortcut_baseline`): the reference line in the report.
* ``lm-causal`` and ``lm-masked``: character-level modelling of Python's own standard-library
  sources (:func:`stdlib_corpus`): next-character prediction with a causal mask, or BERT-style
  masked-character prediction with bidirectional attention (15 % of the positions chosen; of those
  80 % replaced by a ``[MASK]`` token, 10 % by a random character, 10 % left; scored on the chosen
  positions). Loss in nats per character on a fixed validation set (evenly spaced windows of the
  validation files; for the masked task with masks drawn once from ``DATA_SEED``).
* ``vision``: scikit-learn's digits (1797 grey 8x8 images of 0-9, shipped inside scikit-learn),
  pixels scaled to [0, 1], a fixed random 80/20 split.

The standard library differs between Python versions, so its task records the Python version, the
file count and a SHA-256 of the corpus (``Task.info``) and the report prints them.
"""
from __future__ import annotations

import hashlib
import os
import platform
import sysconfig
from dataclasses import dataclass, field
from typing import Optional

import torch

__all__ = ["Task", "SequenceTask", "CharLMTask", "make_task", "TASKS", "TASK_GROUPS", "mqar_sequences",
           "mqar_shortcut_baseline", "stdlib_corpus", "encode_chars", "CHAR_VOCAB", "DATA_SEED",
           "require_sklearn"]

TASKS = ("mqar-32", "mqar-128", "lm-causal", "lm-masked", "vision")
TASK_GROUPS = {"all": TASKS, "mqar": ("mqar-32", "mqar-128"), "lm": ("lm-causal", "lm-masked")}
# The split / the synthetic data set never change with the run's seed.
DATA_SEED = 20260609


@dataclass
class Task:
    """A supervised task: fixed train and test tensors, and which positions count.

    ``x_*``: model inputs; ``y_*``: targets; for sequence tasks ``y`` is ``[n, L]`` with ``-100``
    at positions that are not scored (``torch.nn.functional.cross_entropy``'s ignore_index).
    ``metric``: ``"accuracy"`` (higher is better) or ``"loss"`` (validation loss, lower is better).
    """

    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int
    metric: str = "accuracy"
    causal: bool = False
    info: dict = field(default_factory=dict)

    def batch(self, batch_size: int, generator: torch.Generator):
        """A batch of training examples drawn without replacement within the batch."""
        idx = torch.randperm(self.x_train.shape[0], generator=generator)[:batch_size]
        return self.x_train[idx], self.y_train[idx]


@dataclass
class SequenceTask(Task):
    """MQAR: a sequence task scored at fixed query positions (``query_positions``)."""

    query_positions: tuple = ()


# ------------------------------------------------------------------------------------------------
# vision

def require_sklearn():
    """scikit-learn's ``load_digits``, or a ValueError saying how to install it."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:  # a missing optional dependency is the user's to fix: say how
        raise ValueError("task 'vision' needs scikit-learn for the digits data set "
                         "(pip install 'condinit[demo]', or leave 'vision' out of --task)") from exc
    return load_digits


def load_digits_task(test_fraction: float = 0.2) -> Task:
    """scikit-learn's digits as ``[n, 1, 8, 8]`` float32 images in [0, 1] and int64 labels."""
    load_digits = require_sklearn()
    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(DATA_SEED))
    n_test = int(round(test_fraction * x.shape[0]))
    test, train = perm[:n_test], perm[n_test:]
    return Task("vision", x[train], y[train], x[test], y[test], num_classes=10)


# ------------------------------------------------------------------------------------------------
# MQAR

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
    qpos = _query_positions(num_pairs)
    y[:, qpos] = nxt[:, qpos]
    return x.contiguous(), y


def _query_positions(num_pairs: int) -> torch.Tensor:
    return torch.arange(2 * num_pairs, 4 * num_pairs, 2)   # positions of the query keys in x


def mqar_shortcut_baseline(x: torch.Tensor, y: torch.Tensor, num_pairs: int) -> list[float]:
    """Per-query accuracy of a predictor that never matches keys, computed from the data.

    At query ``i`` it knows only which context values have not been asked for yet (the context's
    values minus the answers already shown to it, as a multiset) and guesses, uniformly, one of the
    values that occur most often among them. Its expected score on one sequence is
    ``1 / #(most frequent values)`` when the true answer is one of them and ``0`` otherwise; the
    result is the mean over the sequences, per query. The last query is always answered right
    (one value is left); with 4 pairs and 16 values the others average about ``0.34, 0.39, 0.52``.
    A model at these numbers has learned the shortcut, not recall.

    Examples:
        >>> g = torch.Generator().manual_seed(0)
        >>> x, y = mqar_sequences(512, num_pairs=4, num_keys=16, num_values=16, generator=g)
        >>> [round(v, 2) for v in mqar_shortcut_baseline(x, y, 4)][-1]
        1.0
    """
    n_seq = x.shape[0]
    ctx_values = x[:, 1:2 * num_pairs:2]                       # [n, num_pairs]
    qpos = _query_positions(num_pairs)
    answers = y[:, qpos]                                      # [n, num_pairs], the true values in query order
    scores = torch.zeros(num_pairs, dtype=torch.float64)
    for i in range(num_pairs):
        # remaining multiset: context values minus answers 0..i-1 (each answer removes one copy)
        remaining = ctx_values.clone()
        for j in range(i):
            hit = (remaining == answers[:, j:j + 1]).int()
            first = hit.argmax(dim=1)                          # the first copy of answer j
            remaining[torch.arange(n_seq), first] = -1
        counts = (remaining.unsqueeze(2) == remaining.unsqueeze(1)) & (remaining.unsqueeze(2) >= 0)
        counts = counts.sum(dim=2)                             # per slot: how often its value remains
        best = counts.max(dim=1).values                        # [n]
        top = (counts == best[:, None]) & (remaining >= 0)     # slots holding a most frequent value
        n_top_values = top.sum(dim=1) // best                  # distinct most-frequent values
        true_is_top = (top & (remaining == answers[:, i:i + 1])).any(dim=1)
        scores[i] = (true_is_top.double() / n_top_values.double()).mean()
    return scores.tolist()


def load_mqar_task(name: str = "mqar-32", *, num_train: int = 8192, num_test: int = 512, num_pairs: int = 4,
                   num_keys: int = 16, num_values: int = 16) -> SequenceTask:
    g = torch.Generator().manual_seed(DATA_SEED)
    kw = dict(num_pairs=num_pairs, num_keys=num_keys, num_values=num_values, generator=g)
    x_tr, y_tr = mqar_sequences(num_train, **kw)
    x_te, y_te = mqar_sequences(num_test, **kw)
    info = {"num_pairs": num_pairs, "num_keys": num_keys, "num_values": num_values,
            "shortcut_per_query": mqar_shortcut_baseline(x_te, y_te, num_pairs), "chance": 1.0 / num_values}
    info["shortcut_mean"] = sum(info["shortcut_per_query"]) / num_pairs
    return SequenceTask(name, x_tr, y_tr, x_te, y_te, num_classes=num_keys + num_values, causal=True, info=info,
                        query_positions=tuple(_query_positions(num_pairs).tolist()))


# ------------------------------------------------------------------------------------------------
# character LM on the standard library

# 98 character tokens: newline, the 95 printable ASCII characters, tab, and one "other" token
# (carriage returns and every byte of a non-ASCII character); the masked task adds [MASK].
CHAR_VOCAB = 98
_OTHER = 97


def _char_table() -> torch.Tensor:
    lut = torch.full((256,), _OTHER, dtype=torch.int64)
    lut[10] = 0
    lut[32:127] = torch.arange(1, 96)
    lut[9] = 96
    return lut


def encode_chars(data: bytes) -> torch.Tensor:
    """Raw UTF-8 bytes -> ``int64`` character tokens (see ``CHAR_VOCAB``)."""
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)
    return _char_table()[raw.long()]


def stdlib_corpus(*, file_chars: int = 8192, root: Optional[str] = None):
    """``(train_bytes, valid_bytes, info)``: the ``*.py`` files of Python's standard library.

    Files: every ``*.py`` under ``sysconfig.get_paths()["stdlib"]`` (or ``root``), third-party
    ``site-packages`` / ``dist-packages`` left out, sorted by relative path (``/``-separated);
    file ``i`` of that list goes to validation when ``i % 10 == 9``, to training otherwise. Each
    file contributes its first ``file_chars`` bytes (the corpus size cap: about 9 MB for Python
    3.11, read in well under a second, and no single large generated module dominates). ``info``
    holds the Python version, the file counts, the sizes and a SHA-256 over the file names and
    contents, since the standard library differs between Python versions.

    Examples:
        >>> train, valid, info = stdlib_corpus()
        >>> info["files"] == info["train_files"] + info["valid_files"], len(info["sha256"])
        (True, 64)
    """
    root = root or sysconfig.get_paths()["stdlib"]
    rel = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        for f in filenames:
            if f.endswith(".py"):
                rel.append(os.path.relpath(os.path.join(dirpath, f), root).replace(os.sep, "/"))
    rel.sort()
    if len(rel) < 10:
        raise ValueError(f"the standard library at {root!r} holds {len(rel)} *.py files; the LM tasks need "
                         f"at least 10 (leave lm-causal / lm-masked out of --task)")
    digest = hashlib.sha256()
    train, valid = [], []
    for i, r in enumerate(rel):
        with open(os.path.join(root, r), "rb") as fh:
            data = fh.read(file_chars)
        digest.update(r.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
        (valid if i % 10 == 9 else train).append(data)
    train_b, valid_b = b"".join(train), b"".join(valid)
    info = {"corpus": "Python standard library *.py", "python": platform.python_version(),
            "files": len(rel), "train_files": len(train), "valid_files": len(valid),
            "train_chars": len(train_b), "valid_chars": len(valid_b), "file_chars": file_chars,
            "sha256": digest.hexdigest()}
    return train_b, valid_b, info


@dataclass
class CharLMTask(Task):
    """Character LM: random training windows of ``context`` characters from ``train_tokens``."""

    train_tokens: Optional[torch.Tensor] = None
    context: int = 64
    mask_fraction: float = 0.15

    @property
    def mask_token(self) -> int:
        return CHAR_VOCAB

    def batch(self, batch_size: int, generator: torch.Generator):
        high = self.train_tokens.shape[0] - self.context - 1
        starts = torch.randint(0, high, (batch_size,), generator=generator)
        windows = self.train_tokens[starts[:, None] + torch.arange(self.context + 1)]
        return self._example(windows, generator)

    def _example(self, windows: torch.Tensor, generator: torch.Generator):
        if self.causal:
            return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
        return bert_mask(windows[:, :-1], self.mask_fraction, self.mask_token, generator)


def bert_mask(tokens: torch.Tensor, fraction: float, mask_token: int, generator: torch.Generator):
    """BERT-style masking: ``fraction`` of the positions chosen (at least one per row); of those 80 %
    become ``mask_token``, 10 % a random character, 10 % stay. Targets ``-100`` off the chosen ones."""
    b, n = tokens.shape
    k = max(1, int(round(fraction * n)))
    chosen = torch.argsort(torch.rand(b, n, generator=generator), dim=1)[:, :k]
    how = torch.rand(b, k, generator=generator)
    rand_tok = torch.randint(0, CHAR_VOCAB, (b, k), generator=generator)
    orig = tokens.gather(1, chosen)
    new = torch.where(how < 0.8, torch.full_like(orig, mask_token), torch.where(how < 0.9, rand_tok, orig))
    x = tokens.clone().scatter_(1, chosen, new)
    y = torch.full_like(tokens, -100).scatter_(1, chosen, orig)
    return x, y


def load_char_lm_task(name: str, *, context: int = 64, num_valid: int = 128, file_chars: int = 8192) -> CharLMTask:
    """``lm-causal`` or ``lm-masked`` on :func:`stdlib_corpus`; the validation set is ``num_valid``
    windows at evenly spaced offsets of the validation text (masks drawn from ``DATA_SEED``)."""
    train_b, valid_b, info = stdlib_corpus(file_chars=file_chars)
    train_t, valid_t = encode_chars(train_b), encode_chars(valid_b)
    causal = name == "lm-causal"
    span = valid_t.shape[0] - context - 1
    starts = torch.linspace(0, span, num_valid).round().long()
    windows = valid_t[starts[:, None] + torch.arange(context + 1)]
    task = CharLMTask(name, torch.zeros(0), torch.zeros(0), torch.zeros(0), torch.zeros(0),
                      num_classes=CHAR_VOCAB + (0 if causal else 1), metric="loss", causal=causal,
                      info=info, train_tokens=train_t, context=context)
    task.x_test, task.y_test = task._example(windows, torch.Generator().manual_seed(DATA_SEED))
    info.update({"context": context, "valid_windows": num_valid, "vocab": task.num_classes})
    return task


def make_task(name: str, **kwargs) -> Task:
    """One of :data:`TASKS` (see the module doc).

    Examples:
        >>> task = make_task("lm-masked")
        >>> task.metric, task.causal, task.x_test.shape
        ('loss', False, torch.Size([128, 64]))
    """
    if name == "vision":
        return load_digits_task(**kwargs)
    if name in ("mqar-32", "mqar-128"):
        return load_mqar_task(name, **kwargs)
    if name in ("lm-causal", "lm-masked"):
        return load_char_lm_task(name, **kwargs)
    raise ValueError(f"task must be one of {TASKS}, got {name!r}")
