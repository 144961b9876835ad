"""Plain-PyTorch reference kernels.

These are the references the Triton kernels are tested against (forward and backward parity);
they run anywhere PyTorch does, CPU included.
"""

from lmlab.kernels.chunked_cross_entropy import chunked_cross_entropy
from lmlab.kernels.flash_reference import FlashAttentionReference, flash_attention_reference

__all__ = ["FlashAttentionReference", "chunked_cross_entropy", "flash_attention_reference"]
