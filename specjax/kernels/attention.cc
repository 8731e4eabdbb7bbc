// specjax_attend_cache: the online-softmax state of a few query rows over the cached cells.
//
//   q      f32 [B, G, Q, E]      Q = R * T query rows per KV group (R heads of T tokens, t fastest)
//   k, v   f16 or f32 [B, G, S, E]   the cache, as stored
//   k_pos  s32 [B, S]            position of each cell, -1 = empty
//   q_pos  s32 [B, T]            position of each token, -1 = padding
//   n_used s32 []                cells at and above this index are not read (high-water mark)
//   attr window (i64)            sliding window (0 = none)
// returns
//   m      f32 [B, G, Q]         max scaled score over visible cells (-inf if none)
//   l      f32 [B, G, Q]         sum of exp(score - m)
//   acc    f32 [B, G, Q, E]      sum of exp(score - m) * v
//
// A cell is visible to a token when k_pos >= 0, q_pos >= 0, k_pos <= q_pos and, with a
// window, q_pos - k_pos < window: the rule of llama.attention_mask. The caller merges this
// state with the attention over the new tokens themselves (llama._attend).
//
// Why: XLA runs the cache part as a while loop over 256-cell chunks, each a dozen small
// kernels (slices, F16 converts, dots, exp), ~30 us per chunk and layer on the development
// machine: most of a decode step once the linear layers ran on specjax_linear. Here a (row,
// group) pair converts each used K/V row once, for all its query rows, and scores, softmax
// weights and value sums run a vector of cells (16 with AVX-512, 8 with AVX2) at a time.

#include <cmath>
#include <limits>
#include <vector>

#include "common.h"

