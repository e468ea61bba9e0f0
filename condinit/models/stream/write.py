"""The streamed writer's entry points: :func:`write_pretrained` (a ``from_pretrained``-ready
directory) and :func:`write_checkpoint` (one ``.safetensors`` file), and the loop that computes
tensors in file order and hands them to the writer thread.

**Files**: each file is written atomically; the writer thread ``fsync``\\ s a shard before its
rename. SIGTERM (and Ctrl-C, and any error) removes the shard being written, so an interrupted
write leaves only complete shards and never a partial file. A previous
``model.safetensors.index.json`` / ``model.safetensors`` in the directory is removed before the
first shard is written and the index is written last, so an interrupted write never leaves a
directory that loads; shards of an earlier write that this one does not replace
(``model-*-of-*.safetensors``) are removed at the end, as ``save_pretrained`` does. Each shard's
header has ``"format": "pt"`` and the ``condinit`` entry of
:func:`condinit.models.checkpoint.condinit_metadata` restricted to the layers whose Q, K and V all
lie in that shard (so ``condinit inspect`` can read every shard alone), plus ``"shard": [k, n]``
(:func:`condinit.models.checkpoint.shard_metadata`);
the index's ``metadata`` has ``total_size`` and ``total_parameters`` as ``save_pretrained`` writes
them, and the whole ``condinit`` entry (every layer) under ``"condinit"``. Headers are
deterministic: the same call writes the same bytes.

**Before anything is written**: every argument is checked (:mod:`condinit.models.stream.prepare`),
a symlink in the place of a file the write creates and a directory holding another model are
refused, and the free space compared with the bytes to write
(:mod:`condinit.models.stream.destination`).

**Inside the directory only**: every file is created in the directory; a symlink there is never
written through (refused; with ``overwrite`` replaced itself by a regular file), a stale file that
is a symlink is removed as a link, its target untouched.

**One writer per directory**: a write (and a resume) holds the directory's lock
(:func:`condinit.io.dirlock.directory_lock`, the file ``.condinit.lock`` in it) from its checks of
what is there to its last file, so a second writer is refused (naming the first one's PID and host)
and never mixes its files with the first one's. A dry run takes no lock.
"""
from __future__ import annotations

import contextlib
import copy
import os
import time
from dataclasses import dataclass, field
from typing import NamedTuple, Optional, Union

import torch

from condinit._util import format_bytes, tensor_bytes
from condinit._validate import check_bool, check_int
from condinit.io.atomic import check_output_path, removing_temps_on_sigterm
from condinit.io.dirlock import directory_lock
from condinit.io.safetensors_format import (CONFIG_NAME, SHARD_NAME_RE, WEIGHTS_INDEX_NAME, WEIGHTS_NAME,
                                            encode_header, json_text)

from ..checkpoint import METADATA_KEY, shard_metadata
from ..report import ApplyReport
from .destination import (check_out_dir, complete, free_bytes, missing_parent, needed_bytes, not_regular, other_model,
                          symlinked)
from .materialize import Replay, compute_threads
from .plan import WritePlan, make_plan
from .ranks import RankWritten, decided, ranks_of, reported
from .prepare import Job, Settings, prepare
from .shards import parse_shard_size, plan_files
from .tuning import tuning
from .writer import Progress, Writer, write_text

__all__ = ["write_pretrained", "write_checkpoint", "PretrainedWriteReport"]


@dataclass
class PretrainedWriteReport:
    """What :func:`write_pretrained` wrote: the directory, its files (weights files in order), the
    tensor bytes (``total_size`` as in the index), the parameter count, and the conditioning as an
    :class:`condinit.models.ApplyReport` (``apply``: layers, seed, uncovered modules; no singular values).
    ``plan``: the :class:`WritePlan`; ``kept``: the shards a resume found complete; ``dry_run``:
    nothing was written; ``written``: what each rank wrote
    (:class:`condinit.models.stream.ranks.RankWritten`, in rank order; one entry for one process)."""

    out_dir: str
    files: list
    weight_map: dict
    total_size: int
    num_parameters: int
    apply: ApplyReport
    time_s: float = 0.0
    extra: dict = field(default_factory=dict)
    plan: Optional[WritePlan] = None
    kept: list = field(default_factory=list)
    dry_run: bool = False
    written: list = field(default_factory=list)

    @property
    def seed(self) -> int:
        return self.apply.seed

    @property
    def uncovered(self) -> list:
        return self.apply.uncovered


