// Attention that reads the paged KV cache in place (no gathered copy of the context).
//
// The caller describes the work as "items": a set of query rows of the flat batch that all attend the same run of
// keys [kv_lo, kv_hi) of one block table, each row j (0-based within the item) seeing keys < causal + j + 1.
//  - a decode sequence is an item of one row (causal = context length - 1);
//  - a prefill chunk with cached context is an item of its rows (causal = its first position);
//  - a shared prefix (cascade) is an item whose rows are the decode rows of every sequence sharing it, not causal
//    (causal = kv_hi); each of those rows also has a suffix item [shared, context) and the two partial results are
//    merged by log-sum-exp. The shared blocks are then read once per KV head for the whole group.
// Work units are (item, tile of rows, KV head): a unit streams its blocks once and keeps one running softmax per
// query head of its rows (GQA: the G query heads of a KV head share every K/V row read).
// int8 caches (engine/kv_quant.py): a block has block_size token rows plus one scale row holding a float32 per KV
// head; values are dequantized as they are read (k = scale * int8).
#include "kernels.h"

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kRowTile = 16;  // query rows per work unit: 16 rows x G heads running softmaxes
constexpr int kMeta = 7;          // row_off, row_cnt, blk_off, kv_lo, kv_hi, causal, direct
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Unit {
  int64_t item, r0, r1, head, cost;
};

template <typename T>
inline float load(T x) {
  return static_cast<float>(x);
}

struct Cache {
  const void* data;
  int64_t s_block, s_row, s_head;  // element strides
  int64_t block_size;
};

// NOTE: kLanes independent partial sums the compiler keeps in one vector register, folded by halves (a short
// vector tree); a plain `dot += ...` reduction compiled to a chain of 16 dependent scalar adds per key.
using pdcluster::kLanes;
using pdcluster::v16;
constexpr int64_t kTransposeMin = 8;  // queries per unit from which a block's keys are transposed

template <typename cache_t>
inline float dot(const float* q, const cache_t* k, int64_t d) {
  float part[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= d; i += kLanes) {
#pragma omp simd
    for (int64_t l = 0; l < kLanes; ++l) part[l] += q[i + l] * load(k[i + l]);
  }
  for (int64_t w = kLanes / 2; w > 0; w /= 2) {
#pragma omp simd
    for (int64_t l = 0; l < w; ++l) part[l] += part[l + w];
  }
  float total = part[0];
  for (; i < d; ++i) total += q[i] * load(k[i]);
  return total;
}

// exp for the softmax weights (arguments <= 0): Cephes' expf (range reduction by ln 2, degree-5 polynomial, within
// 2 ulp), written so `omp simd` loops vectorize it; std::exp stays a scalar libm call per key.
inline float fast_exp(float x) {
  x = std::max(x, -87.0f);  // exp(-87) ~ 1.6e-38: below that the weight is nothing anyway
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(float));
  return y * scale;
}

template <typename cache_t>
inline void prefetch_rows(const cache_t* base, int64_t row_stride, int64_t rows, int64_t d) {
  const int64_t line = 64 / static_cast<int64_t>(sizeof(cache_t));
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t i = 0; i < d; i += line) __builtin_prefetch(base + t * row_stride + i);
}

// The online softmax's step for one query over keys [t_lo, lim) of a block whose highest score is bmax: weights
// p[t] = exp(s[t] - max) (p may be s), the accumulator a [D] and the running sum rescaled when the max grows.
inline void softmax_step(const float* s, float* p, int64_t t_lo, int64_t lim, float bmax, float* a, int64_t d,
                         float& mx, float& sum) {
  const float new_max = std::max(mx, bmax);
  if (new_max > mx && mx != kNegInf) {
    const float alpha = std::exp(mx - new_max);
    sum *= alpha;
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) a[i] *= alpha;
  }
  mx = new_max;
  float block_sum = 0.f;
#pragma omp simd reduction(+ : block_sum)
  for (int64_t t = t_lo; t < lim; ++t) {
    p[t] = fast_exp(s[t] - new_max);
    block_sum += p[t];
  }
  sum += block_sum;
}

constexpr int64_t kQueryTile = 8;  // queries a transposed block is read for at once

