// specjax_ngram_cache_ingest: count new stream positions into ngram-cache's per-row context
// tables (specjax/drafters/ngram_cache.py, `NgramCache.ingest`), in place.
//
//   0..13   the state (`NgramCacheState`, B rows, 4 sub-tables of N slots each):
//           keys s32[B,4,N,4]  tok, count, stamp, gs s32[B,4,N]  ng_keys s32[B,4,N,4]
//           ng_occ pred[B,4,N]  ng_sum s32[B,4,N]  ng_best s32[B,4,N,4]
//           ng_heads s32[B,4,N,13]  n_used s32[B,4]  n_dropped, cache_size, seq_start s32[B]
//   14      tokens s32[B,S]     the history
//   15, 16  length, last s32[B] the stream: tokens[0:length] + [last]
//   17      target s32[B]       count positions [cache_size, target) (target <= cache_size:
//                               the row is left as it is)
//   attrs   cap (new pairs per sub-table), max_probe, lookup (0: "speculative", n-grams
//           start at seq_start or later; 1: "lookup", at 0 or later), open_sequence (1:
//           seq_start stays, 0: it moves to target)
// returns the state (aliased to arguments 0..13).
//
// Why: the XLA version ingests blocks of positions with while loops of gathers and scatters
// over all rows and sizes: ~15 us of small kernels for one new position on the 2-core host,
// ~70 us for 64 (benchmarks/ask_cost.py), most of an ngram-cache ask. Here a position costs
// a few hash probes.
//
// The same tables as the XLA version: the same hash (`hash_words`), linear probing from the
// same home slot, the same fields. Positions are counted one at a time in stream order
// (sizes 1..4 each), where the XLA version counts a block's distinct pairs at once: slots
// can differ (which of two pairs probing into one free slot takes it), contents do not
// (counts, first stamps, bucket stamps, part sums and best members), and both are valid
// linear-probing tables for `_find_parts`. Which new pairs a full sub-table drops can
// differ too (results equal upstream only while nothing is dropped, in both).

#include "common.h"

