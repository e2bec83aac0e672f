// A CTA's timeline, for dev/cta_timeline.py: where a kernel's time goes besides its steps (the
// prologue before the first step, the epilogue after the last, the gap between one CTA's exit and
// the next CTA's start on the same SM). With CF_CTA_TIMELINE defined, which only that harness
// does (NVRTC's -D), one thread of each CTA records its SM, its walk's length and a clock at each
// mark into cf_cta_timeline; otherwise every mark is empty and the kernels' code is unchanged
// (dev/compare_sass.py --identical).
//
// A CTA's row, CF_CTA_TIMELINE_SLOTS 64-bit words: the SM (%smid), the walk's length (the steps
// the kernel names at MARK_WALKED), %globaltimer at MARK_ENTRY and at MARK_EXIT (ns, one clock for
// every SM), then clock64 at each of the four marks (cycles of the CTA's SM). Rows are the CTAs'
// linear indices (x fastest); CTAs past CF_CTA_TIMELINE_CTAS are not recorded.
#pragma once

#ifdef CF_CTA_TIMELINE
#define CF_CTA_TIMELINE_SLOTS 8
extern "C" {  // an unmangled name, for the harness's RawModule.get_global
__device__ long long cf_cta_timeline[CF_CTA_TIMELINE_CTAS * CF_CTA_TIMELINE_SLOTS];
}
#endif

namespace cf {

enum CtaMark { MARK_ENTRY = 0, MARK_FIRST_STEP = 1, MARK_WALKED = 2, MARK_EXIT = 3 };

#ifdef CF_CTA_TIMELINE
// Mark `mark` of this CTA, by the one thread (`recorder`) that stays to the CTA's end; `steps` is
// kept at MARK_WALKED.
__device__ __forceinline__ void cta_timeline(CtaMark mark, bool recorder, int steps = 0) {
    if (!recorder) return;
    const long long cta = blockIdx.x + (long long)gridDim.x * (blockIdx.y + (long long)gridDim.y * blockIdx.z);
    if (cta >= CF_CTA_TIMELINE_CTAS) return;
    long long* const row = cf_cta_timeline + cta * CF_CTA_TIMELINE_SLOTS;
    unsigned long long now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    row[4 + mark] = clock64();
    if (mark == MARK_ENTRY) {
        unsigned sm;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
        row[0] = sm;
        row[2] = (long long)now;
    }
    if (mark == MARK_WALKED) row[1] = steps;
    if (mark == MARK_EXIT) row[3] = (long long)now;
}
#else
__device__ __forceinline__ void cta_timeline(CtaMark, bool, int = 0) {}
#endif

}  // namespace cf
