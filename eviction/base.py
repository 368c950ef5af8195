"""The EvictionPolicy protocol: which block of a tier should leave first.

A policy orders the blocks resident in *one* tier (the store keeps one policy instance per tier).
It sees block ids (small ints from the radix index), sizes and times, never payloads or hashes,
and it never removes anything itself:

* ``insert`` / ``touch`` / ``remove`` keep its view in sync with the tier; the store calls them
  under its lock, once per event. ``remove`` of an unknown id is a no-op.
* ``candidates()`` yields ids in eviction order, best victim first. The store consumes it lazily,
  skips what it may not evict (pinned, in use, a block with cached children on the last tier),
  stops at its work cap, and only then removes the chosen blocks: eviction is atomic (it frees
  enough or evicts nothing). The store does not mutate the policy while iterating.
* ``admit`` lets a policy refuse a block at the door of an expensive tier (default: admit all).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator


class EvictionPolicy(ABC):
    name: str = ""

    @abstractmethod
    def insert(self, bid: int, size: int, now: float) -> None: ...

    @abstractmethod
    def touch(self, bid: int, now: float) -> None: ...

    @abstractmethod
    def remove(self, bid: int) -> None: ...

    @abstractmethod
    def candidates(self) -> Iterator[int]: ...

    @abstractmethod
    def __len__(self) -> int: ...

    def admit(self, bid: int, size: int, now: float) -> bool:
        return True
