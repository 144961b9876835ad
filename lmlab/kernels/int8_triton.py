"""int8 weight codes to float32 inside Triton kernels (the int8 of lmlab.inference.quant, read by the decode kernels).

A matrix-vector product at batch 1 converts every weight it reads. The conversion instruction (I2F) runs at a quarter
of the FMA rate on sm_90, once per weight; `_int8_to_f32` uses integer byte moves and a subtraction instead. Under
Triton's CPU interpreter (TRITON_INTERPRET=1), which runs no PTX, `as_f32` casts.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

PTX_INT8: tl.constexpr = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")


@triton.jit
def _int8_to_f32(w):
    """Four codes a register; each, its sign bit flipped, becomes the low byte of 2^23's bits, which reads as
    2^23 + 128 + code, and one subtraction leaves the code (exact)."""
    return tl.inline_asm_elementwise("""{
        .reg .b32 t;
        xor.b32 t, $4, 0x80808080;
        prmt.b32 $0, t, 0x4B000000, 0x7650;
        prmt.b32 $1, t, 0x4B000000, 0x7651;
        prmt.b32 $2, t, 0x4B000000, 0x7652;
        prmt.b32 $3, t, 0x4B000000, 0x7653;
        sub.f32 $0, $0, 0f4B000080;
        sub.f32 $1, $1, 0f4B000080;
        sub.f32 $2, $2, 0f4B000080;
        sub.f32 $3, $3, 0f4B000080;
    }""", "=r,=r,=r,=r,r", [w], dtype=tl.float32, is_pure=True, pack=4)


@triton.jit
def as_f32(w):
    """A weight tile (int8 codes or floats) in float32."""
    if PTX_INT8 and w.dtype == tl.int8:
        return _int8_to_f32(w)
    else:
        return w.to(tl.float32)
