"""Wire format of the parameter server: tags, the fixed header, payload chunks, waiting.

Every request and every reply is one **header** message followed by zero or more
**payload** messages, all sent with mpi4py's uppercase (buffer) methods on the parameter
server's private duplicate of the user's communicator:

- The header is a ``numpy.int64`` array of :data:`HEADER_LEN` fields (indices below).
- The payload is the shard's elements as raw bytes, cut into chunks of at most
  ``chunk_bytes`` bytes, each one message. Sender and receiver both derive the number of
  chunks from the header's ``NBYTES`` field and the ``chunk_bytes`` agreed at set-up.
- Requests (worker -> server) use :data:`TAG_REQUEST` / :data:`TAG_REQUEST_DATA`;
  replies (server -> worker) :data:`TAG_REPLY` / :data:`TAG_REPLY_DATA`. All tags are far
  below 32767, the smallest ``MPI_TAG_UB`` the standard allows.
- MPI's non-overtaking rule (same source, same communicator, same tag) is what pairs a
  header with its payload: a receiver that takes a header from rank ``s`` immediately
  receives the payload messages from ``s``, and a sender never interleaves two payloads.
- A reply echoes the request's ``SEQ`` so a worker with several requests outstanding
  (asynchronous handles, several shards per server) matches replies in any order.
- An error reply has ``STATUS`` != 0 and the reason as UTF-8 bytes in its payload.
- The co-located layout (:mod:`~mpicoll.ps.colocated`) has no headers: every step starts
  with an ``Iallgather`` of ``int64[3] = (op, clock, error flag)`` per rank, after which
  every rank knows every message of the step; gradient segments go to their owner with
  :data:`TAG_SCATTER`, updated values back with :data:`TAG_GATHER` (raw bytes, at most
  ``chunk_bytes`` per message, in (name, shard, segment) order on every rank).

Header fields:

======== ==================================================================================
``OP``     operation (:class:`Op`)
``KEY``    ``zlib.crc32`` of the parameter's name (the key; names are checked collision-free)
``SHARD``  index of the shard within the key (0 for a whole tensor)
``CLOCK``  request: the worker's clock (pushes made so far); reply: server's version or
           the slowest worker's clock when answered
``COUNT``  elements in the payload
``TOTAL``  elements of the whole tensor (so a shard of the wrong tensor is caught)
``DTYPE``  dtype code (index in :data:`DTYPES`)
``SEQ``    per-worker request sequence number, echoed in the reply
``OFFSET`` first element of the shard within the flat tensor
``SHAPE``  ``zlib.crc32`` of the tensor's shape, so a same-size reshape is caught
``STATUS`` reply status (0 ok, else an :class:`Status` code)
``NBYTES`` payload bytes (``COUNT * itemsize``, or the UTF-8 error message's length)
``AUX``    op-specific: for a reply to a pull, the staleness the server saw; for a reply
           to a push, 1 if the push came for a round already closed (``bsp`` with backup
           workers) and was dropped
``CODED``  1 if the payload is the agreed codec's encoding of ``COUNT`` elements
           (``compression=``, :mod:`~mpicoll.ps.compressed`; ``NBYTES`` is then the
           codec's ``wire_bytes``), 0 if it holds the elements themselves
======== ==================================================================================
"""
from __future__ import annotations

import enum
import os
import time
import zlib
from typing import Any, Sequence

import numpy as np
from mpi4py import MPI

__all__ = ["Op", "CollOp", "Status", "HEADER_LEN", "OP", "KEY", "SHARD", "CLOCK", "COUNT", "TOTAL",
           "DTYPE", "SEQ", "OFFSET", "SHAPE", "STATUS", "NBYTES", "AUX", "CODED",
           "TAG_REQUEST", "TAG_REQUEST_DATA", "TAG_REPLY", "TAG_REPLY_DATA", "TAG_SCATTER",
           "TAG_GATHER", "TAG_FORWARD", "TAG_FORWARD_ACK",
           "DTYPES", "dtype_code", "dtype_of", "key_of", "shape_code", "new_header", "chunk_count",
           "send_payload", "post_recv_payload", "recv_payload", "drain_payload", "Backoff",
           "wait_all", "scratch", "count_bytes", "STATS_FIELDS", "STALENESS_BINS",
           "WORKER_COUNTERS", "SERVER_COUNTERS", "DEFAULT_CHUNK_BYTES"]

HEADER_LEN = 14
(OP, KEY, SHARD, CLOCK, COUNT, TOTAL, DTYPE, SEQ, OFFSET, SHAPE, STATUS, NBYTES, AUX,
 CODED) = range(HEADER_LEN)

