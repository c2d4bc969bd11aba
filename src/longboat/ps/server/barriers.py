"""The named barriers of one parameter server: who reached each generation, and which
generations completed (independent counters: the engine's, kv's and fleet's never mix)."""

from __future__ import annotations

from collections.abc import Iterator


class Barriers:
    """Arrivals per (name, generation) and the highest generation completed per name; every
    method runs under the server state's lock."""

    def __init__(self) -> None:
        self.arrived: dict[tuple[str, int], set[int]] = {}
        self.done: dict[str, int] = {}  # name -> the highest generation completed

    def arrive(self, name: str, gen: int, trainer: int) -> None:
        """``trainer`` reached generation ``gen`` of ``name`` (generations two behind are
        forgotten)."""
        self.arrived.setdefault((name, gen), set()).add(trainer)
        for old in [k for k in self.arrived if k[0] == name and k[1] < gen - 1]:
            del self.arrived[old]

    def over(self, name: str, gen: int, present: set[int]) -> bool:
        """Generation ``gen`` completed, every trainer in ``present`` reached it, or one is
        past it."""
        return (
            gen <= self.done.get(name, 0)
            or present <= self.arrived.get((name, gen), set())
            or any(n == name and g > gen for n, g in self.arrived)
        )

    def complete(self, name: str, gen: int) -> None:
        self.done[name] = max(gen, self.done.get(name, 0))

    def latest(self, name: str) -> int:
        """The highest generation of ``name`` completed (0: none)."""
        return self.done.get(name, 0)

    def absent(self, name: str, gen: int, everyone: set[int]) -> list[int]:
        """The trainers of ``everyone`` that have not reached generation ``gen`` of ``name``."""
        return sorted(everyone - self.arrived.get((name, gen), set()))

    def waiting(self, present: set[int]) -> Iterator[tuple[int, str]]:
        """Each trainer of ``present`` a barrier with arrivals waits for, with that barrier,
        barriers in order of (name, generation)."""
        for (name, gen), arrived in sorted(self.arrived.items()):
            if arrived and not self.over(name, gen, present):
                for t in sorted(present - arrived):
                    yield t, f"barrier {name or 'step'} {gen}"

    def clear(self) -> None:
        self.arrived.clear()
        self.done.clear()
