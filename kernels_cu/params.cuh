// The run-time arguments of every kernel: one struct per direction, passed by value as a
// __grid_constant__ parameter (read from the parameter bank, never copied to local memory).
//
// Python builds each as a NumPy structured scalar (cupyflash/kernels/params.py: FWD_PARAMS,
// BWD_PARAMS, the same fields in the same order with align=True, so the offsets are C's); the CPU
// test tests/kernels/test_params.py compiles static_asserts of every field's offset, the sizes
// and the alignment under NVRTC, so the two cannot drift apart.
//
// The scalars come after the pointers in both structs and in the same order: batch, seqlen_q,
// seqlen_k, nheads, nheads_kv, group (nheads / nheads_kv, query heads per kv head), headdim (of q
// and k), headdim_v (of v and o), window_left, window_right (the Local policy's bounds, mask.cuh; NoMask and Causal ignore them).
//
// Compile-time choices (dtype, tiles, the mask policy, how dQ is added) stay template arguments;
// everything that varies per call is here. A field a kernel does not read is zero (a null
// pointer), never another tensor standing in. A new variant parameter (softcap, ALiBi slopes,
// sinks, the cumulative lengths of a packed batch) becomes a field of both structs and of their
// twins.
#pragma once

#include "common.cuh"
#include "dropout.cuh"
#include "modifier.cuh"

namespace cf {

// One (batch, seqlen, heads, dim) tensor with a contiguous last dimension: its address and its
// strides in elements, 64-bit (one tensor may pass 2^31 elements).
struct TensorRows {
    void* data;
    i64 batch_stride, row_stride, head_stride;

