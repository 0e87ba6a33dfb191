"""Growing the world: new processes join a running job (Horovod's "hosts added").

:func:`grow_world` is what every rank of the world runs once a commit raised
:class:`~mpicoll.elastic.discovery.HostsAddedInterrupt`:

1. *spawn*: ``MPI_Comm_spawn`` (collective over the world, root rank 0) starts ``new_size
   - size`` processes of this same program: ``sys.executable``, rank 0's interpreter
   options, ``-m mpicoll.elastic.joiner``, then the program as rank 0 was started
   (``sys.orig_argv``: a script, ``-m module`` or ``-c code``, and its arguments), in rank
   0's working directory;
2. *merge*: ``MPI_Intercomm_merge`` of the spawn's intercommunicator; the running ranks keep
   their ranks ``0 .. size-1`` (so rank 0, whose state is the commit, stays rank 0) and the
   new ones follow;
3. *hello*: rank 0 tells the new ranks what they need of the job's past (the size it was
   launched with);
4. *switch*: drop the old world's contexts and make the merged communicator the runtime's
   next world, what ``comm=None`` means (:func:`mpicoll.context.set_world`), as
   :func:`mpicoll.elastic.shrink_world` does; per-communicator state is built again on the
   new world's first collective.

A new process runs :mod:`mpicoll.elastic.joiner`, which does steps 2-4 from its side
(:func:`join`) and then runs the program as ``python`` would (``sys.argv``, ``__main__``,
``sys.path[0]``). The program's world is the merged one from its first line; its elastic
function then starts with the state sync that the running ranks make after their reset,
as a new Horovod worker does. So, as in Horovod, a program makes no collective before its
elastic function runs. Nothing here depends on the MPI library's spawn options: the same
works with any MPI whose ``MPI_Comm_spawn`` works.

Exit: every process, a joiner too, ends through :mod:`mpicoll.runtime.exit` (under ULFM,
``MPI_Finalize`` within a bound). Measured with Open MPI 5.0.11: once a rank of the job
has died, a spawned process's plain ``MPI_Finalize`` can crash (SIGSEGV in
``ompi_dpm_dyn_finalize``), and a spawned process that skips it while no failure happened
makes ``prterun`` end the job with status 1; so every process tries ``MPI_Finalize``.
"""
from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mpi4py import MPI

from .. import context
from ..runtime import comms, failures

__all__ = ["Growth", "grow_world", "refusers", "refusal", "check_made_in_order", "HVD_INIT",
           "DIST_INIT", "join", "joined", "joining", "end_joining",
           "running_ranks_at_sync", "SYNC_NOTICE_TAG", "spawn_command",
           "split_command_line", "last_growth", "GrowthError", "JOINER", "launch_size"]

log = logging.getLogger("mpicoll.elastic")

#: The module the new processes run: it joins, then runs the program.
JOINER = "mpicoll.elastic.joiner"


