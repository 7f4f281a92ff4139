// y[M, N] = x[M, K] @ w[N, K]^T in float32 for the few rows (1..12) of a decode or batch-1 verification
// step on an AVX-512 CPU. Beside its torch reference, F.linear (kernels/cpu_linear.py holds the
// dispatch and the reasons; tests/test_cpu_linear.py compares the two).
//
// Why by hand: at these row counts a forward is one pass over the weights, and the libraries do not
// hide the extra rows' multiply-adds behind that pass. MKL's sgemm reads the weight once per 3 rows
// and oneDNN's packed path costs more per call than a whole small matrix; on the 2-core CI host a
// 30M-parameter target's forward over 5 tokens costs 1.40x one over 1 token with them and 1.15x with
// this kernel. It streams every weight row exactly once for all rows of x (x stays in L1), prefetches
// the weight 8 KB ahead into L2 and 512 B ahead into L1 so the loads are in flight while the FMAs run,
// and parallelises over output features with ATen's own thread pool.
//
// Every output element is summed in the same order whatever M is (16 lanes along K, then one fixed
// horizontal reduction), so a row's result does not depend on which other rows share the call: a
// verification over k+1 tokens gets bit-for-bit the products a one-token decode step gets.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

constexpr int64_t kPrefetchL1 = 128;   // floats ahead (512 B)
constexpr int64_t kPrefetchL2 = 2048;  // floats ahead (8 KB)
constexpr int64_t kMaxRows = 12;

// One pass over weight rows [n0, n1) for M rows of x, R weight rows at a time: M*R accumulators,
// R weight vectors and one x vector must fit in the 32 zmm registers.
template <int M, int R>
void rows_block(const float* x, const float* w, float* y, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  const int64_t kfull = K & ~int64_t(15);
  const __mmask16 tail = static_cast<__mmask16>((1u << (K - kfull)) - 1);
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    __m512 acc[M][R];
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
    const float* wn = w + n * K;
    for (int64_t k = 0; k < kfull; k += 16) {
      __m512 wv[R];
      for (int r = 0; r < R; ++r) {
        const float* p = wn + r * K + k;
        wv[r] = _mm512_loadu_ps(p);
        _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchL1), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchL2), _MM_HINT_T1);
      }
      for (int m = 0; m < M; ++m) {
        const __m512 xv = _mm512_loadu_ps(x + m * K + k);
        for (int r = 0; r < R; ++r) acc[m][r] = _mm512_fmadd_ps(xv, wv[r], acc[m][r]);
      }
    }
    if (kfull < K) {
      for (int m = 0; m < M; ++m) {
        const __m512 xv = _mm512_maskz_loadu_ps(tail, x + m * K + kfull);
        for (int r = 0; r < R; ++r)
          acc[m][r] = _mm512_fmadd_ps(xv, _mm512_maskz_loadu_ps(tail, wn + r * K + kfull), acc[m][r]);
      }
    }
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < R; ++r) y[m * N + n + r] = _mm512_reduce_add_ps(acc[m][r]);
  }
  // the last < R weight rows of this range, one at a time, in the same summation order
  for (; n < n1; ++n) {
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    const float* wn = w + n * K;
    for (int64_t k = 0; k < kfull; k += 16) {
      const __m512 wv = _mm512_loadu_ps(wn + k);
      for (int m = 0; m < M; ++m) acc[m] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * K + k), wv, acc[m]);
    }
    if (kfull < K) {
      const __m512 wv = _mm512_maskz_loadu_ps(tail, wn + kfull);
      for (int m = 0; m < M; ++m)
        acc[m] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, x + m * K + kfull), wv, acc[m]);
    }
    for (int m = 0; m < M; ++m) y[m * N + n] = _mm512_reduce_add_ps(acc[m]);
  }
}

template <int M, int R>
void rows_pass(const float* x, const float* w, float* y, int64_t K, int64_t N) {
  constexpr int64_t grain = 4 * R;  // weight rows per task
  at::parallel_for(0, (N + grain - 1) / grain, 1, [&](int64_t b0, int64_t b1) {
    rows_block<M, R>(x, w, y, K, N, b0 * grain, std::min(N, b1 * grain));
  });
}

}  // namespace

// x [M, K] float32 contiguous, w [N, K] float32 contiguous -> [M, N]; M > 12 runs in passes of 12.
torch::Tensor skinny_linear(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "skinny_linear: shapes ", x.sizes(), " and ", w.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "skinny_linear: float32 only");
  TORCH_CHECK(x.is_cpu() && w.is_cpu() && x.is_contiguous() && w.is_contiguous(), "skinny_linear: contiguous CPU tensors only");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  const float* wp = w.data_ptr<float>();
  for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
    const float* xs = x.data_ptr<float>() + m0 * K;
    float* ys = y.data_ptr<float>() + m0 * N;
    switch (std::min(kMaxRows, M - m0)) {
      case 1: rows_pass<1, 4>(xs, wp, ys, K, N); break;
      case 2: rows_pass<2, 4>(xs, wp, ys, K, N); break;
      case 3: rows_pass<3, 4>(xs, wp, ys, K, N); break;
      case 4: rows_pass<4, 4>(xs, wp, ys, K, N); break;
      case 5: rows_pass<5, 4>(xs, wp, ys, K, N); break;
      case 6: rows_pass<6, 4>(xs, wp, ys, K, N); break;
      case 7: rows_pass<7, 3>(xs, wp, ys, K, N); break;
      case 8: rows_pass<8, 3>(xs, wp, ys, K, N); break;
      case 9: rows_pass<9, 2>(xs, wp, ys, K, N); break;
      case 10: rows_pass<10, 2>(xs, wp, ys, K, N); break;
      case 11: rows_pass<11, 2>(xs, wp, ys, K, N); break;
      default: rows_pass<12, 2>(xs, wp, ys, K, N); break;
    }
  }
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("skinny_linear", &skinny_linear, "x @ w.T for a few float32 rows (AVX-512)");
}
