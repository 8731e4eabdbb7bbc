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
// machine: most of a decode step once the linear layers ran on specjax_linear. Here each
// (row, group) item walks its cells in chunks (one online-softmax update per query row and
// chunk), query rows four at a time (the last one to three in a pair) so that every K and V
// vector read (and converted from F16) feeds several rows' FMAs; scores, softmax weights and
// value sums run a vector of cells (16 with AVX-512, 8 with AVX2) at a time.
//
// Invariant: a query row's result does not depend on the other rows of the call (its
// partners in a quad or pair, Q, T): it has its own accumulators, summed in the same order
// by the quad and the pair code.

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
#if defined(__AVX512F__)
  return _mm512_test_epi32_mask((__m512i)mask, (__m512i)mask) != 0;
#elif defined(__AVX2__)
  return !_mm256_testz_si256((__m256i)mask, (__m256i)mask);
#else
  int32_t lanes[kNativeLanes];
  std::memcpy(lanes, &mask, sizeof lanes);
  int32_t any = 0;
  for (int i = 0; i < kNativeLanes; ++i) any |= lanes[i];
  return any != 0;
#endif
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

// Query rows are processed in pairs (a last odd row is paired with itself): each K or V
// vector loaded (and, read from an F16 cache, converted) serves two rows' FMAs, which moves
// the loops from load-bound to FMA-bound. A row's sums do not depend on its partner: each
// has its own accumulators, in the same order whatever the pairing.
constexpr int kHalf = kBlock / 2;

// Left alone, GCC folds a vector load into every FMA that uses it: each K (or V) vector and
// each query vector would be read once per use, and the loops would stay load-bound. An empty
// asm makes the value a register (these loops need ~11 of AVX2's 16).
inline void in_register(f32xn& v) {
#if defined(__x86_64__) && defined(__GNUC__) && defined(__AVX512F__)
  asm("" : "+v"(v));  // any of the 32 vector registers
#elif defined(__x86_64__) && defined(__GNUC__)
  asm("" : "+x"(v));
#else
  (void)v;
#endif
}

// Lanes 0..H-1 of a and b side by side (lo) and lanes H..N-1 of both (hi), H = N / 2.
inline f32xn lower_halves(f32xn a, f32xn b) {
#if defined(__AVX512F__)
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
#else
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11);
#endif
}
inline f32xn upper_halves(f32xn a, f32xn b) {
#if defined(__AVX512F__)
  return __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30,
                                 31);
#else
  return __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15);
#endif
}

// Unscaled scores of query rows q0 and q1 against kBlock cells (rows of E values from kb):
// per row a vector of kBlock dot products. Two halves of kHalf cells, each reduced for both
// rows at once by transpose_reduce (lanes 0..H-1: row 0's cells, H..N-1: row 1's).
template <typename KV>
inline void pair_scores(const float* q0, const float* q1, const KV* kb, int64_t E, int64_t e_vec,
                        f32xn& s0, f32xn& s1) {
  f32xn halves[2];
  for (int h = 0; h < 2; ++h) {
    const KV* kh = kb + h * kHalf * E;
    f32xn part[kBlock];
    for (int j = 0; j < kBlock; ++j) part[j] = f32xn{};
    for (int64_t i = 0; i < e_vec; i += kNativeLanes) {
      f32xn a = loadn(q0 + i), b = loadn(q1 + i);
      in_register(a);
      in_register(b);
      for (int j = 0; j < kHalf; ++j) {
        f32xn kv = loadn(kh + j * E + i);
        in_register(kv);
        part[j] += kv * a;
        part[kHalf + j] += kv * b;
      }
    }
    halves[h] = transpose_reduce(part);
  }
  s0 = lower_halves(halves[0], halves[1]);
  s1 = upper_halves(halves[0], halves[1]);
  for (int j = 0; j < kBlock; ++j)
    for (int64_t i = e_vec; i < E; ++i) {
      const float kv = to_float(kb[j * E + i]);
      s0[j] += kv * q0[i];
      s1[j] += kv * q1[i];
    }
}

