"""What the attention kernels compile to on sm_90, without a GPU: registers, spills, and how their wgmmas wait.

Compiles, for sm_90a with the ptxas that ships with Triton, every 16-bit tile setting of
`lmlab.kernels.flash_triton`'s three kernels (forward, dK/dV, dQ), each setting that the probes
sweep of `lmlab.kernels.flash_gluon`'s one-warpgroup kernels (the Hopper path), and each setting of its
warp-specialized ones (`flash_gluon_ws`, and the fused backward's `dkdvq_ws_kernel`), as a launch would
specialize them (causal, bf16, --group query heads per K/V head, 1 by default, pointers and strides 16-byte
aligned). Per kernel and setting it prints:

- registers per thread, spilled bytes (`ptxas -v`) and shared memory per block (an H100's or H200's SM holds
  228 KiB: two blocks of up to 113 KiB share one);
- HGMMA and `WARPGROUP.DEPBAR` counts in the SASS: one DEPBAR after every HGMMA means ptxas
  serialized the wgmmas, which it also says in a C75xx "Potential Performance Loss" line, shown;
- the `wgmma.wait_group` arguments in the PTX, in order: 0 waits for every wgmma in flight, N lets
  the N most recent groups run on (the Gluon kernels' overlap of the softmax with the tensor cores).

A warp-specialized kernel's registers are the launch's (`maxnreg`); its partitions then move them with
`setmaxnreg`, and ptxas says so (C7507) where one cannot keep what its code needs.

    python experiments/kernels/attention_sass.py [--head-dims 64 128] [--group 4]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource

from lmlab.kernels import flash_gluon, flash_gluon_fused, flash_gluon_kernels, flash_gluon_ws, flash_triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import attention_gluon_bwd_probe  # noqa: E402  (sibling scripts, not a package): their sweeps
import attention_gluon_probe  # noqa: E402

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
SM90 = GPUTarget("cuda", 90, 32)
POINTERS = {"Q": "bf16", "K": "bf16", "V": "bf16", "O": "bf16", "DO": "bf16", "DK": "bf16", "DV": "bf16",
            "DQ": "bf16", "LSE": "fp32", "DELTA": "fp32"}
FLOATS = ("qk_scale", "scale")


def _signature(names: list[str], constants: dict, descriptor=None) -> tuple[dict, dict]:
    """Triton's signature and alignment attributes for a launch with these argument names."""
    signature, attrs = {}, {}
    for i, name in enumerate(names):
        if name in constants:
            signature[name] = "constexpr"
        elif name.endswith("_desc"):
            signature[name] = descriptor(name)
        elif name in POINTERS:
            signature[name], attrs[(i,)] = "*" + POINTERS[name], [["tt.divisibility", 16]]
        elif name in FLOATS:
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if name.startswith(("stride", "SEQ")) or name.endswith(("_RB", "_RH", "_CH")):
                attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, attrs


def triton_kernel(kernel, head_dim: int, block_m: int, block_n: int, warps: int, stages: int):
    constants = {"HEAD_DIM": head_dim, "CAUSAL": True, "PREC": "tf32", "BLOCK_M": block_m, "BLOCK_N": block_n,
                 "GROUP": 1}
    names = kernel.arg_names
    signature, attrs = _signature(names, constants)
    source = ASTSource(kernel, signature, {(names.index(k),): v for k, v in constants.items()}, attrs)
    return triton.compile(source, target=SM90, options=dict(num_warps=warps, num_stages=stages))


def gluon_kernel(kernel, head_dim: int, block_m: int, block_n: int, num_buf: int, warps: int,
                 in_regs: bool | None = None):
    """A flash_gluon kernel; its descriptors of query rows (q, o, do, dq) take block_m rows, the others block_n.
    The fused backward's dq_desc is float32 (the dQ it reduces into); `in_regs` sets the kernel's resident-tiles-
    in-registers flag (the forward's Q_IN_REGS, the dK/dV kernel's KV_IN_REGS), False where not given."""
    constants = {"HEAD_DIM": head_dim, "BLOCK_M": block_m, "BLOCK_N": block_n, "NUM_BUF": num_buf,
                 "NUM_WARPS": warps, "GROUP": 1}
    for flag in (name for name in kernel.arg_names if name.endswith("_IN_REGS")):
        constants[flag] = bool(in_regs)

    def descriptor(name: str) -> str:
        if name in ("lse_desc", "delta_desc"):  # the key-block kernels' statistics, 1-D
            return f"tensordesc<fp32[{block_m}],{flash_gluon.STATS_LAYOUT!r}>"
        rows = block_m if name in ("q_desc", "o_desc", "do_desc", "dq_desc") else block_n
        fp32 = kernel is flash_gluon_fused.dkdvq_kernel and name == "dq_desc"
        layout = gl.NVMMASharedLayout.get_default_for([rows, head_dim], gl.float32 if fp32 else gl.bfloat16)
        return f"tensordesc<{'fp32' if fp32 else 'bf16'}[{rows}, {head_dim}],{layout!r}>"

    names = kernel.arg_names
    signature, attrs = _signature(names, constants, descriptor)
    source = GluonASTSource(kernel, signature, {(names.index(k),): v for k, v in constants.items()}, attrs)
    return triton.compile(source, target=SM90, options=dict(num_warps=warps))


