// The mask policy of every live kernel: which (query i, key j) pairs are visible, and from that
// the key blocks a query block visits (forward, dQ), the query blocks a key block visits (dK/dV),
// which visited blocks need element masking, and the order of query blocks for load balance.
// Kernels take the policy as a template argument and ask it; none works out a range itself.
// Python twin: cupyflash/masks.py (same answers, checked against a brute-force element mask).
//
// A policy is a band of S around the bottom-right diagonal: with diag = seqlen_k - seqlen_q,
//   query i sees key j  iff  j < seqlen_k,  i + lo_off <= j (LEFT),  j <= i + hi_off (RIGHT),
// lo_off = diag - window_left and hi_off = diag + window_right. NoMask has neither bound, Causal
// the right one with window_right = 0 known at compile time, Local both at run time (a side the
// caller leaves unbounded, window -1, gets an offset no index reaches). The bounds reach a kernel
// as window_left and window_right of its Params struct (params.cuh); NoMask and Causal ignore them.
//
// Block ranges are of keys (or queries) as indices, half-open; a kernel visits the blocks that
// hold them and no others, so key blocks outside the window are never loaded. A row of a visited
// block may see none of its keys (its running maximum stays -inf): online_softmax.cuh and the
// backward's lse_base_log2 keep such rows at 0 rather than NaN.
//
// To add a variant: a new policy type here (its bounds and its element test), its twin in
// cupyflash/masks.py (with its entry in KINDS, which the launchers compile), the API argument
// that selects it, and its cases in tests/test_masks.py (docs/algorithm.md, "Mask policy").
// A variant that changes scores rather than the band (softcap, ALiBi, sinks) is a score policy
// (score.cuh) that a band carries as its Score: WithScore<Causal, ScoreMod<...>>; the plain
// bands carry NoScore.
#pragma once

#include "score.cuh"

namespace cf {

// Offset of an unbounded side: beyond every index (seqlens stay below 2^29).
constexpr int MASK_UNBOUNDED = 1 << 30;

template <bool LEFT, bool RIGHT>
struct Band {
    static constexpr bool HAS_LEFT = LEFT, HAS_RIGHT = RIGHT;
    // Whether the right bound is the diagonal (hi_off = seqlen_k - seqlen_q): no pair the band keeps
    // lies right of it, so ALiBi's |i + sk - sq - j| is that distance itself (score.cuh's
    // transform_scaled). Causal's answer; WithScore and Packed inherit it.
    static constexpr bool RIGHT_IS_DIAGONAL = false;
    static constexpr bool HAS_BLOCK_MAP = false;  // WithScore with a user mask: narrower ranges
    static constexpr bool PACKED = false;         // Packed<...>: a varlen batch (below)
    typedef NoScore Score;  // WithScore replaces it
    int seqlen_q, seqlen_k;
    int lo_off, hi_off;  // query i sees keys [i + lo_off, i + hi_off] (where the bound applies)

    // --- elements -------------------------------------------------------------------------
    __device__ __forceinline__ bool visible(int i, int j) const {
        return i < seqlen_q && j < seqlen_k && (!RIGHT || j <= i + hi_off) && (!LEFT || j >= i + lo_off);
    }
    // Whether row i must not see key j, for rows that exist or are never stored.
    __device__ __forceinline__ bool hides(int i, int j) const {
        return j >= seqlen_k || (RIGHT && j > i + hi_off) || (LEFT && j < i + lo_off);
    }
    // Keys of row i that its bounds allow: [row_key_begin(i), row_key_end(i)).
    __device__ __forceinline__ int row_key_end(int i) const {
        return RIGHT ? min(seqlen_k, i + 1 + hi_off) : seqlen_k;
    }
    __device__ __forceinline__ int row_key_begin(int i) const { return LEFT ? i + lo_off : 0; }
    // First query of key row j that its right bound allows (S^T; the left one ends the range).
    __device__ __forceinline__ int row_query_begin(int j) const { return RIGHT ? j - hi_off : 0; }

