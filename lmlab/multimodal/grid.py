"""PNG grids of images, e.g. originals above their reconstructions."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image

from lmlab.atomic import atomic_write


def save_image_grid(rows: list[torch.Tensor], path: str | Path, scale: int = 4, gap: int = 2) -> Path:
    """Write rows of images (each (N, 3, H, W) in [0, 1], the same N, H and W) as one PNG, each image
    enlarged `scale` times (nearest neighbour, so a pixel stays a pixel) with `gap` pixels between them."""
    if not rows or any(r.shape != rows[0].shape or r.dim() != 4 or r.shape[1] != 3 for r in rows):
        shapes = [tuple(r.shape) for r in rows]
        raise ValueError(f"save_image_grid takes rows of equal (N, 3, H, W) shapes, got {shapes}")
    n, _, h, w = rows[0].shape
    cell_h, cell_w = h * scale + gap, w * scale + gap
    canvas = np.full((len(rows) * cell_h + gap, n * cell_w + gap, 3), 255, dtype=np.uint8)
    for r, row in enumerate(rows):
        pixels = (row.detach().float().clamp(0, 1).cpu() * 255).round().to(torch.uint8)
        pixels = pixels.repeat_interleave(scale, 2).repeat_interleave(scale, 3).permute(0, 2, 3, 1).numpy()
        for i, image in enumerate(pixels):
            top, left = gap + r * cell_h, gap + i * cell_w
            canvas[top:top + h * scale, left:left + w * scale] = image
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda tmp: Image.fromarray(canvas).save(tmp, format="PNG"))
    return path
