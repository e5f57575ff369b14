"""Asynchronous host-to-device copies: the next batch travels to the GPU on a side CUDA stream while the
current step computes, from page-locked (pinned) host memory so the copy does not block the host.

On a non-CUDA device the prefetcher hands batches through unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch


class DevicePrefetcher:
    """Iterates `batches` (dicts, lists or tensors) with their tensors already on `device`."""

    def __init__(self, batches: Iterable[Any], device: torch.device | str) -> None:
        self.batches = batches
        self.device = torch.device(device)

    def __iter__(self) -> Iterator[Any]:
        if self.device.type != "cuda":
            yield from self.batches
            return
        side = torch.cuda.Stream(self.device)
        source = iter(self.batches)
        upcoming = self._copy(next(source, None), side)
        while upcoming is not None:
            current_stream = torch.cuda.current_stream(self.device)
            current_stream.wait_stream(side)  # the step must not read the batch before its copy is done
            batch = upcoming
            _record(batch, current_stream)  # the allocator must not reuse its memory while the step uses it
            upcoming = self._copy(next(source, None), side)  # overlaps with the step that consumes `batch`
            yield batch

    def _copy(self, batch: Any, side: torch.cuda.Stream) -> Any:
        if batch is None:
            return None
        with torch.cuda.stream(side):
            return _to_device(batch, self.device)


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        host = value if value.is_pinned() else value.pin_memory()  # pageable memory would make the copy synchronous
        return host.to(device, non_blocking=True)
    if isinstance(value, dict):
        return {key: _to_device(item, device) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(item, device) for item in value)
    return value


def _record(value: Any, stream: torch.cuda.Stream) -> None:
    if isinstance(value, torch.Tensor):
        value.record_stream(stream)
    elif isinstance(value, dict):
        for item in value.values():
            _record(item, stream)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _record(item, stream)
