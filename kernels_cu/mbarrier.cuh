// Shared-memory mbarriers and warpgroup register reallocation (sm_90): the pieces of a
// warp-specialized kernel, where a producer warpgroup fills stages of shared memory and consumer
// warpgroups compute on them, each side waiting on the other through a full and an empty barrier
// per stage instead of __syncthreads. First used by flash_fwd_tf32_wgmma_ws.cu (a candidate).
//
// Phases: a barrier initialised with count N completes a phase when N arrivals have been made;
// try_wait.parity(P) succeeds once the phase of parity P has completed. A fresh barrier is in
// phase 0, and waiting for parity 1 succeeds at once (the "phase before" counts as completed), so
// a producer that waits on an empty barrier with parity ((use & 1) ^ 1) finds its first use of
// every stage free without anyone having arrived.
#pragma once

#include "common.cuh"
#include "mma.cuh"

namespace cf {

__device__ __forceinline__ void mbarrier_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

// Makes the initialisations visible to the other threads (and the async proxy) before the CTA
// barrier that follows them.
__device__ __forceinline__ void mbarrier_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// One arrival (release: this thread's earlier shared-memory writes are visible to a thread whose
// wait on the completed phase succeeds).
__device__ __forceinline__ void mbarrier_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

__device__ __forceinline__ bool mbarrier_try_wait(u32 bar, u32 parity) {
    u32 done;
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
    return done != 0;
}

// Until the phase of this parity has completed (acquire).
__device__ __forceinline__ void mbarrier_wait(u32 bar, u32 parity) {
    while (!mbarrier_try_wait(bar, parity)) {
    }
}

// A producer / consumer ring of STAGES stages, each with a full and an empty barrier (8 bytes
// apart in two arrays). Use i of the ring is stage i % STAGES, in its (i / STAGES)-th round:
// the producer waits until the stage is empty (wait_empty: parity ((round & 1) ^ 1), so the
// first round finds every stage free), fills it, fences its stores and arrives on full; the
// consumer waits until it is full (wait_full: parity round & 1), computes and arrives on empty.
template <int STAGES>
struct StageRing {
    u32 full, empty;  // the barrier arrays

    // Thread 0 initialises them: a stage is full after `full_count` arrivals (the producer's
    // threads), empty after `empty_count` (the consumers'). The CTA barrier that must follow
    // makes them visible.
    __device__ __forceinline__ void init(u32 full_count, u32 empty_count) const {
        if (threadIdx.x == 0) {
#pragma unroll
            for (int s = 0; s < STAGES; ++s) {
                mbarrier_init(full + 8 * s, full_count);
                mbarrier_init(empty + 8 * s, empty_count);
            }
            mbarrier_init_fence();
        }
    }
    __device__ __forceinline__ void wait_empty(int i) const {
        mbarrier_wait(empty + 8 * (i % STAGES), ((i / STAGES) & 1) ^ 1);
    }
    __device__ __forceinline__ void arrive_full(int i) const { mbarrier_arrive(full + 8 * (i % STAGES)); }
    __device__ __forceinline__ u32 full_barrier(int i) const { return full + 8 * (i % STAGES); }
    __device__ __forceinline__ void wait_full(int i) const { mbarrier_wait(full + 8 * (i % STAGES), (i / STAGES) & 1); }
    __device__ __forceinline__ void arrive_empty(int i) const { mbarrier_arrive(empty + 8 * (i % STAGES)); }
};

// Named barrier `id` (1..15; 0 is __syncthreads') of `threads` threads, a multiple of 32: bar.sync
// waits until that many have arrived (itself included), bar.arrive counts toward it without
// waiting (one group letting another's bar.sync through). Shared-memory writes before the arrive
// are visible after the sync. The library's one copy: the backward kernels' warp pairs and the
// tf32 wgmma forward's warpgroups use it.
__device__ __forceinline__ void named_barrier_sync(u32 id, u32 threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(u32 id, u32 threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Turns at the tensor cores for a forward block's issues (the tf32 forward's S products, then
// P V's; flash_fwd_wgmma_ws's S_j with P_{j-1} V_{j-1}): `wait` before a warpgroup issues, `pass`
// once it has. ConsumerTurns<true> (tf32-wgmma-v2 PINGPONG, wgmma-fwd-ws-v0): two consumer
// warpgroups alternate on two named barriers, so the products of one are issued, and run, while
// the other does its softmax; left alone (NoTurns, v0 .. v2: both calls nothing) the two are
// released by the same full barrier each block and reach their softmax together, the tensor
// cores idle meanwhile (tf32-wgmma-v2 measured 62% of the three-product ceiling).
template <bool ON>
struct ConsumerTurns {
    u32 mine = 0, other = 0;  // named barrier ids: this warpgroup's turn, the other's
    __device__ __forceinline__ void wait() const {
        if constexpr (ON) named_barrier_sync(mine, 256);
    }
    __device__ __forceinline__ void pass() const {
        if constexpr (ON) named_barrier_arrive(other, 256);
    }
};
using NoTurns = ConsumerTurns<false>;

// The warpgroup's registers per thread lowered / raised to N (a multiple of 8 in 24..256); every
// thread of the warpgroup executes it. Registers move within the CTA's launch allocation: a raise
// waits until other warpgroups' releases cover it, so the counts after both must fit in it (or
// the raise waits forever).
template <int N>
__device__ __forceinline__ void warpgroup_registers_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void warpgroup_registers_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}

// One arrival that also expects `bytes` more of asynchronous copies (complete_tx) before the phase
// can complete: the producer's arrival for a stage that a bulk copy fills.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

// Copies `bytes` (a multiple of 16; both addresses 16-byte aligned) from global to shared memory
// by the TMA unit, in the async proxy (as wgmma reads), counted on barrier `bar` as they land.
__device__ __forceinline__ void cp_async_bulk_to_shared(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                 ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

}  // namespace cf
