// Where the rows of a KV-cache forward come from (flash_fwd_kvcache_mma.cu): the packed query
// rows of one kv head, and the keys of one sequence in a contiguous or paged cache, with the
// cp.async loaders that gather them into swizzled shared tiles row by row.
#pragma once

#include "mask.cuh"
#include "mma.cuh"
#include "params.cuh"

namespace cf {


// The query rows of a CTA: the (query, head) pairs of one kv head, the head fastest. Packed row r
// is query r / group of query head head_kv * group + r % group, so consecutive rows share a query
// (and its mask row) and the GQA group's heads share every K/V tile.
struct PackedRows {
    int group, rows, head_kv;  // rows = seqlen_q * group
    __device__ __forceinline__ int query(int r) const { return min(r, rows - 1) / group; }
    __device__ __forceinline__ int head(int r) const { return head_kv * group + min(r, rows - 1) % group; }
};

// The keys of one sequence in a cache (CacheFwdParams' block table): element offsets of key n's
// row in K and in V (head head_kv). PAGED: through the table, one division (a multiply-high) and
// one read per row; otherwise the sequence is one cache row (its table entry), key n its slot n.
// Tried on the H200 and slower (docs/perf-log.md, "kvcache"): walking a thread's rows page by page
// (one division, a read where a page starts: a branch per row), and reading the next tile's pages
// while this tile's copies go out (a second division per row). This form's reads and divisions
// are independent of each other, and issue back to back.
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

    __device__ __forceinline__ void offsets(int n, i64& k_off, i64& v_off) const {
        int page_id = row, slot = n;
        if constexpr (PAGED) {
            const int index = page.div(n);
            slot = n - index * page.divisor;
            page_id = __ldg(table + index);
        }
        k_off = page_id * k_page + slot * k_row + k_head;
        v_off = page_id * v_page + slot * v_row + v_head;
    }
};

// Issues the copies of keys [n0, n0 + ROWS) of K and V into swizzled shared tiles, spread over
// NTHREADS threads (`thread` the caller's index); keys >= seqlen_k, K's columns >= headdim and
// V's >= headdim_v are zero-filled. Each thread copies one chunk column of ROWS / ROW_STEP rows
// and looks each row up once for both tiles.
template <int ROWS, int DIM, int NTHREADS, bool PAGED, typename T>
__device__ __forceinline__ void cp_async_cache_rows(u32 k_tile, u32 v_tile, const T* k, const T* v,
                                                    const CacheKeys<PAGED>& keys, int n0, int seqlen_k,
                                                    int headdim, int headdim_v, int thread) {
    constexpr int CHUNKS = DIM / 8;
    constexpr int ROW_STEP = NTHREADS / CHUNKS;
    static_assert(NTHREADS % CHUNKS == 0 && ROWS % ROW_STEP == 0, "tile chunks must divide evenly among the threads");
    const int row0 = thread / CHUNKS, chunk = thread % CHUNKS;
    const bool k_column = chunk * 8 < headdim, v_column = chunk * 8 < headdim_v;
#pragma unroll
    for (int i = 0; i < ROWS / ROW_STEP; ++i) {
        const int r = row0 + i * ROW_STEP;
        const bool key = n0 + r < seqlen_k;
        const bool k_valid = k_column && key, v_valid = v_column && key;
        i64 k_off = 0, v_off = 0;
        if (k_valid || v_valid) keys.offsets(n0 + r, k_off, v_off);
        const u32 dst = swizzled_offset<DIM>(r, chunk);
        cp_async_16(k_tile + dst, k + k_off + chunk * 8, k_valid);
        cp_async_16(v_tile + dst, v + v_off + chunk * 8, v_valid);
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
