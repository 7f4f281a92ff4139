// y[M, N] = x[M, K] @ w[N, K]^T in float32 for the few to few dozen rows of a decode or verification
// step on an AVX-512 CPU. Beside its torch reference, F.linear (kernels/cpu_linear.py holds the
// dispatch, up to 48 rows, and the reasons; tests/test_cpu_linear.py compares the two).
//
// Why by hand: at these row counts a forward is about one pass over the weights, and the libraries
// do not hide the extra rows' multiply-adds behind that pass. MKL's sgemm reads the weight once per 3
// rows and oneDNN's packed path costs more per call than a whole small matrix; on the 2-core CI host a
// 30M-parameter target's forward over 4 tokens costs 1.37x one over 1 token with them and 1.14x with
// this kernel, and its batch-8 forward over 16 rows takes 1.27x less time than on oneDNN
// (results/cpu_linear.jsonl, measured before the next-block prefetch below). Each block of 4 weight
// rows is read from memory once, prefetched 8 KB ahead into L2 and 512 B ahead into L1 so the loads
// are in flight while the FMAs run, and used from cache for every 6-row tile of x (from L1 while 4 rows
// of K floats fit, K <= ~3000; from L2 beyond); the blocks are split over ATen's own thread pool.
// The tiles after a block's first (7+ rows) also prefetch the next block into L2, spread over them: without
// that, memory sat idle while they ran. Over a 189M-parameter target streamed from DRAM, its linears in
// forward order of 8 rows cost 1.50x those of 1 row before and 1.24x with it (16 rows 1.87x -> 1.55x,
// 32 rows 3.19x -> 2.56x; benchmarks/cpu_linear.py, results/cpu_linear_big_random.jsonl), and a whole
// batch-8 forward 6-13% less; 1-6 rows take the same code as before. A target that sits in L3 (the 30M
// default) is bound by the FMAs there, so the prefetch matters less for it (not remeasured on that host).
//
// Every output element is summed in the same order whatever M is (16 lanes along K, then one fixed
// horizontal reduction), so a row's result does not depend on which other rows share the call: a
// verification over k+1 tokens gets bit-for-bit the products a one-token decode step gets.
//
// Tried and not kept: the weight packed K-major in panels of 48 columns with x broadcast (BLIS-style,
// no horizontal sums). On the CI host it was 4-8% slower at 1-4 rows and 6-15% faster at 8-48
// (model-shaped weights, interleaved medians), so a batch-8 verification's gain over a batch-8 decode
// step was ~2%, for another copy of the weights and a summation order of its own.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

constexpr int64_t kPrefetchL1 = 128;   // floats ahead (512 B)
constexpr int64_t kPrefetchL2 = 2048;  // floats ahead (8 KB)
constexpr int kRowsPerTile = 6;        // rows of x per tile: 6 x 4 accumulators + 4 weight vectors + 1 x vector <= 32 zmm
constexpr int kWeightRows = 4;         // weight rows per block

// y[m, r] (row stride N) = sum_k x[m, k] * w[r, k] for M rows of x and R rows of w. Every output is
// summed the same way: 16 lanes along K in ascending order, the masked tail, one horizontal sum.
// PF: this is the block's first tile, the one that brings the weight rows in from memory (later
// tiles of the same block find them in L1). A later tile given `next` (the next block's R weight rows)
// prefetches rows r0, r0 + rstep, ... of it into L2, one cache line per 16 floats of K, so the block
// after this one is already in flight while these FMAs run. Prefetches change no arithmetic.
template <int M, int R, bool PF>
inline void tile(const float* x, const float* w, float* y, int64_t K, int64_t N,
                 const float* next = nullptr, int r0 = 0, int rstep = R) {
  const int64_t kfull = K & ~int64_t(15);
  __m512 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < kfull; k += 16) {
    __m512 wv[R];
    for (int r = 0; r < R; ++r) {
      const float* p = w + r * K + k;
      wv[r] = _mm512_loadu_ps(p);
      if (PF) {
        _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchL1), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchL2), _MM_HINT_T1);
      }
    }
    if (!PF && next != nullptr)
      for (int r = r0; r < R; r += rstep) _mm_prefetch(reinterpret_cast<const char*>(next + r * K + k), _MM_HINT_T1);
    for (int m = 0; m < M; ++m) {
      const __m512 xv = _mm512_loadu_ps(x + m * K + k);
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_fmadd_ps(xv, wv[r], acc[m][r]);
    }
  }
  if (kfull < K) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (K - kfull)) - 1);
    for (int m = 0; m < M; ++m) {
      const __m512 xv = _mm512_maskz_loadu_ps(tail, x + m * K + kfull);
      for (int r = 0; r < R; ++r)
        acc[m][r] = _mm512_fmadd_ps(xv, _mm512_maskz_loadu_ps(tail, w + r * K + kfull), acc[m][r]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) y[m * N + r] = _mm512_reduce_add_ps(acc[m][r]);
}

