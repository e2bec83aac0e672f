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

    // Key n's page and its slot in it: `page_id` is a read of the table (PAGED), which a caller
    // that has other work issues early and uses late (RowOffsetRing).
    __device__ __forceinline__ void locate(int n, int& page_id, int& slot) const {
        page_id = row, slot = n;
        if constexpr (PAGED) {
            const int index = page.div(n);
            slot = n - index * page.divisor;
            page_id = __ldg(table + index);
        }
    }
    // Where key n's table entry is, and its slot in its page (PAGED).
    __device__ __forceinline__ const int* table_entry(int n) const { return table + page.div(n); }
    __device__ __forceinline__ int slot_of(int n) const { return n - page.div(n) * page.divisor; }
    __device__ __forceinline__ void offsets_at(int page_id, int slot, i64& k_off, i64& v_off) const {
        k_off = page_id * k_page + slot * k_row + k_head;
        v_off = page_id * v_page + slot * v_row + v_head;
    }
    __device__ __forceinline__ void offsets(int n, i64& k_off, i64& v_off) const {
        int page_id, slot;
        locate(n, page_id, slot);
        offsets_at(page_id, slot, k_off, v_off);
    }
};

// A paged cache's row offsets worked out once per row, a tile ahead of their copies. The copy
// loaders' threads each take one 16-byte chunk column of a tile (16 threads per row at d128), and
// looking the row up in each of them (cp_async_cache_rows) made the paged kernel execute 1.67x
// the contiguous kernel's instructions, each tile's copies waiting on their table reads; at one
// CTA per SM it read K+V at half the contiguous rate (docs/perf-log.md, "decode-v3").
// Here ROWS threads each work out one row of tile t + 1 while tile t's copies go out (before the
// tile's math, stored after it), into one of two slots of (k offset, v offset) pairs, 16 bytes
// per row; the copies then read their row's pair from shared memory. The key loop's barrier
// orders a slot's stores before its reads, and its reads (tile t, the slot of tile t - 2 before)
// before the stores of tile t + 2.
// The rows' table entries come earlier still: tile t's are copied (cp.async, 4 bytes a row) into
// one of PAGE_SLOTS slots of page ids with the K/V copies of tile t - PAGE_SLOTS (the kernel's
// STAGES), so the key loop's wait for that tile covers them, and no register waits on a table
// read. Read into a register a tile ahead and stored after the math (the form before), the
// read's result was waited on in every iteration: with pages of 16 keys a tile enters a new table line every 8
// tiles, and that read, queued behind the K/V copies in flight, outlasted the iteration (ncu:
// the offsets' store the hottest long-scoreboard stall, docs/perf-log.md, "decode-v3").
template <int ROWS, int NTHREADS, int PAGE_SLOTS>
struct RowOffsetRing {
    static constexpr u32 SLOT_BYTES = ROWS * 16;
    static constexpr u32 PAGE_SLOT_BYTES = ROWS * 4;
    static constexpr u32 BYTES = 2 * SLOT_BYTES + PAGE_SLOTS * PAGE_SLOT_BYTES;
    static constexpr int ROWS_PER_THREAD = (ROWS + NTHREADS - 1) / NTHREADS;
    u32 base;

    __device__ __forceinline__ u32 slot(int block) const { return base + (block & 1) * SLOT_BYTES; }
    __device__ __forceinline__ u32 page_slot(int block) const {
        return base + 2 * SLOT_BYTES + (block % PAGE_SLOTS) * PAGE_SLOT_BYTES;
    }