    // Row 0 of head `head` in batch `batch`, as T (const T for inputs).
    template <typename T>
    __device__ __forceinline__ T* head_rows(int batch, int head) const {
        return static_cast<T*>(data) + row_offset(batch, 0, head, batch_stride, row_stride, head_stride);
    }
    template <typename T>
    __device__ __forceinline__ T* row(int batch, int r, int head) const {
        return static_cast<T*>(data) + row_offset(batch, r, head, batch_stride, row_stride, head_stride);
    }
};

// The values of a call's variant (score.cuh), read only by the kernels whose score policy uses
// them (zero otherwise): ALiBi's slopes, (batch, nheads) float32 with batch stride
// alibi_batch_stride (0 for (nheads,) slopes); the sink logits, (nheads,) float32 (forward);
// the softcap c, as float and as double; the user modifiers' tensors and block map
// (modifier.cuh); dropout's seed, offset, threshold and scale (dropout.cuh).
struct VariantArgs {
    const float* alibi_slopes;
    const float* sink;
    i64 alibi_batch_stride;
    float softcap;
    double softcap_f64;
    ModArgs mods;
    DropoutArgs dropout;
};

// Forward: o and lse from q, k, v.
struct FwdParams {
    TensorRows q, k, v, o;
    void* lse;          // (batch, nheads, seqlen_q), C-contiguous, float32 (float64 for float64)
    int batch, seqlen_q, seqlen_k, nheads, nheads_kv;
    int group;          // nheads / nheads_kv: query heads per kv head (GQA)
    int headdim;        // of q and k
    int headdim_v;      // of v and o (and dout, dv): headdim or another width (DeepSeek MLA's 192 / 128)
    int window_left, window_right;  // the mask's run-time bounds (mask.cuh), -1 unbounded
    // softmax_scale * log2(e) and softmax_scale, rounded to the nearest float (the 16-bit and
    // float32 kernels), and in double (the float64 kernels): a kernel reads its own precision with
    // scale_log2_in<A>, scale_in<A>.
    float scale_log2, scale;
    double scale_log2_f64, scale_f64;
    VariantArgs variant;
    // A packed batch (mask.cuh's Packed policies): (sequences + 1,) int32 cumulative lengths;
    // seqlen_q and seqlen_k above are then the tensors' total rows. Null for a dense batch.
    const int* cu_seqlens_q;
    const int* cu_seqlens_k;
    // A packed batch's issue order (mask.cuh's cta_sequence): grid slot z runs sequence
    // sequence_order[z], a permutation of the sequences; null: slot z runs sequence z.
    const int* sequence_order;
    // flash_fwd_split_kv_tf32's image of the key blocks split once for the grid (the float32
    // forward's producer with PRESPLIT, wgmma_tf32_fwd_steps.cuh's kv_fwd_image_offset); null otherwise.
    void* kv_split;
};

// Backward: dq, dk, dv (and the statistics and buffers around them) from dout, q, k, v, o, lse.
struct BwdParams {
    TensorRows q, k, v, o, dout, dq, dk, dv;
    // dQ partial sums of the kernels that add dQ across key blocks (dq_add.cuh, every DqAdd but
    // none): float32 or int64 rows of the head-dim tile, or (fixed_panels) int64 64-column
    // panels, a head being D_TILE / 64 consecutive panels (head_stride). Column c of a row is at
    // (c / 64) dq_accum_panel_stride + c % 64: the panel stride is 64 for row-major accumulators.
    TensorRows dq_accum;
    i64 dq_accum_panel_stride;
    const void* lse;    // (batch, nheads, seqlen_q), C-contiguous, the accumulator type
    void* delta;        // D = rowsum(dO * O), same layout (the preprocess; D - dp_ref: flash_bwd_stats_simt)
    int* dq_semaphore;  // DqAdd::ordered: one counter per (batch, head, query block)
    float* dq_row_scale;        // DqAdd::fixed*: 2^E_i per row, same layout as lse
    unsigned* kv_bound;         // DqAdd::fixed*: max |K|, max |V| per (batch, kv head)
    int batch, seqlen_q, seqlen_k, nheads, nheads_kv;
    int group;          // nheads / nheads_kv: query heads per kv head (GQA)
    int headdim;        // of q and k
    int headdim_v;      // of v and o (and dout, dv): headdim or another width (DeepSeek MLA's 192 / 128)
    int window_left, window_right;  // the mask's run-time bounds (mask.cuh), -1 unbounded
    // softmax_scale * log2(e) and softmax_scale, rounded to the nearest float and in double, as in
    // FwdParams (scale_log2_in<A>, scale_in<A>).
    float scale_log2, scale;
    double scale_log2_f64, scale_f64;
    VariantArgs variant;
    const int* cu_seqlens_q;    // a packed batch, as in FwdParams
    const int* cu_seqlens_k;
    const int* sequence_order;
    // The SIMT backward's row statistics (softmax_bwd.cuh's RowStats): P = 2^(x - top) weight,
    // top = lse * lse_to_log2, and dS = P ((dP - dp_ref) - delta). Saved statistics: lse natural,
    // lse_to_log2 = log2(e), weight and dp_ref null (1 and 0). Recomputed (flash_bwd_stats_simt):
    // lse holds each row's top score, weight 1 / its sum, lse_to_log2 = 1, dp_ref the dP of the
    // top key and delta D - dp_ref; kept apart so that x - top and dP - dp_ref are exact at the
    // maximum, and nothing small is lost in the rounding of a large lse or D. The tensor-core
    // kernels take the saved lse only and read log2(e) as a constant.
    const void* weight;
    const void* dp_ref;
    float lse_to_log2;
    double lse_to_log2_f64;
    // The float32 backward's split key blocks (flash_bwd_split_kv_tf32, read by
    // flash_bwd_dq_tf32_wgmma_ws with PRESPLIT): wgmma_tf32_bwd_steps.cuh's kv_image_offset.
    // Last, so that the fields before it keep their offsets in every kernel.
    void* kv_split;
    // The same for the dK/dV kernel's query blocks (flash_bwd_split_q_tf32, read by
    // flash_bwd_dkdv_tf32_wgmma_ws with PRESPLIT): q_image_offset.
    void* q_split;
};

// Where each sequence's keys live in a KV cache (flash_fwd_kvcache_mma): key n of sequence b is
// slot n % page_size of page block_table[b * block_table_stride + n / page_size], the page being a
// "batch" of the cache tensors (k.batch_stride). A contiguous cache is the one-page case: its
// table holds each sequence's cache row (cache_batch_idx, or b) and page_size its capacity. The
// division by page_size is a multiply-high and a shift (page_div, FastDivmod below): any page
// size, not only powers of two.
struct FastDivmod {
    int divisor;
    unsigned multiplier;  // ceil(2^(31 + L) / divisor), L = ceil(log2(divisor)) (divisor > 1)
    unsigned shift;       // L - 1 (divisor > 1); host side: cupyflash/kernels/kvcache_mma.py
    // n / divisor for 0 <= n < 2^31 (Granlund and Montgomery's division by a run-time invariant).
    __device__ __forceinline__ int div(int n) const {
        return divisor == 1 ? n : static_cast<int>(__umulhi(static_cast<unsigned>(n), multiplier) >> shift);
    }
};

// Forward over a KV cache: the new queries of each sequence against its seqlens_k[b] cached keys
// (the new keys already appended), their query heads packed by kv head (a CTA's rows are the
// (query, head) pairs of one kv head, so each K/V byte is read once per step for the whole GQA
// group), the keys split across num_splits CTAs. q, o: (batch, seqlen_q, nheads, d); k, v: the
// caches (pages, page_size, nheads_kv, d) as TensorRows. The shape and scale fields are
// FwdParams' (seqlen_k: the longest sequence), so the mask and score policies take this struct
// as they take FwdParams.
struct CacheFwdParams {
    TensorRows q, k, v, o;
    void* lse;          // (batch, nheads, seqlen_q) float32, written when num_splits == 1
    int batch, seqlen_q, seqlen_k, nheads, nheads_kv;
    int group;
    int headdim, headdim_v;
    int window_left, window_right;
    float scale_log2, scale;
    double scale_log2_f64, scale_f64;
    VariantArgs variant;
    const int* seqlens_k;       // (batch,) keys of each sequence, the appended ones included
    const int* block_table;     // (batch, block_table_stride) pages of each sequence
    i64 block_table_stride;
    FastDivmod page;            // page_size
    int num_splits;             // CTAs along the keys of one sequence
    int split_keys;             // keys per split, a multiple of the kernel's key block
    // num_splits > 1: each split's O / l and lse (natural log, without the sink), float32,
    // (num_splits, batch, nheads, seqlen_q, headdim) and (num_splits, batch, nheads, seqlen_q);
    // flash_fwd_combine makes o and lse from them.
    float* o_partial;
    float* lse_partial;
};

// flash_kvcache_append: the new keys and values of each sequence written into its cache slots on
// the device, so that a call reads no index array back and a CUDA graph can hold the append
// (cupyflash.capture). Token t of sequence b goes to position cache_seqlens[b] + t, which
// CacheFwdParams' addressing puts in slot position % page_size of page
// block_table[b * block_table_stride + position / page_size] (a contiguous cache: one page per
// sequence, its row, page_size its capacity). seqlens_k (or null) gets cache_seqlens[b] +
// seqlen_new, the lengths the attention kernel then reads.
struct AppendParams {
    TensorRows k_new, v_new;    // (batch, seqlen_new, nheads_kv, headdim or headdim_v)
    TensorRows k, v;            // the caches (pages, page_size, nheads_kv, headdim or headdim_v)
    const int* cache_seqlens;   // (batch,)
    const int* block_table;
    i64 block_table_stride;
    int* seqlens_k;
    FastDivmod page;
    int batch, seqlen_new, nheads_kv, headdim, headdim_v;
};

// flash_rotary: rotary position embeddings of flash_attn_with_kvcache (cupyflash/rotary.py). Row
// (b, t, head) of x is turned by the cos / sin rows of its position, starts[b] + t (per_token) or
// starts[b], into the same row of out; cos and sin are (rows, half) C-contiguous, of x's type.
struct RotaryParams {
    TensorRows x, out;          // (batch, tokens, heads, headdim)
    const void* cos;
    const void* sin;
    const int* starts;          // (batch,)
    int batch, tokens, heads, headdim, half, per_token;
};

// flash_fwd_combine: o and lse of every (batch, head, query) row from its num_splits partial
// results (CacheFwdParams' o_partial, lse_partial) by the LSE rule, the sink's term added once.
struct CombineParams {
    const float* o_partial;
    const float* lse_partial;
    TensorRows o;
    float* lse;                 // (batch, nheads, seqlen_q) float32
    const float* sink;          // (nheads,) float32 or null
    int num_splits, batch, seqlen_q, nheads, headdim;  // headdim: o's (the call's headdim_v)
};

// The scales in a kernel's accumulator type A. The float fields are read in place: a float kernel
// takes them as constant-bank operands of its FFMAs, as it took the positional float arguments
// before the structs. A double field converted in the kernel instead (float(x) under -ftz: F2F
// plus a DSETP flush test) is rematerialized by NVVM at its uses, inside the key-block loop of
// the wgmma kernels, where the DSETP alone drew 7% of dq_wgmma d64's stall samples and the
// kernels ran 6-14% slower (ncu, H200; docs/perf-log.md, "params").
template <typename A, class Params>
__device__ __forceinline__ A scale_log2_in(const Params& p) {
    if constexpr (sizeof(A) == sizeof(double)) return p.scale_log2_f64;
    else return p.scale_log2;
}
template <typename A, class Params>
__device__ __forceinline__ A scale_in(const Params& p) {
    if constexpr (sizeof(A) == sizeof(double)) return p.scale_f64;
    else return p.scale;
}

}  // namespace cf

namespace cf {

// The statistics (lse) of one attention result: (batch, nheads, seqlen) with its strides in
// elements, so that a kernel can read and write a row range of a larger lse in place (the ring's
// second-half rows are lse[:, :, C:], a strided view).
struct LseRows {
    void* data;
    i64 batch_stride, head_stride, row_stride;

    template <typename A>
    __device__ __forceinline__ A* at(int batch, int head, int r) const {
        return static_cast<A*>(data) + batch * batch_stride + head * head_stride + r * row_stride;
    }
};

// merge_attention_states: (o, lse) of attention over the union of two disjoint key sets, from the
// results over each, (o_a, lse_a) and (o_b, lse_b), all of one (batch, seqlen, nheads, headdim)
// shape. o may be o_a and lse may be lse_a (accumulation in place).
struct MergeParams {
    TensorRows o_a, o_b, o;
    LseRows lse_a, lse_b, lse;
    int batch, seqlen, nheads, headdim;  // o's
};

}  // namespace cf