// The same scores for four query rows (qr[0..3]) at once: each K vector read (and converted)
// feeds four rows' FMAs, two cells at a time (8 accumulators, 4 query and 2 K registers). A
// row's per-lane partial sums and their transpose_reduce tree are pair_scores' exactly, so a
// score's bits do not depend on which of the two computed it. The two cells' FMAs are written
// out: as fixed-bound loops over an array of accumulators GCC's code ran the 17- and
// 65-token verifies ~15-20% slower (kernels.py --only attend, two interleaved pairs).
template <typename KV>
inline void quad_scores(const float* const* qr, const KV* kb, int64_t E, int64_t e_vec,
                        f32xn* s) {
  f32xn part[4][kBlock];
  for (int j = 0; j < kBlock; j += 2) {
    const KV* k0 = kb + j * E;
    const KV* k1 = k0 + E;
    f32xn c00{}, c10{}, c20{}, c30{}, c01{}, c11{}, c21{}, c31{};
    for (int64_t i = 0; i < e_vec; i += kNativeLanes) {
      f32xn a0 = loadn(qr[0] + i), a1 = loadn(qr[1] + i), a2 = loadn(qr[2] + i),
            a3 = loadn(qr[3] + i);
      in_register(a0);
      in_register(a1);
      in_register(a2);
      in_register(a3);
      f32xn x = loadn(k0 + i);
      in_register(x);
      c00 += x * a0;
      c10 += x * a1;
      c20 += x * a2;
      c30 += x * a3;
      f32xn y = loadn(k1 + i);
      in_register(y);
      c01 += y * a0;
      c11 += y * a1;
      c21 += y * a2;
      c31 += y * a3;
    }
    part[0][j] = c00;
    part[1][j] = c10;
    part[2][j] = c20;
    part[3][j] = c30;
    part[0][j + 1] = c01;
    part[1][j + 1] = c11;
    part[2][j + 1] = c21;
    part[3][j + 1] = c31;
  }
  for (int r = 0; r < 4; ++r) s[r] = transpose_reduce(part[r]);
  for (int j = 0; j < kBlock; ++j)
    for (int64_t i = e_vec; i < E; ++i) {
      const float kv = to_float(kb[j * E + i]);
      for (int r = 0; r < 4; ++r) s[r][j] += kv * qr[r][i];
    }
}

// acc0[0 : N NC] += sum_j w0[j] * vb[j E : j E + N NC] over n cells, and the same for acc1
// with w1 (N native lanes): 2 NC accumulators in registers, each V vector read once.
// Not inlined: inlined into attend_pair, GCC kept a copy of the accumulators on the stack,
// stored on every cell (the loop ran ~1.5x slower).
template <int NC, typename KV>
__attribute__((noinline)) void weigh_pair(float* acc0, float* acc1, const KV* vb, int64_t E,
                                          const float* w0, const float* w1, int64_t n) {
  f32xn a[NC], b[NC];
  for (int c = 0; c < NC; ++c) {
    a[c] = loadn(acc0 + c * kNativeLanes);
    b[c] = loadn(acc1 + c * kNativeLanes);
  }
  for (int64_t j = 0; j < n; ++j) {
    const KV* x = vb + j * E;
    const float u = w0[j], t = w1[j];
    for (int c = 0; c < NC; ++c) {
      f32xn xv = loadn(x + c * kNativeLanes);
      in_register(xv);
      a[c] += u * xv;
      b[c] += t * xv;
    }
  }
  for (int c = 0; c < NC; ++c) {
    std::memcpy(acc0 + c * kNativeLanes, &a[c], sizeof a[c]);
    std::memcpy(acc1 + c * kNativeLanes, &b[c], sizeof b[c]);
  }
}

// weigh_pair for four rows: acc[r][0 : N NC] += sum_j w[r][j] * vb[j E : j E + N NC], 4 NC
// accumulators in registers, each V vector read once for four rows' FMAs.
template <int NC, typename KV>
__attribute__((noinline)) void weigh_quad(float* const* acc, int64_t offset, const KV* vb,
                                          int64_t E, const float* const* w, int64_t n) {
  f32xn a[4][NC];
  for (int r = 0; r < 4; ++r)
    for (int c = 0; c < NC; ++c) a[r][c] = loadn(acc[r] + offset + c * kNativeLanes);
  for (int64_t j = 0; j < n; ++j) {
    const KV* x = vb + j * E;
    const float u0 = w[0][j], u1 = w[1][j], u2 = w[2][j], u3 = w[3][j];
    for (int c = 0; c < NC; ++c) {
      f32xn xv = loadn(x + c * kNativeLanes);
      in_register(xv);
      a[0][c] += u0 * xv;
      a[1][c] += u1 * xv;
      a[2][c] += u2 * xv;
      a[3][c] += u3 * xv;
    }
  }
  for (int r = 0; r < 4; ++r)
    for (int c = 0; c < NC; ++c)
      std::memcpy(acc[r] + offset + c * kNativeLanes, &a[r][c], sizeof a[r][c]);
}

