"""Float8 training of the linear layers through torchao (``pip install 'uma-lightning[float8]'``).

Matmuls run in float8 with dynamic per-tensor scales, on GPUs with float8 tensor cores (Ada and
Hopper, compute capability 8.9 or newer); weights, optimizer state and everything outside the
converted layers keep their precision. It pays off on large matmuls under torch.compile; layers
whose sizes are not multiples of 16 stay as they are, because float8 matmuls cannot take them.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

from uma_lightning.kernels.dispatch import log_once

MIN_CAPABILITY = (8, 9)


def convert_to_float8(model: nn.Module, device: torch.device | None = None) -> nn.Module:
    """Swap eligible ``nn.Linear`` layers of ``model`` for torchao's float8 training layers, in place."""
    if importlib.util.find_spec("torchao") is None:
        raise RuntimeError("kernels.linear=float8 needs torchao: pip install 'uma-lightning[float8]'")
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < MIN_CAPABILITY:
        found = torch.cuda.get_device_capability(device) if device.type == "cuda" else device.type
        raise RuntimeError(
            f"kernels.linear=float8 needs a CUDA GPU with compute capability 8.9 or newer (Ada, Hopper), found {found}"
        )
    from torchao.float8 import convert_to_float8_training

    converted = []

    def eligible(module: nn.Module, name: str) -> bool:
        ok = isinstance(module, nn.Linear) and module.in_features % 16 == 0 and module.out_features % 16 == 0
        if ok:
            converted.append(name)
        return ok

    convert_to_float8_training(model, module_filter_fn=eligible)
    log_once(f"linear layers: float8 via torchao for {len(converted)} layers (kernels.linear=float8)")
    return model
