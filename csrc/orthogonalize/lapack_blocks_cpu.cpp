// The CPU kernels of condinit/ops/orthogonalize/reference.py's factorizations, one block per call,
// all blocks of a batch in one OpenMP team:
//
//   orthonormal_blocks_(Tensor(a!) A, Tensor(b!) out, str method, ScalarType gemm, Tensor? draws=None,
//                       int seed_lo=0, int seed_hi=0) -> ()
//       out[b] = the sign-fixed Householder Q^T of A[b] ("householder") or U V^T of its SVD ("svd",
//       the product in `gemm`); float32 contiguous [C, m, n], m <= n; out may be A.
//   cholqr2_blocks_(Tensor(a!) A, Tensor(b!) out, ScalarType gemm, float max_diag_ratio,
//                   float max_deviation, float first_order_max, Tensor? draws=None, int seed_lo=0,
//                   int seed_hi=0) -> ()
//       out[b] = CholeskyQR2 of A[b] (reference.py: _cholqr2_, _chol_inverse,
//       _near_identity_chol_inverse, the same steps and thresholds), its GEMMs in `gemm`; a block
//       that fails a check is redone by the Householder kernel, alone.
//   With `draws` (int64 [C, 2]: stream and block id per block), A[b] is first overwritten with
//   the Gaussians philox_randn draws for that block under key (seed_lo, seed_hi), by the thread
//   that then factors it: drawing and factoring are one team instead of two, one region per chunk.
//   per_block_single_thread() -> bool
//       whether every call above runs single-threaded: MKL's per-thread setter was found, or torch
//       has no MKL. (An MKL whose setter were missing would open nested teams inside this one.)
//
// Why one team: MKL's multithreaded QR / SVD / Cholesky reduce in an order that depends on the
// thread count, and a batched torch call opens one OpenMP region per matrix (per trsm, per geqrf
// panel) or per small elementwise step, each of which waits at its barrier for any thread the OS
// has descheduled: on a busy machine that cost several times the quiet time. Here one
// at::parallel_for covers the batch: its threads take blocks from a shared counter (any thread may
// run any block: a block's bits depend on its data only), and every ATen call inside runs inline
// (at::parallel_for marks the region, so no further team is created). Each thread sets MKL to one
// thread for the duration (MKL_Set_Num_Threads_Local, a setting of the calling thread only,
// restored after), found with dlsym in the library that holds ATen, where torch is built with MKL.
// MKL drops that setting once, at a thread's first factorization (its per-thread initialization):
// each thread first runs a tiny one and sets it again; and a block is written only after MKL
// reports (MKL_Get_Max_Threads) that the setting held through its calls, else it is recomputed,
// so no team thread count can reach a block's bits. A torch without MKL has no such setter: its
// LAPACK / BLAS then run inside the team as that library runs nested calls (OpenBLAS built with
// OpenMP: one thread), which the Python side documents.
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "random/philox_cpu.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <string>
#include <tuple>

#if defined(__unix__) || defined(__APPLE__)
#include <dlfcn.h>
#endif