namespace {

using namespace specjax;

// Cells scored before the running max is updated: one native vector of scores (16 with
// AVX-512, 8 with AVX2, whose 16 registers a 16-cell block would overflow).
constexpr int kBlock = kNativeLanes;

typedef int32_t i32xn __attribute__((vector_size(kNativeLanes * 4)));

// exp(x) for x <= 0 (x - running max), lane-wise: Cephes' expf polynomial on the remainder
// after 2^n, within ~2 ulp of expf; -inf (masked cells) and x < -87.3 give 0.
inline f32xn exp_nonpositive(f32xn x) {
  const f32xn xc = x < -87.3f ? f32xn{} - 87.3f : x;
  const f32xn magic = f32xn{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const f32xn t = xc * 1.44269504088896341f + magic;
  const f32xn n = t - magic;
  const f32xn r = xc - n * 0.693359375f + n * 2.12194440e-4f;
  f32xn p = f32xn{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const f32xn y = p * r * r + r + 1.0f;
  const i32xn bits = (__builtin_convertvector(n, i32xn) + 127) << 23;
  f32xn two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return x < -87.3f ? f32xn{} : y * two_n;
}

inline bool any_lane(i32xn mask) {
  int32_t lanes[kNativeLanes];
  std::memcpy(lanes, &mask, sizeof lanes);
  int32_t any = 0;
  for (int i = 0; i < kNativeLanes; ++i) any |= lanes[i];
  return any != 0;
}

inline float reduce_max(f32xn v) {
  typedef float f32x8 __attribute__((vector_size(32)));
  typedef float f32x4 __attribute__((vector_size(16)));
#if defined(__AVX512F__)
  const f32x8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
  const f32x8 b = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const f32x8 m8 = a > b ? a : b;
#else
  const f32x8 m8 = v;
#endif
  const f32x4 c = __builtin_shufflevector(m8, m8, 0, 1, 2, 3);
  const f32x4 d = __builtin_shufflevector(m8, m8, 4, 5, 6, 7);
  const f32x4 m4 = c > d ? c : d;
  return std::max(std::max(m4[0], m4[1]), std::max(m4[2], m4[3]));
}

// acc[0:E] *= c: native vectors, then the tail.
inline void scale_in_place(float* acc, float c, int64_t e_vec, int64_t E) {
  for (int64_t i = 0; i < e_vec; i += kNativeLanes) {
    const f32xn y = loadn(acc + i) * c;
    std::memcpy(acc + i, &y, sizeof y);
  }
  for (int64_t i = e_vec; i < E; ++i) acc[i] *= c;
}

// One vector of kBlock dot products from kBlock vectors of partial sums: lane j of the
// result is the sum of v[j]'s lanes. A fixed tree of shuffles and adds (lanes i and i + N/2
// first, then i + N/4, ..., as in reduce_native), ~3 operations per cell instead of a
// horizontal reduction each.
inline f32xn transpose_reduce(const f32xn* v) {
#if defined(__AVX512F__)
  f32xn l1[8], l2[4], l3[2];
  for (int i = 0; i < 8; ++i) {
    const f32xn a = v[2 * i], b = v[2 * i + 1];
    // lanes 0-7: a's 8 pair sums, lanes 8-15: b's
    l1[i] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
            __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29,
                                    30, 31);
  }
  for (int i = 0; i < 4; ++i) {
    const f32xn a = l1[2 * i], b = l1[2 * i + 1];
    // groups of 4 lanes: cells 4i, 4i+2, 4i+1, 4i+3
    l2[i] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26,
                                    27) +
            __builtin_shufflevector(a, b, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30,
                                    31);
  }
  for (int i = 0; i < 2; ++i) {
    const f32xn a = l2[2 * i], b = l2[2 * i + 1];
    l3[i] = __builtin_shufflevector(a, b, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28,
                                    29) +
            __builtin_shufflevector(a, b, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30,
                                    31);
  }
  const f32xn a = l3[0], b = l3[1];
  const f32xn r = __builtin_shufflevector(a, b, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12,
                                          28, 14, 30) +
                  __builtin_shufflevector(a, b, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13,
                                          29, 15, 31);
  // r's lanes hold the cells in bit-reversed order
  return __builtin_shufflevector(r, r, 0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15);
#else
  f32xn l1[4], l2[2];
  for (int i = 0; i < 4; ++i) {
    const f32xn a = v[2 * i], b = v[2 * i + 1];
    // lanes 0-3: a's 4 pair sums, lanes 4-7: b's
    l1[i] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11) +
            __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15);
  }
  for (int i = 0; i < 2; ++i) {
    const f32xn a = l1[2 * i], b = l1[2 * i + 1];
    // pairs of lanes: cells 4i, 4i+2, 4i+1, 4i+3
    l2[i] = __builtin_shufflevector(a, b, 0, 1, 8, 9, 4, 5, 12, 13) +
            __builtin_shufflevector(a, b, 2, 3, 10, 11, 6, 7, 14, 15);
  }
  const f32xn a = l2[0], b = l2[1];
  const f32xn r = __builtin_shufflevector(a, b, 0, 8, 2, 10, 4, 12, 6, 14) +
                  __builtin_shufflevector(a, b, 1, 9, 3, 11, 5, 13, 7, 15);
  // r's lanes hold the cells in bit-reversed order
  return __builtin_shufflevector(r, r, 0, 4, 2, 6, 1, 5, 3, 7);
#endif
}

// acc[0 : N NC] += sum_j w[j] * vb[j E : j E + N NC] (N native lanes) over the block's n
// cells: NC chunks side by side and even / odd cells in separate sums, so the FMAs do not
// wait on each other (one chain of n dependent FMAs per chunk made this loop latency-bound).
template <int NC>
inline void weigh_values(float* acc, const float* vb, int64_t E, f32xn w, int64_t n) {
  f32xn a[NC], b[NC];
  for (int c = 0; c < NC; ++c) {
    a[c] = loadn(acc + c * kNativeLanes);
    b[c] = f32xn{};
  }
  int64_t j = 0;
  for (; j + 1 < n; j += 2) {
    const float* x = vb + j * E;
    const float* y = x + E;
    for (int c = 0; c < NC; ++c) {
      a[c] += w[j] * loadn(x + c * kNativeLanes);
      b[c] += w[j + 1] * loadn(y + c * kNativeLanes);
    }
  }
  if (j < n)
    for (int c = 0; c < NC; ++c) a[c] += w[j] * loadn(vb + j * E + c * kNativeLanes);
  for (int c = 0; c < NC; ++c) {
    const f32xn t = a[c] + b[c];
    std::memcpy(acc + c * kNativeLanes, &t, sizeof t);
  }
}