template <typename cache_t>
inline v16 load16(const cache_t* x) {
  v16 r;
  if constexpr (std::is_same_v<cache_t, float>) {
    std::memcpy(&r, x, sizeof(v16));
  } else {
    for (int64_t l = 0; l < kLanes; ++l) r[l] = load(x[l]);
  }
  return r;
}

// One block of a transposed unit for its queries [q0, q0 + QN): kt holds the block's keys as [D, bsp] (bsp = bs
// rounded up to kLanes), lim[j] the keys query j may see. Each key vector read feeds QN FMAs (scores), each value
// vector read QN FMAs (output); one query at a time read every vector once per query.
// NOTE: per query the math and its order are those of the one-query loop: scores over D in order, the running max
// and sum, weights by fast_exp, values over the keys in order (a key past a query's horizon adds 0 * v).
template <int64_t QN, typename cache_t>
void tile_block(const float* qb, int64_t q0, int64_t d, const float* kt, int64_t bsp, const cache_t* vb,
                int64_t v_row, float ks, float vs, int64_t t_lo, const int64_t* lim, float* acc, float* mx,
                float* sum, float* p) {
  for (int64_t t0 = 0; t0 < bsp; t0 += kLanes) {
    v16 sc[QN];
    for (int64_t j = 0; j < QN; ++j) sc[j] = v16{};
    for (int64_t i = 0; i < d; ++i) {
      v16 kv;
      std::memcpy(&kv, kt + i * bsp + t0, sizeof(v16));
      for (int64_t j = 0; j < QN; ++j) sc[j] += qb[(q0 + j) * d + i] * kv;
    }
    for (int64_t j = 0; j < QN; ++j) {
      const v16 x = sc[j] * ks;
      std::memcpy(p + j * bsp + t0, &x, sizeof(v16));
    }
  }
  int64_t lim_max = t_lo;
  for (int64_t j = 0; j < QN; ++j) {
    float* pj = p + j * bsp;
    const int64_t lj = std::max(lim[j], t_lo), qi = q0 + j;
    for (int64_t t = lj; t < bsp; ++t) pj[t] = 0.f;
    if (lj == t_lo) continue;
    lim_max = std::max(lim_max, lj);
    float bmax = kNegInf;
    for (int64_t t = t_lo; t < lj; ++t) bmax = std::max(bmax, pj[t]);
    softmax_step(pj, pj, t_lo, lj, bmax, acc + qi * d, d, mx[qi], sum[qi]);
  }
  int64_t i = 0;
  for (; i + kLanes <= d; i += kLanes) {
    v16 a[QN];
    for (int64_t j = 0; j < QN; ++j) std::memcpy(&a[j], acc + (q0 + j) * d + i, sizeof(v16));
    for (int64_t t = t_lo; t < lim_max; ++t) {
      const v16 vt = load16(vb + t * v_row + i);
      for (int64_t j = 0; j < QN; ++j) {
        if constexpr (std::is_same_v<cache_t, int8_t>) {
          a[j] += (p[j * bsp + t] * vs) * vt;
        } else {
          a[j] += p[j * bsp + t] * vt;  // vs is 1 (the same product, one multiply fewer)
        }
      }
    }
    for (int64_t j = 0; j < QN; ++j) std::memcpy(acc + (q0 + j) * d + i, &a[j], sizeof(v16));
  }
  for (; i < d; ++i)
    for (int64_t j = 0; j < QN; ++j)
      for (int64_t t = t_lo; t < lim_max; ++t) acc[(q0 + j) * d + i] += p[j * bsp + t] * vs * load(vb[t * v_row + i]);
}

template <typename cache_t>
using TileFn = void (*)(const float*, int64_t, int64_t, const float*, int64_t, const cache_t*, int64_t, float, float,
                        int64_t, const int64_t*, float*, float*, float*, float*);

