// The compiled kernels of engine/kernels.py: one extension module (module.cpp binds them).
#pragma once

#include <torch/extension.h>

namespace pdcluster {

// 16 floats the compiler keeps in one register (one zmm with AVX-512, two ymm with AVX2): GCC vector extensions, so
// a portable build still compiles.
typedef float v16 __attribute__((vector_size(64)));
constexpr int64_t kLanes = 16;

// paged_attention.cpp: attention over work items, reading the paged KV cache in place.
void attend(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& meta,
            const at::Tensor& rows, const at::Tensor& blocks, int64_t block_size, double scale, at::Tensor out);

// linear.cpp: y = x @ W.T + bias with W blocked by pack_linear().
at::Tensor pack_linear(const at::Tensor& weight);
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                  const c10::optional<at::Tensor>& bias);

}  // namespace pdcluster
