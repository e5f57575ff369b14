"""A least-recently-used map bounded by a total cost: open file handles (cost 1 each) or decoded data (bytes)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

Value = TypeVar("Value")


class LRU(Generic[Value]):
    """Values made on demand and kept until the total cost exceeds `capacity`; the least recently used go first.

    Keys that are held (`hold`: known later requests will ask for them, kept or not yet) go only
    when nothing else is left: a loader holds the frames its next batches show, so that frames
    used a while ago and never again leave before them. A value costing more than the whole
    capacity is returned but not kept. `on_evict` runs for every value that leaves the map (closing
    a file handle, for instance), including in `clear()`.
    """

    def __init__(
        self,
        capacity: float,
        cost: Callable[[Any], float] = lambda value: 1,
        on_evict: Callable[[Any], None] | None = None,
    ) -> None:
        self.capacity = capacity
        self.total = 0.0
        self.held_cost = 0.0  # the cost of the held values kept
        self._cost = cost
        self._on_evict = on_evict
        # Each in least recently used order: values no hold names, and held ones.
        self._items: OrderedDict[Hashable, tuple[Value, float]] = OrderedDict()
        self._held: OrderedDict[Hashable, tuple[Value, float]] = OrderedDict()
        self._holds: dict[Hashable, int] = {}

    def __len__(self) -> int:
        return len(self._items) + len(self._held)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._items or key in self._held

    def get(self, key: Hashable, make: Callable[[], Value]) -> Value:
        value = self.peek(key)
        if value is None:
            value = make()
            self.put(key, value)
        return value

    def peek(self, key: Hashable) -> Value | None:
        """The value for `key` if it is kept (marking it recently used), else None."""
        items = self._items if key in self._items else self._held if key in self._held else None
        if items is None:
            return None
        items.move_to_end(key)
        return items[key][0]

    def put(self, key: Hashable, value: Value) -> None:
        cost = float(self._cost(value))
        if key in self:
            self._drop(key)
        if cost > self.capacity:
            return
        if key in self._holds:
            self._held[key] = (value, cost)
            self.held_cost += cost
        else:
            self._items[key] = (value, cost)
        self.total += cost
        while self.total > self.capacity:
            self._drop(next(iter(self._items or self._held)))

    def hold(self, key: Hashable) -> None:
        """Count one more later request for `key`: until released, it goes after every unheld value."""
        self._holds[key] = self._holds.get(key, 0) + 1
        if key in self._items:
            self._held[key] = self._items.pop(key)
            self.held_cost += self._held[key][1]

    def release(self, key: Hashable) -> None:
        """Undo one `hold`; with none left, the value (if kept) goes as any other recently used one.
        A key not held is left as it is (a hold that failed half way is released whole)."""
        left = self._holds.get(key, 1) - 1
        if left:
            self._holds[key] = left
            return
        self._holds.pop(key, None)
        if key in self._held:
            self._items[key] = self._held.pop(key)
            self.held_cost -= self._items[key][1]

    def clear(self) -> None:
        for key in [*self._items, *self._held]:
            self._drop(key)

    def _drop(self, key: Hashable) -> None:
        if key in self._items:
            value, cost = self._items.pop(key)
        else:
            value, cost = self._held.pop(key)
            self.held_cost -= cost
        self.total -= cost
        if self._on_evict is not None:
            self._on_evict(value)