template <typename scalar_t, typename cache_t>
void run_unit(const Unit& u, const int64_t* meta, const int64_t* rows, const int64_t* blocks, const scalar_t* q,
              int64_t q_s0, int64_t q_s1, const Cache& kc, const Cache& vc, int64_t num_heads, int64_t kv_heads,
              int64_t d, float scale, scalar_t* out, float* part, float* lse) {
  const int64_t* m = meta + u.item * kMeta;
  const int64_t row_off = m[0], blk_off = m[2], kv_lo = m[3], kv_hi = m[4], causal = m[5];
  const bool direct = m[6] != 0;
  const int64_t g = num_heads / kv_heads, nq = (u.r1 - u.r0) * g, bs = kc.block_size;
  const bool transposed = nq >= kTransposeMin;
  const int64_t bsp = (bs + kLanes - 1) / kLanes * kLanes;
  std::vector<float> qb(nq * d), acc(nq * d, 0.f), mx(nq, kNegInf), sum(nq, 0.f);
  std::vector<float> s(transposed ? 0 : bs), p(transposed ? 0 : bs);  // one query's scores and weights
  std::vector<float> kt(transposed ? d * bsp : 0), pt(transposed ? kQueryTile * bsp : 0);  // [D, bsp]: keys^T
  static constexpr TileFn<cache_t> kTiles[kQueryTile + 1] = {
      nullptr,                tile_block<1, cache_t>, tile_block<2, cache_t>, tile_block<3, cache_t>,
      tile_block<4, cache_t>, tile_block<5, cache_t>, tile_block<6, cache_t>, tile_block<7, cache_t>,
      tile_block<8, cache_t>};
  for (int64_t j = u.r0; j < u.r1; ++j) {
    const scalar_t* qr = q + rows[row_off + j] * q_s0;
    for (int64_t h = 0; h < g; ++h) {
      const scalar_t* qh = qr + (u.head * g + h) * q_s1;
      float* dst = qb.data() + ((j - u.r0) * g + h) * d;
      for (int64_t i = 0; i < d; ++i) dst[i] = load(qh[i]) * scale;
    }
  }
  const int64_t end = std::min(kv_hi, causal + u.r1);  // the last row's horizon bounds the unit's keys
  const cache_t* kbase = static_cast<const cache_t*>(kc.data);
  const cache_t* vbase = static_cast<const cache_t*>(vc.data);
  for (int64_t b = kv_lo / bs; b * bs < end; ++b) {
    const int64_t bid = blocks[blk_off + b];
    const int64_t t_lo = std::max(kv_lo, b * bs) - b * bs, t_hi = std::min(end, (b + 1) * bs) - b * bs;
    const cache_t* kb = kbase + bid * kc.s_block + u.head * kc.s_head;
    const cache_t* vb = vbase + bid * vc.s_block + u.head * vc.s_head;
    if ((b + 1) * bs < end) {  // NOTE: blocks lie anywhere in the pool; fetch the next one while this one is used
      const int64_t next = blocks[blk_off + b + 1];
      prefetch_rows(kbase + next * kc.s_block + u.head * kc.s_head, kc.s_row, bs, d);
      prefetch_rows(vbase + next * vc.s_block + u.head * vc.s_head, vc.s_row, bs, d);
    }
    float ks = 1.f, vs = 1.f;
    if constexpr (std::is_same_v<cache_t, int8_t>) {  // the scale row: a float32 in the head's first 4 bytes
      std::memcpy(&ks, kb + bs * kc.s_row, sizeof(float));
      std::memcpy(&vs, vb + bs * vc.s_row, sizeof(float));
    }
    if (transposed) {
      // NOTE: with many queries per unit (a shared prefix, a prefill tile) the block's keys are transposed once,
      // [D, bsp], so scores are kLanes-wide vector FMAs with no horizontal sums, kQueryTile queries per vector read;
      // a decode unit's G queries would not pay the transpose back and take one dot product per key (below).
      for (int64_t t = t_lo; t < t_hi; ++t) {
        const cache_t* kr = kb + t * kc.s_row;
        for (int64_t i = 0; i < d; ++i) kt[i * bsp + t] = load(kr[i]);
      }
      for (int64_t q0 = 0; q0 < nq; q0 += kQueryTile) {
        const int64_t qn = std::min(kQueryTile, nq - q0);
        int64_t lim[kQueryTile];
        for (int64_t j = 0; j < qn; ++j)
          lim[j] = std::min(t_hi, std::min(kv_hi, causal + u.r0 + (q0 + j) / g + 1) - b * bs);
        kTiles[qn](qb.data(), q0, d, kt.data(), bsp, vb, vc.s_row, ks, vs, t_lo, lim, acc.data(), mx.data(),
                   sum.data(), pt.data());
      }
      continue;
    }
    for (int64_t qi = 0; qi < nq; ++qi) {
      const int64_t j = u.r0 + qi / g;
      const int64_t lim = std::min(t_hi, std::min(kv_hi, causal + j + 1) - b * bs);
      if (lim <= t_lo) continue;
      const float* qv = qb.data() + qi * d;
      float bmax = kNegInf;
      for (int64_t t = t_lo; t < lim; ++t) {
        s[t] = dot(qv, kb + t * kc.s_row, d) * ks;
        bmax = std::max(bmax, s[t]);
      }
      float* a = acc.data() + qi * d;
      softmax_step(s.data(), p.data(), t_lo, lim, bmax, a, d, mx[qi], sum[qi]);
      // NOTE: d-chunk outer, keys inner: the chunk of the accumulator stays in a register across the block's keys
      // (keys outer kept it in memory: a store-to-load chain per key).
      int64_t i = 0;
      for (; i + kLanes <= d; i += kLanes) {
        float a16[kLanes];
        for (int64_t l = 0; l < kLanes; ++l) a16[l] = a[i + l];
        for (int64_t t = t_lo; t < lim; ++t) {
          const cache_t* vr = vb + t * vc.s_row + i;
          const float pt = p[t] * vs;
#pragma omp simd
          for (int64_t l = 0; l < kLanes; ++l) a16[l] += pt * load(vr[l]);
        }
        for (int64_t l = 0; l < kLanes; ++l) a[i + l] = a16[l];
      }
      for (; i < d; ++i)
        for (int64_t t = t_lo; t < lim; ++t) a[i] += p[t] * vs * load(vb[t * vc.s_row + i]);
    }
  }
  for (int64_t qi = 0; qi < nq; ++qi) {
    const int64_t r = row_off + u.r0 + qi / g, h = u.head * g + qi % g;
    const float inv = sum[qi] > 0.f ? 1.f / sum[qi] : 0.f;
    const float* a = acc.data() + qi * d;
    if (direct) {
      scalar_t* o = out + (rows[r] * num_heads + h) * d;
      for (int64_t i = 0; i < d; ++i) o[i] = static_cast<scalar_t>(a[i] * inv);
    } else {
      float* o = part + (r * num_heads + h) * d;
      for (int64_t i = 0; i < d; ++i) o[i] = a[i] * inv;
      lse[r * num_heads + h] = sum[qi] > 0.f ? mx[qi] + std::log(sum[qi]) : kNegInf;
    }
  }
}

