// Rotary position embeddings of flash_attn_with_kvcache (RotaryParams, params.cuh; the definition
// and the positions: cupyflash/rotary.py). One launch turns the rows of q, or of the new keys,
// where the array code took a dozen elementwise launches a tensor.
//
// The arithmetic is the array code's, operation for operation: each pair (x1, x2) and its angle's
// (c, s) widened to float32 (float64 for float64), x1 c - x2 s and x1 s + x2 c each as two
// products and a sum rounded one at a time (explicit mul.rn / add.rn / sub.rn: no contraction into
// an FMA, and no .ftz, so subnormals survive as in NumPy although the library compiles with
// -ftz=true), then rounded once to the element type. So a row turned here equals the NumPy form's
// bit for bit (NaNs aside: their payload bits are the conversion's, not NumPy's).
//
// One CTA per (sequence, token) and head, its threads over the pairs and then the entries past
// rotary_dim, which are copied.
#include "common.cuh"
#include "params.cuh"

namespace cf {

constexpr int ROTARY_THREADS = 64;  // cupyflash/kernels/rotary.py's THREADS

// One IEEE operation each, rounded to nearest, subnormals kept (PTX without .ftz).
#define CF_ROTARY_OP(NAME, PTX)                                                         \
    __device__ __forceinline__ float NAME(float a, float b) {                          \
        float r;                                                                        \
        asm(PTX ".rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));                      \
        return r;                                                                       \
    }                                                                                   \
    __device__ __forceinline__ double NAME(double a, double b) {                       \
        double r;                                                                       \
        asm(PTX ".rn.f64 %0, %1, %2;" : "=d"(r) : "d"(a), "d"(b));                      \
        return r;                                                                       \
    }
CF_ROTARY_OP(mul_rn, "mul")
CF_ROTARY_OP(add_rn, "add")
CF_ROTARY_OP(sub_rn, "sub")
#undef CF_ROTARY_OP

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
