"""Elastic state: what a training function commits, restores and synchronises (Horovod's
``horovod.common.elastic.State`` and ``ObjectState``, over mpicoll).

- :meth:`State.commit` saves a copy of the state in memory (and, under the relaunching
  supervisor, rank 0 writes it to disk: :mod:`mpicoll.elastic.disk`);
- :meth:`State.restore` goes back to the last commit (after a failure);
- :meth:`State.sync` makes every rank's state rank 0's (at the start, and after a reset);
- :meth:`State.register_reset_callbacks`: functions called after each reset (the world
  has changed size: rebuild what depends on it, rescale the learning rate, ...).
"""
from __future__ import annotations

import copy
import enum
import pickle
import queue
import warnings
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from .. import config, context
from ..errors import CollectiveError, HostsUpdatedInterrupt
from ..runtime import failures
from .discovery import active as discovery_active
from .discovery import check_host_updates

__all__ = ["State", "ObjectState", "broadcast_object", "HostUpdateResult"]


class HostUpdateResult(enum.IntFlag):
    """What a host update did (Horovod's ``horovod.runner.elastic.worker.HostUpdateResult``),
    the second argument of :meth:`State.on_hosts_updated`."""
    no_update = 0
    removed = 1
    added = 2
    mixed = removed | added


def broadcast_object(obj: Any, root_rank: int = 0) -> Any:
    """``obj`` of rank ``root_rank`` of the current world (:func:`mpicoll.context.world`),
    on every rank (pickled: for small state; arrays go through the collectives).

    Raises:
        mpicoll.ProcessFailedError: a rank of the world failed (under ULFM).
    """
    world = context.world()
    try:
        return world.bcast(obj, root=root_rank)
    except MPI.Exception as exc:
        failures.raise_translated(exc, world, "the elastic state's broadcast")
        raise


def _world_rank() -> int:
    return context.world().Get_rank()


def checks_host_messages() -> bool:
    """Whether commits check host update messages now: with a discovery active (every
    rank knows it), or under ``MPICOLL_ELASTIC_HOST_UPDATES=1``. The same on every rank."""
    return discovery_active() is not None or config.env_bool("MPICOLL_ELASTIC_HOST_UPDATES",
                                                             False)


def _copy(value: Any) -> Any:
    """A deep copy of ``value``, or ``value`` itself when it cannot be deep-copied."""
    try:
        return copy.deepcopy(value)
    except (TypeError, copy.Error, pickle.PicklingError, AttributeError, ValueError):
        return value


class _Unpicklable:
    """What rank 0 broadcasts instead of a state that does not pickle: why."""

    def __init__(self, problem: str) -> None:
        self.problem = problem


def _pickled(state: dict) -> bytes | _Unpicklable:
    """``state`` (attribute -> value) pickled, or why it does not pickle (the first
    attribute that does not)."""
    try:
        return pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        for name, value in state.items():
            try:
                pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as exc:  # noqa: BLE001  (pickling raises many types)
                return _Unpicklable(f"rank 0's attribute {name!r} does not pickle "
                                    f"({type(exc).__name__}: {exc})")
        raise


