"""A least-recently-used map bounded by a total cost: open file handles (cost 1 each) or decoded data (bytes)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

Value = TypeVar("Value")


class LRU(Generic[Value]):
    """Values made on demand and kept until the total cost exceeds `capacity`; the least recently used go first.

    A value costing more than the whole capacity is returned but not kept. `on_evict` runs for every
    value that leaves the map (closing a file handle, for instance), including in `clear()`.
    """

    def __init__(
        self,
        capacity: float,
        cost: Callable[[Any], float] = lambda value: 1,
        on_evict: Callable[[Any], None] | None = None,
    ) -> None:
        self.capacity = capacity
        self.total = 0.0
        self._cost = cost
        self._on_evict = on_evict
        self._items: OrderedDict[Hashable, tuple[Value, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._items

    def get(self, key: Hashable, make: Callable[[], Value]) -> Value:
        if key in self._items:
            self._items.move_to_end(key)
            return self._items[key][0]
        value = make()
        self.put(key, value)
        return value

    def peek(self, key: Hashable) -> Value | None:
        """The value for `key` if it is kept (marking it recently used), else None."""
        if key not in self._items:
            return None
        self._items.move_to_end(key)
        return self._items[key][0]

    def put(self, key: Hashable, value: Value) -> None:
        cost = float(self._cost(value))
        if key in self._items:
            self._drop(key)
        if cost > self.capacity:
            return
        self._items[key] = (value, cost)
        self.total += cost
        while self.total > self.capacity:
            self._drop(next(iter(self._items)))

    def clear(self) -> None:
        for key in list(self._items):
            self._drop(key)

    def _drop(self, key: Hashable) -> None:
        value, cost = self._items.pop(key)
        self.total -= cost
        if self._on_evict is not None:
            self._on_evict(value)
