// specjax_linear: y[r, o] = sum_i x[r, i] * w[o, i], for the few activation rows of decode and
// verify steps on CPU. x is f32 [rows, in]; the weight comes packed in panels of 16 outputs,
// f16 or f32 [P, in, 16] with panels[p, i, j] = w[16 p + j, i] (zero past the last output);
// y is f32 [rows, out], out <= 16 P.
//
// Why: at one to a few dozen rows a linear layer reads its whole weight matrix to do a few
// FLOPs per weight. XLA's CPU dot runs these products on one thread and cannot read f16
// weights without first converting the whole matrix. This kernel reads f16 (half the bytes)
// or f32 weights, converts a register's width at a time, and splits the panels over XLA's
// intra-op thread pool.
//
// The panel layout makes the product an outer product: for each input i, a tile of R rows x
// NP panels loads NP x 16 weights (one stream per panel, contiguous), broadcasts each row's
// x[r, i], and accumulates R x NP x 16 outputs in registers with one FMA per weight vector
// and row. No horizontal sums, nothing reduced at the end of a tile, and a weight vector
// converted from F16 once per R rows. The earlier layout ([out, in], 16-lane partial sums per
// output, a reduction per (row, output)) ran at ~30 / ~48 GFLOP/s per core at 1 / 5 rows on
// the 2-core AMD EPYC (Zen 3) development machine, whose FMA peak is ~100; this one at ~65 /
// ~100 (a standalone harness, the target's shapes).
//
// Invariant (tested): the value of y[r, o] depends only on x[r, :] and w[o, :], not on the
// number of rows, their order, the tile shape or the thread split. Each (row, output) sum is
// one accumulator lane updated in input order i = 0, 1, ..., in - 1 (acc = acc + x w, the
// compiler contracting it to an FMA wherever it does). So a row's logits are bit-identical
// whether it is decoded alone, in a batch, or verified among draft rows.
//
// Built by specjax.cpu_kernels on first use (g++ -O3 -march=native) and loaded with ctypes.

#include "common.h"

