"""Quantized weight codes to float32 inside Triton kernels: the int8 and int4 of lmlab.inference.quant, read by the
decode kernels (lmlab.kernels.decode_tiles_triton, decode_layers_triton, normed_head_triton).

A matrix-vector product at batch 1 converts every weight it reads. The conversion instruction (I2F) runs at a quarter
of the FMA rate on sm_90, once per weight; here integer byte moves and one subtraction do it: a code c placed in the
low byte of 2^23's bits reads as the float 2^23 + c. Under Triton's CPU interpreter (TRITON_INTERPRET=1), which runs
no PTX, the same values come from casts.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

PTX: tl.constexpr = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")


def _bytes_as_floats(source: str, first: int, minus: str) -> str:
    """PTX: byte i of register `source` into the low byte of 2^23's bits, as output $(first + i), minus `minus`."""
    return "".join([f"prmt.b32 ${first + i}, {source}, 0x4B000000, 0x765{i};\n" for i in range(4)]
                   + [f"sub.f32 ${first + i}, ${first + i}, {minus};\n" for i in range(4)])


# int8: four codes a register ($4); each, its sign bit flipped (+128), becomes 2^23 + 128 + code; minus 2^23 + 128
_INT8_PTX: tl.constexpr = tl.constexpr("{\n.reg .b32 t;\nxor.b32 t, $4, 0x80808080;\n"
                                       + _bytes_as_floats("t", 0, "0f4B000080") + "}")
# int4: four bytes a register ($8); the high nibbles, then the low ones, each 2^23 + code; minus 2^23 + 8
_NIBBLES_PTX: tl.constexpr = tl.constexpr("{\n.reg .b32 h, l;\nshr.b32 h, $8, 4;\nand.b32 h, h, 0x0F0F0F0F;\n"
                                          "and.b32 l, $8, 0x0F0F0F0F;\n" + _bytes_as_floats("h", 0, "0f4B000008")
                                          + _bytes_as_floats("l", 4, "0f4B000008") + "}")


@triton.jit
def _int8_to_f32(w):
    return tl.inline_asm_elementwise(_INT8_PTX, "=r,=r,=r,=r,r", [w], dtype=tl.float32, is_pure=True, pack=4)


@triton.jit
def as_f32(w):
    """A weight tile (int8 codes or floats) in float32."""
    if PTX and w.dtype == tl.int8:
        return _int8_to_f32(w)
    else:
        return w.to(tl.float32)


@triton.jit
def _nibbles_ptx(w):
    return tl.inline_asm_elementwise(_NIBBLES_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r", [w], dtype=(tl.float32, tl.float32),
                                     is_pure=True, pack=4)


@triton.jit
def nibbles_f32(w):
    """Bytes of two int4 codes each (the high nibble the even column's, as lmlab.inference.quant packs them) ->
    (code - 8 of the high nibbles, of the low ones), float32, each w's shape."""
    if PTX:
        return _nibbles_ptx(w)
    else:
        return ((w >> 4) & 15).to(tl.float32) - 8.0, (w & 15).to(tl.float32) - 8.0
