"""Build condinit, with its optional native extension ``condinit._C``.

The extension holds the C++ CPU kernels and, when nvcc is found, the CUDA kernels, all registered
under the ``condinit_C`` torch.library namespace. It is optional: when torch is not importable at
build time (an isolated build), no C++ compiler works, or the build fails, condinit installs without
it and falls back to Triton / PyTorch (``python -m condinit info`` says why). Build it with::

    pip install --no-build-isolation .

Switches (environment variables):
  CONDINIT_NO_EXT=1        skip the extension entirely
  CONDINIT_NO_CUDA=1       build only the CPU part even when nvcc is present
  CONDINIT_FORCE_CUDA=1    build the CUDA part even without a visible GPU (needs nvcc / CUDA_HOME)
  CONDINIT_STRICT_BUILD=1  a failed extension build fails the install (CI uses this)
  TORCH_CUDA_ARCH_LIST     CUDA archs, default "8.0;9.0"; the newest plain arch also gets PTX
                           ("+PTX"), which GPUs newer than every listed arch JIT-compile
  MAX_JOBS                 parallel compile jobs (ninja)
"""
import glob
import os
import re
import shutil
import subprocess
import sys
import warnings

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _flag(name):
    return os.environ.get(name, "0").lower() in ("1", "true", "yes", "on")


def _is_cuda_home(path):
    return bool(path) and os.path.isfile(os.path.join(path, "bin", "nvcc")) and os.path.isfile(
        os.path.join(path, "include", "cuda_runtime.h"))


def _cuda_home():
    """A CUDA toolkit with both nvcc and its headers, or None.

    torch guesses CUDA_HOME from `which nvcc`, which is wrong when nvcc on PATH is a wrapper script
    (e.g. /usr/local/bin/nvcc -> CUDA_HOME=/usr/local, without headers); check each candidate."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    try:
        from torch.utils.cpp_extension import CUDA_HOME
        candidates.append(CUDA_HOME)
    except Exception:
        pass
    candidates.append("/usr/local/cuda")
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    return next((c for c in candidates if _is_cuda_home(c)), None)


def _cxx_standard():
    """C++20 when torch's headers demand it (torch >= 2.13), else C++17."""
    from torch.utils.cpp_extension import include_paths
    for inc in include_paths():
        header = os.path.join(inc, "ATen", "ATen.h")
        if os.path.exists(header):
            with open(header) as f:
                return "c++20" if "C++20 or later" in f.read() else "c++17"
    return "c++17"


def _arch_list(text):
    """``TORCH_CUDA_ARCH_LIST`` with PTX for its newest plain arch (``8.0;9.0`` -> ``8.0;9.0+PTX``),
    unless an entry already carries PTX: the fatbin then holds SASS for every listed arch and the
    PTX a newer GPU compiles at load time. Arch-specific entries (``9.0a``) are left alone (their
    PTX runs on that arch only)."""
    archs = [a for a in text.replace(" ", ";").split(";") if a]
    plain = [i for i, a in enumerate(archs) if re.fullmatch(r"\d+\.\d+", a)]
    if plain and not any(a.endswith("+PTX") for a in archs):
        newest = max(plain, key=lambda i: tuple(int(x) for x in archs[i].split(".")))
        archs[newest] += "+PTX"
    return ";".join(archs)


def _nvidia_wheel_includes():
    try:
        import nvidia
    except ImportError:
        return []
    return sorted(glob.glob(os.path.join(list(nvidia.__path__)[0], "*", "include")))