TAG_REQUEST = 7101
TAG_REQUEST_DATA = 7102
TAG_REPLY = 7103
TAG_REPLY_DATA = 7104
TAG_SCATTER = 7105      #: co-located: a gradient segment to its owner
TAG_GATHER = 7106       #: co-located: an updated value segment from its owner
TAG_FORWARD = 7107      #: replicas: a request (or a state copy) from a primary to its backup,
                        #: header and payload in one message
TAG_FORWARD_ACK = 7109  #: replicas: the backup holds a forwarded request

DEFAULT_CHUNK_BYTES = 4 << 20

#: dtypes a parameter may have; the header carries the index.
DTYPES: tuple[np.dtype, ...] = tuple(np.dtype(d) for d in (
    "float32", "float64", "float16", "int8", "int16", "int32", "int64", "uint8", "uint16",
    "uint32", "uint64", "complex64", "complex128", "bool"))
_CODE = {d: i for i, d in enumerate(DTYPES)}

#: counters in a STATS reply (float64 payload), followed by STALENESS_BINS histogram bins.
STATS_FIELDS = ("server", "rank", "shards", "bytes_stored", "pushes", "pulls", "updates",
                "bytes_in", "bytes_out", "errors", "staleness_max", "staleness_sum",
                "staleness_count", "active_workers", "late_pushes_dropped", "short_rounds",
                "bytes_in_uncompressed", "bytes_out_uncompressed")
STALENESS_BINS = 16

#: a worker side's counters (a client, a co-located engine, a node group)
WORKER_COUNTERS = ("pushes", "pulls", "bytes_sent", "bytes_received", "bytes_sent_uncompressed",
                   "bytes_received_uncompressed")
#: a server side's counters (a server, a co-located engine's owned shards)
SERVER_COUNTERS = ("pushes", "pulls", "updates", "bytes_in", "bytes_out", "errors",
                   "bytes_in_uncompressed", "bytes_out_uncompressed")


class Op(enum.IntEnum):
    """Request operations."""

    INIT = 1       #: set a shard's initial value (payload: the values)
    PUSH = 2       #: a gradient for a shard (payload: the gradient)
    PULL = 3       #: ask for a shard's value (reply payload: the values)
    CLOSE = 4      #: this worker is done; the server answers once and forgets it
    STATS = 5      #: ask for the server's counters (reply payload: float64 vector)
    SAVE = 6       #: checkpoint (payload: UTF-8 "directory\\nid"); answered when all saved
    REPLICATE = 7  #: replicas: a slot's whole state, primary -> new backup (TAG_FORWARD)
    NOTICE = 8     #: replicas: a worker tells a server which servers died (AUX); no reply


class CollOp(enum.IntEnum):
    """What a rank does in one collective step (co-located, or a node group's): the first
    field of the control all-gather."""

    IDLE = 0        #: closed earlier: serves its shards, contributes nothing
    PUSH = 1
    PULL = 2
    PUSH_PULL = 3
    CLOSE = 4       #: closes now (does not contribute to this step)
    STATS = 5
    SAVE = 6


class Status(enum.IntEnum):
    """Reply status codes (0 is success)."""

    OK = 0
    UNKNOWN_KEY = 1
    BAD_SHAPE = 2
    BAD_DTYPE = 3
    NOT_INITIALIZED = 4
    DUPLICATE_INIT = 5
    BAD_REQUEST = 6
    FAILED = 7


def dtype_code(dtype: Any) -> int:
    """The header code of ``dtype``; ``-1`` if the parameter server does not carry it."""
    return _CODE.get(np.dtype(dtype), -1)


def dtype_of(code: int) -> np.dtype | None:
    """The dtype for header code ``code``, or ``None`` for an unknown code."""
    return DTYPES[code] if 0 <= code < len(DTYPES) else None


def key_of(name: str) -> int:
    """The stable 32-bit key of a parameter name (``zlib.crc32`` of its UTF-8 bytes)."""
    return zlib.crc32(name.encode("utf-8"))


def shape_code(shape: Sequence[int]) -> int:
    """A stable 32-bit code of a shape (``zlib.crc32`` of its text)."""
    return zlib.crc32(repr(tuple(int(s) for s in shape)).encode("ascii"))


def new_header(op: int = 0, **fields: int) -> np.ndarray:
    """A header array with ``OP`` set and the named fields (``key=...``, ``seq=...``)."""
    h = np.zeros(HEADER_LEN, dtype=np.int64)
    h[OP] = op
    for name, value in fields.items():
        h[globals()[name.upper()]] = value
    return h


