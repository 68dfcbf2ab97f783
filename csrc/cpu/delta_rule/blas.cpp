// Small dense matrix products for the CPU kernels.
//
// The chunk kernels multiply many small matrices (chunk x head-dim), thousands of times per call, inside
// at::parallel_for. Going through at::mm would cost a tensor allocation and a dispatch per product, so gemm()
// calls the Fortran BLAS that PyTorch's CPU library carries (MKL or OpenBLAS export sgemm_/dgemm_) directly on
// raw pointers. The symbols are weak: where the library does not export them, or with GATED_DELTA_CPU_BLAS=0,
// portable loops run instead (also where the compiler has no weak references). Inside a parallel region the BLAS
// runs single-threaded (it sees the OpenMP region).
#include <c10/util/Exception.h>

#include <climits>
#include <cstdlib>
#include <cstring>

#include "algorithms.h"

#if defined(__GNUC__)  // GCC and Clang: weak references, null where no library defines them
#define GATED_DELTA_WEAK_BLAS 1
extern "C" {
void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k, const float* alpha,
            const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c,
            const int* ldc) __attribute__((weak));
void dgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k, const double* alpha,
            const double* a, const int* lda, const double* b, const int* ldb, const double* beta, double* c,
            const int* ldc) __attribute__((weak));
}
#else
#define GATED_DELTA_WEAK_BLAS 0
#endif

namespace gated_delta {
namespace cpu {
namespace {

bool blas_available() {
  static const bool available = [] {
    const char* env = std::getenv("GATED_DELTA_CPU_BLAS");
    if (env != nullptr && std::strcmp(env, "0") == 0) return false;
#if GATED_DELTA_WEAK_BLAS
    return sgemm_ != nullptr && dgemm_ != nullptr;
#else
    return false;
#endif
  }();
  return available;
}

// Portable fallback, row-major: C = alpha op(A) op(B) + beta C.
template <typename T>
void gemm_loops(bool ta, bool tb, int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda, const T* b,
                int64_t ldb, T beta, T* c, int64_t ldc) {
  for (int64_t i = 0; i < m; ++i) {
    T* ci = c + i * ldc;
    if (beta == T(0)) {
      for (int64_t j = 0; j < n; ++j) ci[j] = T(0);
    } else if (beta != T(1)) {
      for (int64_t j = 0; j < n; ++j) ci[j] *= beta;
    }
    for (int64_t p = 0; p < k; ++p) {
      const T aip = alpha * (ta ? a[p * lda + i] : a[i * lda + p]);
      if (!tb) {
        const T* bp = b + p * ldb;
        for (int64_t j = 0; j < n; ++j) ci[j] += aip * bp[j];
      } else {
        for (int64_t j = 0; j < n; ++j) ci[j] += aip * b[j * ldb + p];
      }
    }
  }
}

inline int as_int(int64_t x) {
  TORCH_CHECK(x >= 0 && x <= INT_MAX, "gated_delta: matrix dimension ", x, " exceeds the BLAS int range");
  return static_cast<int>(x);
}

}  // namespace

bool gemm_uses_blas() { return blas_available(); }

namespace {

#if GATED_DELTA_WEAK_BLAS
inline void xgemm(const char* ta, const char* tb, const int* m, const int* n, const int* k, const float* alpha,
                  const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c,
                  const int* ldc) {
  sgemm_(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
inline void xgemm(const char* ta, const char* tb, const int* m, const int* n, const int* k, const double* alpha,
                  const double* a, const int* lda, const double* b, const int* ldb, const double* beta, double* c,
                  const int* ldc) {
  dgemm_(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
#endif

// Row-major C^T = op(B)^T op(A)^T is the column-major product with the operands swapped.
template <class T>
void gemm_any(bool ta, bool tb, int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda, const T* b,
              int64_t ldb, T beta, T* c, int64_t ldc) {
  if (m <= 0 || n <= 0) return;
  if (!blas_available()) return gemm_loops(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
#if GATED_DELTA_WEAK_BLAS
  const char opa = ta ? 'T' : 'N', opb = tb ? 'T' : 'N';
  const int im = as_int(m), in = as_int(n), ik = as_int(k), ilda = as_int(lda), ildb = as_int(ldb),
            ildc = as_int(ldc);
  xgemm(&opb, &opa, &in, &im, &ik, &alpha, b, &ildb, a, &ilda, &beta, c, &ildc);
#endif
}

}  // namespace

void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
          const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  gemm_any(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, double alpha, const double* a, int64_t lda,
          const double* b, int64_t ldb, double beta, double* c, int64_t ldc) {
  gemm_any(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

}  // namespace cpu
}  // namespace gated_delta