template <int R, bool PF>
inline void tile_rows(int rows, const float* x, const float* w, float* y, int64_t K, int64_t N,
                      const float* next = nullptr, int r0 = 0, int rstep = R) {
  switch (rows) {
    case 1: tile<1, R, PF>(x, w, y, K, N, next, r0, rstep); break;
    case 2: tile<2, R, PF>(x, w, y, K, N, next, r0, rstep); break;
    case 3: tile<3, R, PF>(x, w, y, K, N, next, r0, rstep); break;
    case 4: tile<4, R, PF>(x, w, y, K, N, next, r0, rstep); break;
    case 5: tile<5, R, PF>(x, w, y, K, N, next, r0, rstep); break;
    default: tile<6, R, PF>(x, w, y, K, N, next, r0, rstep); break;
  }
}

// Weight rows [n0, n1) against all M rows of x, R weight rows at a time: the first tile of each
// block streams those weight rows from memory, the other tiles of the block reuse them from L1, so
// the weight is read from memory once whatever M is. The later tiles share the next block's rows
// between them (tile j takes rows j, j + later, ...), so each of its lines is prefetched once.
template <int R>
void block_range(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  const int later = static_cast<int>((M - 1) / kRowsPerTile);  // tiles after the first
  for (int64_t n = n0; n < n1; n += R) {
    const float* wn = w + n * K;
    const float* next = n + 2 * R <= n1 ? wn + R * K : nullptr;
    for (int64_t m0 = 0; m0 < M; m0 += kRowsPerTile) {
      const int rows = static_cast<int>(std::min<int64_t>(kRowsPerTile, M - m0));
      const int j = static_cast<int>(m0 / kRowsPerTile) - 1;
      if (m0 == 0)
        tile_rows<R, true>(rows, x, wn, y + n, K, N);
      else
        tile_rows<R, false>(rows, x + m0 * K, wn, y + m0 * N + n, K, N, j < R ? next : nullptr, j, later);
    }
  }
}

}  // namespace

// x [M, K] float32 contiguous, w [N, K] float32 contiguous -> [M, N]
torch::Tensor skinny_linear(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "skinny_linear: shapes ", x.sizes(), " and ", w.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "skinny_linear: float32 only");
  TORCH_CHECK(x.is_cpu() && w.is_cpu() && x.is_contiguous() && w.is_contiguous(), "skinny_linear: contiguous CPU tensors only");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  constexpr int64_t grain = 4 * kWeightRows;  // weight rows per task
  const int64_t nfull = N - N % kWeightRows;
  at::parallel_for(0, (nfull + grain - 1) / grain, 1, [&](int64_t b0, int64_t b1) {
    block_range<kWeightRows>(xp, wp, yp, M, K, N, b0 * grain, std::min(nfull, b1 * grain));
  });
  if (nfull < N) block_range<1>(xp, wp, yp, M, K, N, nfull, N);  // the last N % 4 weight rows
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("skinny_linear", &skinny_linear, "x @ w.T in float32 for a few to a few dozen rows (AVX-512)");
}
