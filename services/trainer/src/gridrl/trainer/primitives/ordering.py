"""A client's requests to one training model run in the order it numbered them.

Tinker's SDK numbers each training client's requests (``seq_id`` 1, 2, ... after
``create_model``; a model created from a saved state starts with its load at 0) and sends
them on separate connections, so they may arrive out of order; the server must run them in
``seq_id`` order (a forward-backward before the optimizer step that applies it).
:class:`SequenceGate` holds what arrived early and releases runs of consecutive numbers. A
number received twice (the SDK retried a request whose answer it lost) is the same request:
the gate answers the first one's ticket. Pure: no threads, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

from gridrl.common.errors import invalid_argument

T = TypeVar("T")


@dataclass
class SequenceGate(Generic[T]):
    """Releases items in sequence-number order.

    Attributes:
        next_seq: the number that runs next.
        held: items that arrived before their turn, by number.
        seen: ticket of every number taken (for repeats).
    """

    next_seq: int = 1
    held: dict[int, T] = field(default_factory=dict)
    seen: dict[int, str] = field(default_factory=dict)

    def repeat_of(self, seq: int) -> str | None:
        """The ticket (request id) given to ``seq`` before, or None when it is new."""
        return self.seen.get(seq)

    def offer(self, seq: int | None, item: T, ticket: str) -> list[T]:
        """Take request ``seq`` (None: after everything taken so far) and return the items
        that may run now, in order (empty while an earlier number is missing).

        Raises:
            StatusError: INVALID_ARGUMENT ``seq_id`` for a number already run or held
                (callers look for a repeat with :meth:`repeat_of` first).
        """
        if seq is None:
            seq = max([self.next_seq - 1, *self.held]) + 1
        if seq < self.next_seq or seq in self.held:
            raise invalid_argument("seq_id", f"{seq} was already received (next expected: "
                                   f"{self.next_seq})")
        self.held[seq] = item
        self.seen[seq] = ticket
        ready = []
        while self.next_seq in self.held:
            ready.append(self.held.pop(self.next_seq))
            self.next_seq += 1
        return ready

    @property
    def waiting(self) -> list[int]:
        """Numbers held for an earlier one, ascending."""
        return sorted(self.held)
