"""Random number generator state of one process (python, numpy, torch CPU and CUDA) as tensors, and
per-rank seeding.

As tensors, the states of every rank go into the sharded checkpoint under ``rng/<rank>/...`` and load
back without pickle.
"""

from __future__ import annotations

import random

import numpy as np
import torch


def capture() -> dict[str, torch.Tensor]:
    version, internal, gauss_next = random.getstate()
    kind, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        # Python's Mersenne Twister words are < 2**32: exact in int64. The floats are exact in float64.
        "python": torch.tensor(internal, dtype=torch.int64),
        "python_gauss": torch.tensor([version, gauss_next is not None, gauss_next or 0.0], dtype=torch.float64),
        "numpy": torch.from_numpy(keys.astype(np.int64)),
        "numpy_gauss": torch.tensor([position, has_gauss, cached_gaussian], dtype=torch.float64),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.stack(torch.cuda.get_rng_state_all())
    return state


def restore(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["torch"])
    version, has_gauss_next, gauss_next = state["python_gauss"].tolist()
    random.setstate((int(version), tuple(state["python"].tolist()), gauss_next if has_gauss_next else None))
    position, has_gauss, cached_gaussian = state["numpy_gauss"].tolist()
    np.random.set_state(
        ("MT19937", state["numpy"].numpy().astype(np.uint32), int(position), int(has_gauss), cached_gaussian)
    )
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(state["cuda"]))


def seed_process(seed: int, rank: int) -> None:
    """Seed python, numpy and torch from (seed, rank): reproducible, and different on every rank, so that
    ranks do not draw identical noise."""
    torch_seed, numpy_seed = np.random.SeedSequence([seed, rank]).generate_state(2, dtype=np.uint64).tolist()
    torch.manual_seed(torch_seed)
    random.seed(torch_seed)
    np.random.seed(numpy_seed % 2**32)