    // Element test of a fragment at a fixed origin (query i0, key j0): the origin's part once,
    // then one compare per bound for each offset (di, dj) known after unrolling.
    struct Origin {
        int keys_left, queries_left;  // seqlen_k - j0, seqlen_q - i0
        int hi_slack, lo_slack;       // i0 + hi_off - j0, i0 + lo_off - j0
    };
    __device__ __forceinline__ Origin origin(int i0, int j0) const {
        return {seqlen_k - j0, seqlen_q - i0, i0 + hi_off - j0, i0 + lo_off - j0};
    }
    __device__ __forceinline__ bool hidden(const Origin& o, int di, int dj) const {
        return dj >= o.keys_left || di >= o.queries_left || (RIGHT && dj - di > o.hi_slack) ||
               (LEFT && dj - di < o.lo_slack);
    }
    // The left bound's part of hidden() alone: kernels that hold per-row bounds for the other
    // sides add the window's with one register (lo_slack) instead of one per row.
    __device__ __forceinline__ bool hidden_left(const Origin& o, int di, int dj) const {
        return LEFT && dj - di < o.lo_slack;
    }

    // --- S: the keys of query rows [m0, m0 + rows) ------------------------------------------
    // Visible to some row: [key_begin, key_end) (empty when key_begin >= key_end).
    __device__ __forceinline__ int key_begin(int m0) const { return LEFT ? max(0, m0 + lo_off) : 0; }
    __device__ __forceinline__ int key_end(int m0, int rows) const {
        return RIGHT ? min(seqlen_k, max(0, m0 + rows + hi_off)) : seqlen_k;
    }
    // Visible to every row, as far as the bounds go: keys [key_full_begin, key_full_end).
    __device__ __forceinline__ int key_full_begin(int m0, int rows) const {
        return LEFT ? m0 + rows - 1 + lo_off : 0;
    }
    __device__ __forceinline__ int key_full_end(int m0) const {
        return RIGHT ? min(seqlen_k, max(0, m0 + 1 + hi_off)) : seqlen_k;
    }
    // Whether keys [n0, n0 + cols) need the element mask for these rows (rows past seqlen_q
    // are not asked about: the forward never stores them).
    __device__ __forceinline__ bool keys_partial(int m0, int rows, int n0, int cols) const {
        return n0 + cols > key_full_end(m0) || (LEFT && n0 < key_full_begin(m0, rows));
    }

    // --- S^T: the queries of key rows [n0, n0 + cols) ---------------------------------------
    __device__ __forceinline__ int query_begin(int n0) const { return RIGHT ? max(0, n0 - hi_off) : 0; }
    __device__ __forceinline__ int query_end(int n0, int cols) const {
        return LEFT ? min(seqlen_q, max(0, min(n0 + cols, seqlen_k) - lo_off)) : seqlen_q;
    }

    // Whether some (i, j) of the block [m0, m0 + rows) x [n0, n0 + cols) is hidden.
    __device__ __forceinline__ bool partial(int m0, int rows, int n0, int cols) const {
        return m0 + rows > seqlen_q || n0 + cols > seqlen_k || (RIGHT && n0 + cols - 1 > m0 + hi_off) ||
               (LEFT && n0 < m0 + rows - 1 + lo_off);
    }
    // The band's answers alone, whatever the score policy: for a kernel at its register limit that
    // keeps a user mask's predicate on every block (its score origins take no block answer), so
    // it does not pay for WithScore's map_full (perf log mask-whole-blocks).
    __device__ __forceinline__ bool band_partial(int m0, int rows, int n0, int cols) const {
        return Band::partial(m0, rows, n0, cols);
    }
    __device__ __forceinline__ bool band_keys_partial(int m0, int rows, int n0, int cols) const {
        return Band::keys_partial(m0, rows, n0, cols);
    }

