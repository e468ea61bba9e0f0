"""Every optional feature whose dependency is missing says which extra installs it.

Each test makes the dependency's import fail (its ``sys.modules`` entry set to None, which makes
``import`` raise ImportError), so the messages are checked whether or not the package is installed.
"""
import json
import sys

import pytest

from condinit.cli import main


def _hide(monkeypatch, *modules):
    """Make ``import m`` fail for each module (and reload-by-import of the modules that use them)."""
    for m in modules:
        monkeypatch.setitem(sys.modules, m, None)


def _forget(monkeypatch, module):
    """Import ``module`` afresh on the next ``import`` (monkeypatch restores the old entry)."""
    monkeypatch.delitem(sys.modules, module, raising=False)


@pytest.mark.parametrize("missing", ["accelerate", pytest.param("transformers", marks=pytest.mark.slow)])   # imports accelerate
def test_hf_trainer_callback_names_the_hf_extra(monkeypatch, missing):
    _forget(monkeypatch, "condinit.integrations.trainer")
    _hide(monkeypatch, missing)
    with pytest.raises(ImportError, match=r"HF Trainer callback .* needs transformers and accelerate: "
                                          r"pip install 'condinit\[hf\]'") as err:
        import condinit.integrations.trainer  # noqa: F401
    assert missing in str(err.value)       # the underlying failure is kept in the message


def test_hf_attention_names_the_hf_extra(monkeypatch):
    import condinit.integrations.hf as hf

    monkeypatch.setattr(hf, "_registered", False)
    _hide(monkeypatch, "transformers", "transformers.masking_utils")
    with pytest.raises(ImportError, match=r"attn_implementation=\"condinit\" needs transformers: "
                                          r"pip install 'condinit\[hf\]'"):
        hf.register_hf_attention()


def test_lightning_callback_names_the_lightning_extra(monkeypatch):
    import condinit.integrations.lightning as lmod

    monkeypatch.setattr(lmod, "_cls", None)
    _hide(monkeypatch, "lightning", "lightning.pytorch", "pytorch_lightning")
    for _ in range(2):                     # the error repeats: nothing half-built is cached
        with pytest.raises(ImportError, match=r"needs lightning or pytorch_lightning, and neither is installed: "
                                              r"pip install 'condinit\[lightning\]'"):
            lmod.JacobianMonitorCallback
    with pytest.raises(ImportError, match=r"condinit\[lightning\]"):
        from condinit.integrations.lightning import JacobianMonitorCallback  # noqa: F401


def test_inspect_plot_names_the_plot_extra(monkeypatch, tmp_path, capsys):
    _hide(monkeypatch, "matplotlib")
    rc = main(["inspect", str(tmp_path / "absent.safetensors"), "--plot", str(tmp_path / "k.png")])
    err = capsys.readouterr().err
    assert rc == 2 and "--plot needs matplotlib: pip install 'condinit[plot]'" in err, err
    assert not (tmp_path / "k.png").exists()


def test_plot_command_names_the_plot_extra(monkeypatch, tmp_path, capsys):
    (tmp_path / "jacobian.jsonl").write_text(json.dumps({"step": 0, "layer": 0, "kappa": 3.0}) + "\n")
    _hide(monkeypatch, "matplotlib", "matplotlib.pyplot")
    rc = main(["plot", str(tmp_path), "--out", str(tmp_path / "plots")])
    err = capsys.readouterr().err
    assert rc == 2 and "condinit plot needs matplotlib: pip install 'condinit[plot]'" in err, err


def test_demo_names_the_demo_extra(monkeypatch, tmp_path, capsys):
    _hide(monkeypatch, "matplotlib")
    rc = main(["demo", "--quick", "--out", str(tmp_path / "demo")])
    err = capsys.readouterr().err
    assert rc == 2 and "pip install 'condinit[demo]', or pass --no-plots" in err, err
    _hide(monkeypatch, "sklearn", "sklearn.datasets")
    rc = main(["demo", "--quick", "--no-plots", "--task", "vision", "--out", str(tmp_path / "demo")])
    err = capsys.readouterr().err
    assert rc == 2 and "scikit-learn" in err and "pip install 'condinit[demo]'" in err, err
