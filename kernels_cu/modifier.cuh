// User modifiers: the contract between cupyflash/modifiers.py's generated structs and the
// kernels. A call with score_mod / mask_mod compiles every kernel it launches with a struct
//
//   namespace cfu { struct mod_<hash> {
//       static constexpr bool HAS_SCORE, HAS_MASK, HAS_GRAD, FAST_MATH;
//       template <typename A, bool FAST> static A score(A z, int b, int h, int q_idx, int kv_idx,
//                                                       const cf::ModArgs& t, A& dz_dz);   // HAS_SCORE
//       static bool mask(int b, int h, int q_idx, int kv_idx, const cf::ModArgs& t); // HAS_MASK
//   }; }
//
// appended to the kernel's source (the hash is of the struct's own text, so it is in the
// specialization's name and CuPy's cache key); score.cuh's UserScore<M, SINK> applies it where
// the built-in variants apply theirs, and mask.cuh's WithScore narrows the block ranges by the
// mask's block map. The helpers below are the only functions the generated text calls.
#pragma once

#include "common.cuh"

namespace cf {

constexpr int MOD_TENSORS = 4;     // cupyflash/modifiers.py: MAX_TENSORS, MAX_TENSOR_DIMS
constexpr int MOD_TENSOR_DIMS = 4;

// The run-time part of a call's modifiers (a field of VariantArgs, so of both Params structs):
// the tensors a modifier reads (address, strides in elements), and a mask modifier's block map
// (cupyflash.modifiers.BlockMask): per (batch, query head) and granule of block_m query rows the
// key granules (block_n keys) [first, end) that may hold a visible pair, per (batch, kv head) and
// key granule the query granules [first, end) over the kv head's query heads, each entry folded
// with its neighbours as mask.cuh's WithScore reads it (a suffix minimum of first, a prefix
// maximum of end); then MAP_LEVELS whole runs [first, end): level k's is the intersection of the
// runs of the aligned group of 2^k granules that holds this one, a run being a granule's longest
// run of granules of the other axis whose every pair the mask keeps (over the kv head's query
// heads: the intersection). A kernel tile of 2^k granules, aligned as every tile is, reads its
// run with one load (mask.cuh's WithScore::map_full). A stride of 0 broadcasts a map made for
// every batch entry or head at once.
constexpr int MAP_GRANULE = 16;  // rows (keys) a granule: cupyflash/modifiers.py's BlockMask.GRANULE
constexpr int MAP_LEVELS = 4;    // tiles of 16, 32, 64 and 128 rows (keys)
constexpr int MAP_ENTRY = 2 + 2 * MAP_LEVELS;  // ints a granule: visible first, end; a run a level

struct ModArgs {
    const void* data[MOD_TENSORS];
    i64 strides[MOD_TENSORS][MOD_TENSOR_DIMS];
    const int* key_blocks;    // [batch][head][query granule][MAP_ENTRY]
    const int* query_blocks;  // [batch][kv head][key granule][MAP_ENTRY]
    i64 key_blocks_batch_stride, key_blocks_head_stride;      // in ints
    i64 query_blocks_batch_stride, query_blocks_head_stride;  // in ints
    int block_m, block_n;     // the granules: rows, keys
};

// Element (idx...) of tensor `slot`, read through the read-only cache.
template <typename T, typename... I>
__device__ __forceinline__ T mod_load(const ModArgs& t, int slot, I... idx) {
    static_assert(sizeof...(I) >= 1 && sizeof...(I) <= MOD_TENSOR_DIMS, "one index per dimension");
    i64 offset = 0;
    int d = 0;
    ((offset += i64(idx) * t.strides[slot][d++]), ...);
    return __ldg(static_cast<const T*>(t.data[slot]) + offset);
}

// The built-in softcap's forms (score.cuh, mma.cuh), declared here for FAST below.
__device__ __forceinline__ float tanh_rational(float y);
__device__ __forceinline__ float exp2_approx(float x);
__device__ __forceinline__ float rcp_approx(float x);

// The modifiers' math, in the score's type (float or double). FAST (a struct made with FAST_MATH,
// in the kernels that take it: UserScoreFn's FAST, score.cuh's FAST_MODS, the 16-bit producer
// kernels flash_fwd_wgmma_ws, flash_bwd_wgmma_ws and flash_bwd_dq_wgmma_ws): division, tanh, exp
// and sigmoid in float to a few 1e-6 relative, far under their 16-bit inputs' own rounding
// (bfloat16's 2^-9), tanh on the rational form the built-in softcap's RATIONAL takes; the
// score_mod softcap ran at 0.41 of the built-in one's forward, mostly IEEE division's checks and
// slow path (docs/perf-log.md modifier-fast-math). Otherwise accurate: float32 "ieee", float64 and
// the SIMT kernels, where a modifier's value is the model's definition to the last bits, and the
// other 16-bit kernels, where the cheaper code let ptxas spill. The plans try the FAST_MATH struct
// first for a modifier that reads no tensors (Modifiers.has_fast_forms: the compile check's
// example, which reads two, spilled in its fast form) and keep it only where ptxas compiles it
// without spills, the accurate struct otherwise.
//
// a / b: FAST takes PTX div.full.f32 (full range, about 2 ulp, no slow path), where IEEE division
// checked every quotient (FCHK) and branched to a called slow path: 8-10 instructions a score and
// a call, most of a `score / cap`'s cost.
template <bool FAST>
__device__ __forceinline__ float mod_div(float a, float b) {
    if constexpr (FAST) {
        float r;
        asm("div.full.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
        return r;
    } else {
        return a / b;
    }
}
template <bool FAST>
__device__ __forceinline__ double mod_div(double a, double b) { return a / b; }
template <bool FAST>
__device__ __forceinline__ float mod_exp(float x) {
    if constexpr (FAST) return exp2_approx(x * 1.4426950408889634f);
    else return expf(x);
}
template <bool FAST>
__device__ __forceinline__ double mod_exp(double x) { return exp(x); }
template <bool FAST>
__device__ __forceinline__ float mod_log(float x) { return logf(x); }
template <bool FAST>
__device__ __forceinline__ double mod_log(double x) { return log(x); }
template <bool FAST>
__device__ __forceinline__ float mod_tanh(float x) {
    if constexpr (FAST) return tanh_rational(x);
    else return tanhf(x);
}
template <bool FAST>
__device__ __forceinline__ double mod_tanh(double x) { return tanh(x); }
template <bool FAST>
__device__ __forceinline__ float mod_sqrt(float x) { return sqrtf(x); }
template <bool FAST>
__device__ __forceinline__ double mod_sqrt(double x) { return sqrt(x); }
template <bool FAST>
__device__ __forceinline__ float mod_floor(float x) { return floorf(x); }
template <bool FAST>
__device__ __forceinline__ double mod_floor(double x) { return floor(x); }
template <bool FAST>
__device__ __forceinline__ float mod_sigmoid(float x) {
    if constexpr (FAST) return rcp_approx(1.f + exp2_approx(x * -1.4426950408889634f));
    else return 1.f / (1.f + expf(-x));
}
template <bool FAST>
__device__ __forceinline__ double mod_sigmoid(double x) { return 1.0 / (1.0 + exp(-x)); }
__device__ __forceinline__ float mod_pow(float x, float y) { return powf(x, y); }
__device__ __forceinline__ double mod_pow(double x, double y) { return pow(x, y); }
template <typename T>
__device__ __forceinline__ T mod_min(T a, T b) { return a < b ? a : b; }
template <typename T>
__device__ __forceinline__ T mod_max(T a, T b) { return a < b ? b : a; }

// Python's // and % (floor), which modifiers.py's NumPy form computes: C's / and % truncate. A
// divisor of 0 divides by 1 in both (C's would be undefined).
__device__ __forceinline__ int mod_floordiv(int a, int b) {
    b = b == 0 ? 1 : b;
    const int q = a / b;
    return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}
__device__ __forceinline__ int mod_mod(int a, int b) {
    b = b == 0 ? 1 : b;
    const int r = a % b;
    return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}
__device__ __forceinline__ float mod_floordiv(float a, float b) { return floorf(a / b); }
__device__ __forceinline__ double mod_floordiv(double a, double b) { return floor(a / b); }
__device__ __forceinline__ float mod_mod(float a, float b) { return a - b * floorf(a / b); }
__device__ __forceinline__ double mod_mod(double a, double b) { return a - b * floor(a / b); }

}  // namespace cf

namespace cf {

// The block map of a mask modifier (cupyflash.modifiers.BlockMask, made by flash_block_map.cu):
// per (batch, head) of the map (map_batch, map_heads: 1 where the mask reads no b or no h) and
// granule of query rows, the key granules [first, end) that hold a pair the mask keeps and the
// longest run of key granules it keeps whole, and per key granule the query granules [first, end)
// and the query run; both [map_batch][map_heads][granule][BLOCK_MAP_ROW] (unfolded, per query
// head), the query table's first filled with the row granule count and its end with 0 beforehand.
// (cupyflash/modifiers.py makes the kernels' tables, ModArgs', from them.)
constexpr int BLOCK_MAP_ROW = 4;  // visible first, end; whole run first, end

struct BlockMapParams {
    ModArgs t;         // the mask's tensors (slots from 0)
    int* key_blocks;   // [..][query granules][BLOCK_MAP_ROW]
    int* query_blocks; // [..][key granules][BLOCK_MAP_ROW], first and end by atomic min / max
    int map_batch, map_heads, seqlen_q, seqlen_k;
    int query_granules, key_granules;
    int by_keys;       // 0: a CTA per query granule (both visible ranges, the key runs); 1: a CTA
                       // per key granule (the query runs)
};

}  // namespace cf
