"""The parameter server's exception."""
from __future__ import annotations

from ..errors import CollectiveError

__all__ = ["PSError"]


class PSError(CollectiveError):
    """A parameter-server request failed, or ranks disagree about the server's set-up.

    Raised on a worker when a server rejects a request (unknown key, wrong shape or dtype,
    push before init, duplicate init, ...): the message carries the server's reason and
    the server keeps serving the other workers. Also raised, on every rank, when the
    collective set-up (constructor, restore) finds ranks or a checkpoint that disagree.

    Attributes:
        reasons: one line per rejected request (server rank and reason).
    """

    def __init__(self, message: str, reasons: list[str] | None = None) -> None:
        super().__init__(message)
        self.reasons = list(reasons or [])