namespace condinit {
namespace {

using SetLocalFn = int (*)(int);
using GetMaxFn = int (*)();

// MKL_Set_Num_Threads_Local / MKL_Get_Max_Threads of the MKL linked into ATen (libtorch_cpu,
// already loaded), or nullptr.
struct MklThreads {
  SetLocalFn set = nullptr;
  GetMaxFn get = nullptr;
};

const MklThreads& mkl_threads() {
  static const MklThreads fns = [] {
    MklThreads f;
#if defined(__unix__) || defined(__APPLE__)
    const char* names[] = {"libtorch_cpu.so", "libtorch_cpu.dylib"};
    for (const char* name : names) {
      void* lib = dlopen(name, RTLD_LAZY | RTLD_NOLOAD);  // a reference to the loaded library, or null
      if (lib == nullptr) continue;
      void* set = dlsym(lib, "MKL_Set_Num_Threads_Local");
      void* get = dlsym(lib, "MKL_Get_Max_Threads");
      dlclose(lib);  // drops that reference only: the library stays loaded
      if (set != nullptr && get != nullptr) {
        f.set = reinterpret_cast<SetLocalFn>(set);
        f.get = reinterpret_cast<GetMaxFn>(get);
      }
      break;
    }
#endif
    return f;
  }();
  return fns;
}

// MKL on one thread for this thread while alive (no-op without MKL), the previous setting restored.
// MKL initializes a thread's state at the thread's first factorization and drops the per-thread
// setting then (measured: a new team thread's first geqrf ran with the team's count): a tiny
// factorization first absorbs that, and kept() tells whether a call ran with the setting.
struct OneMklThread {
  const MklThreads& mkl;
  int previous = 0;
  OneMklThread() : mkl(mkl_threads()) {
    if (mkl.set == nullptr) return;
    previous = mkl.set(1);
    at::linalg_qr(at::ones({2, 2}));
    mkl.set(1);
  }
  bool kept() const { return mkl.set == nullptr || mkl.get() == 1; }
  void renew() const {
    if (mkl.set != nullptr) mkl.set(1);
  }
  ~OneMklThread() {
    if (mkl.set != nullptr) mkl.set(previous);
  }
};

// Attempts at a block whose factorization ran without the one-thread setting (see OneMklThread).
constexpr int kAttempts = 3;

// out[b] = fn(b) (a float32 [m, n] result of A[b], drawn first with draws) for every block b < C, on one
// OpenMP team; threads take
// blocks from a shared counter. A block is written only once MKL confirms that it ran on one
// thread; otherwise it is recomputed (it reads its input again, so out may alias the input).
// With draws, A[b] is drawn first (see the header comment).
struct Draws {
  const int64_t* rows = nullptr;  // [C, 2]: stream, block id; nullptr: A holds the inputs
  int64_t seed_lo = 0, seed_hi = 0;
  at::Tensor keep;  // the contiguous copy rows points into
};

Draws check_draws(const c10::optional<at::Tensor>& draws, const at::Tensor& A, int64_t seed_lo, int64_t seed_hi) {
  Draws d;
  if (!draws.has_value()) return d;
  const at::Tensor& t = *draws;
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kLong && t.dim() == 2 && t.size(0) == A.size(0) &&
                  t.size(1) == 2,
              "draws must be a CPU int64 tensor [C, 2] with C = ", A.size(0), ", got ", t.scalar_type(), " ",
              t.sizes(), " on ", t.device());
  TORCH_CHECK(seed_lo >= 0 && seed_lo < (int64_t(1) << 32) && seed_hi >= 0 && seed_hi < (int64_t(1) << 32),
              "seed_lo and seed_hi must be 32-bit words, got ", seed_lo, " and ", seed_hi);
  d.keep = t.contiguous();
  d.rows = d.keep.data_ptr<int64_t>();
  for (int64_t b = 0; b < A.size(0); ++b)
    TORCH_CHECK(d.rows[2 * b] >= 0 && d.rows[2 * b] < (int64_t(1) << 32) && d.rows[2 * b + 1] >= 0,
                "draws[", b, "] must hold a 32-bit stream and a block id >= 0, got (", d.rows[2 * b], ", ",
                d.rows[2 * b + 1], ")");
  d.seed_lo = seed_lo;
  d.seed_hi = seed_hi;
  return d;
}

template <typename F>
void for_each_block(int64_t C, const at::Tensor& A, const Draws& draws, const at::Tensor& out, const F& fn) {
  std::atomic<int64_t> next{0};
  std::atomic<bool> unconfirmed{false};
  const int64_t slots = std::min<int64_t>(C, at::get_num_threads());
  at::parallel_for(0, slots, 1, [&](int64_t, int64_t) {
    at::NoGradGuard no_grad;
    OneMklThread one;
    const int64_t mn = A.size(1) * A.size(2);
    for (int64_t b = next.fetch_add(1); b < C; b = next.fetch_add(1)) {
      if (draws.rows != nullptr)
        philox_randn_block(draws.seed_lo, draws.seed_hi, draws.rows[2 * b], draws.rows[2 * b + 1], mn,
                           A.data_ptr<float>() + b * mn);
      at::Tensor r;
      for (int attempt = 0; attempt < kAttempts; ++attempt) {
        r = fn(b);
        if (one.kept()) break;
        one.renew();
        if (attempt + 1 == kAttempts) unconfirmed = true;
      }
      out.select(0, b).copy_(r);
    }
  });
  if (unconfirmed) {
    TORCH_WARN("condinit: MKL did not keep one thread for a factorization after ", kAttempts,
               " attempts; that block's bits may depend on the thread count");
  }
}

bool per_block_single_thread() { return mkl_threads().set != nullptr || !at::hasMKL(); }

void check_blocks(const at::Tensor& t, const char* name, bool square) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 3 && t.is_contiguous(), name,
              " must be a contiguous CPU tensor [C, m, n], got ", t.sizes(), " on ", t.device());
  TORCH_CHECK(!square || t.size(1) == t.size(2), name, " must be square blocks, got ", t.sizes());
}

