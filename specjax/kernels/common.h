// Shared pieces of specjax's native CPU kernels (see cpu_kernels.py): native float vectors,
// F16 loads, broadcasts, a fixed-order lane reduction, and a work-claiming loop over XLA's
// thread pool.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <utility>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace specjax {

namespace ffi = xla::ffi;

// 16 lanes (kLanes): a linear layer's weight panel (16 outputs), kParts native vectors.
constexpr int kLanes = 16;
constexpr int kSpinsBeforeYield = 4096;

// The widest vector the target holds in one register: 16 lanes with AVX-512, 8 otherwise
// (AVX2). GCC lowers a 16-lane vector on AVX2 through memory (the accumulators of a tile
// went to the stack on every step: ~3 GMAC/s), so the kernels run on native vectors.
#if defined(__AVX512F__)
constexpr int kParts = 1;
#else
constexpr int kParts = 2;
#endif
constexpr int kNativeLanes = kLanes / kParts;
typedef float f32xn __attribute__((vector_size(kNativeLanes * 4)));

inline f32xn loadn(const float* p) {
  f32xn v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline f32xn loadn(const _Float16* p) {
#if defined(__AVX512F__)
  return (f32xn)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__F16C__)
  return (f32xn)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  typedef _Float16 f16xn __attribute__((vector_size(kNativeLanes * 2)));
  f16xn h;
  std::memcpy(&h, p, sizeof h);
  return __builtin_convertvector(h, f32xn);
#endif
}

// *p in every lane, loaded straight into the vector (GCC turns `f32xn{} + *p` into a scalar
// add and a register broadcast: two extra operations per use).
inline f32xn broadcast(const float* p) {
#if defined(__AVX512F__)
  return (f32xn)_mm512_set1_ps(*p);
#elif defined(__AVX__)
  return (f32xn)_mm256_broadcast_ss(p);
#else
  return f32xn{} + *p;
#endif
}

inline float to_float(float v) { return v; }
inline float to_float(_Float16 v) { return static_cast<float>(v); }

// Fixed pairwise tree over a native vector's lanes: lane i += lane i + N/2, then i + N/4, ...
// in vector halves rather than through memory.
inline float reduce_native(f32xn v) {
  typedef float f32x8 __attribute__((vector_size(32)));
  typedef float f32x4 __attribute__((vector_size(16)));
  typedef float f32x2 __attribute__((vector_size(8)));
#if defined(__AVX512F__)
  const f32x8 s8 = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                   __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  const f32x8 s8 = v;
#endif
  const f32x4 s4 = __builtin_shufflevector(s8, s8, 0, 1, 2, 3) +
                   __builtin_shufflevector(s8, s8, 4, 5, 6, 7);
  const f32x2 s2 = __builtin_shufflevector(s4, s4, 0, 1) + __builtin_shufflevector(s4, s4, 2, 3);
  return s2[0] + s2[1];
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#endif
}

// Items [0, n) are claimed from a shared counter by the calling thread and by helpers on
// XLA's pool, and `run(i)` is called once per item. The caller never waits for an item nobody
// has claimed (it claims it itself), so a busy or single-threaded pool cannot deadlock it; a
// helper that starts late finds nothing to claim and only touches the counters, which it
// co-owns. `serial` runs everything on the caller (small work is not worth a wake-up).
struct Progress {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

template <typename Run>
void parallel_for(ffi::ThreadPool& pool, int64_t n, bool serial, const Run& run) {
  const int64_t helpers = serial ? 0 : std::min<int64_t>(pool.num_threads(), n) - 1;
  if (helpers < 1) {
    for (int64_t i = 0; i < n; ++i) run(i);
    return;
  }
  auto progress = std::make_shared<Progress>();
  auto work = [progress, n, &run]() {
    for (;;) {
      const int64_t i = progress->next.fetch_add(1, std::memory_order_relaxed);
      if (i >= n) return;
      run(i);
      progress->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t h = 0; h < helpers; ++h) {
    auto task = work;
    pool.Schedule(std::move(task));
  }
  work();
  // Wait only for items a helper claimed and is finishing. Spin briefly (an item is a few
  // microseconds); past that the helper was likely preempted on a loaded machine, so give up
  // the core instead of spinning against it.
  for (int spins = 0; progress->done.load(std::memory_order_acquire) < n; ++spins) {
    if (spins < kSpinsBeforeYield)
      cpu_relax();
    else
      std::this_thread::yield();
  }
}

}  // namespace specjax
