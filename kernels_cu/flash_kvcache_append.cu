// The KV-cache append of flash_attn_with_kvcache on the device (AppendParams, params.cuh): each new
// key and value row copied into its cache slot, the slot found through the block table from the
// sequence's cache_seqlens by the attention kernel's own lookup (CacheKeys, cache_rows.cuh), so the
// two agree by construction.
// What cupyflash.capture's calls use: nothing is read back to the host, and the append is one
// launch a CUDA graph holds. The values are copied as raw bits of their width (NaN payloads and
// signed zeros kept: the append is checked byte for byte).
//
// One CTA per (sequence, new token) and kv head, its threads over the head dimension; the CTA of
// a sequence's token 0 and head 0 also writes seqlens_k[b]. Two appended tokens on one slot, or an
// append beyond a cache's capacity, is the caller's contract (flash-attn's): nothing checks it here.
#include "cache_rows.cuh"
#include "common.cuh"
#include "params.cuh"

namespace cf {

constexpr int APPEND_THREADS = 128;  // cupyflash/kernels/kvcache_append.py's THREADS

template <int BYTES> struct raw_bits;
template <> struct raw_bits<2> { typedef unsigned short type; };
template <> struct raw_bits<4> { typedef unsigned type; };
template <> struct raw_bits<8> { typedef unsigned long long type; };

template <int BYTES>
__global__ void __launch_bounds__(APPEND_THREADS) flash_kvcache_append(const __grid_constant__ AppendParams p) {
    typedef typename raw_bits<BYTES>::type U;
    const int b = blockIdx.x / p.seqlen_new, t = blockIdx.x % p.seqlen_new, head = blockIdx.y;
    const int cached = __ldg(p.cache_seqlens + b);
    // The slot of key cached + t, found as the attention kernel finds it (cache_rows.cuh). A
    // contiguous cache comes as a table of one page per sequence, its row, of the cache's
    // capacity: the paged lookup then gives that row and slot `position`.
    i64 k_off, v_off;
    CacheKeys<true>(p, b, head).offsets(cached + t, k_off, v_off);
    const U* k_src = p.k_new.row<const U>(b, t, head);
    const U* v_src = p.v_new.row<const U>(b, t, head);
    U* k_dst = static_cast<U*>(p.k.data) + k_off;
    U* v_dst = static_cast<U*>(p.v.data) + v_off;
    for (int c = threadIdx.x; c < p.headdim; c += APPEND_THREADS) k_dst[c] = k_src[c];
    for (int c = threadIdx.x; c < p.headdim_v; c += APPEND_THREADS) v_dst[c] = v_src[c];
    if (p.seqlens_k != nullptr && t == 0 && head == 0 && threadIdx.x == 0) p.seqlens_k[b] = cached + p.seqlen_new;
}

}  // namespace cf