class _FileJob(NamedTuple):
    """A weights file to write: where, its header bytes, its tensors in data order."""

    path: str
    head: bytes
    order: list


class _Destination(NamedTuple):
    """What a directory write found there: the planned shards a resume keeps, the free bytes, the
    bytes the write needs, and what the write refuses (a dry run's plan lists it)."""

    keep: list
    free: int
    need: int
    refusals: list = []


class _DirectoryFiles(NamedTuple):
    """Every file a directory write creates: the weights files (name -> path, header), the texts of
    ``config.json``, ``generation_config.json`` and the index (None: not written), the ``condinit``
    entry."""

    paths: dict
    headers: dict
    config_text: str
    gen_text: Optional[str]
    index_text: Optional[str]
    metadata: dict

    def names(self) -> list:
        return list(self.paths) + [CONFIG_NAME] + ([_GENERATION_CONFIG_NAME] if self.gen_text is not None else []) \
            + ([WEIGHTS_INDEX_NAME] if self.index_text is not None else [])


_GENERATION_CONFIG_NAME = "generation_config.json"


def _check_destination(out_dir: str, todo: _DirectoryFiles, resume: bool, overwrite: bool,
                       refuse: bool = True) -> _Destination:
    """The refusals of a directory write (a directory, FIFO, device or socket in the place of a file it
    creates, a symlink there, another model there, a parent directory that does not exist, too little
    disk space), and what a resume keeps.
    ``refuse=False`` (a dry run): the last two are listed in ``refusals`` instead of raised."""
    odd = not_regular(out_dir, todo.names()) if os.path.isdir(out_dir) else None
    if odd is not None:
        raise ValueError(f"out_dir {out_dir}: {odd}; condinit writes a directory's files as regular files: remove it")
    if not overwrite:
        link = symlinked(out_dir, todo.names()) if os.path.isdir(out_dir) else None
        if link is not None:
            raise ValueError(f"out_dir {out_dir}: {link}; condinit writes a directory's files only inside it and never "
                             f"through a link: remove the link, or pass overwrite=True (--overwrite) to replace the "
                             f"link itself by a regular file")
        why = other_model(out_dir, todo.config_text, todo.metadata, set(todo.paths))
        if why is not None:
            raise ValueError(f"out_dir {out_dir} already holds another model: {why}; pass overwrite=True "
                             f"(--overwrite) to replace it, or choose another directory")
    sizes = {f: h.size for f, h in todo.headers.items()}
    keep = [f for f in todo.paths if resume and complete(todo.paths[f], todo.headers[f].head, sizes[f])]
    need = needed_bytes(todo.paths, sizes, set(keep), follow_symlinks=False) + len(todo.config_text) \
        + len(todo.index_text or "") + len(todo.gen_text or "")
    free = free_bytes(out_dir)
    refusals = []
    if not os.path.isdir(os.path.dirname(out_dir)):
        refusals.append(missing_parent(out_dir))
    if need > free:
        refusals.append(f"not enough disk space for {out_dir}: the write needs {format_bytes(need)} "
                        f"({len(todo.paths) - len(keep)} weights file(s)), the filesystem has "
                        f"{format_bytes(free)} free")
    if refusals and refuse:
        raise ValueError(refusals[0])
    return _Destination(keep, free, need, refusals)