namespace {

using namespace specjax;

constexpr int kPanel = kLanes;  // outputs per panel: 16, kParts native vectors
constexpr int kMaxTileRows = 6;
// Panels per unit of work handed between threads (and per pass of the row groups over them:
// 8 panels of a 256-wide F16 matrix are 64 KiB, which stay in L2 while the row groups of a
// many-row product reuse them).
constexpr int64_t kPanelsPerChunk = 8;
constexpr int64_t kSerialWork = int64_t(1) << 16;  // below this many MACs, no threads

// Panels per tile for R rows: accumulators (R x NP x kParts native vectors) plus the
// weight vectors and a broadcast must fit in registers (AVX2: 16, AVX-512: 32), with at
// least ~8 independent accumulators so the FMA latency is covered.
constexpr int panels_per_tile(int rows) {
#if defined(__AVX512F__)
  return rows == 1 ? 8 : rows == 2 ? 4 : rows == 3 ? 4 : 2;
#else
  return rows == 1 ? 4 : rows == 2 ? 2 : 1;
#endif
}

// Rows [0, R) of x (row stride `in`) times panels [0, NP) from `w` (panel stride in * 16);
// `n_out` (<= NP * 16) outputs are written to y (row stride `out`).
template <int R, int NP, typename W>
inline void tile(const float* x, const W* w, float* y, int64_t in, int64_t out, int64_t n_out) {
  constexpr int NV = NP * kParts;
  f32xn acc[R][NV];
#pragma GCC unroll 32
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 32
    for (int c = 0; c < NV; ++c) acc[r][c] = f32xn{};
  const int64_t panel_stride = in * kPanel;
  for (int64_t i = 0; i < in; ++i) {
    if constexpr (R == 1) {  // the broadcast first, each weight vector used as it is loaded
      const f32xn xb = broadcast(x + i);  // (all NV loaded first would spill one of them)
#pragma GCC unroll 32
      for (int c = 0; c < NV; ++c)
        acc[0][c] += xb * loadn(w + (c / kParts) * panel_stride + i * kPanel +
                                (c % kParts) * kNativeLanes);
      continue;
    }
    f32xn wv[NV];
#pragma GCC unroll 32
    for (int p = 0; p < NP; ++p)
#pragma GCC unroll 32
      for (int q = 0; q < kParts; ++q)
        wv[p * kParts + q] = loadn(w + p * panel_stride + i * kPanel + q * kNativeLanes);
#pragma GCC unroll 32
    for (int r = 0; r < R; ++r) {
      const f32xn xb = broadcast(x + r * in + i);
#pragma GCC unroll 32
      for (int c = 0; c < NV; ++c) acc[r][c] += xb * wv[c];
    }
  }
  // Vector by vector (copying a row of accumulators at once would make GCC keep them in
  // memory, storing all of them on every step of the loop above).
  const bool whole = n_out == NP * kPanel;  // else the last panel of an output count 16
  float lanes[NV * kNativeLanes];           // does not divide: through a buffer
#pragma GCC unroll 32
  for (int r = 0; r < R; ++r) {
    float* dst = whole ? y + r * out : lanes;
#pragma GCC unroll 32
    for (int c = 0; c < NV; ++c) std::memcpy(dst + c * kNativeLanes, &acc[r][c], sizeof(f32xn));
    if (!whole) std::copy(lanes, lanes + n_out, y + r * out);
  }
}

// R rows, panels [p0, p1): tiles of panels_per_tile(R) panels, then single panels.
template <int R, typename W>
void row_group(const float* x, const W* w, float* y, int64_t in, int64_t out, int64_t p0,
               int64_t p1) {
  constexpr int NP = panels_per_tile(R);
  int64_t p = p0;
  auto outputs = [&](int64_t panels) {
    return std::min<int64_t>(panels * kPanel, out - p * kPanel);
  };
  for (; p + NP <= p1; p += NP)
    tile<R, NP>(x, w + p * in * kPanel, y + p * kPanel, in, out, outputs(NP));
  for (; p < p1; ++p) tile<R, 1>(x, w + p * in * kPanel, y + p * kPanel, in, out, outputs(1));
}

// All rows, panels [p0, p1): groups of kMaxTileRows rows, then the rest.
template <typename W>
void run_panels(const float* x, const W* w, float* y, int64_t rows, int64_t in, int64_t out,
                int64_t p0, int64_t p1) {
  int64_t r = 0;
  for (; r + kMaxTileRows <= rows; r += kMaxTileRows)
    row_group<kMaxTileRows>(x + r * in, w, y + r * out, in, out, p0, p1);
  const float* xr = x + r * in;
  float* yr = y + r * out;
  switch (rows - r) {
    case 5: row_group<5>(xr, w, yr, in, out, p0, p1); break;
    case 4: row_group<4>(xr, w, yr, in, out, p0, p1); break;
    case 3: row_group<3>(xr, w, yr, in, out, p0, p1); break;
    case 2: row_group<2>(xr, w, yr, in, out, p0, p1); break;
    case 1: row_group<1>(xr, w, yr, in, out, p0, p1); break;
    default: break;
  }
}

template <typename W>
void linear(ffi::ThreadPool& pool, const float* x, const W* w, float* y, int64_t rows,
            int64_t in, int64_t out, int64_t panels) {
  const int64_t chunks = (panels + kPanelsPerChunk - 1) / kPanelsPerChunk;
  parallel_for(pool, chunks, rows * in * out < kSerialWork, [&](int64_t c) {
    const int64_t p0 = c * kPanelsPerChunk;
    run_panels(x, w, y, rows, in, out, p0, std::min(panels, p0 + kPanelsPerChunk));
  });
}

ffi::Error LinearImpl(ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, ffi::ResultBuffer<ffi::F32> y,
                      ffi::ThreadPool pool) {
  const auto w_dims = w.dimensions();
  const auto x_dims = x.dimensions();
  const auto y_dims = y->dimensions();
  if (w_dims.size() != 3 || w_dims[2] != kPanel || x_dims.size() < 1 ||
      x_dims.back() != w_dims[1] || y_dims.size() != x_dims.size() ||
      y_dims.back() > w_dims[0] * kPanel)
    return ffi::Error::InvalidArgument(
        "specjax_linear: want x [..., in], panels [P, in, 16] and y [..., out <= 16 P]");
  const int64_t in = w_dims[1], panels = w_dims[0], out = y_dims.back();
  const int64_t rows = in == 0 ? 0 : static_cast<int64_t>(x.element_count()) / in;
  if (in == 0) {
    std::fill(y->typed_data(), y->typed_data() + y->element_count(), 0.0f);
    return ffi::Error::Success();
  }
  if (w.element_type() == ffi::DataType::F16)
    linear(pool, x.typed_data(), static_cast<const _Float16*>(w.untyped_data()),
           y->typed_data(), rows, in, out, panels);
  else if (w.element_type() == ffi::DataType::F32)
    linear(pool, x.typed_data(), static_cast<const float*>(w.untyped_data()), y->typed_data(),
           rows, in, out, panels);
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
