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
// group) pair reads each used K/V row once, for all its query rows.

#include <cmath>
#include <limits>
#include <vector>

#include "common.h"

namespace {

using namespace specjax;

constexpr int kBlock = 16;  // cells scored before the running max is updated

static_assert(kBlock == kLanes, "a block of scores is one vector");

// exp(x) for x <= 0 (x - running max), 16 lanes: Cephes' expf polynomial on the remainder
// after 2^n, within ~2 ulp of expf; -inf (masked cells) and x < -87.3 give 0.
inline f32x16 exp_nonpositive(f32x16 x) {
  typedef int32_t i32x16 __attribute__((vector_size(64)));
  const f32x16 xc = x < -87.3f ? f32x16{} - 87.3f : x;
  const f32x16 magic = f32x16{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const f32x16 t = xc * 1.44269504088896341f + magic;
  const f32x16 n = t - magic;
  const f32x16 r = xc - n * 0.693359375f + n * 2.12194440e-4f;
  f32x16 p = f32x16{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const f32x16 y = p * r * r + r + 1.0f;
  const i32x16 bits = (__builtin_convertvector(n, i32x16) + 127) << 23;
  f32x16 two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return x < -87.3f ? f32x16{} : y * two_n;
}

inline float reduce_max(f32x16 v) {
  float m = v[0];
  for (int i = 1; i < kLanes; ++i) m = std::max(m, v[i]);
  return m;
}

// acc[0:E] *= c: 16-lane vectors, then the tail.
inline void scale_in_place(float* acc, float c, int64_t e_vec, int64_t E) {
  for (int64_t i = 0; i < e_vec; i += kLanes) {
    const f32x16 y = load16(acc + i) * c;
    std::memcpy(acc + i, &y, sizeof y);
  }
  for (int64_t i = e_vec; i < E; ++i) acc[i] *= c;
}

// acc[0:E] += p * x[0:E]: 16-lane vectors, then the tail.
inline void axpy(float* acc, float p, const float* x, int64_t e_vec, int64_t E) {
  for (int64_t i = 0; i < e_vec; i += kLanes) {
    const f32x16 y = load16(acc + i) + p * load16(x + i);
    std::memcpy(acc + i, &y, sizeof y);
  }
  for (int64_t i = e_vec; i < E; ++i) acc[i] += p * x[i];
}

template <typename KV>
void attend_group(const float* q, const KV* k, const KV* v, const int32_t* k_pos,
                  const int32_t* q_pos, int64_t n_used, int64_t Q, int64_t T, int64_t E,
                  int64_t window, float* m_out, float* l_out, float* acc_out) {
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(E)));
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t e_vec = E - E % kLanes;
  // Per-thread scratch, reused across calls (no allocation per layer and step). Raw
  // pointers: the loops below must not re-read the vectors' internals.
  thread_local std::vector<float> scores_buf, v_buf;
  scores_buf.resize(static_cast<size_t>(Q) * kBlock);
  v_buf.resize(static_cast<size_t>(E));
  float* const scores = scores_buf.data();
  float* const vf = v_buf.data();
  for (int64_t r = 0; r < Q; ++r) {
    m_out[r] = neg_inf;
    l_out[r] = 0.0f;
  }
  std::fill(acc_out, acc_out + Q * E, 0.0f);
  for (int64_t s0 = 0; s0 < n_used; s0 += kBlock) {
    const int64_t n = std::min<int64_t>(kBlock, n_used - s0);
    // Scores of the block (masked cells -inf). K is converted 16 lanes at a time as it is
    // read (scalar F16 conversions of every element made this loop ~7x slower).
    bool any = false;
    for (int64_t j = 0; j < n; ++j) {
      const int64_t s = s0 + j;
      const int32_t kp = k_pos[s];
      const KV* k_row = k + s * E;
      for (int64_t r = 0; r < Q; ++r) {
        const int32_t qp = q_pos[r % T];
        const bool visible =
            kp >= 0 && qp >= 0 && kp <= qp && (window <= 0 || qp - kp < window);
        float dot = neg_inf;
        if (visible) {
          const float* q_row = q + r * E;
          f32x16 a = f32x16{};
          for (int64_t i = 0; i < e_vec; i += kLanes) a += load16(k_row + i) * load16(q_row + i);
          dot = reduce_lanes(a);
          for (int64_t i = e_vec; i < E; ++i) dot += to_float(k_row[i]) * q_row[i];
          dot *= scale;
          any = true;
        }
        scores[r * kBlock + j] = dot;
      }
    }
    if (!any) continue;
    // Per query row: new running max, rescale, turn scores into weights, 16 cells at once
    // (scalar expf per score was half of the kernel's time).
    for (int64_t r = 0; r < Q; ++r) {
      float* sr = scores + r * kBlock;
      for (int64_t j = n; j < kBlock; ++j) sr[j] = neg_inf;
      const f32x16 s = load16(sr);
      const float block_max = reduce_max(s);
      if (block_max == neg_inf) {
        std::memset(sr, 0, sizeof(float) * kBlock);
        continue;
      }
      const float m_new = std::max(m_out[r], block_max);
      if (m_out[r] != neg_inf && m_new != m_out[r]) {
        const float rescale = std::exp(m_out[r] - m_new);
        l_out[r] *= rescale;
        scale_in_place(acc_out + r * E, rescale, e_vec, E);
      }
      m_out[r] = m_new;
      const f32x16 w = exp_nonpositive(s - m_new);
      std::memcpy(sr, &w, sizeof w);
      l_out[r] += reduce_lanes(w);
    }
    // Weighted values: each V row converted once for all query rows.
    for (int64_t j = 0; j < n; ++j) {
      const KV* v_row = v + (s0 + j) * E;
      for (int64_t i = 0; i < e_vec; i += kLanes) {
        const f32x16 x = load16(v_row + i);
        std::memcpy(vf + i, &x, sizeof x);
      }
      for (int64_t i = e_vec; i < E; ++i) vf[i] = to_float(v_row[i]);
      for (int64_t r = 0; r < Q; ++r) {
        const float p = scores[r * kBlock + j];
        if (p != 0.0f) axpy(acc_out + r * E, p, vf, e_vec, E);
      }
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
