// y = x W^T (+ b) for the few rows of a decode step, float32 on the CPU.
//
// At decode batch sizes a weight matrix is read once per step and every element takes part in only a few
// dozen multiply-adds, so the GEMM must stream the weights from memory at full speed while the arithmetic keeps
// up. oneDNN's general GEMM reached about half of the machine's multiply-add rate at 16 rows (its fixed cost per
// call, packing the activations and walking its blocking for large matrices, is paid on every one of the ~120
// GEMMs of a step). Here the weight is packed once, at load time, into panels of 16 output columns whose K rows
// lie one after another, so that a panel streams in one sequential read; a register-blocked kernel then keeps
// 6 rows x 16 columns of the output in registers while the panel's rows pass by (panel_kernel.h). The rows of x
// beyond the first six reuse the panel from cache.
//
// Threads take work from a shared counter (dynamic_parallel.h), not fixed halves. At 7 to 96 rows a work item is a
// run of up to 8 consecutive panels, and while the row blocks pass over one panel they ask for the next one's
// lines into L2, a share each, so that the first row block of the next panel does not wait on memory (about 10%
// faster at 8 to 32 rows with cold weights). With
// fewer rows the GEMM is memory-bound already and the fetches only cost; with more, a panel's row blocks take
// long enough for the hardware's own prefetch, and long runs balance the threads worse.
#include "dynamic_parallel.h"
#include "panel_kernel.h"

#include <ATen/ATen.h>
#include <algorithm>

using panel_gemm::kCols;
using panel_gemm::kKernels;
using panel_gemm::kRows;

// weight [N, K] -> panels [ceil(N / 16), K, 16]: column j of panel p is output p * 16 + j (zeros past N)
at::Tensor pack_gemm_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.device().is_cpu(),
              "pack_gemm_weight: a float32 [out_features, in_features] CPU matrix");
  const int64_t N = weight.size(0), K = weight.size(1), panels = (N + kCols - 1) / kCols;
  auto padded = at::zeros({panels * kCols, K}, weight.options());
  padded.narrow(0, 0, N).copy_(weight);
  return padded.view({panels, kCols, K}).transpose(1, 2).contiguous();
}

// x [M, K] (rows contiguous), packed from pack_gemm_weight for N outputs, bias [N] or undefined -> [M, N]
at::Tensor small_gemm(const at::Tensor& x, const at::Tensor& packed, int64_t N, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1, "small_gemm: x [M, K] float32");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kCols && packed.size(1) == x.size(1) && packed.is_contiguous(),
              "small_gemm: packed weight [panels, K, 16] for x's K");
  TORCH_CHECK(packed.size(0) * kCols >= N && packed.size(0) * kCols < N + kCols, "small_gemm: N does not fit");
  const int64_t M = x.size(0), K = x.size(1), ldx = x.stride(0), panels = packed.size(0);
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N && bias->is_contiguous() && bias->scalar_type() == at::kFloat,
                "small_gemm: bias [N] float32");
    b = bias->data_ptr<float>();
  }
  auto y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t row_blocks = (M + kRows - 1) / kRows;
  const int64_t fetch_per_block = (K + row_blocks - 1) / row_blocks;  // of the next panel's K lines
  const int64_t fetch_every = std::max<int64_t>(1, (K + fetch_per_block - 1) / fetch_per_block);
  auto run_panel = [&](int64_t p, bool fetch_next) {
    const int64_t col = p * kCols, cols = std::min(kCols, N - col);
    const float* panel = wp + p * K * kCols;
    for (int64_t r = 0, i = 0; r < M; r += kRows, ++i) {
      const int64_t rows = std::min<int64_t>(kRows, M - r);
      const float* fetch = fetch_next && i * fetch_per_block < K ? panel + (K + i * fetch_per_block) * kCols : nullptr;
      kKernels[rows](xp + r * ldx, ldx, panel, K, b == nullptr ? nullptr : b + col, yp + r * N + col, N, cols, fetch,
                     fetch_every);
    }
  };
  const int64_t run = M > kRows && M <= 16 * kRows
                          ? std::clamp<int64_t>(panels / (4 * at::get_num_threads()), 1, 8)
                          : 1;  // panels a work item
  parallel_dynamic((panels + run - 1) / run, [] { return 0; }, [&](int64_t item, int) {
    const int64_t end = std::min(panels, (item + 1) * run);
    for (int64_t p = item * run; p < end; ++p) run_panel(p, p + 1 < end);
  });
  return y;
}
