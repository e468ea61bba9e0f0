// The Python module condinit._C. Importing it loads the shared library, whose static
// initializers register every kernel under the torch.library namespace `condinit_C`
// (TORCH_LIBRARY_FRAGMENT / TORCH_LIBRARY_IMPL in each op's .cpp). This file only
// exposes what the library was built with, for `python -m condinit info`.
#include <pybind11/pybind11.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#ifndef CONDINIT_BUILD_TORCH_VERSION
#define CONDINIT_BUILD_TORCH_VERSION "unknown"
#endif

namespace py = pybind11;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "condinit native kernels (C++ CPU and, when built with nvcc, CUDA)";
  py::dict info;
  info["torch_version"] = CONDINIT_BUILD_TORCH_VERSION;
#ifdef CONDINIT_WITH_CUDA
  info["with_cuda"] = true;
#else
  info["with_cuda"] = false;
#endif
#ifdef _OPENMP
  info["openmp"] = _OPENMP;
#else
  info["openmp"] = py::none();
#endif
  m.attr("build_info") = info;
}