// Cells per chunk: the unit of the online softmax (one max update, one rescale and one pass
// of exponentials per query row and chunk), a multiple of kBlock. 128 cells of head size 64:
// against 32, a decode call ~10% and a 65-token verify's ~20% faster (the per-chunk softmax
// work and the calls of weigh_* spread over more cells; K and V chunks, 16 KiB each in F16,
// stay in L1).
constexpr int64_t kChunkFloats = 8192;
constexpr int64_t kMaxChunk = 128;

inline int64_t chunk_cells(int64_t E) {
  const int64_t c = std::min<int64_t>(kMaxChunk, std::max<int64_t>(1, kChunkFloats / E));
  return std::max<int64_t>(kBlock, c - c % kBlock);
}

// The online-softmax state of one query row (m, l, acc[E]) updated with a chunk's scores
// (kBlock-cell vectors, masked cells -inf): one max update and rescale, then the weights a
// vector of cells at a time (a scalar expf per score was half of the kernel's time once),
// written to w. Returns false (w untouched, state as it was) if no cell is visible.
inline bool softmax_update(const f32xn* s, int64_t blocks, bool any_visible, float& m, float& l,
                           float* acc, int64_t e_vec, int64_t E, float* w) {
  if (!any_visible) return false;
  f32xn chunk_max = s[0];
  for (int64_t b = 1; b < blocks; ++b) chunk_max = chunk_max > s[b] ? chunk_max : s[b];
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const float m_new = std::max(m, reduce_max(chunk_max));
  if (m != neg_inf && m_new != m) {
    const float rescale = std::exp(m - m_new);
    l *= rescale;
    scale_in_place(acc, rescale, e_vec, E);
  }
  m = m_new;
  f32xn w_sum = f32xn{};
  for (int64_t b = 0; b < blocks; ++b) {
    const f32xn wb = exp_nonpositive(s[b] - m_new);
    w_sum += wb;
    std::memcpy(w + b * kBlock, &wb, sizeof wb);
  }
  l += reduce_native(w_sum);
  return true;
}

