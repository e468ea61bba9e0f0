"""Triton kernels of condinit, installed as ``condinit.kernels``: one folder per op family
(``attention``, ``orthogonalize``), beside the op's Python side in ``condinit/ops/<family>/``.

Each folder holds the ``@triton.jit`` kernels and the host functions that launch them. Import them
only through the ops in ``condinit`` (which check that triton is usable first): importing this
package itself never imports triton.

Run from the repository root (``python -m ...`` puts the working directory first on ``sys.path``),
this folder would shadow the ``kernels`` distribution that transformers imports; imported under that
top-level name it hands the import over to the installed distribution where there is one.
"""
if __name__ == "kernels":
    import importlib as _importlib
    import os as _os
    import sys as _sys

    _root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    _path = _sys.path[:]
    _self = _sys.modules.pop(__name__)
    try:
        _sys.path[:] = [p for p in _path if _os.path.abspath(p or _os.curdir) != _root]
        _sys.modules[__name__] = _importlib.import_module(__name__)
    except ImportError:
        _sys.modules[__name__] = _self        # no such distribution: this folder it is
    finally:
        _sys.path[:] = _path
