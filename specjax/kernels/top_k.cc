// specjax_top_k: the k largest values of each row of x and their indices, as lax.top_k:
// values descending, equal values by lower index first.
//
//   x        f32 [..., V]   (every leading index is a row; no NaN: -inf is fine)
//   attr k   (i64)          1 <= k <= V
// returns
//   values   f32 [..., k]
//   indices  s32 [..., k]
//
// Why: the drafters take the top 10 of a draft model's logits at every draft step. XLA's CPU
// backend sorts the whole row for lax.top_k (~1 ms for V = 2048), and k rounds of a max and
// a first-index min run ~80 small kernels per step (~100 us of launches). One pass over the
// row keeps a sorted list of the k best so far: a value enters when it beats the k-th (ties
// do not enter: the earlier index stays ahead), so the result is exactly the stable order.

#include "common.h"

namespace {

using namespace specjax;

void top_k_row(const float* x, int64_t V, int64_t k, float* values, int32_t* indices) {
  int64_t n = 0;
  int64_t i = 0;
  // Until the list is full every value enters; after that only one that beats the k-th.
  for (; i < V && n < k; ++i) {
    const float v = x[i];
    int64_t j = n++;
    for (; j > 0 && values[j - 1] < v; --j) {
      values[j] = values[j - 1];
      indices[j] = indices[j - 1];
    }
    values[j] = v;
    indices[j] = static_cast<int32_t>(i);
  }
  for (; i < V; ++i) {
    const float v = x[i];
    if (!(v > values[k - 1])) continue;
    int64_t j = k - 1;
    for (; j > 0 && values[j - 1] < v; --j) {
      values[j] = values[j - 1];
      indices[j] = indices[j - 1];
    }
    values[j] = v;
    indices[j] = static_cast<int32_t>(i);
  }
}

ffi::Error TopKImpl(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> values,
                    ffi::ResultBuffer<ffi::S32> indices, int64_t k) {
  const auto dims = x.dimensions();
  if (dims.size() < 1) return ffi::Error::InvalidArgument("specjax_top_k: x must have an axis");
  const int64_t V = dims.back();
  if (k < 1 || k > V) return ffi::Error::InvalidArgument("specjax_top_k: need 1 <= k <= V");
  const int64_t rows = static_cast<int64_t>(x.element_count()) / V;
  for (int64_t r = 0; r < rows; ++r)
    top_k_row(x.typed_data() + r * V, V, k, values->typed_data() + r * k,
              indices->typed_data() + r * k);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxTopK, TopKImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("k"));