def ws_kernel(kernel, head_dim: int, setting, group: int = 1):
    """A warp-specialized kernel at a flash_gluon.WsSetting (forward, dQ: 64-row query halves, streamed key blocks)
    or DkdvWsSetting (dK/dV, fused: 64-row key halves, streamed query blocks), as flash_gluon launches it."""
    key_block = isinstance(setting, flash_gluon.DkdvWsSetting)
    streamed = setting.block_m if key_block else setting.block_n
    constants = {"HEAD_DIM": head_dim, "NUM_BUF": setting.num_buf, "PINGPONG": setting.pingpong, "GROUP": group}
    if key_block:
        constants.update(BLOCK_M=setting.block_m, KV_IN_REGS=setting.kv_in_regs)
    else:
        constants["BLOCK_N"] = setting.block_n
    fused = kernel is flash_gluon_fused.dkdvq_ws_kernel

    def descriptor(name: str) -> str:
        if name in ("lse_desc", "delta_desc"):
            return f"tensordesc<fp32[{streamed}],{flash_gluon.STATS_LAYOUT!r}>"
        query_side = name in ("q_desc", "o_desc", "do_desc", "dq_desc")
        rows = flash_gluon_ws.ROWS_PER_CONSUMER if query_side != key_block else streamed
        fp32 = fused and name == "dq_desc"
        layout = gl.NVMMASharedLayout.get_default_for([rows, head_dim], gl.float32 if fp32 else gl.bfloat16)
        return f"tensordesc<{'fp32' if fp32 else 'bf16'}[{rows}, {head_dim}],{layout!r}>"

    names = kernel.arg_names
    signature, attrs = _signature(names, constants, descriptor)
    source = GluonASTSource(kernel, signature, {(names.index(k),): v for k, v in constants.items()}, attrs)
    maxnreg = flash_gluon_fused.FUSED_WS_MAXNREG if fused else flash_gluon_ws.MAXNREG
    return triton.compile(source, target=SM90, options=dict(num_warps=4, maxnreg=maxnreg))


def report(compiled) -> str:
    ptx = compiled.asm["ptx"]
    with tempfile.TemporaryDirectory() as tmp:
        ptx_path, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(ptx_path, "w") as f:
            f.write(ptx)
        log = subprocess.run([os.path.join(BIN, "ptxas"), "-v", "--gpu-name", "sm_90a", ptx_path, "-o", cubin],
                             capture_output=True, text=True, check=True).stderr
        sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", cubin], capture_output=True, text=True,
                              check=True).stdout
    registers = re.search(r"Used (\d+) registers", log).group(1)
    spills = re.search(r"(\d+) bytes spill stores", log).group(1)
    waits = ",".join(re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+)", ptx))
    warnings = "; ".join(w[:100] for w in re.findall(r"\(C75\d\d\)[^\n]*", log))
    return (f"{registers:>4} regs {spills:>5} B spilled {compiled.metadata.shared / 1024:6.1f} KiB shared  "
            f"HGMMA {sass.count('HGMMA.'):3}  "
            f"DEPBAR {len(re.findall('WARPGROUP.DEPBAR', sass)):3}  waits [{waits}]  {warnings}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--group", type=int, default=1, help="query heads per K/V head (the warp-specialized "
                        "kernels' loop over them is unrolled)")
    args = parser.parse_args()
    kernels = {"forward": (flash_triton._fwd_kernel, flash_triton._FWD_BLOCKS),
               "dK/dV": (flash_triton._bwd_dkdv_kernel, flash_triton._DKDV_BLOCKS),
               "dQ": (flash_triton._bwd_dq_kernel, flash_triton._DQ_BLOCKS)}
    for head_dim in args.head_dims:
        for name, (kernel, blocks) in kernels.items():
            for setting in blocks[0]:  # the 16-bit settings the autotuner picks from
                print(f"D{head_dim} Triton {name:8} {str(setting):18} "
                      f"{report(triton_kernel(kernel.fn, head_dim, *setting))}", flush=True)
        gluon = {"forward": (flash_gluon_kernels.forward_kernel, attention_gluon_probe.SETTINGS),
                 "dK/dV": (flash_gluon_kernels.dkdv_kernel, attention_gluon_bwd_probe.dkdv_settings(head_dim)),
                 "dQ": (flash_gluon_kernels.dq_kernel, attention_gluon_bwd_probe.DQ_SETTINGS),
                 "fused": (flash_gluon_fused.dkdvq_kernel, attention_gluon_bwd_probe.FUSED_SETTINGS[head_dim])}
        for name, (kernel, settings) in gluon.items():
            for setting in settings:
                print(f"D{head_dim} Gluon  {name:8} {str(setting):18} "
                      f"{report(gluon_kernel(kernel, head_dim, *setting))}",
                      flush=True)
        warp_specialized = {"forward": (flash_gluon_ws.forward_ws_kernel, flash_gluon.FWD_WS_SETTINGS[head_dim]),
                            "dQ": (flash_gluon_ws.dq_ws_kernel, flash_gluon.DQ_WS_SETTINGS[head_dim]),
                            "dK/dV": (flash_gluon_ws.dkdv_ws_kernel, flash_gluon.DKDV_WS_SETTINGS[head_dim]),
                            "fused": (flash_gluon_fused.dkdvq_ws_kernel, flash_gluon.FUSED_WS_SETTINGS[head_dim])}
        for name, (kernel, settings) in warp_specialized.items():
            for setting in settings:
                fields = ", ".join(str(v) for v in vars(setting).values())
                print(f"D{head_dim} WS     {name:8} ({fields}) "
                      f"{report(ws_kernel(kernel, head_dim, setting, args.group))}", flush=True)

if __name__ == "__main__":
    main()
