"""Modality tokenizers: each turns one kind of robot data into tokens for the backbone.

- camera frames (uint8) -> patch embeddings or keypoint tokens (``VisionConfig``), with pixel
  normalisation inside the model;
- proprioceptive state -> one linear token per observation step;
- language -> UTF-8 bytes (no vocabulary file, nothing downloaded);
- continuous actions in [-1, 1] -> uniform bins, the targets of next-token pretraining.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class VisionConfig:
    """How camera frames become tokens.

    - ``patches``: each ``patch_size`` square patch projected linearly, one token per patch (ViT).
    - ``keypoints``: a small conv net computes ``n_keypoints`` feature maps; each map's spatial
      softmax gives the expected (x, y) of what it responds to, and each keypoint becomes one token
      from its (x, y) and a learned identity (deep spatial autoencoders, robomimic). It puts the
      positions of things straight into the tokens, which a tiny backbone cannot learn from patches
      in a few hundred steps (``benchmarks/vision_probe.py``). With ``film``, the instruction scales
      and shifts the net's features before the keypoint maps (FiLM, as RT-1 conditions its image
      encoder), so a keypoint can follow the object the instruction names.

    Args:
        tokenizer: patches or keypoints.
        patch_size: patches: side of each square patch, in pixels.
        n_keypoints: keypoints: feature maps, one token each.
        channels: keypoints: width of the conv net's first layers (its third has twice as many).
        film: keypoints: condition the net's features on the instruction (FiLM).
    """

    tokenizer: str = "patches"
    patch_size: int = 8
    n_keypoints: int = 64
    channels: int = 32
    film: bool = False

    def __post_init__(self):
        if self.tokenizer not in ("patches", "keypoints"):
            raise ValueError(f"vision.tokenizer must be 'patches' or 'keypoints', got {self.tokenizer!r}")
        if self.film and self.tokenizer != "keypoints":
            raise ValueError("vision.film conditions the keypoint net: it needs vision.tokenizer 'keypoints'")

    def tokens_per_image(self, image_size: tuple[int, int]) -> int:
        if self.tokenizer == "keypoints":
            return self.n_keypoints
        height, width = image_size
        return (height // self.patch_size) * (width // self.patch_size)


class _ImageTokenizer(nn.Module):
    """Pixel normalisation shared by the image tokenizers."""

    def __init__(self):
        super().__init__()
        # ImageNet statistics: a fixed, documented choice that keeps inputs near unit scale.
        self.register_buffer("mean", torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1) * 255, persistent=False)
        self.register_buffer("std", torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1) * 255, persistent=False)

    def normalised_pixels(self, frames: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """uint8 [N, H, W, 3] -> [N, 3, H, W] of ``dtype``, near zero mean and unit scale."""
        if frames.dtype != torch.uint8:
            raise TypeError(f"camera frames must be uint8 [N, H, W, 3], got {frames.dtype}")
        pixels = frames.permute(0, 3, 1, 2).to(dtype)
        return (pixels - self.mean.to(dtype)) / self.std.to(dtype)


class ImagePatchTokenizer(_ImageTokenizer):
    """uint8 frames [N, H, W, 3] -> patch tokens [N, n_patches, dim]."""

    def __init__(self, image_size: tuple[int, int], patch_size: int, dim: int):
        super().__init__()
        height, width = image_size
        if height % patch_size or width % patch_size:
            raise ValueError(f"image size {height}x{width} is not divisible by patch_size={patch_size}")
        self.n_patches = (height // patch_size) * (width // patch_size)
        self.proj = nn.Conv2d(3, dim, kernel_size=patch_size, stride=patch_size)
        self.position = nn.Parameter(torch.zeros(self.n_patches, dim))

    def reset_parameters(self) -> None:
        nn.init.normal_(self.position, std=0.02)
        self.proj.reset_parameters()

    def forward(self, frames: torch.Tensor, instruction: torch.Tensor | None = None) -> torch.Tensor:
        return (
            self.proj(self.normalised_pixels(frames, self.proj.weight.dtype)).flatten(2).transpose(1, 2) + self.position
        )


class ImageKeypointTokenizer(_ImageTokenizer):
    """uint8 frames [N, H, W, 3] -> keypoint tokens [N, n_keypoints, dim] (see ``VisionConfig``)."""

    def __init__(self, image_size: tuple[int, int], n_keypoints: int, channels: int, dim: int, film: bool = False):
        super().__init__()
        height, width = image_size
        if height % 2 or width % 2:
            raise ValueError(f"image size {height}x{width}: the keypoint tokenizer needs even sides")
        self.n_keypoints = n_keypoints
        # One stride-2 layer: keypoints live on a half-resolution grid, fine enough for the simulator's objects.
        self.features = nn.Sequential(
            nn.Conv2d(3, channels, 5, padding=2),
            nn.ReLU(),
            nn.Conv2d(channels, channels, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, 3, padding=1),
        )
        self.keypoint_maps = nn.Conv2d(2 * channels, n_keypoints, 1, bias=False)  # no bias: the maps are standardised
        self.sharpness = nn.Parameter(torch.full((1,), 2.0))  # 1-D: FSDP2 cannot shard a 0-dim parameter
        # Per-channel scale and shift of the last features from the instruction; zero at start: no conditioning.
        self.film = nn.Linear(dim, 4 * channels) if film else None
        # Cell centres of the half-resolution grid in [-1, 1], x then y: the expected position is a matmul.
        ys = torch.linspace(-1, 1, height // 2).repeat_interleave(width // 2)
        xs = torch.linspace(-1, 1, width // 2).repeat(height // 2)
        self.register_buffer("grid", torch.stack((xs, ys), dim=1), persistent=False)
        self.coordinates = nn.Linear(2, dim)
        self.identity = nn.Parameter(torch.zeros(n_keypoints, dim))

    def reset_parameters(self) -> None:
        for layer in self.features:
            if isinstance(layer, nn.Conv2d):
                layer.reset_parameters()
        self.keypoint_maps.reset_parameters()
        nn.init.constant_(self.sharpness, 2.0)
        if self.film is not None:
            nn.init.zeros_(self.film.weight), nn.init.zeros_(self.film.bias)
        self.coordinates.reset_parameters()
        nn.init.normal_(self.identity, std=0.02)

    def positions(self, frames: torch.Tensor, instruction: torch.Tensor | None = None) -> torch.Tensor:
        """[N, n_keypoints, 2]: each feature map's expected (x, y) in [-1, 1] (left/top is -1).
        ``instruction`` [N, dim] conditions the features when the tokenizer was built with ``film``."""
        features = self.features(self.normalised_pixels(frames, self.identity.dtype))
        if self.film is not None:
            if instruction is None:
                raise ValueError("this keypoint tokenizer is conditioned on the instruction (film): pass it")
            # Normalised: byte embeddings start tiny, and would make the conditioning learn slowly.
            instruction = nn.functional.layer_norm(instruction, instruction.shape[-1:])
            scale, shift = self.film(instruction)[:, :, None, None].chunk(2, dim=1)
            features = features * (1 + scale) + shift
        maps = self.keypoint_maps(torch.relu(features)).flatten(2)
        # Standardised over the image, then sharpened by a learned factor: at initialisation the maps are
        # nearly flat (spatial std ~0.01), and a softmax of flat maps puts every keypoint at the centre,
        # where they would stay for hundreds of steps.
        maps = (maps - maps.mean(-1, keepdim=True)) / (maps.std(-1, keepdim=True) + 1e-6) * self.sharpness
        attention = maps.softmax(dim=-1)  # [N, K, h*w]: where each keypoint looks
        return attention @ self.grid.to(attention.dtype)

    def forward(self, frames: torch.Tensor, instruction: torch.Tensor | None = None) -> torch.Tensor:
        return self.coordinates(self.positions(frames, instruction)) + self.identity


def build_image_tokenizer(vision: VisionConfig, image_size: tuple[int, int], dim: int) -> nn.Module:
    if vision.tokenizer == "keypoints":
        return ImageKeypointTokenizer(image_size, vision.n_keypoints, vision.channels, dim, vision.film)
    return ImagePatchTokenizer(image_size, vision.patch_size, dim)


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