    // The pages of block `block`'s rows that this thread looks up (read from the table now).
    struct Pending {
        int page_id[ROWS_PER_THREAD], slot[ROWS_PER_THREAD];
    };
    template <bool PAGED>
    __device__ __forceinline__ Pending locate(const CacheKeys<PAGED>& keys, int block, int seqlen_k, int thread) const {
        Pending pending;
#pragma unroll
        for (int i = 0; i < ROWS_PER_THREAD; ++i) {
            const int r = thread + i * NTHREADS, n = block * ROWS + r;
            pending.page_id[i] = 0, pending.slot[i] = 0;
            if (r < ROWS && n < seqlen_k) keys.locate(n, pending.page_id[i], pending.slot[i]);
        }
        return pending;
    }
    // ... and their offsets into block `block`'s slot (rows past the keys: the copies zero-fill them).
    template <bool PAGED>
    __device__ __forceinline__ void store(const CacheKeys<PAGED>& keys, const Pending& pending, int block,
                                          int thread) const {
#pragma unroll
        for (int i = 0; i < ROWS_PER_THREAD; ++i) {
            const int r = thread + i * NTHREADS;
            if (r >= ROWS) continue;
            i64 k_off, v_off;
            keys.offsets_at(pending.page_id[i], pending.slot[i], k_off, v_off);
            asm volatile("st.shared.v2.b64 [%0], {%1, %2};\n" ::"r"(slot(block) + 16 * r), "l"(k_off), "l"(v_off)
                         : "memory");
        }
    }
    template <bool PAGED>
    __device__ __forceinline__ void fill(const CacheKeys<PAGED>& keys, int block, int seqlen_k, int thread) const {
        store(keys, locate(keys, block, seqlen_k, thread), block, thread);
    }
    // The table entries of block `block`'s rows, copied into its page-id slot (cp.async, committed
    // with the caller's next group; rows past the keys get page 0, which no copy reads).
    template <bool PAGED>
    __device__ __forceinline__ void request(const CacheKeys<PAGED>& keys, int block, int seqlen_k, int thread) const {
#pragma unroll
        for (int i = 0; i < ROWS_PER_THREAD; ++i) {
            const int r = thread + i * NTHREADS, n = block * ROWS + r;
            if (r >= ROWS) continue;
            const bool key = n < seqlen_k;
            cp_async_4(page_slot(block) + 4 * r, keys.table_entry(key ? n : 0), key);
        }
    }
    // The pages of block `block`'s rows from its page-id slot (the caller has waited for the group
    // that copied them; each row is requested and read by the same thread).
    template <bool PAGED>
    __device__ __forceinline__ Pending requested(const CacheKeys<PAGED>& keys, int block, int thread) const {
        Pending pending;
#pragma unroll
        for (int i = 0; i < ROWS_PER_THREAD; ++i) {
            const int r = thread + i * NTHREADS, n = block * ROWS + r;
            pending.page_id[i] = 0, pending.slot[i] = 0;
            if (r >= ROWS) continue;
            asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(pending.page_id[i]) : "r"(page_slot(block) + 4 * r)
                         : "memory");
            pending.slot[i] = PAGED ? keys.slot_of(n) : n;
        }
        return pending;
    }
    __device__ __forceinline__ void offsets(int block, int r, i64& k_off, i64& v_off) const {
        asm volatile("ld.shared.v2.b64 {%0, %1}, [%2];\n" : "=l"(k_off), "=l"(v_off) : "r"(slot(block) + 16 * r)
                     : "memory");
    }
};

// Issues the copies of keys [n0, n0 + ROWS) of K and V into swizzled shared tiles, spread over
// NTHREADS threads (`thread` the caller's index); keys >= seqlen_k, K's columns >= headdim and
// V's >= headdim_v are zero-filled. Each thread copies one chunk column of ROWS / ROW_STEP rows;
// `row_offsets(r, k_off, v_off)` gives tile row r's element offsets in K and V, once for both
// tiles.
template <int ROWS, int DIM, int NTHREADS, typename T, class RowOffsets>
__device__ __forceinline__ void cp_async_key_rows(u32 k_tile, u32 v_tile, const T* k, const T* v,
                                                  const RowOffsets& row_offsets, int n0, int seqlen_k, int headdim,
                                                  int headdim_v, int thread) {
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
        if (k_valid || v_valid) row_offsets(r, k_off, v_off);
        const u32 dst = swizzled_offset<DIM>(r, chunk);
        cp_async_16(k_tile + dst, k + k_off + chunk * 8, k_valid);
        cp_async_16(v_tile + dst, v + v_off + chunk * 8, v_valid);
    }
}

// The keys [n0, n0 + ROWS), each row looked up in the cache by the threads that copy it.
template <int ROWS, int DIM, int NTHREADS, bool PAGED, typename T>
__device__ __forceinline__ void cp_async_cache_rows(u32 k_tile, u32 v_tile, const T* k, const T* v,
                                                    const CacheKeys<PAGED>& keys, int n0, int seqlen_k,
                                                    int headdim, int headdim_v, int thread) {
    cp_async_key_rows<ROWS, DIM, NTHREADS>(
        k_tile, v_tile, k, v, [&](int r, i64& k_off, i64& v_off) { keys.offsets(n0 + r, k_off, v_off); }, n0,
        seqlen_k, headdim, headdim_v, thread);
}

// Key block `block` (ROWS keys), each row's offsets from a RowOffsetRing.
template <int ROWS, int DIM, int NTHREADS, int PAGE_SLOTS, typename T>
__device__ __forceinline__ void cp_async_cache_rows(u32 k_tile, u32 v_tile, const T* k, const T* v,
                                                    const RowOffsetRing<ROWS, NTHREADS, PAGE_SLOTS>& ring, int block,
                                                    int seqlen_k, int headdim, int headdim_v, int thread) {
    cp_async_key_rows<ROWS, DIM, NTHREADS>(
        k_tile, v_tile, k, v, [&](int r, i64& k_off, i64& v_off) { ring.offsets(block, r, k_off, v_off); },
        block * ROWS, seqlen_k, headdim, headdim_v, thread);
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
