// The engine's float32 linear layer: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), for every M the engine runs.
//
// W is blocked once at load time as [ceil(N/16)][K][16]: the 16 outputs of a block are one 64-byte vector per k, so
// a block is one sequential stream the prefetcher follows, and each vector read feeds one FMA per input row.
// A pass reads 4 blocks side by side and keeps up to 6 rows x 64 outputs of accumulators in registers (v16, one per
// row and block), walking k once, so each input value read from memory feeds 4 vector FMAs; more rows take more
// passes over the same blocks while they are in L1/L2.
// NOTE: on this project's 2-core AMD EPYC the oneDNN/MKL kernels torch calls read the weight far under what one core
// streams at decode's M = 1..8; with this loop a batch-1 decode step on one core went from 44 to 27 ms, and prefill's
// M stays at the oneDNN speed (`pdcluster bench engine`, per-core step case; BENCHMARKS.md).
// Each output is a plain float32 sum over k in order: the same math as F.linear, in a different summation order.
#include "kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>

namespace {

using pdcluster::kLanes;
using pdcluster::v16;
constexpr int64_t kGroup = 4;    // blocks a pass reads side by side: each input value read feeds 4 vector FMAs
constexpr int64_t kGroupRows = 6;  // rows per grouped pass: 6 x 4 accumulators (24 of AVX-512's 32 registers)
constexpr int64_t kMaxRows = 8;  // rows per single-block pass (the blocks left over after the groups)

// `R` rows x `NB` blocks: acc[c][r] holds outputs [16c, 16c + 16) of row r; `valid` outputs of the last block are
// written (all 16 of the others).
template <int64_t R, int64_t NB>
void pass(const float* x, int64_t k, const float* wb, float* y, int64_t n, int64_t valid, const float* bias) {
  v16 acc[NB][R];
  for (int64_t c = 0; c < NB; ++c)
    for (int64_t r = 0; r < R; ++r) acc[c][r] = v16{};
  const v16* w = reinterpret_cast<const v16*>(wb);
  for (int64_t j = 0; j < k; ++j) {
    v16 wv[NB];
    for (int64_t c = 0; c < NB; ++c) wv[c] = w[c * k + j];
    for (int64_t r = 0; r < R; ++r) {
      const float xs = x[r * k + j];
      for (int64_t c = 0; c < NB; ++c) acc[c][r] += xs * wv[c];
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t c = 0; c < NB; ++c) {
      float* out = y + r * n + c * kLanes;
      const float* b = bias == nullptr ? nullptr : bias + c * kLanes;
      const int64_t lanes = c == NB - 1 ? valid : kLanes;
      for (int64_t l = 0; l < lanes; ++l) out[l] = b == nullptr ? acc[c][r][l] : acc[c][r][l] + b[l];
    }
  }
}

using Pass = void (*)(const float*, int64_t, const float*, float*, int64_t, int64_t, const float*);
constexpr Pass kGroupPass[kGroupRows + 1] = {nullptr,           pass<1, kGroup>, pass<2, kGroup>, pass<3, kGroup>,
                                             pass<4, kGroup>,   pass<5, kGroup>, pass<6, kGroup>};
constexpr Pass kBlockPass[kMaxRows + 1] = {nullptr,      pass<1, 1>, pass<2, 1>, pass<3, 1>, pass<4, 1>,
                                           pass<5, 1>,   pass<6, 1>, pass<7, 1>, pass<8, 1>};

}  // namespace

namespace pdcluster {

at::Tensor pack_linear(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat, "pack_linear: a float32 [N, K] weight");
  const int64_t n = weight.size(0), k = weight.size(1), blocks = (n + kLanes - 1) / kLanes;
  auto padded = at::zeros({blocks * kLanes, k}, weight.options());
  padded.narrow(0, 0, n).copy_(weight);
  return padded.view({blocks, kLanes, k}).transpose(1, 2).contiguous();
}

at::Tensor linear(const at::Tensor& x_in, const at::Tensor& packed, int64_t out_features,
                  const c10::optional<at::Tensor>& bias_in) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "linear: a float32 [M, K] input");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kLanes && packed.size(1) == x_in.size(1) &&
                  packed.is_contiguous() && packed.size(0) * kLanes >= out_features,
              "linear: the weight must come from pack_linear() with the input's K");
  const auto x = x_in.contiguous();
  at::Tensor bias;
  if (bias_in.has_value()) {
    bias = bias_in->contiguous();
    TORCH_CHECK(bias.scalar_type() == at::kFloat && bias.numel() == out_features, "linear: a float32 [N] bias");
  }
  const int64_t m = x.size(0), k = x.size(1), n = out_features, blocks = (n + kLanes - 1) / kLanes;
  auto y = at::empty({m, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  // NOTE: tasks are groups of kGroup full blocks (64 outputs), then the blocks left over one by one (the last may
  // be partial); each task walks its rows in passes over the same weight columns, which stay in L1/L2.
  const int64_t groups = n / (kGroup * kLanes), rest = blocks - groups * kGroup;
  at::parallel_for(0, groups + rest, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const bool grouped = t < groups;
      const int64_t b = grouped ? t * kGroup : groups * kGroup + (t - groups);
      const int64_t col = b * kLanes, valid = grouped ? kLanes : std::min(kLanes, n - col);
      const int64_t step = grouped ? kGroupRows : kMaxRows;
      for (int64_t r0 = 0; r0 < m; r0 += step) {
        const int64_t rows = std::min(step, m - r0);
        (grouped ? kGroupPass : kBlockPass)[rows](xp + r0 * k, k, wp + b * k * kLanes, yp + r0 * n + col, n, valid,
                                                 bp == nullptr ? nullptr : bp + col);
      }
    }
  });
  return y;
}

}  // namespace pdcluster