def _run_write(job: Job, files: list, progress: bool, desc: str, follow_symlinks: bool = True,
               started: Optional[list] = None) -> None:
    """Write ``files`` (:class:`_FileJob`) in order: tensors computed here, written by a
    :class:`Writer` thread, with the threads :func:`compute_threads` gives (units computed whole
    on every core, pieces with one core left to the writer). SIGTERM in the main thread removes
    the file being written. ``follow_symlinks=False``: a symlink at a file's path is replaced;
    ``started``: each file's path is appended to it when its tensors start being computed."""
    engine, state = job.engine, job.state
    piece_bytes = tuning().piece_bytes
    todo = {k for f in files for k in f.order}
    ready: dict = {}       # computed tensors not yet handed to the writer
    done: set = set()

    def compute(key):
        if key not in ready:
            unit = engine.unit_of[key]
            with compute_threads(job.device, leave_one=engine.replays(unit) is not None):
                tensors = engine.unit(unit)
            for k, t in tensors.items():
                if k in todo and k not in done:
                    ready[k] = t
        done.add(key)
        t = ready.pop(key)
        meta = state[key]
        if isinstance(t, Replay):
            if t.dtype != meta.dtype or t.numel != meta.numel():
                raise RuntimeError(f"{key}: replayed {t.dtype} x {t.numel}, the header says {meta.dtype} "
                                   f"{tuple(meta.shape)}")
            return t
        if t.dtype != meta.dtype or tuple(t.shape) != tuple(meta.shape):
            raise RuntimeError(f"{key}: computed {t.dtype} {tuple(t.shape)}, the header says {meta.dtype} "
                               f"{tuple(meta.shape)}")
        return t.to("cpu").contiguous() if t.device.type != "cpu" else t.contiguous()

    def take(n: int, dtype: torch.dtype) -> torch.Tensor:
        if engine.pool is not None:
            return engine.pool.take((n,), dtype)
        return torch.empty(n, dtype=dtype, device=job.device)

    def put(item) -> None:
        if not isinstance(item, Replay):
            writer.put(item)
            return
        with compute_threads(job.device):
            for piece, buf in item.pieces(engine.seed, piece_bytes, take):
                if piece.device.type != "cpu":
                    writer.put(piece.to("cpu"))
                else:
                    writer.put(piece, buf)

    total = sum(tensor_bytes(state[k]) for k in todo)
    bar = Progress(total, desc) if progress and total else None
    with removing_temps_on_sigterm():
        writer = Writer(bar, pool=engine.pool)
        try:
            for f in files:
                if started is not None:
                    started.append(f.path)
                writer.begin(f.path, f.head, follow_symlinks)
                for k in f.order:
                    put(compute(k))
                writer.end()
            writer.finish()
        except BaseException:
            writer.abort()
            raise
        finally:
            if bar is not None:
                bar.close()