template <typename KV>
void attend_group(const float* q, const KV* k, const KV* v, const int32_t* k_pos,
                  const int32_t* q_pos, int64_t n_used, int64_t Q, int64_t T, int64_t E,
                  int64_t window, float* m_out, float* l_out, float* acc_out) {
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(E)));
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t e_vec = E - E % kNativeLanes;
  // Per-thread scratch, reused across calls (no allocation per layer and step): the block's
  // K and V converted to float once for all query rows. Raw pointers below.
  thread_local std::vector<float> k_buf, v_buf;
  k_buf.resize(static_cast<size_t>(kBlock) * E);
  v_buf.resize(static_cast<size_t>(kBlock) * E);
  float* const kb = k_buf.data();
  float* const vb = v_buf.data();
  for (int64_t r = 0; r < Q; ++r) {
    m_out[r] = neg_inf;
    l_out[r] = 0.0f;
  }
  std::fill(acc_out, acc_out + Q * E, 0.0f);
  for (int64_t s0 = 0; s0 < n_used; s0 += kBlock) {
    const int64_t n = std::min<int64_t>(kBlock, n_used - s0);
    i32xn kpv = i32xn{} - 1;
    for (int64_t j = 0; j < n; ++j) kpv[j] = k_pos[s0 + j];
    if (!any_lane(kpv >= 0)) continue;
    // Convert the block's K and V rows a vector at a time (cells past n: zeros, masked).
    for (int64_t j = 0; j < kBlock; ++j) {
      float* kr = kb + j * E;
      float* vr = vb + j * E;
      if (j >= n) {
        std::fill(kr, kr + E, 0.0f);
        std::fill(vr, vr + E, 0.0f);
        continue;
      }
      const KV* ks = k + (s0 + j) * E;
      const KV* vs = v + (s0 + j) * E;
      for (int64_t i = 0; i < e_vec; i += kNativeLanes) {
        const f32xn x = loadn(ks + i), y = loadn(vs + i);
        std::memcpy(kr + i, &x, sizeof x);
        std::memcpy(vr + i, &y, sizeof y);
      }
      for (int64_t i = e_vec; i < E; ++i) {
        kr[i] = to_float(ks[i]);
        vr[i] = to_float(vs[i]);
      }
    }
    for (int64_t r = 0; r < Q; ++r) {
      const int32_t qp = q_pos[r % T];
      const float* q_row = q + r * E;
      // Scores of the block's cells (masked cells -inf): independent partial sums, one per
      // cell (a chain of dependent FMAs per cell made this loop latency-bound).
      f32xn part[kBlock];
      for (int64_t j = 0; j < kBlock; ++j) part[j] = f32xn{};
      for (int64_t i = 0; i < e_vec; i += kNativeLanes) {
        const f32xn qv = loadn(q_row + i);
        for (int64_t j = 0; j < kBlock; ++j) part[j] += loadn(kb + j * E + i) * qv;
      }
      f32xn s = transpose_reduce(part);
      if (e_vec < E)
        for (int64_t j = 0; j < kBlock; ++j)
          for (int64_t i = e_vec; i < E; ++i) s[j] += kb[j * E + i] * q_row[i];
      // visible: k_pos >= 0, q_pos >= 0, k_pos <= q_pos, inside the window (lane masks)
      i32xn visible = (kpv >= 0) & (kpv <= qp);
      if (qp < 0) visible = i32xn{};
      if (window > 0) visible &= (qp - kpv) < static_cast<int32_t>(window);
      if (!any_lane(visible)) continue;
      s = visible ? s * scale : f32xn{} + neg_inf;
      // New running max, rescale, weights (a vector of cells at once: a scalar expf per
      // score was half of the kernel's time).
      const float block_max = reduce_max(s);
      const float m_new = std::max(m_out[r], block_max);
      float* acc = acc_out + r * E;
      if (m_out[r] != neg_inf && m_new != m_out[r]) {
        const float rescale = std::exp(m_out[r] - m_new);
        l_out[r] *= rescale;
        scale_in_place(acc, rescale, e_vec, E);
      }
      m_out[r] = m_new;
      const f32xn w = exp_nonpositive(s - m_new);
      l_out[r] += reduce_native(w);
      // Weighted values, the accumulators held in registers across the block's cells.
      int64_t i = 0;
      for (; i + 4 * kNativeLanes <= e_vec; i += 4 * kNativeLanes)
        weigh_values<4>(acc + i, vb + i, E, w, n);
      for (; i < e_vec; i += kNativeLanes) weigh_values<1>(acc + i, vb + i, E, w, n);
      for (int64_t i = e_vec; i < E; ++i)
        for (int64_t j = 0; j < n; ++j) acc[i] += w[j] * vb[j * E + i];
    }
  }
}