void check_pair(const at::Tensor& A, const at::Tensor& out, at::ScalarType gemm) {
  check_blocks(A, "A", false);
  check_blocks(out, "out", false);
  TORCH_CHECK(A.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat && out.sizes() == A.sizes(),
              "A and out must be float32 of the same shape, got ", A.scalar_type(), " ", A.sizes(), " and ",
              out.scalar_type(), " ", out.sizes());
  TORCH_CHECK(A.size(1) <= A.size(2), "blocks must be wide (m <= n), got ", A.sizes());
  TORCH_CHECK(gemm == at::kFloat || gemm == at::kDouble, "gemm must be float32 or float64, got ", gemm);
}

// dst (float32) = a @ b computed in gemm (a already in gemm), rounded once.
void product_into(at::Tensor dst, const at::Tensor& a, const at::Tensor& b, at::ScalarType gemm) {
  if (gemm == at::kFloat) {
    at::mm_out(dst, a, b);
  } else {
    dst.copy_(at::mm(a, b.to(gemm)));
  }
}

at::Tensor householder_one(const at::Tensor& a) {
  auto [Q, R] = at::linalg_qr(a.t(), "reduced");  // a^T = Q R, Q [n, m]
  at::Tensor d = R.diagonal();
  at::Tensor sign = at::where(d < 0, -1.0, 1.0).to(Q.scalar_type());  // sign(0) := +1
  return (Q * sign.unsqueeze(0)).t();
}

void orthonormal_blocks_(const at::Tensor& A, const at::Tensor& out, c10::string_view method,
                         at::ScalarType gemm, const c10::optional<at::Tensor>& draws, int64_t seed_lo,
                         int64_t seed_hi) {
  check_pair(A, out, gemm);
  const Draws d = check_draws(draws, A, seed_lo, seed_hi);
  const bool householder = method == "householder";
  TORCH_CHECK(householder || method == "svd", "method must be 'householder' or 'svd', got '", method, "'");
  for_each_block(A.size(0), A, d, out, [&](int64_t b) {
    at::Tensor a = A.select(0, b);
    if (householder) return householder_one(a);
    auto [U, S, Vh] = at::linalg_svd(a, /*full_matrices=*/false);  // U [m, m], Vh [m, n]
    at::Tensor r = at::empty_like(a);
    product_into(r, U.to(gemm), Vh, gemm);
    return r;
  });
}

// L^{-1} (float64) of one float64 block, or of I when the block is bad; returns bad.
bool exact_chol_inverse(const at::Tensor& g64, bool near_identity, double max_diag_ratio, double max_deviation,
                        at::Tensor& linv64) {
  const int64_t m = g64.size(0);
  auto [L, info] = at::linalg_cholesky_ex(g64);
  bool bad = info.item<int>() != 0;
  if (near_identity) {
    const double* g = g64.data_ptr<double>();
    double dev = 0.0;
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < m; ++j) {
        const double e = std::abs(g[i * m + j] - (i == j ? 1.0 : 0.0));
        if (!(e <= dev)) dev = e;  // NaN propagates
      }
    bad = bad || dev > max_deviation;
  } else {
    at::Tensor d = L.diagonal();
    const double hi = d.amax().item<double>(), lo = d.amin().item<double>();
    bad = bad || !(hi <= max_diag_ratio * lo);  // also catches NaN
  }
  at::Tensor eye = at::eye(m, g64.options());
  if (bad) L = eye;
  linv64 = at::linalg_solve_triangular(L, eye, /*upper=*/false);
  return bad;
}

