// specjax_linear: y[r, o] = sum_i x[r, i] * w[o, i], for the few activation rows of decode and
// verify steps on CPU. x is f32 [rows, in], w is f16 or f32 [out, in] (the stored layout), y
// is f32 [rows, out].
//
// Why: at one to a few dozen rows a linear layer reads its whole weight matrix to do a few
// FLOPs per weight, so its speed is memory bandwidth. XLA's CPU dot runs these products on one
// thread and cannot read f16 weights without first converting the whole matrix. This kernel
// reads f16 (half the bytes) or f32 weights, converts a register's width at a time (16 with
// AVX-512, 8 with AVX2), and splits the outputs over XLA's intra-op thread pool.
//
// Invariant (tested): the value of y[r, o] depends only on x[r, :] and w[o, :], not on the
// number of rows, their order or the thread split. Each (row, output) sum is 16 lane-wise
// partial sums accumulated in input order, reduced by a fixed tree, plus the tail in order.
// So a row's logits are bit-identical whether it is decoded alone, in a batch, or verified
// among draft rows.
//
// Built by specjax.cpu_kernels on first use (g++ -O3 -march=native) and loaded with ctypes.

#include "common.h"

namespace {

using namespace specjax;

// A tile: OUT outputs sharing one pass over ROWS rows of x. Its accumulators (OUT x ROWS x
// kParts native vectors) must stay in registers: 4 x 4 x 1 (+ 4 of x) of AVX-512's 32.
// AVX2 has 16: 4 outputs x 1 row x 2 parts for one row, 2 x 2 x 2 (+ 4 of x) for two; for
// more rows 1 output x up to 6 rows x 2 parts (12 accumulators, 2 for the weights, x read
// from L1 by the FMAs), so a weight is loaded and converted from F16 once per 6 rows.
// Converting is what bounds a multi-row product: with 2 x 2 tiles (a conversion per 2 FMAs)
// a 5-token verify's linear layers ran at ~45% of the FMA peak, ~3x one token's time, on the
// 2-core AMD EPYC (Zen 3).
constexpr int kOutputsPerTile = 4;  // outputs per unit of the output split
#if defined(__AVX512F__)
constexpr int kRowsPerTile = 4;
constexpr int kOutputsPerRowTile = 4;
#else
constexpr int kRowsPerTile = 6;
constexpr int kOutputsPerRowTile = 1;
#endif
constexpr int64_t kTilesPerChunk = 16;  // unit of work handed between threads
constexpr int64_t kSerialWork = int64_t(1) << 16;  // below this many MACs, no threads
// Software prefetch distance. A tile reads 4 weight rows side by side, which the hardware
// prefetcher does not follow: without this the kernel waits on the cache hierarchy (measured
// 3x slower at one row on the 2-core AMD EPYC development machine); 4 KiB ahead was best there.
constexpr int64_t kPrefetchBytes = 4096;
constexpr int64_t kLine = 64;

// Outputs [o0, o0 + n_out) (n_out <= OUT) for ROWS consecutive rows of x.
template <int OUT, int ROWS, typename W>
void tile(const float* x, const W* w, float* y, int64_t in, int64_t out, int64_t o0,
          int64_t n_out, bool prefetch) {
  f32xn acc[OUT][ROWS][kParts];
  for (auto& per_output : acc)
    for (auto& per_row : per_output)
      for (auto& a : per_row) a = f32xn{};
  const W* w_row[OUT];
  for (int j = 0; j < OUT; ++j) w_row[j] = w + (o0 + (j < n_out ? j : 0)) * in;
  const int64_t in_vec = in - in % kLanes;
  // Tiles are contiguous in memory: fetch the bytes kPrefetchBytes past this tile's start,
  // spread over the loop (only on a tile's first pass; later row groups hit the cache).
  const char* ahead = reinterpret_cast<const char*>(w + o0 * in) + kPrefetchBytes;
  const char* weights_end = reinterpret_cast<const char*>(w + out * in);
  const int64_t steps = in_vec / kLanes;
  const int64_t tile_lines = (OUT * in * int64_t(sizeof(W)) + kLine - 1) / kLine;
  const int64_t lines_per_step = prefetch && steps ? (tile_lines + steps - 1) / steps : 0;
  for (int64_t i = 0; i < in_vec; i += kLanes) {
    for (int64_t l = 0; l < lines_per_step; ++l) {
      const char* line = ahead + ((i / kLanes) * lines_per_step + l) * kLine;
      if (line < weights_end) __builtin_prefetch(line);
    }
    // Lane l of a 16-lane sum takes inputs i + l: part p holds lanes p * kNativeLanes...
    f32xn xv[ROWS][kParts];
    for (int r = 0; r < ROWS; ++r)
      for (int p = 0; p < kParts; ++p) {
        xv[r][p] = loadn(x + r * in + i + p * kNativeLanes);
        if (ROWS > 1) keep_in_register(xv[r][p]);
      }
    for (int j = 0; j < OUT; ++j)
      for (int p = 0; p < kParts; ++p) {
        const f32xn wv = loadn(w_row[j] + i + p * kNativeLanes);
        for (int r = 0; r < ROWS; ++r) acc[j][r][p] += wv * xv[r][p];
      }
  }
  for (int j = 0; j < n_out; ++j)
    for (int r = 0; r < ROWS; ++r) {
      float s = reduce_parts(acc[j][r]);
      for (int64_t i = in_vec; i < in; ++i) s += to_float(w_row[j][i]) * x[r * in + i];
      y[r * out + o0 + j] = s;
    }
}

// ROWS rows of x, outputs [o0, o0 + n_out) (n_out <= kOutputsPerTile) in tiles of OUT.
template <int OUT, int ROWS, typename W>
void row_tiles(const float* x, const W* w, float* y, int64_t in, int64_t out, int64_t o0,
               int64_t n_out, bool prefetch) {
  for (int64_t h = 0; h < n_out; h += OUT)
    tile<OUT, ROWS>(x, w, y, in, out, o0 + h, std::min<int64_t>(OUT, n_out - h), prefetch);
}

// All rows, output tiles [t0, t1) of kOutputsPerTile outputs.
template <typename W>
void run_tiles(const float* x, const W* w, float* y, int64_t rows, int64_t in, int64_t out,
               int64_t t0, int64_t t1) {
  constexpr int O = kOutputsPerRowTile;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t o0 = t * kOutputsPerTile;
    const int64_t n_out = out - o0 < kOutputsPerTile ? out - o0 : kOutputsPerTile;
    int64_t r = 0;
    for (; r + kRowsPerTile <= rows; r += kRowsPerTile)
      row_tiles<O, kRowsPerTile>(x + r * in, w, y + r * out, in, out, o0, n_out, r == 0);
    const float* xr = x + r * in;
    float* yr = y + r * out;
    const bool first = r == 0;
    switch (rows - r) {  // fewer than kRowsPerTile rows left
      case 5:
        if constexpr (kRowsPerTile > 5) row_tiles<O, 5>(xr, w, yr, in, out, o0, n_out, first);
        break;
      case 4:
        if constexpr (kRowsPerTile > 4) row_tiles<O, 4>(xr, w, yr, in, out, o0, n_out, first);
        break;
      case 3:
        if constexpr (kRowsPerTile > 3) row_tiles<O, 3>(xr, w, yr, in, out, o0, n_out, first);
        break;
      case 2:  // on AVX2 2 x 2 (x held in registers) beats 1 x 2 (a conversion per 2 FMAs)
        if constexpr (kRowsPerTile > 2)
          row_tiles<O == 1 ? 2 : O, 2>(xr, w, yr, in, out, o0, n_out, first);
        break;
      case 1: tile<kOutputsPerTile, 1>(xr, w, yr, in, out, o0, n_out, first); break;
      default: break;
    }
  }
}