class State:
    """The base of elastic states: commit / restore / sync and reset callbacks.

    Subclasses implement :meth:`save`, :meth:`restore`, :meth:`sync` and, to be written
    to disk by the relaunching supervisor, :meth:`serialize` / :meth:`deserialize`.

    Args:
        bcast_object: ``f(obj) -> obj`` broadcasting from rank 0 of the current world.
        get_rank: ``f() -> int``, this rank in the current world.
    """

    def __init__(self, bcast_object: Callable[[Any], Any] | None = None,
                 get_rank: Callable[[], int] | None = None) -> None:
        self._bcast_object = bcast_object or broadcast_object
        self._rank = get_rank or _world_rank
        self._reset_callbacks: list[Callable[[], None]] = []
        self._host_messages: queue.Queue = queue.Queue()
        self._last_updated_timestamp: float = 0

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        """Call each of ``callbacks`` (no arguments), in order, after every reset."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Run by :func:`mpicoll.elastic.run` after a reset: :meth:`reset`, then the
        callbacks (host update messages not yet checked are dropped: the reset answered
        them)."""
        self._host_messages = queue.Queue()
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp: float, update_res: HostUpdateResult) -> None:
        """A host update message (Horovod's listener call, from any thread): hosts were
        ``update_res`` (:class:`HostUpdateResult`) at ``timestamp``. The next
        :meth:`check_host_updates` (at the next commit) raises
        :class:`~mpicoll.HostsUpdatedInterrupt` on every rank when rank 0 holds a message
        newer than the last one acted on; its ``skip_sync`` is true when hosts were only
        removed. Checked at commits while a discovery is active (``run(discovery=...)``),
        or always under ``MPICOLL_ELASTIC_HOST_UPDATES=1`` (a broadcast per commit);
        otherwise the message waits, with a warning."""
        if not checks_host_messages():
            warnings.warn("mpicoll.elastic: a host update message is checked at commits "
                          "only while a discovery is active or under "
                          "MPICOLL_ELASTIC_HOST_UPDATES=1; it waits until then",
                          RuntimeWarning, stacklevel=2)
        self._host_messages.put((timestamp, update_res))

    def commit(self) -> None:
        """Save the state in memory (a copy: a failure later goes back to it); under the
        relaunching supervisor rank 0 also writes it to disk and tells every rank whether
        it could (one byte's broadcast; ``CollectiveError`` on every rank if not). Then
        :meth:`check_host_updates` (collective when a discovery is active). Local (no
        communication) otherwise."""
        self.save()
        disk = _disk()
        if disk is not None:
            from .. import collectives  # (imported late, as below)

            failed, error = np.zeros(1, np.int8), None
            if self._rank() == 0:
                try:
                    disk.save(self.serialize())
                except disk.CommitError as exc:
                    failed[0], error = 1, exc
            collectives.broadcast(failed, root=0, comm=context.world())
            if failed[0]:  # every rank, or each next rank 0 would fail in turn (ULFM)
                raise CollectiveError(f"the commit to disk failed on rank 0: "
                                      f"{error or 'see its error'}") from error
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise :class:`~mpicoll.HostsUpdatedInterrupt` on every rank when discovery
        found room for more ranks or a host update message came (Horovod's check).
        Collective (every rank calls it, as often as the others) while a discovery is
        active (:func:`mpicoll.elastic.run` with ``discovery=``) or under
        ``MPICOLL_ELASTIC_HOST_UPDATES=1``; local otherwise. With a discovery, one small
        broadcast from rank 0 for it; then, as Horovod does, rank 0's newest
        :meth:`on_hosts_updated` message and the last one acted on are broadcast (rank 0
        decides for all): 24 bytes through mpicoll's broadcast over the current world, not
        ``bcast_object`` (a pickled broadcast through the Horovod engine costs
        milliseconds per commit).

        Raises:
            HostsUpdatedInterrupt: the job is to grow or to reset (the state is not rolled
                back); ``HostsAddedInterrupt`` from a discovery.
            DiscoveryError: discovery failed (on every rank).
        """
        check_host_updates()
        if not checks_host_messages():
            return
        previous = newest = self._last_updated_timestamp
        update = HostUpdateResult.no_update
        while not self._host_messages.empty():      # this thread is the only reader
            timestamp, result = self._host_messages.get_nowait()
            if timestamp > newest:
                newest = timestamp
                update |= result
        from .. import collectives  # noqa: PLC0415  (the guarded broadcast; imported late)

        word = np.array([previous, newest, int(update)], dtype=np.float64)
        collectives.broadcast(word, root=0, comm=context.world())
        previous, self._last_updated_timestamp = float(word[0]), float(word[1])
        if self._last_updated_timestamp > previous:
            raise HostsUpdatedInterrupt(skip_sync=int(word[2]) == HostUpdateResult.removed)

    def save(self) -> None:
        """Keep a copy of the state (the commit)."""
        raise NotImplementedError

    def restore(self) -> None:
        """Go back to the last :meth:`save`."""
        raise NotImplementedError

    def sync(self) -> None:
        """Make every rank's state rank 0's (collective over the current world)."""
        raise NotImplementedError

    def reset(self) -> None:
        """Called after a reset, before the callbacks (nothing by default)."""

    def serialize(self) -> bytes:
        """The last commit as bytes (for the supervisor's disk copy)."""
        raise NotImplementedError

    def deserialize(self, payload: bytes) -> None:
        """Make ``payload`` (from :meth:`serialize`) the last commit; :meth:`restore`
        then goes back to it."""
        raise NotImplementedError


class ObjectState(State):
    """State made of plain Python objects, given as keyword arguments and read and
    written as attributes (``state.epoch += 1``).

    A commit deep-copies every attribute (so arrays changed in place after a commit are
    restored too: a commit costs a memory copy of the state); an object that cannot be
    deep-copied (a lock, an open file, a generator) is kept by reference, as Horovod keeps
    every attribute.

    Args:
        bcast_object, get_rank: see :class:`State` (default: the current world's).
        **kwargs: the attributes and their initial values.
    """

    def __init__(self, bcast_object: Callable[[Any], Any] | None = None,
                 get_rank: Callable[[], int] | None = None, **kwargs: Any) -> None:
        self._saved_state = {name: _copy(value) for name, value in kwargs.items()}
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self) -> None:
        self._saved_state = {name: _copy(getattr(self, name))
                             for name in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        """Every rank's attributes := rank 0's last commit (pickled: they must pickle).

        Raises:
            mpicoll.CollectiveError: on every rank, when rank 0's attributes do not pickle
                (naming the first that does not), instead of rank 0 alone raising while
                the others wait in the broadcast.
        """
        if self._saved_state:
            root = self._rank() == 0
            payload = self._bcast_object(_pickled(self._saved_state) if root else None)
            if isinstance(payload, _Unpicklable):
                raise CollectiveError(f"mpicoll.elastic: the state cannot be synchronised: "
                                      f"{payload.problem} (an ObjectState's or TorchState's "
                                      f"plain attributes are pickled to reach the other "
                                      f"ranks)")
            if not root:
                self._saved_state = pickle.loads(payload)   # (rank 0's commit)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for name, value in self._saved_state.items():
            setattr(self, name, _copy(value))

    def serialize(self) -> bytes:
        return pickle.dumps(self._saved_state, protocol=pickle.HIGHEST_PROTOCOL)

    def deserialize(self, payload: bytes) -> None:
        # (an attribute this program has and the commit not, from an older script, keeps
        # its value: replacing the set dropped it from every later commit and sync)
        self._saved_state = {**self._saved_state,
                             **pickle.loads(payload)}  # noqa: S301  (our own commit)


def _disk() -> Any:
    """:mod:`mpicoll.elastic.disk` when the relaunching supervisor runs this job, else
    ``None`` (imported lazily: only the supervisor's jobs use it)."""
    from . import disk  # noqa: PLC0415  (only the supervisor's jobs need it)

    return disk if disk.active() else None


def load_from_disk(state: State) -> bool:
    """Under the relaunching supervisor: rank 0 makes the commit on disk (if any) its
    state (the :meth:`State.sync` that follows gives it to every rank). Returns whether
    this rank loaded one."""
    disk = _disk()
    if disk is None or state._rank() != 0:
        return False
    payload = disk.load()
    if payload is None:
        return False
    state.deserialize(payload)
    state.restore()
    return True