// Rows with several partial results (cascade): combine them by log-sum-exp and write the output rows.
template <typename scalar_t>
void merge_partials(const int64_t* meta, int64_t num_items, const int64_t* rows, int64_t num_rows, int64_t num_heads,
                    int64_t d, float* part, float* lse, scalar_t* out) {
  std::vector<int64_t> first;  // flat row -> first partial holding it
  std::vector<int64_t> order;
  for (int64_t it = 0; it < num_items; ++it) {
    const int64_t* m = meta + it * kMeta;
    if (m[6]) continue;
    for (int64_t r = m[0]; r < m[0] + m[1]; ++r) {
      const int64_t t = rows[r];
      if (t >= static_cast<int64_t>(first.size())) first.resize(t + 1, -1);
      if (first[t] < 0) {
        first[t] = r;
        order.push_back(r);
        continue;
      }
      const int64_t f = first[t];
      for (int64_t h = 0; h < num_heads; ++h) {
        float& l0 = lse[f * num_heads + h];
        const float l1 = lse[r * num_heads + h];
        if (l1 == kNegInf) continue;
        const float mm = std::max(l0, l1);
        const float w0 = l0 == kNegInf ? 0.f : std::exp(l0 - mm), w1 = std::exp(l1 - mm);
        float* o0 = part + (f * num_heads + h) * d;
        const float* o1 = part + (r * num_heads + h) * d;
        const float inv = 1.f / (w0 + w1);
        for (int64_t i = 0; i < d; ++i) o0[i] = (o0[i] * w0 + o1[i] * w1) * inv;
        l0 = mm + std::log(w0 + w1);
      }
    }
  }
  (void)num_rows;
  for (const int64_t r : order) {
    scalar_t* o = out + rows[r] * num_heads * d;
    const float* p = part + r * num_heads * d;
    for (int64_t i = 0; i < num_heads * d; ++i) o[i] = static_cast<scalar_t>(p[i]);
  }
}