template <typename W>
void linear(ffi::ThreadPool& pool, const float* x, const W* w, float* y, int64_t rows,
            int64_t in, int64_t out) {
  const int64_t tiles = (out + kOutputsPerTile - 1) / kOutputsPerTile;
  const int64_t chunks = (tiles + kTilesPerChunk - 1) / kTilesPerChunk;
  parallel_for(pool, chunks, rows * in * out < kSerialWork, [&](int64_t c) {
    run_tiles(x, w, y, rows, in, out, c * kTilesPerChunk, std::min(tiles, (c + 1) * kTilesPerChunk));
  });
}

ffi::Error LinearImpl(ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, ffi::ResultBuffer<ffi::F32> y,
                      ffi::ThreadPool pool) {
  const auto w_dims = w.dimensions();
  const auto x_dims = x.dimensions();
  if (w_dims.size() != 2 || x_dims.size() < 1 || x_dims.back() != w_dims[1])
    return ffi::Error::InvalidArgument("specjax_linear: want x [..., in] and w [out, in]");
  const int64_t in = w_dims[1], out = w_dims[0];
  const int64_t rows = in == 0 ? 0 : static_cast<int64_t>(x.element_count()) / in;
  if (w.element_type() == ffi::DataType::F16)
    linear(pool, x.typed_data(), static_cast<const _Float16*>(w.untyped_data()),
           y->typed_data(), rows, in, out);
  else if (w.element_type() == ffi::DataType::F32)
    linear(pool, x.typed_data(), static_cast<const float*>(w.untyped_data()), y->typed_data(),
           rows, in, out);
  else
    return ffi::Error::InvalidArgument("specjax_linear: weights must be f16 or f32");
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxLinear, LinearImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ctx<ffi::ThreadPool>());