    // --- load balance -----------------------------------------------------------------------
    // Query block of grid index `block` of `blocks`: with a right bound later query blocks see
    // more keys, so they are handed out first.
    __device__ __forceinline__ static int query_block(int block, int blocks) {
        return RIGHT ? blocks - 1 - block : block;
    }
};

struct NoMask : Band<false, false> {
    __device__ __forceinline__ NoMask(int seqlen_q_, int seqlen_k_, int, int)
        : Band{seqlen_q_, seqlen_k_, 0, 0} {}
};

struct Causal : Band<false, true> {
    static constexpr bool RIGHT_IS_DIAGONAL = true;
    __device__ __forceinline__ Causal(int seqlen_q_, int seqlen_k_, int, int)
        : Band{seqlen_q_, seqlen_k_, 0, seqlen_k_ - seqlen_q_} {}
};

struct Local : Band<true, true> {
    __device__ __forceinline__ Local(int seqlen_q_, int seqlen_k_, int window_left, int window_right)
        : Band{seqlen_q_, seqlen_k_,
               window_left < 0 ? -MASK_UNBOUNDED : seqlen_k_ - seqlen_q_ - window_left,
               window_right < 0 ? MASK_UNBOUNDED : seqlen_k_ - seqlen_q_ + window_right} {}
};

// A band with the score policy S (score.cuh): the band's answers, S's transforms. With a user
// mask (S::HAS_BLOCK_MAP) the block ranges are also the block map's (modifier.cuh's ModArgs), so
// a document mask costs what its visible blocks cost: a query block visits only the keys from
// the first one its rows may see to the last, a key block only such queries. The map is kept
// per granule of rows (columns), not per kernel tile, so one map serves every kernel: entry r
// holds the smallest first visible key of granules r, r + 1, ... (a suffix minimum) and the
// largest end of granules 0..r (a prefix maximum). A block's range is then one read at its
// first granule and one at its last, exact where the visible keys move forward with the query
// (documents, causal, windows, prefix-LM) and wider, never narrower, elsewhere.
//
// The mask's own predicate is applied by the score's transform (UserScoreFn) on the blocks that
// need it: a block is partial when the band's bounds cross it or when the map does not hold it
// full, every pair of it kept (FlexAttention's full blocks). The map's full ranges are per
// granule, raw (no fold: a granule without a full block would empty every later one): each
// entry's longest run of granules whose every pair the mask keeps, and the intersections of the
// runs over aligned groups of 2, 4 and 8 granules (modifier.cuh's MAP_LEVELS), so that a CTA's
// fixed tile reads the run of all its granules with one load: a query CTA (forward, dQ) the key
// runs of its query granules, per query head; a key CTA (dK/dV) the query runs of its key
// granules, per kv head (the intersection over its group).
// Which one a CTA is, cta_mask's CtaRows says. The kernels pass partial() (or keys_partial())
// to the score's origin(), so a full block's elements never evaluate the predicate.
template <class Band_, class S>
struct WithScore : Band_ {
    typedef S Score;
    static constexpr bool HAS_BLOCK_MAP = S::HAS_BLOCK_MAP;
    const int* key_blocks = nullptr;    // this (batch, query head)'s [query granule][4]
    const int* query_blocks = nullptr;  // this (batch, kv head)'s [key granule][4]
    int rows_per_granule = 1, keys_per_granule = 1;
    bool key_cta = false;  // the CTA's fixed tile is of keys (dK/dV), not of queries

    __device__ __forceinline__ WithScore(int seqlen_q_, int seqlen_k_, int window_left, int window_right)
        : Band_(seqlen_q_, seqlen_k_, window_left, window_right) {}

    __device__ __forceinline__ void bind_blocks(const ModArgs& t, int batch, int head, bool key_cta_) {
        key_blocks = t.key_blocks + batch * t.key_blocks_batch_stride + head * t.key_blocks_head_stride;
        query_blocks = t.query_blocks + batch * t.query_blocks_batch_stride + head * t.query_blocks_head_stride;
        rows_per_granule = t.block_m;
        keys_per_granule = t.block_n;
        key_cta = key_cta_;
    }