def write_pretrained(model_or_config, out_dir, *, seed: int = 0, method: str = "auto", v_mode: str = "identity",
                     qk_gain: float = 1.0, v_gain: float = 1.0, dtype: Optional[torch.dtype] = None,
                     max_shard_size: Union[int, str] = "5GB", model_class=None, include=None, exclude=None,
                     strict: bool = False, memory_budget: Optional[int] = None, family: Optional[str] = None,
                     extra_metadata: Optional[dict] = None, progress: bool = False, device=None,
                     resume: bool = False, overwrite: bool = False, dry_run: bool = False, process_group=None,
                     world_size: Optional[int] = None) -> PretrainedWriteReport:
    """Write a ``from_pretrained``-ready model directory of the conditioned model, streamed (see
    :mod:`condinit.models.stream`).

    Args:
        model_or_config: a ``transformers.PretrainedConfig`` (the model is built from it on meta:
            ``model_class``, else the config's ``architectures[0]``, else ``AutoModelForCausalLM`` for
            decoder language models and ``AutoModel`` otherwise), or a ``PreTrainedModel`` whose
            tensors are all on the meta device (left as it is, apart from ``dtype``).
        out_dir: the directory; created (in an existing directory) when missing.
        max_shard_size: bytes per weights file, an int or ``"5GB"`` / ``"500MB"`` / ``"2GiB"`` (as
            ``save_pretrained``; a bigger tensor gets a file of its own).
        resume: keep the planned shards already in ``out_dir`` that are complete (size and header
            exactly as this write gives them), write the rest.
        overwrite: write even when ``out_dir`` holds another model (its files of the same names are
            replaced, a symlink among them by a regular file in its place, its other shards removed).
        seed: ``0 <= seed < 2**64``, for the conditioned Q/K (as ``condinit.apply(model, seed=seed)``)
            and the own init of everything else. Not drawn: the same call writes the same bytes.
        method, v_mode, qk_gain, v_gain, include, exclude, strict, memory_budget: as in
            :func:`condinit.apply`.
        dtype: storage dtype (``torch.bfloat16``, ...); default: the model's, or the config's
            ``dtype``, or float32.
        device: where tensors are computed (``"cpu"``, ``"cuda"``); they are written from the CPU.
        model_class: the transformers class to build a config with.
        family: the ``family`` field of the ``condinit`` metadata (default: the config's ``model_type``).
        extra_metadata: more fields for the ``condinit`` metadata (e.g. ``{"preset": ...}``).
        progress: a progress bar over the bytes written (tqdm; else a line every 10 s on stderr).
        dry_run: plan, check and measure only (``report.plan``); nothing is written. The plan lists
            what the write would refuse (too little disk space, a parent directory that does not
            exist yet) instead of refusing it.
        process_group: when torch.distributed is initialized, the write is shared by the ranks of
            this group (default: the default group), every rank calling with the same arguments:
            each writes the shards :func:`condinit.models.stream.ranks.assign` gives it, rank 0
            holds the lock, makes the checks and writes the configs and, once every rank's shards
            are durable, the index (:mod:`condinit.models.stream.ranks`). The files are the same
            bytes for any number of ranks.
        world_size: with ``dry_run``, the number of ranks to plan for (``plan.ranks``; default the
            group's size, 1 without torch.distributed).
    Returns:
        :class:`PretrainedWriteReport`.

    Raises:
        ValueError / TypeError: a bad argument, a model that is not all on meta, no attention layer,
            ``strict`` with uncovered modules, a symlink in ``out_dir`` in the place of a file the write
            creates or another model there (both without ``overwrite``), too little free disk space;
            all before anything is written.
        condinit.io.dirlock.DirectoryLocked (a ValueError): another process is writing ``out_dir``.
        condinit.models.stream.ranks.RankFailed (a RuntimeError): another rank's write failed, or it
            ended without reporting; no index is written.

    Examples:
        >>> config = transformers.LlamaConfig(num_hidden_layers=32, hidden_size=4096, ...)
        >>> rep = write_pretrained(config, "llama-8b-cond/", seed=0, dtype=torch.bfloat16, max_shard_size="5GB")
        >>> model = transformers.AutoModelForCausalLM.from_pretrained("llama-8b-cond/")
        >>> rep = write_pretrained(config, "llama-8b-cond/", dtype=torch.bfloat16, resume=True)  # after a crash
    """
    t_start = time.perf_counter()
    limit = parse_shard_size(max_shard_size)
    progress = check_bool("progress", progress)
    resume = check_bool("resume", resume)
    overwrite = check_bool("overwrite", overwrite)
    dry_run = check_bool("dry_run", dry_run)
    out_dir = check_out_dir(out_dir, missing_parent_ok=dry_run)
    ranks = ranks_of(process_group)
    world = check_int("world_size", world_size, min=1, allow_none=True) or ranks.size
    if not dry_run and world != ranks.size:
        raise ValueError(f"world_size={world_size}: a write is shared by the ranks of its process group "
                         f"({ranks.size}); world_size plans for other counts with dry_run=True only")
    job = prepare(model_or_config, Settings(
        seed=seed, method=method, v_mode=v_mode, qk_gain=qk_gain, v_gain=v_gain, dtype=dtype, model_class=model_class,
        include=include, exclude=exclude, strict=strict, memory_budget=memory_budget, family=family,
        extra_metadata=extra_metadata, device=device))
    model, state, metadata = job.model, job.state, job.metadata
    files = plan_files(state, limit)
    weight_map = {k: f for f, ks in files.items() for k in ks}
    paths = {f: check_output_path(os.path.join(out_dir, f), follow_symlinks=False) if os.path.isdir(out_dir)
             else os.path.join(out_dir, f) for f in files}

    headers = {}
    n = len(files)
    for i, (fname, keys) in enumerate(files.items()):
        headers[fname] = encode_header(keys, state, {"format": "pt",
                                                     METADATA_KEY: shard_metadata(metadata, set(keys), i + 1, n)})
    sizes = {f: h.size for f, h in headers.items()}

    config = copy.deepcopy(model.config)
    config.dtype = str(next(iter(state.values())).dtype).split(".")[1] if state else None
    config.architectures = [type(model).__name__]
    config_text = config.to_json_string(use_diff=True)
    gen = getattr(model, "generation_config", None)
    gen_text = gen.to_json_string(use_diff=True) if gen is not None and callable(getattr(model, "can_generate", None)) \
        and model.can_generate() else None
    index_text = None
    if n > 1:
        index_text = json_text({"metadata": {"total_parameters": job.num_parameters, "total_size": job.total_size,
                                             METADATA_KEY: metadata}, "weight_map": weight_map})

    todo = _DirectoryFiles(paths, headers, config_text, gen_text, index_text, metadata)
    if dry_run:   # no lock, nothing written; the refusals of the real write are in the plan
        found = _check_destination(out_dir, todo, resume, overwrite, refuse=False)
        plan = make_plan(job, files, sizes, found.keep, found.free, found.need, measure=True, world=world,
                         refusals=found.refusals)
        job.report.total_time_s = time.perf_counter() - t_start
        return PretrainedWriteReport(out_dir, [paths[f] for f in files], weight_map, job.total_size,
                                     job.num_parameters, job.report, job.report.total_time_s, plan=plan,
                                     kept=[paths[f] for f in found.keep], dry_run=True)

    with contextlib.ExitStack() as held:
        held.enter_context(removing_temps_on_sigterm())
        created, found = [], None
        if ranks.rank == 0:   # the lock, the checks and the configs are rank 0's
            try:
                found = _begin_directory(out_dir, todo, resume, overwrite, held, created)
            except BaseException as exc:
                _remove(created)
                decided(ranks, error=exc)   # every rank raises it
                raise
        keep, free, need = decided(ranks, None if found is None else (found.keep, found.free, found.need))
        plan = make_plan(job, files, sizes, keep, free, need, measure=False, world=world)
        mine = plan.ranks[ranks.rank].files
        started: list = []
        error, t0 = None, time.perf_counter()
        try:
            for f in mine:
                paths[f] = check_output_path(paths[f], follow_symlinks=False)
            desc = "condinit write" if ranks.size == 1 else f"condinit write, rank 0 of {ranks.size}"
            _run_write(job, [_FileJob(paths[f], headers[f].head, headers[f].order) for f in mine],
                       progress and ranks.rank == 0, desc, follow_symlinks=False, started=started)
        except BaseException as exc:
            error = exc
        done = RankWritten(ranks.rank, list(mine), sum(sizes[f] for f in mine), time.perf_counter() - t0)
        try:
            written = reported(ranks, done, error, os.path.basename(started[-1]) if started else None)
        except BaseException:
            # a failed write leaves no file of its own behind: the shards' temporary files are gone
            # (atomic_output), and so are the configs this write created
            _remove(created)
            raise
        if ranks.rank == 0:
            if index_text is not None:   # every shard is durable: the directory loads from now on
                write_text(os.path.join(out_dir, WEIGHTS_INDEX_NAME), index_text, follow_symlinks=False)
            for name in os.listdir(out_dir):    # shards of an earlier write that this one did not replace
                path = os.path.join(out_dir, name)
                if SHARD_NAME_RE.match(name) and name not in files and (os.path.isfile(path) or os.path.islink(path)):
                    os.unlink(path)
    job.report.total_time_s = time.perf_counter() - t_start
    return PretrainedWriteReport(out_dir, [paths[f] for f in files], weight_map, job.total_size,
                                 job.num_parameters, job.report, job.report.total_time_s, plan=plan,
                                 kept=[paths[f] for f in keep], written=written)


