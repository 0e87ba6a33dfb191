"""The backend's name and :class:`Options` (a ``c10d::Backend::Options``, like gloo's and
NCCL's), importable without building the backend's C++ extension."""
from __future__ import annotations

from datetime import timedelta
from typing import Any

from torch._C._distributed_c10d import Backend as _C10dBackend

__all__ = ["BACKEND", "Options", "CHECKS"]

#: The backend name for ``dist.init_process_group``.
BACKEND = "mpicoll"
#: The values of :attr:`Options.check`.
CHECKS = ("every", "first")


class Options(_C10dBackend.Options):
    """Options of an mpicoll process group: ``init_process_group("mpicoll",
    pg_options=Options(...))`` or ``new_group(..., pg_options=Options(...))``.

    A ``torch.distributed`` ``Backend.Options`` (as ``ProcessGroupGloo.Options``): each
    group keeps its own copy, in which ``_timeout`` is the group's timeout (from
    ``timeout=`` of ``init_process_group``/``new_group``, then ``set_timeout``),
    ``group_name`` the group's name and ``global_ranks_in_group`` its ranks (``[]``: the
    default group); ``backend`` is ``"mpicoll"``. ``pg._get_backend(device).options``
    returns it.

    Args:
        algorithm: the all-reduce algorithm (a name registered for ``allreduce``, or
            ``"auto"``); ``None``: ``MPICOLL_ALLREDUCE_ALGORITHM``, else ``"auto"``.
        check: ``"every"`` (default): every collective call is agreed on first, so bad or
            mismatched arguments raise on every rank instead of hanging; ``"first"``: only
            the first call of each kind (unless ``MPICOLL_CHECK=1``).
    Raises:
        ValueError: ``check`` is not one of :data:`CHECKS`.
    """

    def __init__(self, algorithm: str | None = None, check: str = "every") -> None:
        if check not in CHECKS:
            raise ValueError(f"check={check!r}; choose one of {', '.join(CHECKS)}")
        super().__init__(BACKEND)
        self.algorithm = algorithm
        self.check = check

    def for_group(self, timeout: timedelta | None, group_name: str,
                  ranks: list[int]) -> Options:
        """A copy for one group, with its timeout, name and ranks."""
        mine = Options(self.algorithm, self.check)
        mine._timeout = timeout if timeout is not None else self._timeout
        mine.group_name = group_name
        mine.global_ranks_in_group = list(ranks)
        return mine

    def __copy__(self) -> Options:
        return self.for_group(self._timeout, self.group_name, self.global_ranks_in_group)

    def __deepcopy__(self, memo: dict[int, Any]) -> Options:
        return self.__copy__()

    def __repr__(self) -> str:
        return (f"Options(algorithm={self.algorithm!r}, check={self.check!r}, "
                f"timeout={self._timeout}, group_name={self.group_name!r})")