def chunk_count(nbytes: int, chunk_bytes: int) -> int:
    """How many payload messages carry ``nbytes`` bytes (0 for an empty payload)."""
    return -(-int(nbytes) // int(chunk_bytes)) if nbytes > 0 else 0


def _chunks(data: np.ndarray, chunk_bytes: int) -> list[np.ndarray]:
    raw = data.view(np.uint8) if data.size else np.empty(0, np.uint8)
    return [raw[i:i + chunk_bytes] for i in range(0, raw.size, chunk_bytes)]


def send_payload(comm: MPI.Comm, data: np.ndarray, dest: int, tag: int,
                 chunk_bytes: int) -> list[MPI.Request]:
    """Start sending flat array ``data`` in chunks; returns the requests (keep ``data`` alive)."""
    return [comm.Isend([c, MPI.BYTE], dest, tag) for c in _chunks(data, chunk_bytes)]


def post_recv_payload(comm: MPI.Comm, out: np.ndarray, source: int, tag: int,
                      chunk_bytes: int) -> list[MPI.Request]:
    """Start receiving a chunked payload into flat array ``out``; returns the requests."""
    return [comm.Irecv([c, MPI.BYTE], source, tag) for c in _chunks(out, chunk_bytes)]


def recv_payload(comm: MPI.Comm, out: np.ndarray, source: int, tag: int,
                 chunk_bytes: int) -> None:
    """Receive a chunked payload into flat array ``out`` (blocking: it is already in flight)."""
    chunks = _chunks(out, chunk_bytes)
    if len(chunks) == 1:
        comm.Recv([chunks[0], MPI.BYTE], source, tag)
    elif chunks:
        wait_all(post_recv_payload(comm, out, source, tag, chunk_bytes), spin=1 << 30)


def drain_payload(comm: MPI.Comm, nbytes: int, source: int, tag: int, chunk_bytes: int) -> bytes:
    """Receive and return a payload of ``nbytes`` bytes (error texts, rejected requests)."""
    buf = np.empty(max(0, int(nbytes)), dtype=np.uint8)
    recv_payload(comm, buf, source, tag, chunk_bytes)
    return buf.tobytes()


def scratch(cache: dict, key: Any, count: int, dtype: Any = np.uint8) -> np.ndarray:
    """The reusable flat array ``cache[key]`` of ``count`` elements of ``dtype``, made on
    first use (again when the size or dtype changed)."""
    buf = cache.get(key)
    if buf is None or buf.size != count or buf.dtype != dtype:
        buf = cache[key] = np.empty(count, dtype=dtype)
    return buf


def count_bytes(counters: dict[str, int], key: str, wire: int, plain: int) -> None:
    """Count ``wire`` bytes (what travelled) in ``counters[key]`` and ``plain`` (what the
    same messages carry uncompressed) in ``counters[key + "_uncompressed"]``."""
    counters[key] += wire
    counters[key + "_uncompressed"] += plain


class Backoff:
    """Polls without burning a core: spin a little, then sleep with growing pauses.

    ``pause()`` after a poll that found nothing; ``reset()`` after one that found work.
    On an oversubscribed machine a blocking MPI wait spins at 100 % CPU (MPICH's ch4
    progress loop ignores yield settings), so every wait in the parameter server polls
    through one of these.
    """

    def __init__(self, spin: int = 50, first_sleep: float = 20e-6, max_sleep: float = 1e-3,
                 busy_window: float = 0.1) -> None:
        self.spin = spin
        self.first_sleep = first_sleep
        self.max_sleep = max_sleep
        self.busy_window = busy_window
        self.reset()

    def reset(self) -> None:
        """Forget the idle time: the next pauses are short again."""
        self._polls = 0
        self._sleep = self.first_sleep
        self._since = time.monotonic()

    def pause(self, busy: bool = False) -> None:
        """Wait a little before the next poll.

        Args:
            busy: a large message of ours is in flight. MPICH moves large messages
                through shared memory in a pipeline that both sides must drive, so a
                sleeping rank stalls the transfer: yield the core instead of sleeping.
        """
        if busy and time.monotonic() - self._since < self.busy_window:
            os.sched_yield()
            return
        self._polls += 1
        if self._polls <= self.spin:
            return
        time.sleep(self._sleep)
        self._sleep = min(self._sleep * 2, self.max_sleep)


def wait_all(requests: list[MPI.Request], spin: int = 50, max_sleep: float = 1e-3,
             busy: bool = False) -> None:
    """Complete every request, polling with :class:`Backoff` instead of spinning (``busy``:
    see :meth:`Backoff.pause`)."""
    if not requests:
        return
    backoff = Backoff(spin=spin, max_sleep=max_sleep)
    while not MPI.Request.Testall(requests):
        backoff.pause(busy=busy)