    __device__ __forceinline__ int key_begin(int m0) const {
        const int band = Band_::key_begin(m0);
        if constexpr (!HAS_BLOCK_MAP) return band;
        else return max(band, __ldg(key_blocks + MAP_ENTRY * (m0 / rows_per_granule)) * keys_per_granule);
    }
    __device__ __forceinline__ int key_end(int m0, int rows) const {
        const int band = Band_::key_end(m0, rows);
        if constexpr (!HAS_BLOCK_MAP) return band;
        else {
            const int last = (min(m0 + rows, Band_::seqlen_q) - 1) / rows_per_granule;
            return max(key_begin(m0), min(band, __ldg(key_blocks + MAP_ENTRY * last + 1) * keys_per_granule));
        }
    }
    __device__ __forceinline__ int query_begin(int n0) const {
        const int band = Band_::query_begin(n0);
        if constexpr (!HAS_BLOCK_MAP) return band;
        else return max(band, __ldg(query_blocks + MAP_ENTRY * (n0 / keys_per_granule)) * rows_per_granule);
    }
    __device__ __forceinline__ int query_end(int n0, int cols) const {
        const int band = Band_::query_end(n0, cols);
        if constexpr (!HAS_BLOCK_MAP) return band;
        else {
            const int last = (min(n0 + cols, Band_::seqlen_k) - 1) / keys_per_granule;
            return max(query_begin(n0), min(band, __ldg(query_blocks + MAP_ENTRY * last + 1) * rows_per_granule));
        }
    }

    // Whether the map holds the block [m0, m0 + rows) x [n0, n0 + cols) full. Only asked where
    // the band's bounds do not cross it, so its keys lie inside the sequence (its rows too, but
    // for keys_partial's last block, whose level-k run holds the granules up to the end). The CTA's fixed tile
    // (queries in a query CTA, keys in a key CTA) is 2^k granules at a multiple of its size in
    // every kernel: one load of its level-k run (the sizes are constants once inlined, so the
    // level is too); any other tile is not held full (the predicate runs: slower, not wrong).
    __device__ __forceinline__ bool map_full(int m0, int rows, int n0, int cols) const {
        const int fixed0 = key_cta ? n0 : m0, count = key_cta ? cols : rows;
        const int lo = key_cta ? m0 : n0, other = key_cta ? rows : cols;
        const int granules = count / MAP_GRANULE;
        const int level = 31 - __clz(max(granules, 1));
        if (count % MAP_GRANULE != 0 || (1 << level) != granules || level >= MAP_LEVELS || fixed0 % count != 0)
            return false;
        const int* table = key_cta ? query_blocks : key_blocks;
        const int2 run = __ldg(reinterpret_cast<const int2*>(table + MAP_ENTRY * (fixed0 / MAP_GRANULE) + 2 + 2 * level));
        return lo >= run.x * MAP_GRANULE && lo + other <= run.y * MAP_GRANULE;
    }

