"""Which server rank holds each server *slot* (a placement's server index), with replicas.

With ``ParameterServer(..., replicas=1)`` every slot ``s`` (the shards the placement puts
on server ``s``) is held by a **primary** rank and a **backup** rank: at start ``s`` and
``(s + 1) % k`` (``k`` server ranks, a ring, so every server rank is the primary of its own
slot and the backup of the previous one). Workers talk to primaries only; a primary
forwards every state-changing request (push, init, close) to its backup, which replays it,
and acknowledges it to the worker only once the backup has acknowledged it.

When server ranks fail, every rank applies :meth:`Routing.fail` with the failed ranks and
so derives the same routing: a slot's dead holders are dropped (its backup becomes the
primary), and a slot left with one holder gets as new backup the first live server rank
after its primary in ring order that does not hold it already (a *spare*); if there is
none the slot goes on unreplicated. A slot with no live holder is lost (the failure is
then fatal: :class:`~mpicoll.ProcessFailedError`).
"""
from __future__ import annotations

__all__ = ["Routing"]


class Routing:
    """The holders of each slot, primary first.

    Args:
        num_servers: number of server ranks (ranks ``0 .. k-1``) and slots.
        replicas: backups per slot (0 or 1).
    """

    def __init__(self, num_servers: int, replicas: int) -> None:
        self.num_servers = int(num_servers)
        self.replicas = int(replicas)
        self.dead: set[int] = set()
        self.holders: list[list[int]] = [
            [(s + i) % self.num_servers for i in range(self.replicas + 1)]
            for s in range(self.num_servers)]

    def primary(self, slot: int) -> int | None:
        """The rank serving ``slot`` (``None``: every holder died)."""
        h = self.holders[slot]
        return h[0] if h else None

    def backup(self, slot: int) -> int | None:
        """The rank replaying ``slot``'s updates (``None``: unreplicated)."""
        h = self.holders[slot]
        return h[1] if len(h) > 1 else None

    def slots_of(self, rank: int) -> list[int]:
        """The slots ``rank`` holds (as primary or backup)."""
        return [s for s, h in enumerate(self.holders) if rank in h]

    def lost(self) -> list[int]:
        """Slots with no live holder."""
        return [s for s, h in enumerate(self.holders) if not h]

    def fail(self, ranks: list[int] | set[int]) -> dict[int, tuple[list[int], list[int]]]:
        """Drop failed server ranks; give each slot that lost its backup a spare.

        Returns:
            slot -> (holders before, holders after) for every slot that changed.
        """
        new = {r for r in ranks if 0 <= r < self.num_servers} - self.dead
        if not new:
            return {}
        self.dead |= new
        changed = {}
        for slot, before in enumerate(self.holders):
            after = [r for r in before if r not in self.dead]
            if after:     # spares: the live ranks after the primary, in ring order
                ring = [(after[0] + step) % self.num_servers for step in range(1, self.num_servers)]
                spares = [r for r in ring if r not in self.dead and r not in after]
                after += spares[:self.replicas + 1 - len(after)]
            if after != before:
                changed[slot] = (list(before), after)
                self.holders[slot] = after
        return changed
