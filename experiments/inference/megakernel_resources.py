"""What one SM's resources allow the decode megakernel, worked out on a machine without a GPU.

    python experiments/inference/megakernel_resources.py [--case int8] [--set GEMV_CHUNK=512 ...] [--sass]

Compiles `layers_kernel` (persistent, every stage) for sm_90 with Triton's compiler and the ptxas that ships with it,
with the launch settings `launch_plan` gives each case, and prints its registers, spills and shared memory, and how
many programs an H100/H200 SM holds (64K registers in per-warp steps of 256, 228 KiB of shared memory of which each
block reserves 1 KiB, 2,048 threads), against the programs per SM the launch wants. A grid of more programs than fit
hangs at its first barrier: this is how the fp32 tensor-core case's hang was found (2026-12-03; the launch now asks
the CUDA driver). Needs Triton (any Linux machine); the tensors are on the "meta" device, so no memory is used.
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import re
import subprocess
import tempfile

import torch
import triton
from ab_megakernel_steps import apply_settings, known_settings  # this folder's: the A/B's NAME=VALUE settings
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from lmlab.kernels import decode_layers as dl
from lmlab.kernels.decode_layers_triton import layers_kernel

SM90 = dict(regs=65536, shared=233472, reserved=1024, threads=2048)
DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32", torch.int64: "i64",
          torch.int8: "i8", torch.uint8: "u8"}
# name: (batch, layers, d_model, heads, kv heads, head_dim, d_ff, cache length, dtype[, programs, quantized weights])
CASES = {"llama400m bf16, batch 1": (1, 24, 1024, 16, 16, 64, 2816, 384, torch.bfloat16),
         "llama400m bf16, batch 32": (32, 24, 1024, 16, 16, 64, 2816, 384, torch.bfloat16),
         "llama400m int8, batch 1": (1, 24, 1024, 16, 16, 64, 2816, 384, torch.bfloat16, 132, "int8"),
         "llama400m int8, batch 32": (32, 24, 1024, 16, 16, 64, 2816, 384, torch.bfloat16, 132, "int8"),
         "llama400m int4 (g128), batch 1": (1, 24, 1024, 16, 16, 64, 2816, 384, torch.bfloat16, 132, "int4"),
         "the GPU test's fp32 GQA, batch 3": (3, 3, 128, 4, 2, 32, 384, 128, torch.float32),
         # int8 codes into fp32's FMA dot (a test's case, not a fast one): ptxas keeps it in local memory
         "GPU test's fp32 GQA int8, batch 3": (3, 3, 128, 4, 2, 32, 384, 128, torch.float32, 132, "int8")}


def compile_sm90(plan: dl.LaunchPlan, layers: int):
    """The persistent kernel compiled as a launch would specialize it: pointers 16-byte aligned, integers equal to 1
    made constants, integers divisible by 16 marked so. A launch specializes on the real pointers: a view at an
    unaligned offset compiles to narrower loads than shown here (o_proj's sums did until 2026-12-04)."""
    names = layers_kernel.arg_names
    values = dict(zip(names, (*plan.args, 0, layers, *plan.shape)))
    constants = {**{k: v for k, v in plan.meta.items() if k not in ("num_warps", "num_stages")}, "STAGE": -1}
    signature, attrs = {}, {}
    for i, name in enumerate(names):
        value = values.get(name)
        if name in constants or (type(value) is int and value == 1):
            constants.setdefault(name, value)
            signature[name] = "constexpr"
        elif isinstance(value, torch.Tensor):
            signature[name], attrs[(i,)] = "*" + DTYPES[value.dtype], [["tt.divisibility", 16]]
        elif type(value) is int:
            signature[name] = "i32"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "fp32"
    source = ASTSource(layers_kernel, signature, {(names.index(k),): v for k, v in constants.items()}, attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=plan.meta["num_warps"], num_stages=plan.meta["num_stages"]))


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def ptxas_report(kernel) -> tuple[int, int, bytes]:
    """(registers per thread, spilled bytes stored) from `ptxas -v`, and the cubin, with line info."""
    with tempfile.TemporaryDirectory() as tmp:
        path, cubin = os.path.join(tmp, "kernel.ptx"), os.path.join(tmp, "kernel.cubin")
        with open(path, "w") as f:
            f.write(kernel.asm["ptx"])
        log = subprocess.run([_tool("ptxas"), "-v", "-lineinfo", "--gpu-name", "sm_90a", path, "-o", cubin],
                             capture_output=True, text=True, check=True).stderr
        with open(cubin, "rb") as f:
            binary = f.read()
    regs = int(log.split("Used ")[1].split(" registers")[0])
    spills = int(log.split(" bytes spill stores")[0].rsplit(",", 1)[-1])
    return regs, spills, binary


def sass_report(cubin: bytes) -> str:
    """From the cubin's SASS (`nvdisasm -g`): local-memory stores and loads (spills) per source line, and global
    loads per opcode (their widths), the instructions as the code holds them, not how often they run."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([_tool("nvdisasm"), "-g", "-c", f.name], capture_output=True, text=True,
                              check=True).stdout
    line, local, loads = ("?", 0), collections.Counter(), collections.Counter()
    for text in sass.splitlines():
        if found := re.search(r'//## File "([^"]+)", line (\d+)', text):
            line = os.path.basename(found.group(1)), int(found.group(2))
        elif found := re.search(r"\b(STL|LDL|LDG)((?:\.\w+)*)\b", text):
            if found.group(1) == "LDG":
                loads[found.group(0)] += 1
            else:
                local[line, found.group(1)] += 1
    spills = [f"    {file + ':' + str(at):<30} {op} x{n}" for ((file, at), op), n in sorted(local.items())]
    return "\n".join(["  spills (local memory) by source line:", *spills, "  global loads:",
                      *(f"    {op:<30} x{n}" for op, n in sorted(loads.items()))])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", default="", help="compile only the cases whose name holds this")
    parser.add_argument("--set", nargs="*", default=[], metavar="NAME=VALUE",
                        help="module settings of lmlab.kernels.decode_layers, e.g. GEMV_TILE_ELEMS=16384")
    parser.add_argument("--sass", action="store_true", help="where each case spills, and its global loads' widths")
    args = parser.parse_args()
    apply_settings(known_settings(dict(item.split("=", 1) for item in args.set)), {})
    print(f"{'case':<34} {'warps':>5} {'regs':>5} {'spill B':>8} {'shared KiB':>10} {'fit/SM':>6} {'wanted':>6}")
    for name, case in CASES.items():
        if args.case not in name:
            continue
        plan = dl.plan_on_meta(*case)
        kernel = compile_sm90(plan, case[1])
        regs, spills, cubin = ptxas_report(kernel)
        warps, shared = plan.meta["num_warps"], kernel.metadata.shared
        fit = min(SM90["regs"] // (math.ceil(regs * 32 / 256) * 256 * warps),
                  SM90["shared"] // (shared + SM90["reserved"]), SM90["threads"] // (32 * warps))
        print(f"{name:<34} {warps:>5} {regs:>5} {spills:>8} {shared / 1024:>10.1f} {fit:>6} {plan.programs_per_sm:>6}",
              flush=True)
        if args.sass:
            print(sass_report(cubin), flush=True)


if __name__ == "__main__":
    main()
