"""Compute kernels behind small stable interfaces; models call these, never a backend directly.

Each op takes a ``backend`` argument, set per op from :class:`KernelConfig` (the ``kernels:``
section of a model's config):

- ``attention``: see :mod:`uma_lightning.kernels.attention` (flash-attn, SDPA and its kernels, reference);
- ``rms_norm``, ``swiglu``, ``rotary``, ``cross_entropy``: ``triton``, ``torch`` or ``auto``;
- ``experts``: the experts of a mixture-of-experts layer, ``grouped``, ``loop`` or ``auto`` (see :mod:`uma_lightning.kernels.experts`);
- ``linear``: ``torch``, or ``float8`` for float8 training through torchao on Ada/Hopper GPUs.

The Triton ops are registered as ``torch.ops.uma.*`` custom ops with their own backward, so
torch.compile keeps them in its graph instead of breaking around them.
"""

from uma_lightning.kernels.attention import attention
from uma_lightning.kernels.cross_entropy import linear_cross_entropy
from uma_lightning.kernels.dispatch import KernelConfig
from uma_lightning.kernels.experts import expert_feed_forward
from uma_lightning.kernels.float8 import convert_to_float8
from uma_lightning.kernels.rms_norm import rms_norm
from uma_lightning.kernels.rotary import apply_rotary
from uma_lightning.kernels.swiglu import swiglu

__all__ = [
    "KernelConfig",
    "apply_rotary",
    "attention",
    "convert_to_float8",
    "expert_feed_forward",
    "linear_cross_entropy",
    "rms_norm",
    "swiglu",
]