namespace {

using namespace specjax;

constexpr int kMax = 4;       // NGRAM_MAX
constexpr int kBuckets = 13;  // _PHASE0_BUCKETS
constexpr uint32_t kSeed = 0x811C9DC5u;
constexpr uint32_t kMult = 0x9E3779B1u;
constexpr int32_t kIntMax = 2147483647;

uint32_t hash_words(const int32_t* w, int n) {
  uint32_t h = kSeed;
  for (int k = 0; k < n; ++k) h = (h ^ static_cast<uint32_t>(w[k])) * kMult;
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  return h ^ (h >> 16);
}

int32_t wrap_add(int32_t a, int32_t b) {  // int32 wrap, as upstream's int sums
  return static_cast<int32_t>(static_cast<uint32_t>(a) + static_cast<uint32_t>(b));
}

struct Tables {
  int32_t *keys, *tok, *count, *stamp, *gs, *ng_keys, *ng_sum, *ng_best, *ng_heads;
  bool* ng_occ;
  int32_t *n_used, *n_dropped, *cache_size, *seq_start;
};

// (count, gs, stamp) of a > of b, lexicographically (`_better`)
bool better(int32_t ca, int32_t ga, int32_t sa, const int32_t* b) {
  return ca > b[0] || (ca == b[0] && (ga > b[1] || (ga == b[1] && sa > b[2])));
}

// Count `tok` after n-gram `key` (4 words, -1 padded) first seen at stream position `at`,
// in sub-table `base / N` of row `row`.
void count_pair(const Tables& t, int64_t row, int64_t table, int64_t base, int64_t N,
                const int32_t* key, int32_t tok, int32_t at, int32_t cap, int64_t max_probe) {
  int32_t k5[kMax + 1] = {key[0], key[1], key[2], key[3], tok};
  const int64_t mask = N - 1;
  const int64_t home = static_cast<int64_t>(hash_words(k5, kMax + 1)) & mask;
  int64_t pos = -1;
  bool is_new = false;
  for (int64_t p = 0; p < max_probe; ++p) {
    const int64_t s = base + ((home + p) & mask);
    if (t.count[s] > 0) {
      const int32_t* k = t.keys + s * kMax;
      if (k[0] == key[0] && k[1] == key[1] && k[2] == key[2] && k[3] == key[3] && t.tok[s] == tok) {
        pos = s;
        break;
      }
      continue;
    }
    if (t.n_used[table] < cap) {  // a free slot, room left: insert
      std::memcpy(t.keys + s * kMax, key, sizeof(int32_t) * kMax);
      t.tok[s] = tok;
      t.stamp[s] = at;
      t.count[s] = 0;
      t.n_used[table] += 1;
      pos = s;
      is_new = true;
    }
    break;
  }
  if (pos < 0) {  // full sub-table or probe limit: dropped
    t.n_dropped[row] += 1;
    return;
  }
  t.count[pos] = wrap_add(t.count[pos], 1);

  // the pair's part: found or created
  const int64_t ng_home = static_cast<int64_t>(hash_words(key, kMax)) & mask;
  int64_t g = -1;
  for (int64_t p = 0; p < N; ++p) {
    const int64_t s = base + ((ng_home + p) & mask);
    if (t.ng_occ[s]) {
      const int32_t* k = t.ng_keys + s * kMax;
      if (k[0] == key[0] && k[1] == key[1] && k[2] == key[2] && k[3] == key[3]) {
        g = s;
        break;
      }
      continue;
    }
    std::memcpy(t.ng_keys + s * kMax, key, sizeof(int32_t) * kMax);
    t.ng_occ[s] = true;
    for (int b = 0; b < kBuckets; ++b) t.ng_heads[s * kBuckets + b] = kIntMax;
    t.ng_sum[s] = 0;
    for (int c = 0; c < 4; ++c) t.ng_best[s * 4 + c] = 0;
    g = s;
    break;
  }
  if (g < 0) return;  // no part slot (cannot happen: parts <= pairs <= cap < N)
  if (is_new) {
    const int32_t bucket = ((tok % kBuckets) + kBuckets) % kBuckets;
    int32_t& head = t.ng_heads[g * kBuckets + bucket];
    head = std::min(head, at);
    t.gs[pos] = head;
  }
  t.ng_sum[g] = wrap_add(t.ng_sum[g], 1);
  int32_t* best = t.ng_best + g * 4;
  if (better(t.count[pos], t.gs[pos], t.stamp[pos], best)) {
    best[0] = t.count[pos];
    best[1] = t.gs[pos];
    best[2] = t.stamp[pos];
    best[3] = tok;
  }
}

template <typename T>
T* in_place(ffi::AnyBuffer arg, ffi::Result<ffi::AnyBuffer> out) {
  // aliased: the same memory; if XLA gave a separate buffer, start from the argument's data
  void* dst = out->untyped_data();
  if (dst != arg.untyped_data()) std::memcpy(dst, arg.untyped_data(), arg.size_bytes());
  return static_cast<T*>(dst);
}

ffi::Error IngestImpl(ffi::AnyBuffer keys, ffi::AnyBuffer tok, ffi::AnyBuffer count,
                      ffi::AnyBuffer stamp, ffi::AnyBuffer gs, ffi::AnyBuffer ng_keys,
                      ffi::AnyBuffer ng_occ, ffi::AnyBuffer ng_sum, ffi::AnyBuffer ng_best,
                      ffi::AnyBuffer ng_heads, ffi::AnyBuffer n_used, ffi::AnyBuffer n_dropped,
                      ffi::AnyBuffer cache_size, ffi::AnyBuffer seq_start,
                      ffi::Buffer<ffi::S32> tokens, ffi::Buffer<ffi::S32> length,
                      ffi::Buffer<ffi::S32> last, ffi::Buffer<ffi::S32> target,
                      ffi::Result<ffi::AnyBuffer> o_keys, ffi::Result<ffi::AnyBuffer> o_tok,
                      ffi::Result<ffi::AnyBuffer> o_count, ffi::Result<ffi::AnyBuffer> o_stamp,
                      ffi::Result<ffi::AnyBuffer> o_gs, ffi::Result<ffi::AnyBuffer> o_ng_keys,
                      ffi::Result<ffi::AnyBuffer> o_ng_occ, ffi::Result<ffi::AnyBuffer> o_ng_sum,
                      ffi::Result<ffi::AnyBuffer> o_ng_best,
                      ffi::Result<ffi::AnyBuffer> o_ng_heads,
                      ffi::Result<ffi::AnyBuffer> o_n_used,
                      ffi::Result<ffi::AnyBuffer> o_n_dropped,
                      ffi::Result<ffi::AnyBuffer> o_cache_size,
                      ffi::Result<ffi::AnyBuffer> o_seq_start, int64_t cap, int64_t max_probe,
                      int64_t lookup, int64_t open_sequence) {
  const auto dims = count.dimensions();
  if (dims.size() != 3 || dims[1] != kMax)
    return ffi::Error::InvalidArgument("specjax_ngram_cache_ingest: count must be [B, 4, N]");
  if (ng_occ.element_type() != ffi::DataType::PRED)
    return ffi::Error::InvalidArgument("specjax_ngram_cache_ingest: ng_occ must be bool");
  const int64_t B = dims[0], N = dims[2];
  if (N < 1 || (N & (N - 1)) != 0)
    return ffi::Error::InvalidArgument("specjax_ngram_cache_ingest: N must be a power of two");
  const int64_t S = tokens.dimensions().back();
  Tables t{in_place<int32_t>(keys, o_keys),         in_place<int32_t>(tok, o_tok),
           in_place<int32_t>(count, o_count),       in_place<int32_t>(stamp, o_stamp),
           in_place<int32_t>(gs, o_gs),             in_place<int32_t>(ng_keys, o_ng_keys),
           in_place<int32_t>(ng_sum, o_ng_sum),     in_place<int32_t>(ng_best, o_ng_best),
           in_place<int32_t>(ng_heads, o_ng_heads), in_place<bool>(ng_occ, o_ng_occ),
           in_place<int32_t>(n_used, o_n_used),     in_place<int32_t>(n_dropped, o_n_dropped),
           in_place<int32_t>(cache_size, o_cache_size),
           in_place<int32_t>(seq_start, o_seq_start)};
  const int32_t* toks = tokens.typed_data();
  for (int64_t b = 0; b < B; ++b) {
    const int32_t c0 = t.cache_size[b], end = target.typed_data()[b];
    if (end <= c0) continue;
    const int32_t len = length.typed_data()[b], lst = last.typed_data()[b];
    auto stream_at = [&](int64_t i) -> int32_t {
      if (i == len) return lst;
      return toks[b * S + std::min<int64_t>(std::max<int64_t>(i, 0), S - 1)];
    };
    const int32_t start = lookup ? 0 : t.seq_start[b];
    for (int32_t i = c0; i < end; ++i) {
      const int32_t follower = stream_at(i);
      for (int s = 1; s <= kMax; ++s) {
        if (i < start + s) continue;  // the n-gram would start before the sequence
        int32_t key[kMax] = {-1, -1, -1, -1};
        for (int k = 0; k < s; ++k) key[k] = stream_at(i - s + k);
        const int64_t table = b * kMax + (s - 1);
        count_pair(t, b, table, table * N, N, key, follower, i, static_cast<int32_t>(cap),
                   max_probe);
      }
    }
    t.cache_size[b] = end;
    if (!open_sequence) t.seq_start[b] = end;
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxNgramCacheIngest, IngestImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // keys
                                  .Arg<ffi::AnyBuffer>()  // tok
                                  .Arg<ffi::AnyBuffer>()  // count
                                  .Arg<ffi::AnyBuffer>()  // stamp
                                  .Arg<ffi::AnyBuffer>()  // gs
                                  .Arg<ffi::AnyBuffer>()  // ng_keys
                                  .Arg<ffi::AnyBuffer>()  // ng_occ
                                  .Arg<ffi::AnyBuffer>()  // ng_sum
                                  .Arg<ffi::AnyBuffer>()  // ng_best
                                  .Arg<ffi::AnyBuffer>()  // ng_heads
                                  .Arg<ffi::AnyBuffer>()  // n_used
                                  .Arg<ffi::AnyBuffer>()  // n_dropped
                                  .Arg<ffi::AnyBuffer>()  // cache_size
                                  .Arg<ffi::AnyBuffer>()  // seq_start
                                  .Arg<ffi::Buffer<ffi::S32>>()  // tokens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // length
                                  .Arg<ffi::Buffer<ffi::S32>>()  // last
                                  .Arg<ffi::Buffer<ffi::S32>>()  // target
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("cap")
                                  .Attr<int64_t>("max_probe")
                                  .Attr<int64_t>("lookup")
                                  .Attr<int64_t>("open_sequence"));