def _extensions():
    """Return (ext_modules, cmdclass); empty when the extension cannot or should not be built."""
    if _flag("CONDINIT_NO_EXT"):
        print("condinit: CONDINIT_NO_EXT=1, not building the native extension")
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension
    except Exception as exc:  # isolated build env without torch
        print(f"condinit: torch not importable at build time ({exc}); building without the native "
              "extension (install with --no-build-isolation to build it)")
        return [], {}

    def rel(paths):
        return sorted(os.path.relpath(p, ROOT) for p in paths)

    all_cpp = rel(glob.glob(os.path.join(ROOT, "csrc", "**", "*.cpp"), recursive=True))
    cpu_sources = [p for p in all_cpp if not p.endswith("_cuda.cpp")]
    cuda_sources = [p for p in all_cpp if p.endswith("_cuda.cpp")]
    cu_sources = rel(glob.glob(os.path.join(ROOT, "csrc", "**", "*.cu"), recursive=True))

    cuda_home = _cuda_home()
    torch_has_cuda = torch.version.cuda is not None
    # nvcc plus a CUDA build of torch is enough: the CUDA code compiles without a GPU.
    with_cuda = not _flag("CONDINIT_NO_CUDA") and cuda_home is not None and torch_has_cuda
    if _flag("CONDINIT_FORCE_CUDA") and not with_cuda:
        raise RuntimeError("CONDINIT_FORCE_CUDA=1 but nvcc (CUDA_HOME) or a CUDA build of torch is missing")

    # Portable baseline; hot loops pick AVX2/AVX-512 at run time. Recent torch headers need C++20.
    cxx = ["-O3", f"-std={_cxx_standard()}", "-fopenmp"]
    define_macros = [("CONDINIT_BUILD_TORCH_VERSION", f'"{torch.__version__}"')]
    cpu_ext = CppExtension(
        "condinit._C",
        sources=cpu_sources,
        include_dirs=[os.path.join(ROOT, "csrc")],
        define_macros=list(define_macros),
        extra_compile_args={"cxx": list(cxx)},
        extra_link_args=["-fopenmp"],
    )
    if with_cuda:
        os.environ["TORCH_CUDA_ARCH_LIST"] = _arch_list(os.environ.get("TORCH_CUDA_ARCH_LIST", "8.0;9.0"))
        os.environ["CUDA_HOME"] = cuda_home
        import torch.utils.cpp_extension as cpp_extension
        cpp_extension.CUDA_HOME = cuda_home  # what BuildExtension uses to find nvcc and headers
        define_macros.append(("CONDINIT_WITH_CUDA", None))
        # ATen's CUDA headers include cuSPARSE/cuBLAS headers that a minimal toolkit may lack; the
        # nvidia-* wheels torch depends on carry them. Searched last, so CUDA_HOME's headers win.
        for inc in _nvidia_wheel_includes():
            cxx += ["-idirafter", inc]
        ext = CUDAExtension(
            "condinit._C",
            sources=cpu_sources + cuda_sources + cu_sources,
            include_dirs=[os.path.join(ROOT, "csrc")],
            define_macros=define_macros,
            extra_compile_args={
                "cxx": cxx,
                "nvcc": ["-O3", "-std=c++17", "--use_fast_math", "-lineinfo",
                         "--expt-relaxed-constexpr"],
            },
            extra_link_args=["-fopenmp"],
        )
        print(f"condinit: building condinit._C with CUDA (nvcc at {cuda_home}, archs "
              f"{os.environ['TORCH_CUDA_ARCH_LIST']})")
    else:
        why = ("CONDINIT_NO_CUDA=1" if _flag("CONDINIT_NO_CUDA") else
               "nvcc not found" if cuda_home is None else "torch is a CPU-only build")
        print(f"condinit: building condinit._C for CPU only ({why})")
        ext = cpu_ext

    class OptionalBuildExtension(BuildExtension):
        """A failed native build warns and installs the pure-Python package (unless strict)."""

        def run(self):
            try:
                super().run()
            except Exception as exc:
                if _flag("CONDINIT_STRICT_BUILD"):
                    raise
                warnings.warn(f"condinit: native extension build failed ({exc}); installing without it")

        def build_extension(self, ext):
            try:
                super().build_extension(ext)
            except Exception as exc:
                if _flag("CONDINIT_STRICT_BUILD"):
                    raise
                if ext is not cpu_ext and self._build_cpu_only(exc):
                    return
                warnings.warn(f"condinit: building {ext.name} failed ({exc}); installing without it")

        def _build_cpu_only(self, exc):
            """Keep the C++ CPU kernels when only the CUDA part fails: rebuild without it, in a
            child process (BuildExtension prepares its compiler once per run)."""
            warnings.warn(f"condinit: building condinit._C with CUDA failed ({exc}); retrying for CPU only")
            cmd = [sys.executable, os.path.join(ROOT, "setup.py"), "-q", "build_ext",
                   "--build-temp", os.path.abspath(self.build_temp) + "-cpu"]
            cmd += ["--inplace"] if self.inplace else ["--build-lib", os.path.abspath(self.build_lib)]
            env = {**os.environ, "CONDINIT_NO_CUDA": "1", "CONDINIT_STRICT_BUILD": "1"}
            return subprocess.run(cmd, cwd=ROOT, env=env).returncode == 0

    return [ext], {"build_ext": OptionalBuildExtension.with_options(use_ninja=shutil.which("ninja") is not None)}


ext_modules, cmdclass = _extensions()

setup(
    # kernels/ (the Triton kernels, one folder per op family) is installed as condinit.kernels.
    packages=(find_packages(include=["condinit", "condinit.*"]) + ["condinit.kernels"]
              + ["condinit.kernels." + p for p in find_packages(os.path.join(ROOT, "kernels"))]),
    package_dir={"condinit.kernels": "kernels"},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    zip_safe=False,
)
