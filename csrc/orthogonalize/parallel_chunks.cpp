// condinit._C.run_chunks_in_parallel_region(num_chunks, fn): the CPU chunk scheduler of
// condinit.init.orthogonalize (the "cpp-cpu" row of its ORTHOGONALIZE table).
//
// Calls fn(worker, chunk) once for every chunk in [0, num_chunks), from the threads of one OpenMP
// parallel region of torch's intra-op pool (as many threads as the caller's torch.get_num_threads()).
// Workers take the next chunk from a shared counter. fn is Python (the per-chunk math is the
// PyTorch implementation); a worker holds the GIL only while it runs Python code, which the torch
// ops of the chunk release while they compute.
//
// Why a parallel region: every ATen op called inside one runs single-threaded
// (at::in_parallel_region()), and MKL's BLAS / LAPACK are made single-threaded per worker with
// MKL's thread-local setting (below).
// So each chunk runs on one thread without changing torch's process-wide thread count, and its
// bits do not depend on how many workers there are or on which worker runs it. The GEMMs here are
// small (64 x 2048 blocks): one thread per chunk needs no barrier at all, where a multithreaded
// GEMM pays one per call.
//
// The caller's thread-local torch state (grad mode, inference mode, dispatch keys) is installed in
// every worker for the duration of the call and restored afterwards. The first exception a chunk
// raises stops the other workers from starting new chunks and is re-raised to the caller.
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <c10/util/Exception.h>
#include <c10/util/ParallelGuard.h>
#include <pybind11/pybind11.h>

#include <atomic>
#include <exception>
#include <mutex>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace py = pybind11;

// MKL's thread-local thread count (exported by libtorch_cpu when torch is built with MKL; weak, so
// a build against another BLAS links and simply skips it). Nested OpenMP regions are not enough
// to keep MKL single-threaded: with its dynamic adjustment off (torch.set_num_threads turns it
// off), MKL LAPACK opens its own thread team inside the region, which deadlocked here. A
// thread-local setting affects only the calling worker and is restored when it finishes.
extern "C" int mkl_set_num_threads_local(int nthreads) __attribute__((weak));

namespace condinit {
namespace {

void run_chunks_in_parallel_region(int64_t num_chunks, const py::function& fn) {
  TORCH_CHECK(num_chunks >= 0, "run_chunks_in_parallel_region: num_chunks must be >= 0, got ", num_chunks);
  if (num_chunks == 0) return;
  at::internal::lazy_init_num_threads();  // this thread's OpenMP team size = torch.get_num_threads()
  const at::ThreadLocalState caller_state;
  std::atomic<int64_t> next_chunk{0};
  std::atomic<bool> failed{false};
  std::exception_ptr first_error;
  std::mutex error_mutex;

  auto work = [&](int64_t worker) {
    at::ThreadLocalStateGuard state_guard(caller_state);
    c10::ParallelGuard in_region(true);
    struct MklSingleThread {  // restores the worker's previous MKL thread-local setting
      int previous = mkl_set_num_threads_local ? mkl_set_num_threads_local(1) : 0;
      ~MklSingleThread() {
        if (mkl_set_num_threads_local) mkl_set_num_threads_local(previous);
      }
    } mkl_single_thread;
    while (!failed.load()) {
      const int64_t chunk = next_chunk.fetch_add(1);
      if (chunk >= num_chunks) break;
      try {
        py::gil_scoped_acquire gil;
        fn(worker, chunk);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex);
        if (!first_error) first_error = std::current_exception();
        failed = true;
      }
    }
  };

  {
    py::gil_scoped_release no_gil;
#ifdef _OPENMP
    // No num_threads clause (GOMP's pool misbehaves with varying team sizes): the team is the
    // caller's intra-op pool. A team of one thread is not an active region; it runs the chunks
    // one after the other on the calling thread with the caller's settings, which are then
    // single-threaded already.
#pragma omp parallel
    work(omp_get_thread_num());
#else
    work(0);
#endif
  }
  if (first_error) std::rethrow_exception(first_error);
}

}  // namespace

void bind_parallel_chunks(py::module_& m) {
  m.def("run_chunks_in_parallel_region", &run_chunks_in_parallel_region, py::arg("num_chunks"),
        py::arg("fn"),
        "Call fn(worker, chunk) for every chunk in [0, num_chunks) from the threads of one OpenMP "
        "parallel region (each chunk single-threaded); re-raises the first exception.");
}

}  // namespace condinit
