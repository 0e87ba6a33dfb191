"""``mpicoll.Comm``: an mpi4py communicator whose collectives run mpicoll's algorithms.

Existing mpi4py code switches with one line (``comm = mpicoll.Comm(MPI.COMM_WORLD)``).
``Allreduce``, ``Reduce_scatter_block``, ``Reduce_scatter``, ``Allgather``, ``Bcast`` and
``Reduce`` take exactly mpi4py's arguments and run mpicoll's algorithms; what they cannot
handle (derived datatypes with gaps or of mixed types, user-defined or pair ops, vector
counts, objects without a contiguous buffer) goes to the wrapped communicator, as does
every other method. A buffer on a device (``__cuda_array_interface__`` or DLPack) is the
exception: it takes mpicoll's device path (docs/gpu.md: it needs CuPy, and takes
predefined datatypes only), so that its pointer never reaches an MPI that is not
CUDA-aware. A derived datatype of gap-free copies of one predefined type (a
``Create_contiguous``) counts as that many of its elements, so it pairs with the
predefined type on another rank, as MPI's type signatures do. The decision depends only
on the type signature, the op and the shape of the buffer spec; the one program it
cannot serve describes data with a derived datatype *with gaps* on some ranks and a
predefined one on others in ``Bcast`` or ``Allgather`` (legal MPI: mpicoll's algorithm
would run on some ranks and MPI's on the others): call those on the wrapped
communicator. An explicit count in a spec that holds every rank's
block (``Allgather``'s receive buffer, ``Reduce_scatter_block``'s send buffer) is one
block's, as in mpi4py. A bad argument on one rank is raised there by mpi4py, as without
mpicoll; with ``check=True`` it goes through the agreement step first, so that it raises
there and :class:`~mpicoll.RemoteError` on the other ranks instead of leaving them
waiting.
"""
from __future__ import annotations

from typing import Any

from mpi4py import MPI

from . import collectives, config
from .runtime import comms, failures
from .runtime import world as runtime_world
from .algorithms.registry import names
from .buffers import IN_PLACE, Unsupported, is_in_place, parse_mpi_buffer
from .checked import agree
from .context import get_context
from .fastpath import MISS, run_fast
from .gpu.arrays import is_device
from .ops import resolve_op
from .partition import block_bounds

__all__ = ["Comm"]


def _buffer(spec: Any, argname: str, writable: bool = False, blocks: int = 1) -> Any:
    """One rank's buffer spec as mpicoll takes it: a flat host view, or for device memory
    (:mod:`mpicoll.gpu.specs`) a device argument the collectives route
    (:mod:`mpicoll.gpu.route`: straight to CUDA-aware MPI, or staged through host memory).
    ``blocks``: the ranks' blocks it holds, where mpi4py reads an explicit count as one
    block's (an all-gather's receive buffer, a reduce-scatter's send buffer)."""
    if is_device(spec):
        from .gpu.specs import device_buffer  # noqa: PLC0415

        return device_buffer(spec, argname, blocks)
    return parse_mpi_buffer(spec, argname, writable, blocks)


def _block_counts(recvcounts: Any, size: int) -> bool:
    """Whether ``recvcounts`` are all equal (a device Reduce_scatter is then a
    Reduce_scatter_block; other counts go to MPI, which must then be CUDA-aware)."""
    counts = [int(c) for c in recvcounts] if recvcounts is not None else []
    return len(counts) == size and len(set(counts)) == 1