template <typename KV>
void attend(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& q, ffi::AnyBuffer& k, ffi::AnyBuffer& v,
            ffi::Buffer<ffi::S32>& k_pos, ffi::Buffer<ffi::S32>& q_pos, int64_t n_used,
            int64_t window, ffi::Result<ffi::Buffer<ffi::F32>>& m,
            ffi::Result<ffi::Buffer<ffi::F32>>& l, ffi::Result<ffi::Buffer<ffi::F32>>& acc) {
  const auto qd = q.dimensions();
  const int64_t B = qd[0], G = qd[1], Q = qd[2], E = qd[3];
  const int64_t S = k.dimensions()[2], T = q_pos.dimensions()[1];
  const KV* kd = static_cast<const KV*>(k.untyped_data());
  const KV* vd = static_cast<const KV*>(v.untyped_data());
  n_used = std::max<int64_t>(0, std::min(n_used, S));
  parallel_for(pool, B * G, n_used * Q * E * B * G < (int64_t(1) << 14), [&](int64_t bg) {
    const int64_t b = bg / G;
    attend_group(q.typed_data() + bg * Q * E, kd + bg * S * E, vd + bg * S * E,
                 k_pos.typed_data() + b * S, q_pos.typed_data() + b * T, n_used, Q, T, E, window,
                 m->typed_data() + bg * Q, l->typed_data() + bg * Q, acc->typed_data() + bg * Q * E);
  });
}

ffi::Error AttendImpl(ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                      ffi::Buffer<ffi::S32> k_pos, ffi::Buffer<ffi::S32> q_pos,
                      ffi::Buffer<ffi::S32> n_used, ffi::Result<ffi::Buffer<ffi::F32>> m,
                      ffi::Result<ffi::Buffer<ffi::F32>> l, ffi::Result<ffi::Buffer<ffi::F32>> acc,
                      int64_t window, ffi::ThreadPool pool) {
  const auto kd = k.dimensions(), vd = v.dimensions();
  if (q.dimensions().size() != 4 || kd.size() != 4 || vd.size() != 4 ||
      !std::equal(kd.begin(), kd.end(), vd.begin()))
    return ffi::Error::InvalidArgument("specjax_attend_cache: want q [B,G,Q,E], k = v [B,G,S,E]");
  if (k.element_type() != v.element_type())
    return ffi::Error::InvalidArgument("specjax_attend_cache: k and v dtypes differ");
  const int64_t used = n_used.typed_data()[0];
  if (k.element_type() == ffi::DataType::F16)
    attend<_Float16>(pool, q, k, v, k_pos, q_pos, used, window, m, l, acc);
  else if (k.element_type() == ffi::DataType::F32)
    attend<float>(pool, q, k, v, k_pos, q_pos, used, window, m, l, acc);
  else
    return ffi::Error::InvalidArgument("specjax_attend_cache: cache must be f16 or f32");
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxAttendCache, AttendImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("window")
                                  .Ctx<ffi::ThreadPool>());