def _remove(paths: list) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _begin_directory(out_dir: str, todo: _DirectoryFiles, resume: bool, overwrite: bool, held: contextlib.ExitStack,
                     created: list) -> _Destination:
    """Rank 0's part before any shard: the directory made (in its existing parent) and locked (the
    lock entered into ``held``), every refusal checked, the stale index removed, the configs written
    (those that were not there listed in ``created``, for removal on failure). What a resume keeps."""
    if not os.path.isdir(out_dir):   # refused before the directory is made, checked again once locked
        _check_destination(out_dir, todo, resume, overwrite)
        os.makedirs(out_dir, exist_ok=True)
    held.enter_context(directory_lock(out_dir))
    found = _check_destination(out_dir, todo, resume, overwrite)
    for stale in (WEIGHTS_INDEX_NAME, WEIGHTS_NAME):   # never a loadable mix of old and new files
        path = os.path.join(out_dir, stale)
        if (os.path.isfile(path) or os.path.islink(path)) and stale not in todo.paths:
            os.unlink(path)
    side = [(CONFIG_NAME, todo.config_text)] \
        + ([(_GENERATION_CONFIG_NAME, todo.gen_text)] if todo.gen_text is not None else [])
    for name, text in side:
        path = os.path.join(out_dir, name)
        if not os.path.lexists(path):
            created.append(path)
        write_text(path, text, follow_symlinks=False)
    return found


