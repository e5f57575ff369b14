"""A context in which torch's default dtype is another one, restored on exit."""

from contextlib import contextmanager

import torch


@contextmanager
def default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
