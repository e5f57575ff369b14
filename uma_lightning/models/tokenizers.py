"""Modality tokenizers: each turns one kind of robot data into tokens for the backbone.

- camera frames (uint8) -> patch embeddings, with pixel normalisation inside the model;
- proprioceptive state -> one linear token per observation step;
- language -> UTF-8 bytes (no vocabulary file, nothing downloaded);
- continuous actions in [-1, 1] -> uniform bins, the targets of next-token pretraining.
"""

from __future__ import annotations

import torch
from torch import nn


class ImagePatchTokenizer(nn.Module):
    """uint8 frames [N, H, W, 3] -> patch tokens [N, n_patches, dim]."""

    def __init__(self, image_size: tuple[int, int], patch_size: int, dim: int):
        super().__init__()
        height, width = image_size
        if height % patch_size or width % patch_size:
            raise ValueError(f"image size {height}x{width} is not divisible by patch_size={patch_size}")
        self.n_patches = (height // patch_size) * (width // patch_size)
        self.proj = nn.Conv2d(3, dim, kernel_size=patch_size, stride=patch_size)
        self.position = nn.Parameter(torch.zeros(self.n_patches, dim))
        # ImageNet statistics: a fixed, documented choice that keeps inputs near unit scale.
        self.register_buffer("mean", torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1) * 255, persistent=False)
        self.register_buffer("std", torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1) * 255, persistent=False)

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        if frames.dtype != torch.uint8:
            raise TypeError(f"camera frames must be uint8 [N, H, W, 3], got {frames.dtype}")
        pixels = frames.permute(0, 3, 1, 2).to(self.proj.weight.dtype)
        pixels = (pixels - self.mean.to(pixels.dtype)) / self.std.to(pixels.dtype)
        return self.proj(pixels).flatten(2).transpose(1, 2) + self.position


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255, plus a padding id; fixed length so batches stack."""

    PAD = 256
    vocab_size = 257

    def __init__(self, max_len: int):
        self.max_len = max_len

    def __call__(self, texts: list[str], device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [B, max_len] int64 and mask [B, max_len] bool (True on real bytes). Long texts are cut."""
        ids = torch.full((len(texts), self.max_len), self.PAD, dtype=torch.long)
        for row, text in enumerate(texts):
            encoded = text.encode("utf-8")[: self.max_len]
            if encoded:
                ids[row, : len(encoded)] = torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
        ids = ids.to(device)
        return ids, ids != self.PAD

    def decode(self, ids: torch.Tensor) -> str:
        return bytes(int(i) for i in ids if i != self.PAD).decode("utf-8", errors="replace")


class ActionBinner:
    """Uniform binning of normalised actions in [-1, 1]; values outside are clamped."""

    def __init__(self, n_bins: int):
        self.n_bins = n_bins

    def encode(self, actions: torch.Tensor) -> torch.Tensor:
        scaled = (actions.clamp(-1.0, 1.0) + 1.0) / 2.0 * self.n_bins
        return scaled.long().clamp_(max=self.n_bins - 1)

    def decode(self, bins: torch.Tensor) -> torch.Tensor:
        """Bin centres, so encode(decode(b)) == b."""
        return (bins.float() + 0.5) / self.n_bins * 2.0 - 1.0