class Comm(MPI.Intracomm):
    """A drop-in :class:`mpi4py.MPI.Intracomm` running mpicoll's collectives.

    Args:
        comm: the communicator to wrap (``None``: the world in force, ``MPI.COMM_WORLD``
            unless :mod:`mpicoll.elastic` reconfigured it, as ``comm=None`` everywhere in
            mpicoll; in a process a growth started, ``MPI.COMM_WORLD`` is its spawn's
            alone). The handle is shared, not duplicated: freeing one frees both.
        algorithm: the algorithm for every collective (``"auto"`` by default); a name not
            registered for a collective means ``"auto"`` there.
        check: run the agreement step before every collective (default:
            ``MPICOLL_CHECK``).

    ``Dup`` returns an ``mpicoll.Comm`` with the same settings (as mpi4py keeps a
    subclass); ``Split``, ``Split_type``, ``Create`` and ``Create_group`` return mpi4py's
    ``Intracomm``, as mpi4py does for a subclass: wrap what they return in
    ``mpicoll.Comm`` for mpicoll's collectives on it.
    """

    def __new__(cls, comm: Any = None, algorithm: str = "auto",
                check: bool | None = None) -> "Comm":
        self = super().__new__(cls, runtime_world.comm() if comm is None else comm)
        self._mpicoll_algorithm = algorithm
        self._mpicoll_check = check
        return self

    def _algo(self, collective: str) -> str:
        name = self._mpicoll_algorithm
        return name if name == "auto" or name in names(collective) else "auto"

    def _parse(self, spec: Any, argname: str, blocks: int = 1) -> Any:
        return IN_PLACE if is_in_place(spec) else _buffer(spec, argname, blocks=blocks)

    def _parse_reduction(self, sendbuf: Any, recvbuf: Any, op: Any,
                         with_recv: bool = True, send_blocks: int = 1,
                         recv_blocks: int = 1) -> tuple:
        """``(op, send, recv)`` as mpicoll takes them; ``Unsupported``/``ValueError`` when
        MPI must handle the call (``recv`` is ``None`` when ``with_recv`` is false)."""
        try:
            ours = resolve_op(op)
        except ValueError as exc:   # an MPI op mpicoll lacks (user-defined, LAND, ...): MPI's
            if isinstance(op, MPI.Op):
                raise Unsupported(str(exc)) from exc
            raise
        send = self._parse(sendbuf, "sendbuf", send_blocks)
        recv = _buffer(recvbuf, "recvbuf", True, recv_blocks) if with_recv else None
        if (recv is not None and send is not IN_PLACE and not is_device(recv)
                and not is_device(send) and send.dtype != recv.dtype):   # (device: the route's)
            raise ValueError("mismatch in send and receive MPI datatypes")   # (mpi4py's)
        return ours, send, recv

    def _report(self, error: Exception, collective: str) -> None:
        """In checked mode, report this rank's bad argument (a ``ValueError`` or
        ``TypeError``) through the agreement step: it raises here and ``RemoteError`` on
        the other ranks, as mpicoll's own collectives do, instead of this rank alone
        raising."""
        if config.check_wanted(self._mpicoll_check) and \
                isinstance(error, (ValueError, TypeError)):
            agree(get_context(self), error, collective=collective)

    def _to_mpi(self, error: Exception, collective: str, call: Any) -> None:
        """Hand a call mpicoll does not take to MPI (``call()``), a bad argument
        :meth:`_report`-ed first (a ``TypeError`` is raised here, as before: an argument
        MPI would not take either)."""
        self._report(error, collective)
        if isinstance(error, TypeError):
            raise error
        return call()

    def _run(self, method: str, collective: str, args: tuple, key_args: tuple) -> None:
        """Run mpicoll's ``collective`` on parsed ``args``; cache it under the raw ones.
        Returns ``None``, what the mpi4py methods return."""
        collectives.dispatch(collective, args + (self._algo(collective),), self,
                             self._mpicoll_check,
                             cache_as=("Comm." + method, key_args + (self,)))

    # -- collectives ----------------------------------------------------------------------
    def Allreduce(self, sendbuf: Any, recvbuf: Any, op: MPI.Op = MPI.SUM) -> None:
        """As ``MPI.Comm.Allreduce``, with mpicoll's all-reduce."""
        if run_fast(self._mpicoll_check, "Comm.Allreduce", sendbuf, recvbuf, op, self) is not MISS:
            return None
        try:
            ours, send, recv = self._parse_reduction(sendbuf, recvbuf, op)
        except (Unsupported, ValueError, TypeError) as exc:
            return self._to_mpi(exc, "allreduce", lambda: super(Comm, self).Allreduce(
                sendbuf, recvbuf, op))
        return self._run("Allreduce", "allreduce", (send, recv, ours), (sendbuf, recvbuf, op))

    def Reduce_scatter_block(self, sendbuf: Any, recvbuf: Any, op: MPI.Op = MPI.SUM) -> None:
        """As ``MPI.Comm.Reduce_scatter_block``, with mpicoll's reduce-scatter."""
        if run_fast(self._mpicoll_check, "Comm.Reduce_scatter_block", sendbuf, recvbuf, op,
                    self) is not MISS:
            return None
        size = self.Get_size()
        try:   # (in place, the receive buffer holds every rank's block, as sendbuf would)
            ours, send, recv = self._parse_reduction(
                sendbuf, recvbuf, op, send_blocks=size,
                recv_blocks=size if is_in_place(sendbuf) else 1)
        except (Unsupported, ValueError, TypeError) as exc:
            return self._to_mpi(exc, "reduce_scatter", lambda: super(
                Comm, self).Reduce_scatter_block(sendbuf, recvbuf, op))
        if send is not IN_PLACE and not is_device(send) and \
                send.size != recv.size * size:     # (device: the route checks)
            error = ValueError(f"sendbuf has {send.size} elements; Reduce_scatter_block "
                               f"needs size x recvbuf = {recv.size * size}")
            self._report(error, "reduce_scatter")
            raise error
        return self._run("Reduce_scatter_block", "reduce_scatter", (send, recv, ours),
                         (sendbuf, recvbuf, op))

    def Reduce_scatter(self, sendbuf: Any, recvbuf: Any, recvcounts: Any = None,
                       op: MPI.Op = MPI.SUM) -> None:
        """As ``MPI.Comm.Reduce_scatter``; mpicoll's when ``recvcounts`` are array_split's."""
        if is_device(sendbuf) or is_device(recvbuf):   # no vector counts on the device
            return self.Reduce_scatter_block(sendbuf, recvbuf, op) \
                if _block_counts(recvcounts, self.Get_size()) \
                else super().Reduce_scatter(sendbuf, recvbuf, recvcounts, op)
        try:
            ours, send, recv = self._parse_reduction(sendbuf, recvbuf, op)
            try:
                counts = [int(c) for c in recvcounts]
            except TypeError:    # (None: MPI's to handle)
                raise Unsupported("recvcounts that are not a list of counts") from None
            total = sum(counts)
            bounds = block_bounds(total, self.Get_size())
            if counts != [bounds[i + 1] - bounds[i] for i in range(self.Get_size())]:
                raise Unsupported("recvcounts other than numpy.array_split's")
            mine = counts[self.Get_rank()]
            if send is IN_PLACE and recv.size != total:   # (mpi4py's checks and words)
                raise ValueError(f"mismatch in receive count {recv.size} and sum(counts) {total}")
            if send is not IN_PLACE and send.size != total:
                raise ValueError(f"mismatch in send count {send.size} and sum(counts) {total}")
            if send is not IN_PLACE and recv.size != mine:
                raise ValueError(f"mismatch in receive count {recv.size} and "
                                 f"counts[{self.Get_rank()}] {mine}")
        except (Unsupported, ValueError, TypeError) as exc:
            return self._to_mpi(exc, "reduce_scatter", lambda: super(Comm, self).Reduce_scatter(
                sendbuf, recvbuf, recvcounts, op))
        args = (send, recv, ours)
        # keyed by the counts too: a list, so never cached (it could change in place)
        return self._run("Reduce_scatter", "reduce_scatter", args,
                         (sendbuf, recvbuf, recvcounts, op))

    def Allgather(self, sendbuf: Any, recvbuf: Any) -> None:
        """As ``MPI.Comm.Allgather``, with mpicoll's all-gather."""
        if run_fast(self._mpicoll_check, "Comm.Allgather", sendbuf, recvbuf, self) is not MISS:
            return None
        try:
            send = self._parse(sendbuf, "sendbuf")
            recv = _buffer(recvbuf, "recvbuf", writable=True, blocks=self.Get_size())
        except (Unsupported, ValueError, TypeError) as exc:
            return self._to_mpi(exc, "allgather", lambda: super(Comm, self).Allgather(
                sendbuf, recvbuf))
        return self._run("Allgather", "allgather", (send, recv), (sendbuf, recvbuf))

    def Bcast(self, buf: Any, root: int = 0) -> None:
        """As ``MPI.Comm.Bcast``, with mpicoll's broadcast."""
        if run_fast(self._mpicoll_check, "Comm.Bcast", buf, None, root, self) is not MISS:
            return None
        try:
            flat = _buffer(buf, "buf", writable=self.Get_rank() != root)
        except (Unsupported, ValueError, TypeError) as exc:
            return self._to_mpi(exc, "broadcast", lambda: super(Comm, self).Bcast(buf, root))
        return self._run("Bcast", "broadcast", (flat, root), (buf, root))

    def Reduce(self, sendbuf: Any, recvbuf: Any, op: MPI.Op = MPI.SUM, root: int = 0) -> None:
        """As ``MPI.Comm.Reduce``, with mpicoll's reduce."""
        if run_fast(self._mpicoll_check, "Comm.Reduce", sendbuf, recvbuf, op, root,
                    self) is not MISS:
            return None
        at_root = self.Get_rank() == root
        try:
            ours, send, recv = self._parse_reduction(sendbuf, recvbuf, op, with_recv=at_root)
        except (Unsupported, ValueError, TypeError) as exc:
            return self._to_mpi(exc, "reduce", lambda: super(Comm, self).Reduce(
                sendbuf, recvbuf, op, root))
        return self._run("Reduce", "reduce", (send, recv, ours, root),
                         (sendbuf, recvbuf, op, root))

    # -- communicator management ----------------------------------------------------------
    def Dup(self, info: Any = None) -> "Comm":
        """Duplicate the communicator; the duplicate is an ``mpicoll.Comm`` too, with the
        same ``algorithm`` and ``check`` (also through ``Clone``, ``Dup_with_info`` and
        ``Idup``, whose request is complete)."""
        dup = comms.dup(self, "user", info=info)
        comms.forget_when_freed(dup)   # the user frees it, through any object of its handle
        return Comm(dup, self._mpicoll_algorithm, self._mpicoll_check)

    Clone = Dup_with_info = Dup

    def Idup(self, info: Any = None) -> tuple[Comm, MPI.Request]:  # (Dup's doc)
        return Comm.Clone(self, info), MPI.Request()


if failures.ENABLED:  # ULFM on: a process failure raises ProcessFailedError (mpicoll.runtime)
    for _method in ("Allreduce", "Reduce_scatter_block", "Reduce_scatter", "Allgather",
                    "Bcast", "Reduce"):
        setattr(Comm, _method, failures.guard(getattr(Comm, _method), "self"))
    del _method