    // The band's answers, and partial wherever the map does not hold the block full.
    // (keys_partial leaves rows past seqlen_q out, as the band's does: the runs count the pairs
    // past the ends as kept, and the forward never stores those rows.)
    __device__ __forceinline__ bool keys_partial(int m0, int rows, int n0, int cols) const {
        if constexpr (!HAS_BLOCK_MAP) return Band_::keys_partial(m0, rows, n0, cols);
        else return Band_::keys_partial(m0, rows, n0, cols) || !map_full(m0, rows, n0, cols);
    }
    __device__ __forceinline__ bool partial(int m0, int rows, int n0, int cols) const {
        if constexpr (!HAS_BLOCK_MAP) return Band_::partial(m0, rows, n0, cols);
        else return Band_::partial(m0, rows, n0, cols) || !map_full(m0, rows, n0, cols);
    }
};

// Which tile a CTA holds fixed while it walks the other axis: its query rows (the forwards, dQ)
// or its key rows (dK/dV, and the fused backwards whose CTA is a key block). The block map's
// full runs are read along the fixed tile's granules (WithScore::map_full).
enum class CtaRows { QUERIES, KEYS };

// The policy of the calling CTA: the band's bounds from p and, with a user mask, the block map of
// the CTA's (batch, head): its sequence (cta_sequence's seq.index: blockIdx.z, unless a packed
// batch is issued in another order) and blockIdx.y in every attention kernel, the query head in
// the forward and dQ grids, the kv head in the dK/dV grids, which is the head each of the map's
// two tables is kept by.
template <class Mask, CtaRows ROWS, class Params>
__device__ __forceinline__ Mask cta_mask(const Params& p, int sequence, int seqlen_q, int seqlen_k) {
    Mask mask(seqlen_q, seqlen_k, p.window_left, p.window_right);
    if constexpr (Mask::HAS_BLOCK_MAP) mask.bind_blocks(p.variant.mods, sequence, blockIdx.y, ROWS == CtaRows::KEYS);
    return mask;
}

// --- the sequences of a call --------------------------------------------------------------
// A dense batch: sequence b is batch b of every tensor, each of the call's seqlen_q x seqlen_k.
// A packed batch (flash_attn_varlen_func; the policy Packed<Band>): the tensors are one batch of
// total_q query and total_k key rows (the Params' seqlen_q and seqlen_k), and sequence b is rows
// cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1 of q (keys likewise), its own attention problem with
// its own bottom-right diagonal. Every (batch, nheads, seqlen_q) buffer (lse, D) is then
// flash-attn's varlen (nheads, total_q). The grid's z is the sequence, its x covers the longest
// sequence (max_seqlen), and a CTA whose block lies past its sequence's end leaves at once.
//
// A kernel asks the policy for its CTA's sequence once, cta_sequence<Mask>(p, b), and then reads
// every length from it, offsets every row index by it and builds its mask and score from it; for
// a dense batch the answers are the Params' fields and zero offsets, known to the compiler, so
// the dense kernels are what they were without it.
//
// User modifiers see a sequence as a dense batch entry: b is the sequence, q_idx and kv_idx count
// from its first row (the score policy is built from the sequence's problem), and a mask's block
// map is made for (sequences, heads, max_seqlen_q, max_seqlen_k) (cupyflash/varlen.py), so
// cta_mask's (sequence, head) is the sequence's map and its granules count from the sequence's
// first row too. A sequence shorter than the longest reads only its own granules.
template <class Mask_>
struct Packed : Mask_ {
    static constexpr bool PACKED = true;
    using Mask_::Mask_;
};

// A sequence's problem as the score policies (score.cuh) see it: the call's variant values and
// this sequence's own lengths (ScoreFn's ALiBi diagonal is seqlen_k - seqlen_q of the sequence).
struct SequenceProblem {
    const VariantArgs& variant;
    int seqlen_q, seqlen_k;
};

struct SequenceRows {
    int index;             // b: the sequence (ALiBi's slope row, the block map's and dropout's batch)
    int batch;             // the tensors' batch of it (b dense, 0 packed)
    int q_begin, k_begin;  // its first query and key row in that batch (0 dense)
    int seqlen_q, seqlen_k;

