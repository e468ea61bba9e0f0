"""Trainer callbacks around JacobianMonitor: Hugging Face Trainer (records written, training unchanged)
and Lightning (skipped when it is not installed)."""
import csv
import json
import os
import sys

import pytest
import torch

pytestmark = pytest.mark.usefixtures("one_thread")


def _lightning_installed() -> bool:
    import importlib.util
    return any(importlib.util.find_spec(m) is not None for m in ("lightning", "pytorch_lightning"))


def test_lightning_callback_without_lightning_names_the_package(monkeypatch):
    import condinit.integrations.lightning as lmod
    for name in ("lightning", "lightning.pytorch", "pytorch_lightning"):     # as if neither were installed
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setattr(lmod, "_cls", None)
    with pytest.raises(ImportError, match=r"pip install 'condinit\[lightning\]'"):
        lmod.JacobianMonitorCallback
    with pytest.raises(ImportError, match=r"pip install 'condinit\[lightning\]'"):
        from condinit.integrations.lightning import JacobianMonitorCallback  # noqa: F401


def _lightning():
    try:
        import lightning.pytorch as pl
    except ImportError:
        import pytorch_lightning as pl
    return pl


def _lightning_module(pl, log_loss: bool):
    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=24, batch_first=True)

        def training_step(self, batch, batch_idx):
            loss = self.layer(batch[0]).square().mean()
            if log_loss:
                self.log("loss", loss, on_step=True, on_epoch=False)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)
    return Module()


@pytest.mark.skipif(not _lightning_installed(), reason="neither lightning nor pytorch_lightning is installed")
def test_lightning_callback_records(tmp_path):
    pl = _lightning()
    from condinit.integrations.lightning import JacobianMonitorCallback

    data = torch.utils.data.TensorDataset(torch.randn(8, 6, 16))
    cb = JacobianMonitorCallback(every=2, steps=4, frobenius_samples=0, log_dir=tmp_path, log_signals=False)
    trainer = pl.Trainer(max_steps=4, callbacks=[cb], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, accelerator="cpu")
    trainer.fit(_lightning_module(pl, log_loss=False), torch.utils.data.DataLoader(data, batch_size=2))
    recs = [json.loads(l) for l in open(tmp_path / "jacobian.jsonl")]
    assert [r["step"] for r in recs] == [0, 2]


@pytest.mark.slow
@pytest.mark.skipif(not _lightning_installed(), reason="neither lightning nor pytorch_lightning is installed")
def test_lightning_logs_records_at_the_step_they_were_measured(tmp_path):
    pl = _lightning()
    CSVLogger = pl.loggers.CSVLogger
    from condinit.integrations.lightning import JacobianMonitorCallback

    steps_seen = []

    class Steps(pl.Callback):        # the trainer's own count when each batch starts: the step measured
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            steps_seen.append(trainer.global_step)

    data = torch.utils.data.TensorDataset(torch.randn(8, 6, 16))
    cb = JacobianMonitorCallback(every=2, steps=4, frobenius_samples=0, log_dir=tmp_path / "jac")
    logger = CSVLogger(tmp_path, name="csv")
    trainer = pl.Trainer(max_steps=4, callbacks=[Steps(), cb], logger=logger, log_every_n_steps=1,
                         enable_checkpointing=False, enable_progress_bar=False, accelerator="cpu")
    trainer.fit(_lightning_module(pl, log_loss=True), torch.utils.data.DataLoader(data, batch_size=2))
    assert steps_seen == [0, 1, 2, 3]
    rows = list(csv.DictReader(open(os.path.join(logger.log_dir, "metrics.csv"))))
    kappa_steps = [int(r["step"]) for r in rows if r.get("jacobian/00/kappa")]
    assert kappa_steps == [steps_seen[0], steps_seen[2]] == [0, 2]
    recs = [json.loads(l) for l in open(tmp_path / "jac" / "jacobian.jsonl")]
    assert [r["step"] for r in recs if "alert" not in r] == kappa_steps


# -- Hugging Face Trainer --------------------------------------------------------------------------

def _hf_run(tmp_path, name, callbacks, steps=4):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.manual_seed(0)
    # GPT-2: causal, fused c_attn Conv1D, and dropout (a draw from the global RNG by the monitor would
    # change the weights). A tiny Llama is checked by tests/test_monitor_signals.py.
    cfg = GPT2Config(vocab_size=32, n_embd=16, n_head=4, n_layer=2, n_positions=16)
    model = GPT2LMHeadModel(cfg)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 32, (16, 8), generator=gen)
    data = [{"input_ids": r, "labels": r} for r in ids]
    args = TrainingArguments(output_dir=str(tmp_path / name), max_steps=steps, per_device_train_batch_size=2,
                             learning_rate=1e-2, report_to=[], use_cpu=True, logging_steps=1, save_strategy="no",
                             disable_tqdm=True, seed=3, dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
    trainer.train()
    return model, trainer


@pytest.mark.slow
def test_hf_trainer_callback_writes_records_and_leaves_training_unchanged(tmp_path):
    from condinit.integrations.trainer import JacobianMonitorCallback

    model0, _ = _hf_run(tmp_path, "plain", None)
    cb = JacobianMonitorCallback(every=2, steps=4, frobenius_samples=2, alerts={"max_logit": 1e-3})
    with pytest.warns(UserWarning, match="max_logit"):
        model1, trainer = _hf_run(tmp_path, "monitored", [cb])
    for (n0, p0), (n1, p1) in zip(model0.state_dict().items(), model1.state_dict().items()):
        assert n0 == n1 and torch.equal(p0, p1), n0
    path = tmp_path / "monitored" / "jacobian" / "jacobian.jsonl"
    lines = [json.loads(l) for l in open(path)]
    recs = [r for r in lines if "alert" not in r]
    # optimizer steps 0 and 2 of 4 are sampled, both layers each, all estimated
    assert [(r["step"], r["layer"]) for r in recs] == [(s, l) for s in (0, 2) for l in (0, 1)]
    assert all(r["skipped"] is None and r["kappa"] is not None and len(r["max_logit_heads"]) == 4 for r in recs)
    assert {(a["layer"], a["alert"]) for a in lines if "alert" in a} == {(0, "max_logit"), (1, "max_logit")}
    assert os.path.getsize(path.with_suffix(".csv")) > 0
    assert cb.monitor._capture is None                      # closed on train end
    # each sampled step's values reached the Trainer's log history at the step they were measured:
    # the Trainer's own count of optimizer steps done before it (its losses are logged at 1, 2, ...)
    logged = [h for h in trainer.state.log_history if "jacobian/00/kappa" in h]
    losses = [h["step"] for h in trainer.state.log_history if "loss" in h]
    assert losses == [1, 2, 3, 4]                                 # logging_steps=1: the count after each step
    assert [h["step"] for h in logged] == [losses[0] - 1, losses[2] - 1] == [0, 2]
    assert logged[-1]["jacobian/01/max_logit"] == recs[-1]["max_logit"]


def test_hf_callback_rejects_bad_arguments():
    pytest.importorskip("transformers")
    from condinit.integrations.trainer import JacobianMonitorCallback

    with pytest.raises(ValueError, match="every"):
        JacobianMonitorCallback(every=0)
    with pytest.raises(TypeError, match="log_signals"):
        JacobianMonitorCallback(log_signals=1)
    with pytest.raises(TypeError, match="model"):
        JacobianMonitorCallback(model=torch.nn.Linear(2, 2))