// L^{-1} in G's dtype T of one Gram block G = L L^T ([m, m] contiguous), written to linv; returns
// whether the block must be redone. second_pass: G = I + E from a nearly orthonormal block, whose
// inverse factor is I - tril(E, -1) - diag(E) / 2 to O(m |E|^2) when max|E| <= first_order_max.
template <typename T>
bool chol_inverse_one(const at::Tensor& G, at::Tensor& linv, bool second_pass, double max_diag_ratio,
                      double max_deviation, double first_order_max) {
  const int64_t m = G.size(0);
  const T* g = G.data_ptr<T>();
  T* out = linv.data_ptr<T>();
  if (second_pass) {
    T dev = T(0);
    for (int64_t i = 0; i < m * m; ++i) {
      const T e = std::abs(g[i] - (i % (m + 1) == 0 ? T(1) : T(0)));
      if (!(e <= dev)) dev = e;  // NaN propagates
    }
    if (dev <= static_cast<T>(first_order_max)) {  // compared in G's dtype, as torch does
      for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < m; ++j) {
          const T e = g[i * m + j] - (i == j ? T(1) : T(0));
          const T f = i > j ? e : (i == j ? e * T(0.5) : T(0));
          out[i * m + j] = (i == j ? T(1) : T(0)) - f;
        }
      return false;
    }
  }
  at::Tensor linv64;
  const bool bad = exact_chol_inverse(G.to(at::kDouble), second_pass, max_diag_ratio, max_deviation, linv64);
  linv.copy_(linv64);
  return bad;
}

template <typename T>
at::Tensor cholqr2_one(const at::Tensor& a, at::ScalarType gemm, double max_diag_ratio,
                 double max_deviation, double first_order_max) {
  const int64_t m = a.size(0);
  auto gram = [&](const at::Tensor& x) {
    at::Tensor xg = x.to(gemm);
    return at::mm(xg, xg.t());
  };
  at::Tensor linv = at::empty({m, m}, a.options().dtype(gemm));
  bool bad = chol_inverse_one<T>(gram(a), linv, false, max_diag_ratio, max_deviation, first_order_max);
  at::Tensor B = at::empty_like(a);
  product_into(B, linv, a, gemm);
  bad = chol_inverse_one<T>(gram(B), linv, true, max_diag_ratio, max_deviation, first_order_max) || bad;
  if (bad) return householder_one(a);
  at::Tensor r = at::empty_like(a);
  product_into(r, linv, B, gemm);
  return r;
}

void cholqr2_blocks_(const at::Tensor& A, const at::Tensor& out, at::ScalarType gemm, double max_diag_ratio,
                     double max_deviation, double first_order_max, const c10::optional<at::Tensor>& draws,
                     int64_t seed_lo, int64_t seed_hi) {
  check_pair(A, out, gemm);
  const Draws d = check_draws(draws, A, seed_lo, seed_hi);
  AT_DISPATCH_FLOATING_TYPES(gemm, "cholqr2_blocks_", [&] {
    for_each_block(A.size(0), A, d, out, [&](int64_t b) {
      return cholqr2_one<scalar_t>(A.select(0, b), gemm, max_diag_ratio, max_deviation, first_order_max);
    });
  });
}

}  // namespace
}  // namespace condinit

TORCH_LIBRARY_FRAGMENT(condinit_C, m) {
  m.def("orthonormal_blocks_(Tensor(a!) A, Tensor(b!) out, str method, ScalarType gemm, Tensor? draws=None, "
        "int seed_lo=0, int seed_hi=0) -> ()");
  m.def("cholqr2_blocks_(Tensor(a!) A, Tensor(b!) out, ScalarType gemm, float max_diag_ratio, float max_deviation, "
        "float first_order_max, Tensor? draws=None, int seed_lo=0, int seed_hi=0) -> ()");
  m.def("per_block_single_thread() -> bool", &condinit::per_block_single_thread);
}

TORCH_LIBRARY_IMPL(condinit_C, CPU, m) {
  m.impl("orthonormal_blocks_", &condinit::orthonormal_blocks_);
  m.impl("cholqr2_blocks_", &condinit::cholqr2_blocks_);
}