    // Index of (head, query r of the sequence) in a (batch, nheads, rows) statistics buffer of the
    // call (lse, D, rows = p.seqlen_q).
    template <class Params>
    __device__ __forceinline__ i64 stat(const Params& p, int head, int r) const {
        return ((i64)batch * p.nheads + head) * p.seqlen_q + q_begin + r;
    }
    template <class Params>
    __device__ __forceinline__ SequenceProblem problem(const Params& p) const {
        return {p.variant, seqlen_q, seqlen_k};
    }
};

// The grid issues its z slots in order, so a packed batch in batch order can leave its longest
// sequence's CTAs for last, a tail the other SMs wait out; the host may sort the sequences, most
// (query, key) pairs first (cupyflash/varlen.py's issue_order), and slot z then runs sequence
// sequence_order[z]. Only the issue order changes: every sequence's work and result are the same.
template <class Mask, class Params>
__device__ __forceinline__ SequenceRows cta_sequence(const Params& p, int slot) {
    if constexpr (Mask::PACKED) {
        const int b = p.sequence_order ? __ldg(p.sequence_order + slot) : slot;
        const int q0 = __ldg(p.cu_seqlens_q + b), k0 = __ldg(p.cu_seqlens_k + b);
        return {b, 0, q0, k0, __ldg(p.cu_seqlens_q + b + 1) - q0, __ldg(p.cu_seqlens_k + b + 1) - k0};
    } else {
        return {slot, slot, 0, 0, p.seqlen_q, p.seqlen_k};
    }
}

// What a score policy (score.cuh) is built from: a packed sequence's own problem, or p itself for
// a dense batch (seq.problem(p) holds the same values, yet dense ALiBi and user-score instances
// came out with other code: up to 14 registers more or fewer in flash_bwd_dq_simt, and 8 bytes of
// spills in flash_fwd_mma d64 with the compile check's user modifiers at sm_80).
template <class Mask, class Params>
__device__ __forceinline__ decltype(auto) score_problem(const Params& p, const SequenceRows& seq) {
    if constexpr (Mask::PACKED) return seq.problem(p);
    else return (p);
}

// What a forward CTA of the kernels that pre-scale Q (scores in log2 units: flash_fwd_simt,
// flash_fwd_dmma) asks the policies once: its sequence, mask and score policy (unit ln 2), and its
// first query row. A CTA with past_end() (a block past a packed sequence's end) leaves at once.
template <class Mask, typename A>
struct Log2ForwardCta {
    SequenceRows seq;
    A scale_log2;
    Mask mask;
    ScoreOf<Mask, A> score;
    int head, head_kv, m0;

    template <class Params>
    __device__ __forceinline__ Log2ForwardCta(const Params& p, int block_m)
        : seq(cta_sequence<Mask>(p, blockIdx.z)),
          scale_log2(scale_log2_in<A>(p)),
          mask(cta_mask<Mask, CtaRows::QUERIES>(p, seq.index, seq.seqlen_q, seq.seqlen_k)),
          score(score_problem<Mask>(p, seq), seq.index, blockIdx.y, A(0.6931471805599453094172321)),
          head(blockIdx.y),
          head_kv(head / p.group),
          m0(Mask::query_block(blockIdx.x, gridDim.x) * block_m) {}

    __device__ __forceinline__ bool past_end() const { return Mask::PACKED && m0 >= seq.seqlen_q; }
};

// Whether the policy hides pairs inside both sequences: a bound (causal, a window) or a user mask's
// map. Without either, a block is partial only where it crosses a sequence's end, so a kernel that
// keeps a second, unmasked copy of its element step for whole blocks gains nothing by it and pays
// in code and registers (perf log tf32-bwd-whole-blocks: 0.94-0.95x the unmasked dK/dV).
template <class Mask>
__device__ __forceinline__ constexpr bool hides_inside_sequences() {
    return Mask::HAS_LEFT || Mask::HAS_RIGHT || Mask::HAS_BLOCK_MAP;
}

// The policy of a sequence with lengths of its own (a KV cache's sequence: seqlen_k from the
// cache's seqlens_k), the band's bounds from p. No block map: a user mask's map is made per call
// for one (seqlen_q, seqlen_k), not per sequence.
template <class Mask, class Params>
__device__ __forceinline__ Mask sequence_mask(const Params& p, int seqlen_q, int seqlen_k) {
    static_assert(!Mask::HAS_BLOCK_MAP, "a block map is made for one dense problem, not per sequence");
    return Mask(seqlen_q, seqlen_k, p.window_left, p.window_right);
}

// cta_sequence's policy for a kernel that needs a sequence's rows but no mask (a dense or a packed
// batch, nothing else): flash_bwd_split_kv_tf32.
template <bool PACKED_>
struct SequencesOnly {
    static constexpr bool PACKED = PACKED_;
};

}  // namespace cf
