"""Peak throughput of known accelerators, for model FLOPs utilisation (MFU)."""

from __future__ import annotations

import torch

# Dense (no sparsity) bf16 tensor-core peak FLOP/s from the vendors' datasheets, keyed by a
# fragment of `torch.cuda.get_device_name()`. Longer fragments are tried first.
BF16_PEAK_FLOPS = {
    "H200": 989e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
    "A10G": 125e12,
    "4090": 165e12,
}


def peak_flops(device: torch.device) -> float | None:
    """The bf16 peak of `device`, or None where it is unknown (CPUs, unlisted GPUs)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for fragment in sorted(BF16_PEAK_FLOPS, key=len, reverse=True):
        if fragment in name:
            return BF16_PEAK_FLOPS[fragment]
    return None