// Query rows r0 and r1 (possibly equal) of one group over one chunk of cells: K and V rows
// from kb / vb as stored (F16 or float), kBlock-cell vectors of their positions in kp.
template <typename KV>
void attend_pair(const float* q, const KV* kb, const KV* vb, const i32xn* kp, int64_t n,
                 int64_t blocks, int64_t r0, int64_t r1, int32_t qp0, int32_t qp1, int64_t E,
                 int64_t window, float* m_out, float* l_out, float* acc_out) {
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(E)));
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t e_vec = E - E % kNativeLanes;
  f32xn s0[kMaxChunk / kBlock], s1[kMaxChunk / kBlock];
  alignas(64) float w0[kMaxChunk], w1[kMaxChunk];
  bool any0 = false, any1 = false;
  for (int64_t b = 0; b < blocks; ++b) {
    // visible: k_pos >= 0, k_pos <= q_pos, inside the window (lane masks); q_pos < 0 = none
    i32xn vis0 = (kp[b] >= 0) & (kp[b] <= qp0), vis1 = (kp[b] >= 0) & (kp[b] <= qp1);
    if (window > 0) {
      vis0 &= (qp0 - kp[b]) < static_cast<int32_t>(window);
      vis1 &= (qp1 - kp[b]) < static_cast<int32_t>(window);
    }
    if (qp0 < 0) vis0 = i32xn{};
    if (qp1 < 0) vis1 = i32xn{};
    const bool some0 = any_lane(vis0), some1 = any_lane(vis1);
    if (!some0 && !some1) {
      s0[b] = s1[b] = f32xn{} + neg_inf;
      continue;
    }
    any0 |= some0;
    any1 |= some1;
    f32xn a, c;
    pair_scores(q + r0 * E, q + r1 * E, kb + b * kBlock * E, E, e_vec, a, c);
    s0[b] = vis0 ? a * scale : f32xn{} + neg_inf;
    s1[b] = vis1 ? c * scale : f32xn{} + neg_inf;
  }
  float* acc0 = acc_out + r0 * E;
  float* acc1 = acc_out + r1 * E;
  const bool use0 = softmax_update(s0, blocks, any0, m_out[r0], l_out[r0], acc0, e_vec, E, w0);
  // (a row paired with itself: updated once)
  const bool use1 = r1 != r0 &&
                    softmax_update(s1, blocks, any1, m_out[r1], l_out[r1], acc1, e_vec, E, w1);
  if (!use0 && !use1) return;
  // A row without a visible cell here weighs nothing; a row paired with itself sends its
  // partner's sums to a scratch row.
  if (!use0) std::fill(w0, w0 + n, 0.0f);
  if (!use1) std::fill(w1, w1 + n, 0.0f);
  thread_local std::vector<float> sink;
  float* out1 = acc1;
  if (r1 == r0) {
    sink.resize(static_cast<size_t>(E));
    out1 = sink.data();
  }
  int64_t i = 0;
  for (; i + 4 * kNativeLanes <= e_vec; i += 4 * kNativeLanes)
    weigh_pair<4>(acc0 + i, out1 + i, vb + i, E, w0, w1, n);
  for (; i < e_vec; i += kNativeLanes) weigh_pair<1>(acc0 + i, out1 + i, vb + i, E, w0, w1, n);
  for (int64_t i = e_vec; i < E; ++i)
    for (int64_t j = 0; j < n; ++j) {
      const float x = to_float(vb[j * E + i]);
      acc0[i] += w0[j] * x;
      out1[i] += w1[j] * x;
    }
}

// attend_pair for four distinct query rows r0..r0+3 (positions qp[0..3]): quad_scores and
// weigh_quad, each row's arithmetic exactly attend_pair's.
template <typename KV>
void attend_quad(const float* q, const KV* kb, const KV* vb, const i32xn* kp, int64_t n,
                 int64_t blocks, int64_t r0, const int32_t* qp, int64_t E, int64_t window,
                 float* m_out, float* l_out, float* acc_out) {
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(E)));
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t e_vec = E - E % kNativeLanes;
  f32xn s[4][kMaxChunk / kBlock];
  alignas(64) float w[4][kMaxChunk];
  bool any[4] = {false, false, false, false};
  const float* qr[4] = {q + r0 * E, q + (r0 + 1) * E, q + (r0 + 2) * E, q + (r0 + 3) * E};
  for (int64_t b = 0; b < blocks; ++b) {
    i32xn vis[4];
    bool some_row = false;
    for (int r = 0; r < 4; ++r) {
      vis[r] = (kp[b] >= 0) & (kp[b] <= qp[r]);
      if (window > 0) vis[r] &= (qp[r] - kp[b]) < static_cast<int32_t>(window);
      if (qp[r] < 0) vis[r] = i32xn{};
      const bool some = any_lane(vis[r]);
      any[r] |= some;
      some_row |= some;
    }
    if (!some_row) {
      for (int r = 0; r < 4; ++r) s[r][b] = f32xn{} + neg_inf;
      continue;
    }
    f32xn sc[4];
    quad_scores(qr, kb + b * kBlock * E, E, e_vec, sc);
    for (int r = 0; r < 4; ++r) s[r][b] = vis[r] ? sc[r] * scale : f32xn{} + neg_inf;
  }
  float* acc[4];
  bool use_any = false;
  for (int r = 0; r < 4; ++r) {
    acc[r] = acc_out + (r0 + r) * E;
    const bool use = softmax_update(s[r], blocks, any[r], m_out[r0 + r], l_out[r0 + r], acc[r],
                                    e_vec, E, w[r]);
    if (!use) std::fill(w[r], w[r] + n, 0.0f);  // a row without a visible cell weighs nothing
    use_any |= use;
  }
  if (!use_any) return;
  const float* wr[4] = {w[0], w[1], w[2], w[3]};
  int64_t i = 0;
  for (; i + 2 * kNativeLanes <= e_vec; i += 2 * kNativeLanes)
    weigh_quad<2>(acc, i, vb + i, E, wr, n);
  for (; i < e_vec; i += kNativeLanes) weigh_quad<1>(acc, i, vb + i, E, wr, n);
  for (int64_t e = e_vec; e < E; ++e)
    for (int64_t j = 0; j < n; ++j) {
      const float x = to_float(vb[j * E + e]);
      for (int r = 0; r < 4; ++r) acc[r][e] += w[r][j] * x;
    }
}

