// Where the rows of a KV-cache forward come from (flash_fwd_kvcache_mma.cu): the packed query
// rows of one kv head, and the keys of one sequence in a contiguous or paged cache, with the
// cp.async loaders that gather them into swizzled shared tiles row by row.
#pragma once

#include "mma.cuh"
#include "params.cuh"

namespace cf {

// A sequence's problem as the score policies (score.cuh) see it: the call's variant values and
// this sequence's own lengths (ScoreFn's ALiBi diagonal is seqlen_k - seqlen_q of the sequence).
struct SequenceProblem {
    const VariantArgs& variant;
    int seqlen_q, seqlen_k;
};

// The query rows of a CTA: the (query, head) pairs of one kv head, the head fastest. Packed row r
// is query r / group of query head head_kv * group + r % group, so consecutive rows share a query
// (and its mask row) and the GQA group's heads share every K/V tile.
struct PackedRows {
    int group, rows, head_kv;  // rows = seqlen_q * group
    __device__ __forceinline__ int query(int r) const { return min(r, rows - 1) / group; }
    __device__ __forceinline__ int head(int r) const { return head_kv * group + min(r, rows - 1) % group; }
};

// The keys of one sequence in a cache (CacheFwdParams' block table) for head head_kv: key n's
// row is slot n % page_size of page table[n / page_size] (PAGED), or slot n of the sequence's
// cache row (its one table entry). Offsets in elements, 64-bit.
template <bool PAGED>
struct CacheKeys {
    const int* table;  // the sequence's row of the block table
    FastDivmod page;
    i64 k_page, k_row, v_page, v_row;  // strides in elements
    i64 k_head, v_head;                // offsets of head head_kv
    int row;                           // !PAGED: the sequence's cache row

    template <class Params>
    __device__ __forceinline__ CacheKeys(const Params& p, int batch, int head_kv)
        : table(p.block_table + batch * p.block_table_stride), page(p.page),
          k_page(p.k.batch_stride), k_row(p.k.row_stride), v_page(p.v.batch_stride), v_row(p.v.row_stride),
          k_head(head_kv * p.k.head_stride), v_head(head_kv * p.v.head_stride), row(PAGED ? 0 : __ldg(table)) {}

    // A walk over keys n, n + STEP, n + 2 STEP, ... (one thread's rows of a tile): one division at
    // the start, then a page is looked up only where the walk enters it, so a thread's 8 rows of a
    // 64-key tile cost one table read at 256 tokens per page and 4 at 16, where a division and a
    // read per row had made paged caches 6-9% slower than contiguous ones. Table entries are read
    // only for keys below seqlen_k (the entries past a sequence's pages may hold anything and the
    // row may end there).
    template <int STEP>
    struct Walk {
        const CacheKeys& keys;
        int n, index, slot, page_id;

        __device__ __forceinline__ Walk(const CacheKeys& keys_, int n_, int seqlen_k) : keys(keys_), n(n_) {
            if constexpr (PAGED) {
                index = keys.page.div(n);
                slot = n - index * keys.page.divisor;
                page_id = n < seqlen_k ? __ldg(keys.table + index) : 0;
            } else {
                index = 0;
                slot = n;
                page_id = keys.row;
            }
        }
        __device__ __forceinline__ i64 k_offset() const { return page_id * keys.k_page + slot * keys.k_row + keys.k_head; }
        __device__ __forceinline__ i64 v_offset() const { return page_id * keys.v_page + slot * keys.v_row + keys.v_head; }
        __device__ __forceinline__ void advance(int seqlen_k) {
            n += STEP;
            slot += STEP;
            if constexpr (PAGED) {
                const int size = keys.page.divisor;
                if (slot >= size) {
                    if (STEP < size) {
                        slot -= size;
                        ++index;
                    } else {
                        const int pages = keys.page.div(slot);
                        index += pages;
                        slot -= pages * size;
                    }
                    if (n < seqlen_k) page_id = __ldg(keys.table + index);
                }
            }
        }
    };
};

// Issues the copies of keys [n0, n0 + ROWS) of K and V into swizzled shared tiles, spread over
// NTHREADS threads (`thread` the caller's index); keys >= seqlen_k and columns >= headdim are
// zero-filled. Each thread copies one chunk column of ROWS / ROW_STEP rows, n0 + row0 + i ROW_STEP,
// walking them with one CacheKeys::Walk for both tiles.
template <int ROWS, int DIM, int NTHREADS, bool PAGED, typename T>
__device__ __forceinline__ void cp_async_cache_rows(u32 k_tile, u32 v_tile, const T* k, const T* v,
                                                    const CacheKeys<PAGED>& keys, int n0, int seqlen_k,
                                                    int headdim, int thread) {
    constexpr int CHUNKS = DIM / 8;
    constexpr int ROW_STEP = NTHREADS / CHUNKS;
    static_assert(NTHREADS % CHUNKS == 0 && ROWS % ROW_STEP == 0, "tile chunks must divide evenly among the threads");
    const int row0 = thread / CHUNKS, chunk = thread % CHUNKS;
    const bool column = chunk * 8 < headdim;
    typename CacheKeys<PAGED>::template Walk<ROW_STEP> walk(keys, n0 + row0, seqlen_k);
#pragma unroll
    for (int i = 0; i < ROWS / ROW_STEP; ++i) {
        const int r = row0 + i * ROW_STEP;
        const bool valid = column && walk.n < seqlen_k;
        const u32 dst = swizzled_offset<DIM>(r, chunk);
        cp_async_16(k_tile + dst, valid ? k + walk.k_offset() + chunk * 8 : k, valid);
        cp_async_16(v_tile + dst, valid ? v + walk.v_offset() + chunk * 8 : v, valid);
        if (i + 1 < ROWS / ROW_STEP) walk.advance(seqlen_k);
    }
}

// The packed query rows [m0, m0 + ROWS) of kv head rows.head_kv (PackedRows) into a swizzled
// shared tile; rows past the packed rows and columns >= headdim are zero-filled.
template <int ROWS, int DIM, int NTHREADS, typename T>
__device__ __forceinline__ void cp_async_packed_rows(u32 tile, const TensorRows& q, int batch, const PackedRows& rows,
                                                     int m0, int headdim, int thread) {
    constexpr int CHUNKS = DIM / 8;
    constexpr int ROW_STEP = NTHREADS / CHUNKS;
    static_assert(NTHREADS % CHUNKS == 0 && ROWS % ROW_STEP == 0, "tile chunks must divide evenly among the threads");
    const int row0 = thread / CHUNKS, chunk = thread % CHUNKS;
    const T* base = static_cast<const T*>(q.data);
#pragma unroll
    for (int i = 0; i < ROWS / ROW_STEP; ++i) {
        const int r = row0 + i * ROW_STEP;
        const bool valid = chunk * 8 < headdim && m0 + r < rows.rows;
        const T* src = valid ? q.row<const T>(batch, rows.query(m0 + r), rows.head(m0 + r)) + chunk * 8 : base;
        cp_async_16(tile + swizzled_offset<DIM>(r, chunk), src, valid);
    }
}

}  // namespace cf
