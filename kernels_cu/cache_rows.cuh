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

    // The pages of a thread's N rows of one tile (keys n, n + STEP, ...), read from the table a
    // tile ahead of their copies: the kernel fetches the next tile's while the copies of this one
    // are issued, so the table read's latency never stands between a tile and its cp.async (read
    // just before them, it had made paged caches 5-9% slower than contiguous ones; walking the
    // pages with a branch per row, 15%). Only entries of keys below seqlen_k are read: those past
    // a sequence's pages may hold anything, and its table row may end there.
    template <int N>
    struct Pages {
        int id[PAGED ? N : 1];
    };
    template <int N, int STEP>
    __device__ __forceinline__ void fetch(Pages<N>& pages, int n, int seqlen_k) const {
        if constexpr (PAGED) {
#pragma unroll
            for (int i = 0; i < N; ++i) {
                const int key = n + i * STEP;
                pages.id[i] = key < seqlen_k ? __ldg(table + page.div(key)) : 0;
            }
        }
    }
    // Element offsets of key n's row in K and V; `page_id` its page (PAGED).
    __device__ __forceinline__ void offsets(int n, int page_id, i64& k_off, i64& v_off) const {
        int slot = n;
        if constexpr (PAGED) slot = n - page.div(n) * page.divisor;
        else page_id = row;
        k_off = page_id * k_page + slot * k_row + k_head;
        v_off = page_id * v_page + slot * v_row + v_head;
    }
};

// The copy layout of a K/V tile of ROWS x DIM on NTHREADS threads: thread t copies chunk column
// t % CHUNKS of rows t / CHUNKS + i ROW_STEP.
template <int ROWS, int DIM, int NTHREADS>
struct CacheTileCopy {
    static constexpr int CHUNKS = DIM / 8;
    static constexpr int ROW_STEP = NTHREADS / CHUNKS;
    static constexpr int ROWS_PER_THREAD = ROWS / ROW_STEP;
    static_assert(NTHREADS % CHUNKS == 0 && ROWS % ROW_STEP == 0, "tile chunks must divide evenly among the threads");
    static __device__ __forceinline__ int row0(int thread) { return thread / CHUNKS; }
};

// Issues the copies of keys [n0, n0 + ROWS) of K and V into swizzled shared tiles, spread over
// NTHREADS threads (`thread` the caller's index) as CacheTileCopy lays them out, `pages` the
// thread's rows' pages (CacheKeys::fetch); keys >= seqlen_k and columns >= headdim are zero-filled.
template <int ROWS, int DIM, int NTHREADS, bool PAGED, typename T, class Pages>
__device__ __forceinline__ void cp_async_cache_rows(u32 k_tile, u32 v_tile, const T* k, const T* v,
                                                    const CacheKeys<PAGED>& keys, const Pages& pages, int n0,
                                                    int seqlen_k, int headdim, int thread) {
    typedef CacheTileCopy<ROWS, DIM, NTHREADS> Copy;
    const int row0 = Copy::row0(thread), chunk = thread % Copy::CHUNKS;
    const bool column = chunk * 8 < headdim;
#pragma unroll
    for (int i = 0; i < Copy::ROWS_PER_THREAD; ++i) {
        const int r = row0 + i * Copy::ROW_STEP;
        const bool valid = column && n0 + r < seqlen_k;
        i64 k_off = 0, v_off = 0;
        if (valid) keys.offsets(n0 + r, pages.id[PAGED ? i : 0], k_off, v_off);
        const u32 dst = swizzled_offset<DIM>(r, chunk);
        cp_async_16(k_tile + dst, k + k_off + chunk * 8, valid);
        cp_async_16(v_tile + dst, v + v_off + chunk * 8, valid);
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
