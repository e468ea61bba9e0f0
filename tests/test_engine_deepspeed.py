"""DeepSpeed ZeRO-3 on CPU (DS_ACCELERATOR=cpu, gloo, 2 ranks): transformers models built under
deepspeed.zero.Init, their parameters partitioned at construction. condinit.apply on every rank must
give the Q/K/V of a single-process apply of the same model, leave every other parameter bit for bit,
gather at most one attention module at a time, and leave every parameter partitioned again."""
import glob
import os
import socket

import pytest
import torch

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")

import condinit  # noqa: E402

SEED = 4321
WORLD = 2
DIM, HEADS, KV_HEADS, LAYERS, VOCAB = 64, 8, 2, 2, 128
DS_CONFIG = {"train_batch_size": WORLD, "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
             "zero_allow_untested_optimizer": True}


def _classes(family):
    """The config and model classes (resolved, and their modules imported, before zero.Init: importing
    under it, while it patches tensor construction, fails)."""
    import transformers
    if family == "llama":
        return transformers.LlamaConfig, transformers.LlamaForCausalLM
    return transformers.GPT2Config, transformers.GPT2LMHeadModel


def _config(family, config):
    if family == "llama":
        return config(hidden_size=DIM, intermediate_size=128, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                      num_hidden_layers=LAYERS, vocab_size=VOCAB, attention_bias=True)
    return config(n_embd=DIM, n_head=HEADS, n_layer=LAYERS, vocab_size=VOCAB, n_positions=32)


def _build(family, classes=None):
    config, model = classes or _classes(family)
    return model(_config(family, config))


def _is_qkv(family, name):
    if family == "llama":
        return any(f"self_attn.{p}_proj." in name for p in "qkv")
    return ".attn.c_attn." in name


def _heads(family, sd):
    """Per layer: Q and K as [heads, d, DIM] blocks and V as a [H_kv d, DIM] matrix, read the way each
    model's forward reads its projections: Llama views q_proj(x) as (..., -1, head_dim); GPT-2's Conv1D
    computes x @ W ([DIM, 3 DIM]) and splits the output into Q, K, V thirds, each viewed per head."""
    d = DIM // HEADS
    out = []
    for i in range(LAYERS):
        if family == "llama":
            p = f"model.layers.{i}.self_attn."
            q, k, v = (sd[p + f"{n}_proj.weight"].double() for n in "qkv")
            out.append((q.reshape(HEADS, d, DIM), k.reshape(KV_HEADS, d, DIM), v,
                        [sd[p + f"{n}_proj.bias"] for n in "qkv"]))
        else:
            w = sd[f"transformer.h.{i}.attn.c_attn.weight"].double()
            q, k, v = (w[:, j * DIM:(j + 1) * DIM].t() for j in range(3))
            out.append((q.reshape(HEADS, d, DIM), k.reshape(HEADS, d, DIM), v,
                        [sd[f"transformer.h.{i}.attn.c_attn.bias"]]))
    return out


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _shm_buffers(port):
    """DeepSpeed's CPU all-reduce buffers for ``port`` (``/dev/shm``, named by uid, address, port and rank).
    DeepSpeed never unlinks them: left behind, they fill memory, and a later run that draws the same port
    opens a stale one as its peer's and aborts."""
    return glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_*")


def _spawn(worker, *args):
    """``worker(rank, WORLD, port, *args)`` on every rank, with no DeepSpeed buffer of that port before or after.

    A rank killed by SIGABRT ("terminate called without an active exception", from the C++ side of the
    CPU stack, 5 of about 50 runs on a 2-core VM) is run again once on a fresh port; a failed check inside a
    worker raises ProcessRaisedException instead and is never retried."""
    for attempt in (1, 2):
        port = _free_port()
        for f in _shm_buffers(port):
            os.unlink(f)
        try:
            torch.multiprocessing.spawn(worker, args=(WORLD, port, *args), nprocs=WORLD, join=True)
            return
        except torch.multiprocessing.ProcessExitedException as e:
            if attempt == 2 or e.signal_name != "SIGABRT":
                raise
        finally:
            for f in _shm_buffers(port):
                os.unlink(f)


def _gathered(model, gather):
    """Every parameter's full value (a copy), read inside GatheredParameters."""
    params = dict(model.named_parameters())
    with gather(list(params.values()), modifier_rank=None):
        return {k: v.detach().clone() for k, v in params.items()}


def _init_distributed(rank, world, port):
    os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_SIZE=str(world), OMP_NUM_THREADS="1")
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    return deepspeed


