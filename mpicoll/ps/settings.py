"""The :class:`~mpicoll.ps.ParameterServer` constructor's arguments, checked on one rank.

:func:`check_settings` validates the arguments a rank passed (raising ``ValueError`` /
``TypeError`` with the argument's name) and returns a :class:`Settings`; the constructor
reports every rank's failure on every rank, then compares :meth:`Settings.as_plain` over
all ranks, so they either all raise or all derive the same layout.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..compression import Codec
from .compressed import resolve_codec
from .optimizers import check_hyperparameters

__all__ = ["Settings", "check_settings", "CONSISTENCY", "COLOCATED"]

CONSISTENCY = ("bsp", "asp", "ssp")

#: ``num_servers`` value of the co-located layout (every rank a worker and a server)
COLOCATED = "colocated"


@dataclass(frozen=True)
class Settings:
    """Checked constructor arguments (see :class:`~mpicoll.ps.ParameterServer`)."""

    num_servers: int | str
    consistency: str
    staleness: int
    optimizer: str
    hyperparameters: dict[str, float]
    average: bool
    split_bytes: int
    chunk_bytes: int
    init: bool
    restore: str | None
    reshard: bool
    keep_aggregate: bool
    backup_workers: int = 0
    #: the codec of pushes and pulls (``None``: uncompressed)
    compression: Codec | None = None
    #: error feedback of compressed pushes (and ``optimizer="sum"`` pulls)
    feedback: bool = True
    #: backup server ranks per shard (0: none; 1: primary + backup, see mpicoll.ps.replicas)
    replicas: int = 0
    #: the workers of a node push and pull as one: "auto", True or False
    #: (mpicoll.ps.node_aggregation)
    local_aggregation: Any = "auto"

    @property
    def compression_name(self) -> str | None:
        """The codec's name (``None`` without compression), compared across ranks."""
        return None if self.compression is None else self.compression.name

    @property
    def colocated(self) -> bool:
        """The co-located layout: every rank a worker and the server of its shards."""
        return self.num_servers == COLOCATED

    @property
    def first_worker(self) -> int:
        """Rank of the first worker (whose values initialize the parameters)."""
        return 0 if self.colocated else int(self.num_servers)

    def is_server(self, rank: int) -> bool:
        """Whether ``rank`` is a server process (never, co-located)."""
        return rank < self.first_worker

    def as_plain(self) -> dict:
        """Plain values that every rank must have alike (compared at set-up), by name."""
        return {"num_servers": self.num_servers, "consistency": self.consistency,
                "staleness": self.staleness, "optimizer": self.optimizer,
                **self.hyperparameters, "average": self.average,
                "split_bytes": self.split_bytes, "chunk_bytes": self.chunk_bytes,
                "init": self.init, "restore": self.restore, "reshard": self.reshard,
                "keep_aggregate": self.keep_aggregate, "backup_workers": self.backup_workers,
                "compression": self.compression_name, "feedback": self.feedback,
                "replicas": self.replicas, "local_aggregation": str(self.local_aggregation)}


def _check_layout(size: int, num_servers: Any, consistency: Any, init: bool) -> None:
    colocated = num_servers == COLOCATED
    if not colocated and (isinstance(num_servers, bool) or not isinstance(num_servers, int)
                          or not 1 <= num_servers < size):
        raise ValueError(f"num_servers={num_servers!r} must be an int in 1..{size - 1} "
                         f"(at least one rank must be a worker; world size {size}) "
                         f"or {COLOCATED!r}")
    if consistency not in CONSISTENCY:
        raise ValueError(f"consistency={consistency!r} is not one of {CONSISTENCY}")
    if colocated and consistency != "bsp":
        raise ValueError(f"num_servers={COLOCATED!r} supports only consistency='bsp' "
                         f"(a rank serves its shards only inside its own calls, so "
                         f"nothing can be applied or answered asynchronously); use "
                         f"separate servers (num_servers=k) for {consistency!r}")
    if colocated and not init:
        raise ValueError(f"num_servers={COLOCATED!r} needs init=True (every rank "
                         f"passes the parameters; the first rank's values are used)")


def _check_backup_workers(size: int, num_servers: Any, consistency: str, optimizer: str,
                          backup_workers: Any) -> None:
    """``backup_workers``: an int in ``0 .. workers-1``; above 0 only where a round can
    close without some workers (separate servers, ``bsp``, an optimizer on the servers)."""
    b = backup_workers
    if isinstance(b, bool) or not isinstance(b, int) or b < 0:
        raise ValueError(f"backup_workers={b!r} must be an int >= 0")
    if b == 0:
        return
    if num_servers == COLOCATED:
        raise ValueError(f"backup_workers={b} needs separate servers, not "
                         f"num_servers={COLOCATED!r}: there every step is collective and a "
                         f"slow rank also owns shards every other rank must receive, so "
                         f"no round can close without it")
    workers = size - int(num_servers)
    if b >= workers:
        raise ValueError(f"backup_workers={b} must be less than the number of workers "
                         f"({workers}): a round needs at least one push")
    if consistency != "bsp":
        raise ValueError(f"backup_workers={b} needs consistency='bsp' ({consistency!r} "
                         f"never waits for a round, so there is nothing to close early)")
    if optimizer == "sum":
        raise ValueError(f"backup_workers={b} needs an optimizer on the servers, not "
                         f"optimizer='sum': with 'sum' each worker updates its own weights "
                         f"from every round's aggregate, and a worker that skips rounds "
                         f"would diverge from the others")


