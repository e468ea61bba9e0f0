"""Importing condinit (and resolving its public names) must stay lean: no CUDA initialization, no
triton or trainer framework import, and no failure when optional backends are missing. Each check
runs in a fresh interpreter so nothing imported by other tests can hide a regression."""
import json
import os
import subprocess
import sys

import pytest


def _run(code: str, **env) -> str:
    full_env = {**os.environ, **env}
    if "PYTHONPATH" in env and os.environ.get("PYTHONPATH"):
        full_env["PYTHONPATH"] = env["PYTHONPATH"] + os.pathsep + os.environ["PYTHONPATH"]
    full_env.pop("TRITON_INTERPRET", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.slow
def test_import_does_not_initialize_cuda_or_import_triton():
    """Every public name resolves (getattr raises for one that does not) without touching CUDA or triton."""
    code = (
        "import sys, json, torch, condinit\n"
        "names = [n for n in condinit.__all__ if n != '__version__']\n"
        "for n in names: getattr(condinit, n)\n"
        "print(json.dumps({'cuda': torch.cuda.is_initialized(), 'triton': 'triton' in sys.modules}))"
    )
    res = json.loads(_run(code))
    assert res == {"cuda": False, "triton": False}


@pytest.mark.slow
def test_import_condinit_imports_no_trainer_framework():
    code = ("import sys, condinit, condinit.probe, condinit.probe.monitor, condinit.integrations.lightning\n"
            "condinit.JacobianMonitor\n"
            "print([m for m in ('transformers', 'lightning', 'pytorch_lightning') if m in sys.modules])")
    assert _run(code) == "[]"


@pytest.mark.slow
def test_import_survives_missing_triton_and_extension(tmp_path):
    # A `triton` that fails to import shadows the real one, and `condinit._C` is blocked, as on a
    # machine without them (or with a broken install).
    (tmp_path / "triton").mkdir()
    (tmp_path / "triton" / "__init__.py").write_text("raise ImportError('triton removed for this test')\n")
    code = (
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'condinit._C':\n"
        "            raise ImportError(f'blocked {name}')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import torch, condinit\n"
        "from condinit import _ext, _backends\n"
        "from condinit.commands import info\n"
        "data = info.collect()\n"
        "assert not data['native_extension']['loaded']\n"
        "rows = [r for r in data['backends'] if r['backend'] == 'torch']\n"
        "assert rows and all(r['available'] for r in rows)\n"
        "tri = [r for r in data['backends'] if r['backend'] == 'triton' and r['device'] == 'cuda'\n"
        "       and r['reason'] != 'not implemented for this op']\n"
        "assert tri\n"
        "assert all(not r['available'] and 'removed for this test' in r['reason'] for r in tri), tri\n"
        "print('ok')"
    )
    assert _run(code, PYTHONPATH=str(tmp_path)) == "ok"


def test_unknown_attribute_raises_attribute_error():
    import condinit
    with pytest.raises(AttributeError, match="no attribute"):
        condinit.does_not_exist


@pytest.mark.slow
def test_import_condinit_models_is_lean():
    import subprocess
    import sys

    code = ("import sys, condinit, condinit.models; m = condinit.apply; "
            "bad = [k for k in ('transformers', 'timm', 'torch.distributed.tensor') if k in sys.modules]; "
            "import torch; assert not torch.cuda.is_initialized(); print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