def _worker(rank, world, port, family, build, drawn, out_dir):
    deepspeed = _init_distributed(rank, world, port)
    try:
        classes = _classes(family)
        torch.manual_seed(0)
        if build == "zero.Init":
            with deepspeed.zero.Init(config_dict_or_path=DS_CONFIG):
                model = _build(family, classes)
        else:      # transformers builds under zero.Init itself while an HfDeepSpeedConfig with stage 3 lives
            from transformers import AutoModelForCausalLM
            from transformers.integrations import HfDeepSpeedConfig
            hf_ds = HfDeepSpeedConfig(DS_CONFIG)  # noqa: F841  (transformers holds a weak reference)
            model = AutoModelForCausalLM.from_config(_config(family, classes[0]))
        params = dict(model.named_parameters())

        def all_partitioned():
            return all(p.ds_status.name == "NOT_AVAILABLE" and p.data.numel() == 0 for p in params.values())

        assert all_partitioned()
        gather = deepspeed.zero.GatheredParameters
        before = _gathered(model, gather)
        peak = [0]

        class Tracking(gather):      # the most elements gathered at once while condinit.apply runs
            def __enter__(self):
                out = super().__enter__()
                peak[0] = max(peak[0], sum(p.ds_numel for p in params.values() if p.ds_status.name == "AVAILABLE"))
                return out

        deepspeed.zero.GatheredParameters = Tracking
        try:
            if drawn:      # each rank's generator differs: the first rank's draw must be used everywhere
                torch.manual_seed(100 + rank)
                rep = condinit.apply(model, report=True, strict=True)
            else:
                rep = condinit.apply(model, seed=SEED, report=True, strict=True)
        finally:
            deepspeed.zero.GatheredParameters = gather
        assert all_partitioned()
        after = _gathered(model, gather)
        for k, v in before.items():
            if not _is_qkv(family, k):
                assert torch.equal(after[k], v), k
        torch.save({"qkv": {k: v for k, v in after.items() if _is_qkv(family, k)}, "report": rep.to_dict(),
                    "peak": peak[0]}, os.path.join(out_dir, f"{rank}.pt"))
        # every rank done with the group before any tears it down (a gloo peer destroyed mid-collective
        # aborts the other rank)
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("family,build,drawn", [("llama", "zero.Init", True), ("gpt2", "zero.Init", False),
                                               ("llama", "HfDeepSpeedConfig", False)])
def test_zero3_apply_equals_single_process(tmp_path, family, build, drawn):
    _spawn(_worker, family, build, drawn, str(tmp_path))
    runs = [torch.load(tmp_path / f"{r}.pt") for r in range(WORLD)]
    seed = runs[0]["report"]["seed"]
    assert drawn or seed == SEED
    ref_model = _build(family)
    ref_rep = condinit.apply(ref_model, seed=seed, report=True, strict=True)
    ref = dict(ref_model.named_parameters())
    attn = ref_model.model.layers[0].self_attn if family == "llama" else ref_model.transformer.h[0].attn
    one_layer = sum(p.numel() for p in attn.parameters())
    for run in runs:
        assert run["report"]["seed"] == seed                 # every rank reports the seed written
        assert 0 < run["peak"] <= one_layer                   # never more than one attention module gathered
        ref_layers = [l.to_dict() for l in ref_rep.layers]
        assert len(run["report"]["layers"]) == len(ref_layers) == LAYERS
        for l, r in zip(run["report"]["layers"], ref_layers):
            same = ("index", "name", "adapter", "num_heads", "num_kv_heads", "head_dim", "layout", "cross", "shapes")
            assert {f: l[f] for f in same} == {f: r[f] for f in same}
            assert l["before"].keys() == r["before"].keys() and all(v is not None for v in l["before"].values())
            for p in "qkv":
                for f in ("sigma_max", "sigma_min"):
                    assert l["after"][p][f] == pytest.approx(r["after"][p][f], abs=1e-6), (l["name"], p, f)
        for k, v in run["qkv"].items():
            torch.testing.assert_close(v.double(), ref[k].detach().double(), rtol=0, atol=1e-6, msg=k)
    # independently of the reference: per-head singular values 1, V the rectangular identity, biases 0
    for q, k, v, biases in _heads(family, runs[0]["qkv"]):
        for blocks in (q, k):
            s = torch.linalg.svdvals(blocks)
            torch.testing.assert_close(s, torch.ones_like(s), rtol=0, atol=1e-5)
        torch.testing.assert_close(v, torch.eye(*v.shape, dtype=v.dtype), rtol=0, atol=0)
        for b in biases:
            assert torch.equal(b, torch.zeros_like(b))


def _engine_worker(rank, world, port):
    deepspeed = _init_distributed(rank, world, port)
    try:
        classes = _classes("llama")
        with deepspeed.zero.Init(config_dict_or_path=DS_CONFIG):
            model = _build("llama", classes)
        deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=DS_CONFIG)
        gather = deepspeed.zero.GatheredParameters
        before = _gathered(model, gather)
        with pytest.raises(ValueError, match="before deepspeed.initialize"):
            condinit.apply(model, seed=SEED)
        with gather(list(model.parameters()), modifier_rank=0):    # gathered by the caller: refused as well
            with pytest.raises(ValueError, match="before deepspeed.initialize"):
                condinit.apply(model, seed=SEED)
        after = _gathered(model, gather)
        for k, v in before.items():
            assert torch.equal(after[k], v), k
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_zero3_model_under_an_engine_is_refused():
    """After deepspeed.initialize the ZeRO-3 optimizer holds fp32 copies of the partitions that its next
    step writes back: condinit.apply refuses such a model and writes nothing."""
    _spawn(_engine_worker)
