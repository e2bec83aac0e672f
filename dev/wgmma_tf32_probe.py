"""What ptxas accepts of wgmma's tf32 form, on the CPU (NVRTC for sm_90a, no GPU): perf log
tf32-wgmma-v0's premise that its shared-memory operands cannot be transposed (both K-major) and
that A may come from registers. Four one-instruction kernels of m64n64k8 .f32.tf32.tf32 (A from
shared memory or registers, with and without the transpose arguments) and, as the control that
the transposed syntax is right, the same instruction on .bf16 (m64n64k16) with them.

    python dev/wgmma_tf32_probe.py

Measured 2026-12-04 (NVRTC 13.5): tf32 ss and rs compile; tf32 with imm-trans-a / imm-trans-b:
"Arguments mismatch for instruction 'wgmma.mma_async'"; bf16 with them compiles.
"""
from __future__ import annotations

from cupyflash.kernels import compile_check

ACCUMULATORS = 32  # m64n64: 64 x 64 / 128 threads


def _kernel(name: str, instruction: str, a_operand: str, extra_args: str, a_in_registers: bool) -> str:
    d_list = ", ".join(f"%{i}" for i in range(ACCUMULATORS))
    d_constraints = ", ".join(f'"+f"(d[{i}])' for i in range(ACCUMULATORS))
    b_operand = f"%{ACCUMULATORS + (4 if a_in_registers else 1)}"
    inputs = ('"r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(db)' if a_in_registers else '"l"(da), "l"(db)')
    return f"""
typedef unsigned long long u64;
typedef unsigned int u32;
extern "C" __global__ void {name}(float* out, u64 da, u64 db, u32 a0, u32 a1, u32 a2, u32 a3) {{
    float d[{ACCUMULATORS}];
    for (int i = 0; i < {ACCUMULATORS}; ++i) d[i] = 0.f;
    asm volatile("wgmma.fence.sync.aligned;\\n");
    asm volatile("{instruction} {{{d_list}}}, {a_operand}, {b_operand}, 1, 1, 1{extra_args};\\n"
                 : {d_constraints} : {inputs});
    asm volatile("wgmma.commit_group.sync.aligned;\\n");
    asm volatile("wgmma.wait_group.sync.aligned 0;\\n");
    float s = 0.f;
    for (int i = 0; i < {ACCUMULATORS}; ++i) s += d[i];
    out[threadIdx.x] = s;
}}
"""


def main() -> None:
    tf32 = "wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32"
    bf16 = "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16"
    a_smem = f"%{ACCUMULATORS}"
    a_regs = "{" + ", ".join(f"%{ACCUMULATORS + i}" for i in range(4)) + "}"
    cases = [
        ("tf32_ss", tf32, a_smem, "", False),
        ("tf32_ss_transposed", tf32, a_smem, ", 1, 1", False),
        ("tf32_rs", tf32, a_regs, "", True),
        ("tf32_rs_transposed_b", tf32, a_regs, ", 1", True),
        ("bf16_ss_transposed_control", bf16, a_smem, ", 1, 1", False),
    ]
    for name, instruction, a_operand, extra_args, a_in_registers in cases:
        source = _kernel(name, instruction, a_operand, extra_args, a_in_registers)
        try:
            compile_check.compile_text(source, f"{name}.cu", [], "90a")
            print(f"{name:28} compiles")
        except RuntimeError as exc:
            errors = [line.strip() for line in str(exc).splitlines() if "error" in line]
            print(f"{name:28} rejected: {errors[0] if errors else str(exc).splitlines()[-1]}")


if __name__ == "__main__":
    main()
