// Rotary position embeddings of flash_attn_with_kvcache (RotaryParams, params.cuh; the definition
// and the positions: cupyflash/rotary.py). One launch turns the rows of q, or of the new keys,
// where the array code took a dozen elementwise launches a tensor.
//
// The arithmetic is the array code's, operation for operation: each pair (x1, x2) and its angle's
// (c, s) widened to float32 (float64 for float64), x1 c - x2 s and x1 s + x2 c each as two
// products and a sum rounded one at a time (the _rn intrinsics: no contraction into an FMA), then
// rounded once to the element type. So a row turned here equals the NumPy twin's bit for bit.
//
// One CTA per (sequence, token) and head, its threads over the pairs and then the entries past
// rotary_dim, which are copied.
#include "common.cuh"
#include "params.cuh"

namespace cf {

constexpr int ROTARY_THREADS = 64;  // cupyflash/kernels/rotary.py's THREADS

__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ float sub_rn(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ double sub_rn(double a, double b) { return __dsub_rn(a, b); }

// INTERLEAVED: pairs (x[2i], x[2i + 1]) (GPT-J); otherwise (x[i], x[i + half]) (GPT-NeoX).
template <typename T, bool INTERLEAVED>
__global__ void __launch_bounds__(ROTARY_THREADS) flash_rotary(const __grid_constant__ RotaryParams p) {
    const int b = blockIdx.x / p.tokens, t = blockIdx.x % p.tokens, head = blockIdx.y;
    const i64 position = __ldg(p.starts + b) + (p.per_token ? t : 0);
    const T* __restrict__ x = p.x.row<const T>(b, t, head);
    T* __restrict__ out = p.out.row<T>(b, t, head);
    const T* __restrict__ cos = static_cast<const T*>(p.cos) + position * p.half;
    const T* __restrict__ sin = static_cast<const T*>(p.sin) + position * p.half;
    for (int i = threadIdx.x; i < p.half; i += ROTARY_THREADS) {
        const int first = INTERLEAVED ? 2 * i : i, second = INTERLEAVED ? 2 * i + 1 : i + p.half;
        const auto x1 = to_acc(ldg(x + first)), x2 = to_acc(ldg(x + second));
        const auto c = to_acc(ldg(cos + i)), s = to_acc(ldg(sin + i));
        store_as(out + first, sub_rn(mul_rn(x1, c), mul_rn(x2, s)));
        store_as(out + second, add_rn(mul_rn(x1, s), mul_rn(x2, c)));
    }
    for (int d = 2 * p.half + threadIdx.x; d < p.headdim; d += ROTARY_THREADS) out[d] = x[d];
}

}  // namespace cf
