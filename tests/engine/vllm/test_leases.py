"""The scheduler's lease book (``engine.vllm.leases``): what it holds, lends and gives back."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.vllm.leases import LeaseBook, PreLease, lease_chunks


@dataclass(eq=False)
class FakeLease:
    locations: tuple[tuple[int, int], ...]
    arena: str = "arena-1"
    released: int = 0
    log: list[str] = field(default_factory=list)

    @property
    def num_blocks(self) -> int:
        return len(self.locations)

    def release(self) -> None:
        self.released += 1


def _lease(n: int) -> FakeLease:
    return FakeLease(tuple((i * 64, 64) for i in range(n)))


def test_a_lent_lease_goes_back_only_when_its_copies_landed() -> None:
    book = LeaseBook()
    a = _lease(4)
    book.take("a", a)
    assert book.lend("a", 1, 2) == PreLease("arena-1", ((64, 64), (128, 64)))
    assert book.end_step() == 0 and a.released == 0  # lent: the step's end keeps it
    book.landed({"b"})
    assert a.released == 0
    book.landed({"a"})
    assert a.released == 1 and not book.lent
    book.landed({"a"})
    assert a.released == 1


def test_a_lease_not_lent_in_its_step_goes_back_at_the_step_end() -> None:
    """A request looked up but not allocated (or loading nothing) pins nothing past the step;
    a lease covering none of the load, an empty one, a second lookup's or a finished
    request's held one goes back at once."""
    book = LeaseBook()
    a, b, c, d, e = _lease(3), _lease(2), _lease(0), _lease(2), _lease(2)
    book.take("a", a)
    book.take("b", b)
    book.take("c", c)
    assert c.released == 1 and "c" not in book.held
    assert book.lend("b", 2, 4) is None and b.released == 1  # the load starts past the lease
    assert book.lend("x", 0, 4) is None
    book.take("d", d)
    book.take("d", e)  # looked up again: the first goes back
    assert d.released == 1
    book.drop("d")
    assert e.released == 1
    assert book.end_step() == 1 and a.released == 1
    book.take("a", a)
    book.lend("a", 0, 3)
    book.take("a", b)  # vLLM loads the request again before the first report
    book.lend("a", 0, 2)
    book.close()
    assert a.released == 2 and b.released == 2


def test_lease_chunks_grow_fourfold_and_cover_the_load() -> None:
    assert lease_chunks(0, 4) == []
    assert lease_chunks(30, 2) == [(0, 2), (2, 10), (10, 30)]
    assert lease_chunks(3, 0) == [(0, 1), (1, 3)]