def _check_replicas(num_servers: Any, backup_workers: int, compression: Any,
                    replicas: Any) -> None:
    """``replicas``: 0, or 1 with at least two separate servers, no backup workers and
    no compression (what a backup cannot replay bit for bit is refused)."""
    r = replicas
    if isinstance(r, bool) or not isinstance(r, int) or r not in (0, 1):
        raise ValueError(f"replicas={r!r} must be 0 or 1 (a primary and one backup server "
                         f"rank per shard)")
    if r == 0:
        return
    if num_servers == COLOCATED:
        raise ValueError(f"replicas={r} needs separate servers, not num_servers={COLOCATED!r} "
                         f"(a co-located rank's shards die with its worker)")
    if int(num_servers) < 2:
        raise ValueError(f"replicas={r} needs num_servers >= 2 (the backup of a shard is "
                         f"another server rank), got {num_servers}")
    if backup_workers:
        raise ValueError(f"replicas={r} does not support backup_workers={backup_workers} "
                         f"(which pushes a round holds depends on timing, so a backup "
                         f"could not replay it)")
    if compression not in (None, "none"):
        raise ValueError(f"replicas={r} does not support compression= (the pull encoders' "
                         f"per-worker state is not replicated)")


def _check_local_aggregation(value: Any, backup_workers: int, replicas: int,
                             init: bool) -> None:
    """``local_aggregation``: ``"auto"``, ``True`` or ``False``; ``True`` refused where the
    workers of a node cannot act as one (``"auto"`` falls back to the flat path there)."""
    if not (value is True or value is False or (isinstance(value, str) and value == "auto")):
        raise ValueError(f"local_aggregation={value!r} must be 'auto', True or False")
    if value is not True:
        return
    blockers = []
    if backup_workers:
        blockers.append(f"backup_workers={backup_workers} (a round closes on the first "
                        f"pushes to arrive, counted per worker)")
    if replicas:
        blockers.append(f"replicas={replicas} (failover replays each worker's requests)")
    if not init:
        blockers.append("init=False (any worker may call init())")
    if blockers:
        raise ValueError("local_aggregation=True does not work with " + "; ".join(blockers)
                         + "; pass local_aggregation='auto' (which falls back to the flat "
                         "path there) or False")


def check_settings(size: int, num_servers: Any, consistency: Any, staleness: Any,
                   optimizer: Any, hyperparameters: dict[str, Any], average: bool | None,
                   split_bytes: Any, chunk_bytes: Any, init: bool, restore: str | None,
                   reshard: bool, keep_aggregate: bool, backup_workers: Any = 0,
                   compression: Any = None, feedback: Any = True,
                   replicas: Any = 0, local_aggregation: Any = "auto") -> Settings:
    """Check one rank's constructor arguments for a communicator of ``size`` ranks.

    Returns:
        the :class:`Settings`, hyperparameters completed with their defaults and
        ``average`` defaulting to ``optimizer != "sum"`` and ``compression`` resolved to
        a codec (``None`` for ``None``/``"none"``).
    Raises:
        ValueError: an argument is out of range or does not fit the others (an unknown
            codec name, a top-k/random-k ratio outside (0, 1]).
        TypeError: an argument has the wrong type (``feedback`` not a bool).
    """
    _check_layout(size, num_servers, consistency, init)
    colocated = num_servers == COLOCATED
    if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 0:
        raise ValueError(f"staleness={staleness!r} must be an int >= 0")
    hyper = check_hyperparameters(optimizer, hyperparameters)
    if optimizer == "sum" and consistency != "bsp":
        raise ValueError("optimizer='sum' returns each round's aggregate and needs "
                         "consistency='bsp'")
    if not keep_aggregate and not (colocated and optimizer == "sum"):
        raise ValueError(f"keep_aggregate=False needs num_servers={COLOCATED!r} and "
                         f"optimizer='sum'")
    if int(split_bytes) < 1 or int(chunk_bytes) < 1:
        raise ValueError("split_bytes and chunk_bytes must be positive")
    _check_backup_workers(size, num_servers, consistency, optimizer, backup_workers)
    codec = resolve_codec(compression)
    _check_replicas(num_servers, backup_workers, None if codec is None else codec.name,
                    replicas)
    if not isinstance(feedback, bool):
        raise TypeError(f"feedback={feedback!r} must be True or False")
    _check_local_aggregation(local_aggregation, backup_workers, replicas, init)
    return Settings(num_servers=num_servers, consistency=consistency, staleness=staleness,
                    optimizer=optimizer, hyperparameters=hyper,
                    average=optimizer != "sum" if average is None else bool(average),
                    split_bytes=int(split_bytes), chunk_bytes=int(chunk_bytes),
                    init=bool(init), restore=restore, reshard=bool(reshard),
                    keep_aggregate=bool(keep_aggregate), backup_workers=backup_workers,
                    compression=codec, feedback=feedback, replicas=replicas,
                    local_aggregation=local_aggregation)
