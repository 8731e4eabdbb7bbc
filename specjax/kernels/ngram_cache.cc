// specjax_ngram_cache_ingest: count new stream positions into ngram-cache's per-row context
// tables (specjax/drafters/ngram_cache.py, `NgramCache.ingest`), in place.
//
//   0       tokens s32[B,S]     the history
//   1, 2    length, last s32[B] the stream: tokens[0:length] + [last]
//   3       target s32[B]       count positions [cache_size, target) (target <= cache_size:
//                               the row is left as it is)
//   4..17   the state (`NgramCacheState`, B rows, 4 sub-tables of N slots each):
//           keys s32[B,4,N,4]  tok, count, stamp, gs s32[B,4,N]  ng_keys s32[B,4,N,4]
//           ng_occ pred[B,4,N]  ng_sum s32[B,4,N]  ng_best s32[B,4,N,4]
//           ng_heads s32[B,4,N,13]  n_used s32[B,4]  n_dropped, cache_size, seq_start s32[B]
//   attrs   cap (new pairs per sub-table), max_probe, lookup (0: "speculative", n-grams
//           start at seq_start or later; 1: "lookup", at 0 or later), open_sequence (1:
//           seq_start stays, 0: it moves to target)
// returns the state (aliased to arguments 4..17).
//
// Why: the XLA version ingests blocks of positions with while loops of gathers and scatters
// over all rows and sizes, most of an ngram-cache ask: 72 of 87 us at 8 new positions, 158
// of 243 us at 64, on a loaded 2-core host (benchmarks/governor.py ask's ngram-cache/counting in
// benchmarks/results/ask-cost-before.json, where each loop's first ask also counts the
// prompt; 4.7 and 9.1 us here, ask-cost-counting.json).
// Here a position costs a few hash probes.
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
// in sub-table `table` (= row * 4 + size - 1) of row `row`.
void count_pair(const Tables& t, int64_t row, int64_t table, int64_t N, const int32_t* key,
                int32_t tok, int32_t at, int32_t cap, int64_t max_probe) {
  const int64_t base = table * N;  // the sub-table's first slot
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

// The tables' element types in `NgramCacheState`'s order (ng_occ is bool, the rest int32).
constexpr int kTables = 14;
constexpr int kOcc = 6;

ffi::Error IngestImpl(ffi::Buffer<ffi::S32> tokens, ffi::Buffer<ffi::S32> length,
                      ffi::Buffer<ffi::S32> last, ffi::Buffer<ffi::S32> target,
                      ffi::RemainingArgs tables, ffi::RemainingRets outs, int64_t cap,
                      int64_t max_probe, int64_t lookup, int64_t open_sequence) {
  if (tables.size() != kTables || outs.size() != kTables)
    return ffi::Error::InvalidArgument("specjax_ngram_cache_ingest: needs the 14 tables");
  void* data[kTables];
  for (int i = 0; i < kTables; ++i) {
    auto arg = tables.get<ffi::AnyBuffer>(i);
    auto out = outs.get<ffi::AnyBuffer>(i);
    if (!arg.has_value() || !out.has_value())
      return ffi::Error::InvalidArgument("specjax_ngram_cache_ingest: a table is not a buffer");
    const auto want = i == kOcc ? ffi::DataType::PRED : ffi::DataType::S32;
    if (arg->element_type() != want)
      return ffi::Error::InvalidArgument("specjax_ngram_cache_ingest: a table's type is wrong");
    // aliased: the same memory; if XLA gave a separate buffer, start from the argument's data
    data[i] = (*out)->untyped_data();
    if (data[i] != arg->untyped_data())
      std::memcpy(data[i], arg->untyped_data(), arg->size_bytes());
  }
  const auto dims = tables.get<ffi::AnyBuffer>(2)->dimensions();  // count [B, 4, N]
  if (dims.size() != 3 || dims[1] != kMax)
    return ffi::Error::InvalidArgument("specjax_ngram_cache_ingest: count must be [B, 4, N]");
  const int64_t B = dims[0], N = dims[2];
  if (N < 1 || (N & (N - 1)) != 0)
    return ffi::Error::InvalidArgument("specjax_ngram_cache_ingest: N must be a power of two");
  const int64_t S = tokens.dimensions().back();
  auto i32 = [&](int i) { return static_cast<int32_t*>(data[i]); };
  Tables t{i32(0), i32(1), i32(2), i32(3), i32(4), i32(5), i32(7), i32(8), i32(9),
           static_cast<bool*>(data[kOcc]), i32(10), i32(11), i32(12), i32(13)};
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
        count_pair(t, b, table, N, key, follower, i, static_cast<int32_t>(cap), max_probe);
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
                                  .Arg<ffi::Buffer<ffi::S32>>()  // tokens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // length
                                  .Arg<ffi::Buffer<ffi::S32>>()  // last
                                  .Arg<ffi::Buffer<ffi::S32>>()  // target
                                  .RemainingArgs()               // the 14 tables
                                  .RemainingRets()               // the same, updated
                                  .Attr<int64_t>("cap")
                                  .Attr<int64_t>("max_probe")
                                  .Attr<int64_t>("lookup")
                                  .Attr<int64_t>("open_sequence"));