template <typename KV>
void attend_group(const float* q, const KV* k, const KV* v, const int32_t* k_pos,
                  const int32_t* q_pos, int64_t n_used, int64_t S, int64_t Q, int64_t T,
                  int64_t E, int64_t window, float* m_out, float* l_out, float* acc_out) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t C = chunk_cells(E);
  i32xn kp[kMaxChunk / kBlock];
  for (int64_t r = 0; r < Q; ++r) {
    m_out[r] = neg_inf;
    l_out[r] = 0.0f;
  }
  std::fill(acc_out, acc_out + Q * E, 0.0f);
  for (int64_t c0 = 0; c0 < n_used; c0 += C) {
    const int64_t n = std::min<int64_t>(C, n_used - c0);
    const int64_t blocks = (n + kBlock - 1) / kBlock;
    // The lowest position in the chunk: rows before it see nothing here (a prompt's rows over
    // its later chunks, padding rows) and skip the chunk, which leaves their state as it was.
    constexpr int32_t kNone = std::numeric_limits<int32_t>::max();
    i32xn lowest = i32xn{} + kNone;
    for (int64_t b = 0; b < blocks; ++b) {
      i32xn kpv = i32xn{} - 1;
      for (int64_t j = 0; j < kBlock && b * kBlock + j < n; ++j)
        kpv[j] = k_pos[c0 + b * kBlock + j];
      kp[b] = kpv;
      lowest = (kpv >= 0) & (kpv < lowest) ? kpv : lowest;
    }
    int32_t first_pos = kNone;
    for (int j = 0; j < kNativeLanes; ++j) first_pos = std::min(first_pos, lowest[j]);
    if (first_pos == kNone) continue;  // no cell in the chunk
    // The rows are read as stored (F16 converted in registers: converting a chunk to float
    // scratch once for all query rows was slower at every row count measured, up to 128). The
    // scores read whole blocks: a last block that would read past the cache is copied,
    // zero-padded, first.
    const KV* kc = k + c0 * E;
    const KV* vc = v + c0 * E;
    if (c0 + blocks * kBlock > S) {
      thread_local std::vector<KV> k_tail, v_tail;
      k_tail.assign(static_cast<size_t>(blocks * kBlock * E), KV{});
      v_tail.assign(static_cast<size_t>(blocks * kBlock * E), KV{});
      std::copy(kc, kc + n * E, k_tail.begin());
      std::copy(vc, vc + n * E, v_tail.begin());
      kc = k_tail.data();
      vc = v_tail.data();
    }
    int64_t r = 0;
    for (; r + 4 <= Q; r += 4) {
      const int32_t qp[4] = {q_pos[r % T], q_pos[(r + 1) % T], q_pos[(r + 2) % T],
                             q_pos[(r + 3) % T]};
      if (std::max(std::max(qp[0], qp[1]), std::max(qp[2], qp[3])) < first_pos) continue;
      attend_quad(q, kc, vc, kp, n, blocks, r, qp, E, window, m_out, l_out, acc_out);
    }
    for (; r < Q; r += 2) {
      const int64_t r1 = std::min(r + 1, Q - 1);
      if (std::max(q_pos[r % T], q_pos[r1 % T]) < first_pos) continue;
      attend_pair(q, kc, vc, kp, n, blocks, r, r1, q_pos[r % T], q_pos[r1 % T], E, window,
                  m_out, l_out, acc_out);
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
                 k_pos.typed_data() + b * S, q_pos.typed_data() + b * T, n_used, S, Q, T, E,
                 window, m->typed_data() + bg * Q, l->typed_data() + bg * Q,
                 acc->typed_data() + bg * Q * E);
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