class GrowthError(RuntimeError):
    """The new processes could not be started (``MPI_Comm_spawn`` failed on every rank:
    no free slot in the allocation, say), or ``refused``: a rank holds what cannot grow
    (:data:`refusers`); the world is unchanged."""

    def __init__(self, message: str, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused


@dataclass
class Growth:
    """What one growth did, with its phases' durations in seconds.

    Attributes:
        old_size, new_size: the world's size before and after. rank: this rank after.
        spawn_s: ``MPI_Comm_spawn`` (the new processes start and initialise MPI).
        merge_s: the merge (it waits for the new processes to import mpicoll.elastic).
        switch_s: the hello and switching the world.
        phases: further phases recorded by the callers (``reset``: all of the growth;
            ``hvd``: ``shutdown`` of the old engine and ``init`` of the new one;
            ``callbacks``; ``sync``).
        detected_at: when (``time.time()``) rank 0's discovery saw the new slots.
        joined: this process is one of the new ones.
    """

    old_size: int
    new_size: int
    rank: int
    spawn_s: float
    merge_s: float
    switch_s: float
    phases: dict[str, float] = field(default_factory=dict)
    detected_at: float = 0.0
    joined: bool = False
    #: A commit's check passed since (a new process that fails later is a failure like
    #: any other, not a growth that could not work).
    settled: bool = False

    def summary(self) -> str:
        """``spawn=0.9000,merge=1.2000,...``: every phase, in seconds."""
        phases = {"spawn": self.spawn_s, "merge": self.merge_s, "switch": self.switch_s,
                  **self.phases}
        return ",".join(f"{name}={seconds:.4f}" for name, seconds in phases.items())


#: The latest growth of this process (``None``: none).
last_growth: Growth | None = None
#: What the job told this process when it joined (``None``: it was not spawned to join).
joined: dict[str, Any] | None = None
#: What rank 0 tells the processes that join, besides the launch size (the elastic
#: loop's reset count: ``{"resets": n}``, so that a joiner stops at the same reset).
facts: dict[str, Any] = {}
#: This process's interpreter options and program, when it joined (its own command line
#: starts the joiner instead).
_program: tuple[list[str], list[str]] | None = None


def split_command_line(argv: list[str]) -> tuple[list[str], list[str]]:
    """``(interpreter options, program)`` of a Python command line without its first
    word (``["-u", "-X", "dev", "train.py", "--epochs", "3"]`` -> ``(["-u", "-X", "dev"],
    ["train.py", "--epochs", "3"])``; the program is ``script args...``, ``-m module
    args...`` or ``-c code args...``)."""
    i = 0
    while i < len(argv):
        word = argv[i]
        if word.startswith("--") and word != "--":     # a long option (one has a value)
            i += 2 if word == "--check-hash-based-pycs" else 1
            continue
        if word in ("-", "--") or not word.startswith("-"):
            break
        for j in range(1, len(word)):
            if word[j] in "cm":                  # -c code / -m module: the program
                if j == 1:
                    return argv[:i], argv[i:]
                return argv[:i] + [word[:j]], ["-" + word[j:]] + argv[i + 1:]
            if word[j] in "XW":                  # an option with a value
                if j + 1 == len(word):
                    i += 1
                break
        i += 1
    return argv[:i], argv[i:]


def spawn_command() -> tuple[str, list[str]]:
    """``(command, arguments)`` that start this same program in a process that joins:
    the interpreter, its options, ``-m mpicoll.elastic.joiner``, and the program as this
    process was started (``sys.orig_argv``), whatever it has done to ``sys.argv`` since.

    Raises:
        GrowthError: this process runs no program that can be started again (an
            interactive interpreter, a script read from stdin).
    """
    options, program = _program if _program is not None else \
        split_command_line(list(getattr(sys, "orig_argv", [sys.executable, *sys.argv]))[1:])
    if not program or program[0] == "-":
        raise GrowthError("cannot grow: this process runs no script or module that new "
                          "processes could start (interactive, or read from stdin)")
    return sys.executable, [*options, "-m", JOINER, *program]


def joining() -> bool:
    """Whether this process joined a running job and has not reached its elastic state's
    first sync, where the running ranks are (a collective that a constructor makes before
    it would wait for them forever)."""
    return joined is not None and not joined.get("synced", False)


#: The tag of the notice that a running rank has begun the state's first sync after a
#: growth (its reset callbacks done), sent over the growth's intercommunicator to each new
#: process (:func:`end_joining`).
SYNC_NOTICE_TAG = 0x5C
#: A running rank after a growth: the intercommunicator to the new processes, until the
#: sync's notice went; a new process: its posted receives of the notices, one per running
#: rank.
_notice: list[Any] = []


def running_ranks_at_sync() -> bool:
    """In a new process before its first sync: whether every running rank has begun that
    sync, so that none will make a collective this process still waits in (one the
    program made at its top that they never make)."""
    return joining() and bool(_notice) and MPI.Request.Testall(_notice)


def end_joining() -> None:
    """The elastic state's first sync begins (see :func:`joining`); on a running rank
    after a growth: tell the new processes (:func:`running_ranks_at_sync`)."""
    if joined is not None and not joined.get("synced", False):
        joined["synced"] = True
        for request in _notice:
            if not request.Test():
                request.Cancel()  # (each running rank sends it regardless: zero bytes)
        _notice.clear()
    elif _notice:
        inter = _notice.pop()
        for rank in range(inter.Get_remote_size()):
            inter.Send([b"", MPI.BYTE], rank, SYNC_NOTICE_TAG)


#: The calls whose making the running ranks of a growth repeat before their reset
#: callbacks (:func:`check_made_in_order`).
HVD_INIT, DIST_INIT = "hvd.init()", "dist.init_process_group('mpicoll')"


def check_made_in_order(what: str, made: dict[str, bool]) -> None:
    """In a process that joined a running job, before its first sync: ``what`` (a
    ``new_group``, an ``add_process_set``) is refused while this process has not yet made
    all that the running ranks remake before their reset callbacks (where they make
    their groups and process sets): it would wait for them while they wait for it.
    ``made``: whether this process has made each of :data:`HVD_INIT` and
    :data:`DIST_INIT` that the caller knows of.

    Raises:
        RuntimeError: made too early, saying what to call first.
    """
    if not joining():
        return
    missing = [call for call in joined.get("remade", ()) if made.get(call) is False]
    if missing:
        raise RuntimeError(
            f"{what}: this process joined a running job, whose ranks remake "
            f"{' and '.join(missing)} before their reset callbacks, where they make their "
            f"groups and process sets: made before {' and '.join(missing)}, it would wait "
            f"for them while they wait for this process. Make groups and process sets "
            f"after both {DIST_INIT} and {HVD_INIT}")


def launch_size() -> int:
    """The size this job was launched with (a process that joined learns it from rank 0)."""
    return joined["launch_size"] if joined else MPI.COMM_WORLD.Get_size()


def _merge(inter: MPI.Intercomm, old_size: int, spawn_s: float,
           joining: bool) -> tuple[Growth, dict[str, Any]]:
    """Steps 2-4 (collective over the running and the new ranks): merge ``inter`` (the
    running ranks first), rank 0's facts for the new ranks (the hello), switch the world.
    Returns the growth (``last_growth``) and the facts."""
    start = time.perf_counter()
    merged = comms.merge(inter, high=joining)
    merged_at = time.perf_counter()
    told = merged.bcast({"launch_size": launch_size(), **facts} if merged.Get_rank() == 0
                        else None)
    merged.Set_errhandler(MPI.ERRORS_RETURN)
    context.set_world(merged)
    return Growth(old_size, merged.Get_size(), merged.Get_rank(), spawn_s, merged_at - start,
                  time.perf_counter() - merged_at, joined=joining), told


#: What cannot take in new processes, each a function saying ``(what is there, why it
#: cannot grow)`` (``None``: nothing of it here): while one says so on any rank, every
#: rank refuses the growth (``GrowthError``: the job goes on at its size). Clients add
#: theirs (:mod:`mpicoll.torch.distributed.reconfigure`).
refusers: list[Callable[[], tuple[str, str] | None]] = []


def refusal() -> tuple[str, str] | None:
    """Why this rank cannot grow (:data:`refusers`), or ``None``."""
    if any(r.owner == "ps" for r in comms.alive()):
        return ("a parameter server (mpicoll.ps) is open",
                "it cannot take in new ranks (a new process would build one of its own)")
    return next((why for why in (refuse() for refuse in refusers) if why), None)


def grow_world(new_size: int) -> Growth:
    """Start ``new_size - size`` processes of this program and make the world all of
    them (collective over the current world; see the module's docstring).

    Returns:
        The :class:`Growth` (also kept as :data:`last_growth`).
    Raises:
        ValueError: ``new_size`` not above the current size.
        GrowthError: the processes could not be started (the world is unchanged).
        ProcessFailedError or MPI.Exception: a process failed meanwhile (the caller
            shrinks).
    """
    global last_growth
    old = context.world()
    size = old.Get_size()
    if new_size <= size:
        raise ValueError(f"new_size {new_size} must exceed the world's size {size}")
    plain = old if type(old) is MPI.Intracomm else MPI.Intracomm(old)
    refused: dict[tuple[str, str], list[int]] = {}
    for rank, why in enumerate(plain.allgather(refusal())):
        if why is not None:
            refused.setdefault(tuple(why), []).append(rank)
    if refused:            # (every rank: the growth is refused everywhere)
        raise GrowthError("; ".join(f"cannot grow while {what} on rank(s) {ranks}: {cause}"
                                    for (what, cause), ranks in refused.items()),
                          refused=True)
    command, args = spawn_command()
    info = MPI.Info.Create()
    try:
        info.Set("wdir", os.getcwd())
        start = time.perf_counter()
        try:
            inter = comms.spawn(plain, command, args, new_size - size, info)
        except MPI.Exception as exc:
            if failures.failed_by(exc, plain) is not None:
                raise failures.translate(exc, plain, "a growth") from exc
            raise GrowthError(f"starting {new_size - size} process(es) to grow the world "
                              f"from {size} to {new_size} failed: {exc} (are there free "
                              f"slots? Open MPI: 'mpirun --host <host>:<slots>' or "
                              f"'--oversubscribe')") from exc
    finally:
        info.Free()
    last_growth, _ = _merge(inter, size, time.perf_counter() - start, joining=False)
    _notice[:] = [inter]
    log.info("rank %d: world grew from %d to %d ranks (spawn %.3f s, merge %.3f s)",
             last_growth.rank, size, last_growth.new_size, last_growth.spawn_s,
             last_growth.merge_s)
    return last_growth


def join(options: list[str], program: list[str]) -> None:
    """In a process started by :func:`grow_world` (:mod:`mpicoll.elastic.joiner` calls
    it before the program runs): merge with the running job and make the merged
    communicator the world (collective with the running ranks' growth). ``options`` and
    ``program``: this process's own command line, for its growths to come.

    Raises:
        RuntimeError: this process was not spawned (no parent).
    """
    global joined, last_growth, _program
    parent = comms.adopt(MPI.Comm.Get_parent(), "world")
    if parent == MPI.COMM_NULL:
        raise RuntimeError(f"python -m {JOINER} starts the processes that join a running "
                           f"job (mpicoll.elastic.grow); this one has no parent job")
    _program = (list(options), list(program))
    last_growth, joined = _merge(parent, parent.Get_remote_size(), 0.0, joining=True)
    _notice[:] = [parent.Irecv([bytearray(0), MPI.BYTE], rank, SYNC_NOTICE_TAG)
                  for rank in range(parent.Get_remote_size())]
    log.info("rank %d: joined a running job of %d ranks (now %d)", last_growth.rank,
             last_growth.old_size, last_growth.new_size)
