"""Streamed checkpoint writing: a conditioned Hugging Face model directory in bounded memory.

:func:`write_pretrained` writes what ``model.save_pretrained(dir)`` would write for the model that
``condinit.apply(model, seed=seed)`` gives, without ever holding the model: ``config.json`` (and
``generation_config.json`` for generative models), the weights as ``model-0000k-of-0000n.safetensors``
shards planned as ``save_pretrained`` plans them (:mod:`.shards`) and
``model.safetensors.index.json``; a model that fits in one shard is the one file
``model.safetensors``, without an index. ``transformers.AutoModelForCausalLM.from_pretrained(dir)``
loads it with no missing or unexpected key. :func:`write_checkpoint` writes the same tensors as one
``.safetensors`` file (``condinit init --out FILE.safetensors``).

**How.** The model is built on the meta device (nothing allocated), what its constructors write
recorded (:mod:`.recording`). Each shard file's header is known from the meta tensors alone, so the
file is written tensor by tensor: a tensor is computed (on ``device``) when the file reaches it,
handed to a writer thread (:mod:`.writer`), and dropped once written, so generation and disk writes
overlap. Tensors are computed in units (:mod:`.materialize`): an attention layer condinit
conditions, bit for bit as :func:`condinit.apply` conditions it, or any other module with the
model's own init, whose ``normal_`` draws are named counter-based streams (:mod:`.streams`): the
same bits whatever the shard size, the chunking, the order of writing or the device. A module whose
init only draws own-init normals and fills is replayed in pieces instead of materialized.
:func:`own_init_` gives a meta model in memory the same tensors (``condinit.apply`` on a meta
model calls it).

Stages, in order: :mod:`.prepare` (checks, the meta model, the materializer), :mod:`.plan`
(:class:`WritePlan`), :mod:`.destination` (refusals, resume, disk space), :mod:`.write` (the entry
points), :mod:`.writer`; sizes and switches in :mod:`.tuning`. Several processes (torchrun) write
one directory together, each its own shards (:mod:`.ranks`), the same bytes as one process.

**Memory**: one unit computed whole (usually an attention layer: its Q/K/V, and the
orthogonalization's scratch, in chunks of :attr:`Tuning.cpu_layer_budget` on the CPU unless
``memory_budget`` says otherwise) plus the tensors of the current shard computed ahead of their
turn (at most another unit) plus the writer's queue (:attr:`Tuning.max_queued_bytes` not yet
written, besides a bigger tensor being written) plus the piece being drawn, plus at most 128 MB of
written tensors' buffers kept for reuse (:class:`.writer.BufferPool`: no page faults on the next
pieces and layers; every piece buffer has one size), whatever the model's size or
``max_shard_size``. The embedding matrix, an MLP's weights, the output head are drawn in pieces.

Only Hugging Face ``PreTrainedModel`` classes: their init rule is what is reproduced here.
Models whose in-memory state-dict names differ from their checkpoint format (transformers'
weight-conversion mappings, e.g. some mixture-of-experts models) are written under their in-memory
names.
"""
from condinit.io.safetensors_format import WEIGHTS_INDEX_NAME, WEIGHTS_NAME

from .own_init import own_init_
from .plan import LargestUnit, PlannedFile, RankShare, Rates, WritePlan
from .ranks import RankFailed, RankWritten, assign
from .shards import parse_shard_size, plan_shards
from .streams import OWN_INIT_BLOCK, own_init_stream, own_normal_
from .tuning import Tuning, tuned, tuning
from .write import PretrainedWriteReport, write_checkpoint, write_pretrained

__all__ = ["write_pretrained", "write_checkpoint", "plan_shards", "parse_shard_size", "own_init_stream",
           "own_normal_", "own_init_", "OWN_INIT_BLOCK", "PretrainedWriteReport", "WritePlan", "PlannedFile",
           "LargestUnit", "Rates", "RankShare", "RankWritten", "RankFailed", "assign", "Tuning", "tuning", "tuned",
           "WEIGHTS_NAME", "WEIGHTS_INDEX_NAME"]
