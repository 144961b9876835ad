"""Peak throughput of known accelerators, for model FLOPs utilisation (MFU) and rooflines."""

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

# Peak HBM/GDDR bandwidth in bytes/s from the same datasheets (A100: the 80 GB SXM part).
PEAK_BANDWIDTH = {
    "H200": 4.8e12,
    "H100 PCIe": 2.0e12,
    "H100": 3.35e12,
    "A100": 2.039e12,
    "L40S": 0.864e12,
    "L4": 0.3e12,
    "A10G": 0.6e12,
    "4090": 1.008e12,
}


def _lookup(table: dict[str, float], device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for fragment in sorted(table, key=len, reverse=True):
        if fragment in name:
            return table[fragment]
    return None


def peak_flops(device: torch.device) -> float | None:
    """The bf16 peak of `device`, or None where it is unknown (CPUs, unlisted GPUs)."""
    return _lookup(BF16_PEAK_FLOPS, device)


def peak_bandwidth(device: torch.device) -> float | None:
    """The memory bandwidth of `device` in bytes/s, or None where it is unknown."""
    return _lookup(PEAK_BANDWIDTH, device)
