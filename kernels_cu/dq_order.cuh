// The ordered dQ adds of the fused backward kernels (flash_bwd_fused_mma.cu, flash_bwd_wgmma.cu):
// per-(batch, head, query block) counters that key block j waits on (acquire) until every warp of
// key blocks 0..j-1 has raised them (release) after its adds to dq_accum. The protocol and why it
// cannot deadlock are laid out at the top of flash_bwd_fused_mma.cu.
#pragma once

namespace cf {

__device__ __forceinline__ int ld_acquire_gpu(const int* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void red_add_release_gpu(int* p, int v) {
    asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;\n" ::: "memory"); }

// Backs off a spinning warp so that it does not steal issue slots from the warps doing work.
__device__ __forceinline__ void nanosleep_64() { asm volatile("nanosleep.u32 64;\n" ::: "memory"); }

// Releases query block `sem` (if any) to the next key block of the order: the fence completes
// when this lane's adds to dq_accum have been performed; the warp barrier orders all lanes' adds
// before lane 0's release (cumulativity of the release).
__device__ __forceinline__ void release_dq_block(int* sem, int lane) {
    if (sem == nullptr) return;
    fence_acq_rel_gpu();
    __syncwarp();
    if (lane == 0) red_add_release_gpu(sem, 1);
}

// Waits (backing off) until the counter of this query block reaches `target`, that is until every
// warp of the key blocks before this one has released it; `seen` holds a value read earlier, so a
// counter that is already there costs no load.
__device__ __forceinline__ void wait_dq_turn(const int* sem, int& seen, int target) {
    while (seen < target) {
        nanosleep_64();
        seen = ld_acquire_gpu(sem);
    }
    __syncwarp();
}

}  // namespace cf