template <typename scalar_t, typename cache_t>
void attend_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& meta,
                 const at::Tensor& rows, const at::Tensor& blocks, int64_t block_size, double scale, at::Tensor& out) {
  const int64_t num_items = meta.size(0), num_heads = q.size(1), d = q.size(2), kv_heads = k_cache.size(2);
  const int64_t* mp = meta.data_ptr<int64_t>();
  std::vector<Unit> units;
  bool any_partial = false;
  for (int64_t it = 0; it < num_items; ++it) {
    const int64_t* m = mp + it * kMeta;
    any_partial |= m[6] == 0;
    for (int64_t r0 = 0; r0 < m[1]; r0 += kRowTile) {
      const int64_t r1 = std::min(m[1], r0 + kRowTile);
      const int64_t keys = std::max<int64_t>(std::min(m[4], m[5] + r1) - m[3], 0);
      for (int64_t h = 0; h < kv_heads; ++h) units.push_back({it, r0, r1, h, (r1 - r0) * keys + 64});
    }
  }
  // NOTE: longest first, handed out dynamically: a shared prefix is one big unit among many small suffixes.
  std::stable_sort(units.begin(), units.end(), [](const Unit& a, const Unit& b) { return a.cost > b.cost; });
  const int64_t num_rows = rows.size(0);
  std::vector<float> part(any_partial ? num_rows * num_heads * d : 0), lse(any_partial ? num_rows * num_heads : 0);
  const Cache kc{k_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_size};
  const Cache vc{v_cache.data_ptr(), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_size};
  const scalar_t* qp = q.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* bp = blocks.data_ptr<int64_t>();
  const int64_t n = static_cast<int64_t>(units.size());
  // NOTE: torch's own thread pool (at::parallel_for), one task per thread, each taking the next unit from a shared
  // counter: dynamic balance with the threads torch.set_num_threads gave the engine.
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t i = next++; i < n; i = next++) {
      run_unit<scalar_t, cache_t>(units[i], mp, rp, bp, qp, q.stride(0), q.stride(1), kc, vc, num_heads, kv_heads,
                                  d, static_cast<float>(scale), op, part.data(), lse.data());
    }
  });
  if (any_partial) merge_partials<scalar_t>(mp, num_items, rp, num_rows, num_heads, d, part.data(), lse.data(), op);
}

template <typename scalar_t>
void dispatch_cache(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& meta,
                    const at::Tensor& rows, const at::Tensor& blocks, int64_t block_size, double scale,
                    at::Tensor& out) {
  if (k_cache.scalar_type() == at::kChar) {
    attend_impl<scalar_t, int8_t>(q, k_cache, v_cache, meta, rows, blocks, block_size, scale, out);
  } else {
    TORCH_CHECK(k_cache.scalar_type() == q.scalar_type(), "KV cache dtype must be int8 or the query dtype");
    attend_impl<scalar_t, scalar_t>(q, k_cache, v_cache, meta, rows, blocks, block_size, scale, out);
  }
}

}  // namespace

namespace pdcluster {

// q [T, H, D]; k_cache/v_cache [num_blocks, rows, KVH, D]; meta [I, 7] int64; rows [R] int64; blocks [B] int64;
// out [T, H, D] contiguous: only the rows named by the items are written.
void attend(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& meta,
            const at::Tensor& rows, const at::Tensor& blocks, int64_t block_size, double scale, at::Tensor out) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [T, H, D] with contiguous D");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "caches: [N, rows, KVH, D]");
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "K and V caches must share a dtype");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0 && q.size(2) == k_cache.size(3), "head layout mismatch");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type(), "out");
  TORCH_CHECK(meta.dim() == 2 && meta.size(1) == kMeta && meta.scalar_type() == at::kLong && meta.is_contiguous());
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.is_contiguous() && blocks.scalar_type() == at::kLong &&
              blocks.is_contiguous());
  switch (q.scalar_type()) {
    case at::kFloat:
      dispatch_cache<float>(q, k_cache, v_cache, meta, rows, blocks, block_size, scale, out);
      break;
    case at::kBFloat16:
      dispatch_cache<at::BFloat16>(q, k_cache, v_cache, meta, rows, blocks, block_size, scale, out);
      break;
    case at::kHalf:
      dispatch_cache<at::Half>(q, k_cache, v_cache, meta, rows, blocks, block_size, scale, out);
      break;
    default:
      TORCH_CHECK(false, "unsupported query dtype ", q.scalar_type());
  }
}

}  // namespace pdcluster