def write_checkpoint(model_or_config, path, *, seed: int = 0, method: str = "auto", v_mode: str = "identity",
                     qk_gain: float = 1.0, v_gain: float = 1.0, dtype: Optional[torch.dtype] = None,
                     model_class=None, include=None, exclude=None, strict: bool = False,
                     memory_budget: Optional[int] = None, family: Optional[str] = None,
                     extra_metadata: Optional[dict] = None, progress: bool = False, device=None,
                     dry_run: bool = False) -> PretrainedWriteReport:
    """Write the conditioned model as one ``.safetensors`` file, streamed: the tensors of
    :func:`write_pretrained` (bit for bit, whatever its ``max_shard_size``), the ``condinit`` entry
    of every layer in the header; the file is replaced atomically.

    Args:
        path: the file.
        model_or_config, seed, method, v_mode, qk_gain, v_gain, dtype, device, model_class, include,
            exclude, strict, memory_budget, family, extra_metadata, progress, dry_run: as in
            :func:`write_pretrained`.
    Returns:
        :class:`PretrainedWriteReport` (``out_dir``: the file's directory).

    Examples:
        >>> rep = write_checkpoint(transformers.LlamaConfig(...), "llama.safetensors", dtype=torch.bfloat16)
    """
    t_start = time.perf_counter()
    progress = check_bool("progress", progress)
    dry_run = check_bool("dry_run", dry_run)
    path = check_output_path(path)
    job = prepare(model_or_config, Settings(
        seed=seed, method=method, v_mode=v_mode, qk_gain=qk_gain, v_gain=v_gain, dtype=dtype, model_class=model_class,
        include=include, exclude=exclude, strict=strict, memory_budget=memory_budget, family=family,
        extra_metadata=extra_metadata, device=device))
    keys = list(job.state)
    name = os.path.basename(path)
    header = encode_header(keys, job.state, {"format": "pt", METADATA_KEY: job.metadata})
    need = needed_bytes({name: path}, {name: header.size}, set())
    free = free_bytes(path)
    refusals = [f"not enough disk space for {path}: the write needs {format_bytes(need)}, the filesystem "
                f"has {format_bytes(free)} free"] if need > free else []
    if refusals and not dry_run:
        raise ValueError(refusals[0])
    plan = make_plan(job, {name: keys}, {name: header.size}, [], free, need, measure=dry_run, refusals=refusals)
    if not dry_run:
        _run_write(job, [_FileJob(path, header.head, header.order)], progress, "condinit write")
    job.report.total_time_s = time.perf_counter() - t_start
    return PretrainedWriteReport(os.path.dirname(path), [path], {k: name for k in keys}, job.total_size,
                                 job.num_parameters, job.report, job.report.total_time_s, plan=plan, dry_run=dry_run)
