"""A callback that measures, on each rank, the memory of building the model and loading the weights it
starts from (from the Lightning ``setup`` hook, before ``configure_model``, to ``on_fit_start``, after
the strategy's layout), and writes the whole model as every rank then holds it."""

import ctypes
import gc
import json
from pathlib import Path

import torch
from lightning.pytorch import Callback


def memory_kb(field: str) -> int:
    """``VmRSS`` (resident now) or ``VmHWM`` (its high-water mark) of this process, in KiB."""
    status = Path("/proc/self/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith(field)).split()[1])


def reset_peak() -> int:
    """Hand back what the allocator keeps, start the high-water mark again from here; the resident KiB."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")
    return memory_kb("VmRSS")


class LoadMemory(Callback):
    def __init__(self, out_dir: str):
        self.out_dir = Path(out_dir)
        self.before_kb = 0

    def setup(self, trainer, pl_module, stage):
        self.before_kb = reset_peak()

    def on_fit_start(self, trainer, pl_module):
        peak_kb = memory_kb("VmHWM") - self.before_kb
        # Gathering the shards is a collective: every rank takes part, rank 0 writes.
        models = {"": pl_module.model, "ema.": getattr(pl_module, "ema_model", None)}
        with torch.no_grad():
            state = {
                prefix + name: (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).clone()
                for prefix, model in models.items()
                if model is not None
                for name, tensor in model.state_dict().items()
            }
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps({"peak_kb": peak_kb}))
        if trainer.global_rank == 0:
            torch.save(state, self.out_dir / "model.pt")
