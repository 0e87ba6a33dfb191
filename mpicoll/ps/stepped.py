"""Operations written as generators of MPI requests, driven to completion by a handle.

An operation (a co-located step, a node group's step) is a generator that yields what it
waits for next and returns its result. :class:`SteppedHandle` runs it up to each wait,
keeps its result or its error for ``wait()``, and tells its owner when it is finished
(``owner.finished(handle)``): the owners run one operation at a time.
"""
from __future__ import annotations

from typing import Any, Generator

__all__ = ["SteppedHandle"]


class SteppedHandle:
    """The part every generator-driven handle shares: construction and stepping.

    Subclasses add ``test()`` and ``wait()`` for what their generator yields.

    Args:
        owner: has ``finished(handle)``, called once the generator has ended.
        kind: the operation's name (``"push"``, ``"pull"``, ``"push_pull"``...).
        steps: the operation's generator (started here, up to its first wait).
    """

    def __init__(self, owner: Any, kind: str, steps: Generator[Any, None, Any]) -> None:
        self.kind = kind
        self._owner = owner
        self._steps = steps
        self._reqs: Any = []
        self._done = False
        self._result: Any = None
        self._error: BaseException | None = None
        self._advance()

    def _advance(self) -> None:
        """Run the operation up to its next wait (or its end)."""
        try:
            self._reqs = self._steps.send(None)
        except StopIteration as stop:
            self._done, self._result = True, stop.value
        except BaseException as exc:  # noqa: BLE001  (re-raised by wait())
            self._done, self._error = True, exc
        if self._done:
            self._owner.finished(self)
