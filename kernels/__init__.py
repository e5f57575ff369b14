"""Compute kernels behind small stable interfaces; models call these, never a backend directly."""

from uma_lightning.kernels.attention import attention

__all__ = ["attention"]
