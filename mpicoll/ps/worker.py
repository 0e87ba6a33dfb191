"""The worker side: send requests to the servers, match their replies, hand out handles.

A :class:`WorkerClient` cuts each tensor into the shards of the placement, sends one request
per shard (header, then payload chunks, all non-blocking) and returns a :class:`Handle`.
Replies are matched by sequence number, so any number of requests may be outstanding and
servers may answer them in any order (a ``bsp`` pull is answered only when its round is
complete). Waiting polls with a back-off instead of spinning.

With backup workers (``bsp``) a round may close without this worker: the server drops its
late push (the reply says so) and a pull may return a newer version than this worker's
clock; the client then moves its clock to that version (``adopt_version``), so its next
push goes to the round that is open instead of falling further behind.

With a codec (``compression=``) each shard of a push is encoded with this worker's error
feedback (:class:`~mpicoll.ps.compressed.PushEncoder`) and each compressed pull reply is
decoded into this worker's replica of the shard (:class:`~mpicoll.ps.compressed.PullDecoder`).

Device arrays (:mod:`mpicoll.ps.device`): a call's gradients or values are copied to host
staging arrays when it starts; its pulls land in host staging arrays, copied into the
caller's device arrays when the handle completes.
"""
from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
from mpi4py import MPI

from ..compression import Codec
from ..runtime import failures
from . import protocol as P
from .compressed import Coders, PullDecoder
from .device import DevicePull, call_side, device_views, first_device, host_arrays
from .errors import PSError
from .failures import guarded
from .placement import ParamSpec, Placement

__all__ = ["Handle", "WorkerClient", "pull_destination", "check_arrays", "check_out_names"]


def pull_destination(spec: ParamSpec, out: dict[str, Any] | None) -> np.ndarray:
    """The array a pull of ``spec`` fills: ``out[name]`` if given (checked), else a new one.

    Raises:
        PSError: ``out[name]`` is not a writable C-contiguous array of the right shape/dtype.
    """
    dest = None if out is None else out.get(spec.name)
    if dest is None:
        return np.empty(spec.shape, dtype=spec.dtype)
    if tuple(dest.shape) != spec.shape or dest.dtype != spec.dtype or \
            not dest.flags.c_contiguous or not dest.flags.writeable:
        raise PSError(f"out[{spec.name!r}] must be a writable C-contiguous {spec.dtype} "
                      f"array of shape {spec.shape}")
    return dest


def check_out_names(specs: dict[str, ParamSpec], out: dict[str, Any] | None) -> None:
    """Raise :class:`PSError` for names in a pull's ``out`` that are not parameters (a
    misspelt one would be left as it was)."""
    unknown = sorted(set(out or ()) - set(specs), key=str)
    if unknown:
        raise PSError(f"out has unknown keys {unknown}; the parameters are {sorted(specs)}")


def check_arrays(specs: dict[str, ParamSpec], arrays: dict[str, Any], complete: bool,
                 what: str, names_only: bool = False) -> None:
    """Raise :class:`PSError` unless names, shapes and dtypes match the parameters ``specs``
    (``complete``: every parameter must be there; ``names_only``: shapes and dtypes are
    left to the servers)."""
    if not isinstance(arrays, dict):
        raise PSError(f"expected a dict name -> array, got {type(arrays).__name__}")
    problems = []
    for name in sorted(arrays, key=str):
        arr = arrays[name]
        spec = specs.get(name)
        if spec is None:
            problems.append(f"unknown key {name!r}")
        elif names_only:
            continue
        elif not hasattr(arr, "shape") or not hasattr(arr, "dtype"):
            problems.append(f"{name!r}: {type(arr).__name__} is not an array")
        elif tuple(arr.shape) != spec.shape:
            problems.append(f"{name!r}: shape {tuple(arr.shape)}, expected {spec.shape}")
        elif np.dtype(arr.dtype) != spec.dtype:
            problems.append(f"{name!r}: dtype {arr.dtype}, expected {spec.dtype}")
    if complete:
        missing = sorted(set(specs) - set(arrays))
        if missing:
            problems.append(f"missing {what} for {missing}")
    if problems:
        raise PSError(f"bad {what}s: " + "; ".join(problems), problems)


class Handle:
    """An outstanding parameter-server operation.

    ``wait()`` completes it and returns its result (a dict name -> array for pulls, ``None``
    for pushes), raising :class:`PSError` if any server rejected a part of it. Arrays being
    pushed must not be modified, and pulled arrays not read, before ``wait()`` returns.
    """

    def __init__(self, client: "WorkerClient", kind: str, result: Any = None) -> None:
        self._client = client
        self.kind = kind
        self.result = result
        self.remaining = 0
        #: shard pushes the servers accepted
        self.pushed = 0
        self.errors: list[str] = []
        self.push_clock: int | None = None
        self._sends: list[tuple[MPI.Request, int]] = []     # (request, rank it sends to)
        self._keep: list[Any] = []
        #: device arrays to pull into: its staging arrays are copied there on completion
        self.device_pull: DevicePull | None = None
        self._done = False

    def track(self, sends: list[MPI.Request], keep: Any, rank: int = -1) -> None:
        """Complete ``sends`` (to ``rank``) before this handle completes, keeping ``keep``
        (the buffer they read) alive until then."""
        self._sends += [(r, rank) for r in sends]
        self._keep.append(keep)

    def forget_sends_to(self, dead: set[int]) -> None:
        """Never wait for sends to failed ranks (their requests are kept, not freed)."""
        lost = [r for r, d in self._sends if d in dead]
        if lost:
            failures.keep_requests(lost)
            self._sends = [(r, d) for r, d in self._sends if d not in dead]

    def test(self) -> bool:
        """Make progress; return whether the operation is complete (without raising); once
        it is, pulled device arrays hold their values."""
        if self.remaining:
            self._client.progress()
        if self.remaining == 0 and self.device_pull is not None:
            self.device_pull.finish()
        return self.remaining == 0

    def wait(self) -> Any:
        """Complete the operation and return its result.

        Raises:
            PSError: a server rejected part of the request (message lists each reason).
        """
        if not self._done:
            backoff = P.Backoff(max_sleep=self._client.max_sleep)
            sending = bool(self._sends)
            client = self._client
            while self.remaining:
                if client.progress():
                    backoff.reset()
                else:
                    sending = sending and not client.sends_done(self)
                    backoff.pause(busy=sending)
            while not client.sends_done(self):
                backoff.pause()
            self._sends, self._keep = [], []
            if self.device_pull is not None:
                self.device_pull.finish()
            self._done = True
            self._client.finished(self)
        if self.errors:
            raise PSError(f"parameter server rejected {self.kind}: " + "; ".join(self.errors),
                          self.errors)
        return self.result


class WorkerClient(Coders):
    """Requests of one worker rank.

    Args:
        comm: the parameter server's private communicator.
        placement: the layout.
        chunk_bytes: payload chunk size.
        max_sleep: longest pause while waiting, in seconds.
        adopt_version: (``bsp`` with backup workers) after a pull, move the clock up to
            the newest version a server answered with (rounds that closed without this
            worker are skipped).
        codec: compress pushes and decode compressed pulls with it (``None``: off).
        pull_deltas: compressed pulls carry the change since this worker's last pull
            (parameters), not the value itself (``optimizer="sum"``).
        feedback: keep a residual per pushed shard (error feedback).
    """

    def __init__(self, comm: MPI.Comm, placement: Placement, chunk_bytes: int,
                 max_sleep: float = 1e-3, adopt_version: bool = False,
                 codec: Codec | None = None, pull_deltas: bool = True,
                 feedback: bool = True) -> None:
        self.comm = comm
        self.placement = placement
        self.chunk_bytes = chunk_bytes
        self.max_sleep = max_sleep
        self.adopt_version = adopt_version
        self.clock = 0
        #: why this worker's clocks on the servers are out of step (a push accepted by some
        #: shards and rejected by others), after which pushes and pulls are refused
        self.out_of_step: str | None = None
        self._seq = 0
        self._setup_coders(codec, feedback, pull_deltas, pushes=True)
        self._raw: dict[tuple[int, int], np.ndarray] = {}     # compressed replies land here
        self._pending: dict[int, list] = {}   # seq -> [handle, dest, what, decoder, request]
        #: replicas: who serves each slot (None: slot s is rank s)
        self.routing: Any = None
        #: failures under ULFM (a FailureWatch; None: not watched)
        self.watch: Any = None
        self._notices: list[tuple[MPI.Request, np.ndarray]] = []
        self._open: list[Handle] = []
        self._status = MPI.Status()
        self._hdr = np.empty(P.HEADER_LEN, dtype=np.int64)
        self.counters = dict.fromkeys(P.WORKER_COUNTERS + (
            "staleness_max", "staleness_sum", "staleness_count", "late_pushes_dropped"), 0)

    # ------------------------------------------------------------------ sending
    def _send(self, handle: Handle, server: int, header: np.ndarray,
              payload: np.ndarray | None = None, dest: np.ndarray | None = None,
              what: str = "", decoder: PullDecoder | None = None,
              dense: np.ndarray | None = None) -> None:
        """Send one request; ``dense`` is the shard a compressed ``payload`` encodes
        (``CODED`` and ``COUNT`` then describe it), ``decoder`` decodes a compressed reply
        into ``dest``."""
        seq = self._seq
        self._seq += 1
        header[P.SEQ] = seq
        if payload is not None:
            header[P.COUNT] = payload.size if dense is None else dense.size
            header[P.NBYTES] = payload.nbytes
            header[P.CODED] = int(dense is not None)
        if payload is not None and payload.size:
            P.count_bytes(self.counters, "bytes_sent", payload.nbytes,
                          payload.nbytes if dense is None else dense.nbytes)
        request = [server, -1, header, payload]      # slot, rank sent to, header, payload
        self._pending[seq] = [handle, dest, what, decoder, request]
        handle.remaining += 1
        self._transmit(handle, request)

    def _transmit(self, handle: Handle, request: list) -> None:
        """(Re)send a request to the rank now serving its slot."""
        slot, _, header, payload = request
        if self.routing is None:
            rank = slot
        else:   # and tell the server which servers this worker knows to be dead
            rank = self.routing.primary(slot)
            header[P.AUX] = sum(1 << r for r in self.routing.dead)
        request[1] = rank
        try:
            handle.track([self.comm.Isend([header, MPI.INT64_T], rank, P.TAG_REQUEST)],
                         header, rank)
            if payload is not None and payload.size:
                handle.track(P.send_payload(self.comm, payload, rank, P.TAG_REQUEST_DATA,
                                            self.chunk_bytes), payload, rank)
        except MPI.Exception as exc:
            if self.watch is None:
                raise
            self.on_failure(self.watch.from_exception(exc))

    def _tensor_requests(self, handle: Handle, op: int, arrays: dict[str, Any],
                         check: bool, clock: int) -> None:
        """One request per shard of each tensor in ``arrays`` (INIT or PUSH); device arrays
        are copied to host arrays first."""
        what = "gradient" if op == P.Op.PUSH else "value"
        device = call_side(**{"grads" if op == P.Op.PUSH else "params": arrays})
        if check or op == P.Op.PUSH:
            # a push's names are checked even unchecked: a parameter left out would never
            # see this push on its shards, whose clocks for this worker would fall behind
            check_arrays(self.placement.specs, device_views(arrays) if device else arrays,
                         complete=(op == P.Op.PUSH), what=what, names_only=not check)
        if device:
            arrays = host_arrays(arrays)
        for name in sorted(arrays):
            arr = np.asarray(arrays[name], order="C")   # (ascontiguousarray would make 0-d 1-d)
            flat = arr.reshape(-1)
            spec = self.placement.specs.get(name)
            shards = self.placement.shards.get(name)
            base = dict(key=P.key_of(name), clock=clock, total=flat.size,
                        dtype=P.dtype_code(arr.dtype), shape=P.shape_code(arr.shape))
            if spec is None or flat.size != spec.size:
                server = (self.placement.server_of_unknown(name) if spec is None
                          else shards[0].server)
                self._send(handle, server, P.new_header(op, shard=0, offset=0, **base),
                           flat, what=name)
                continue
            encode = op == P.Op.PUSH and self.push_encoder is not None and \
                arr.dtype == spec.dtype
            for sh in shards:
                part = flat[sh.lo:sh.hi]
                header = P.new_header(op, shard=sh.index, offset=sh.lo, **base)
                if encode:    # this worker's error feedback, one residual per shard
                    raw, _ = self.push_encoder.encode((name, sh.index), part)
                    self._send(handle, sh.server, header, raw, what=sh.label(), dense=part)
                else:
                    self._send(handle, sh.server, header, part, what=sh.label())

    # ------------------------------------------------------------------ operations
    def init_async(self, values: dict[str, Any], check: bool = True) -> Handle:
        """Send every tensor's initial value to its servers."""
        h = Handle(self, "init")
        self._tensor_requests(h, P.Op.INIT, values, check, clock=0)
        return self._opened(h)

    def push_async(self, grads: dict[str, Any], check: bool = True) -> Handle:
        """Push gradients at the current clock, then advance the clock."""
        self._check_in_step()
        h = Handle(self, "push")
        h.push_clock = self.clock
        self._tensor_requests(h, P.Op.PUSH, grads, check, clock=self.clock)
        self.clock += 1
        self.counters["pushes"] += 1
        return self._opened(h)

    def pull_async(self, out: dict[str, Any] | None = None, handle: Handle | None = None,
                   like: Any = None) -> Handle:
        """Ask for the values the consistency model allows at the current clock.

        Args:
            out: arrays to receive into (name -> array of the parameter's shape and dtype),
                host or device arrays (not both); missing names get new arrays (on the
                device when ``out`` holds device arrays or ``like`` is given).
            handle: add the requests to this handle instead of a new one.
            like: a device array: pull into device arrays on its device.
        Raises:
            PSError: bad ``out`` arrays, device and host arrays mixed.
        """
        self._check_in_step()
        call_side(out=out)
        check_out_names(self.placement.specs, out)
        like = first_device(out) if like is None else like
        device = None if like is None else DevicePull(out, like)
        h = handle or Handle(self, "pull")
        result = {} if h.result is None else h.result
        specs = self.placement.specs
        for name, spec in sorted(specs.items()):
            if device is None:
                dest = result[name] = pull_destination(spec, out)
            else:
                dest, result[name] = device.destination(name, spec)
            flat = dest.reshape(-1)
            for sh in self.placement.shards[name]:
                hdr = P.new_header(P.Op.PULL, key=spec.key, shard=sh.index, clock=self.clock,
                                   total=spec.size, dtype=P.dtype_code(spec.dtype),
                                   offset=sh.lo, count=sh.count, shape=P.shape_code(spec.shape))
                self._send(h, sh.server, hdr, dest=flat[sh.lo:sh.hi], what=sh.label(),
                           decoder=self._pull_decoder(sh))
        h.result, h.device_pull = result, device
        self.counters["pulls"] += 1
        return h if handle else self._opened(h)

    def push_pull_async(self, grads: dict[str, Any], out: dict[str, Any] | None = None,
                        check: bool = True) -> Handle:
        """Push gradients, then pull the values for the next clock, as one handle
        (device gradients: pulled into device arrays)."""
        like = first_device(grads, out) if call_side(grads=grads, out=out) else None
        check_out_names(self.placement.specs, out)   # (before the push goes out)
        if like is None:
            for name in out or ():
                pull_destination(self.placement.specs[name], out)
        h = self.push_async(grads, check=check)
        h.kind = "push_pull"
        self.pull_async(out, handle=h, like=like)
        return h

    def control_async(self, op: int, payload: bytes | None = None,
                      dest_size: int = 0) -> Handle:
        """Send a control request (CLOSE, STATS, SAVE) to every server."""
        h = Handle(self, P.Op(op).name.lower(), result={})
        for server in range(self.placement.num_servers):
            data = None if payload is None else np.frombuffer(payload, dtype=np.uint8)
            dest = np.empty(dest_size, dtype=np.float64) if dest_size else None
            if dest is not None:
                h.result[server] = dest
            self._send(h, server, P.new_header(op, shard=server), data, dest=dest,
                       what=f"server {server}")
        return self._opened(h)

    def _opened(self, h: Handle) -> Handle:
        self._open.append(h)
        return h

    def finished(self, h: Handle) -> None:
        """Called by handle ``h`` once complete: forget it, and undo the clock advance of
        a push that every server rejected (nothing was applied anywhere)."""
        if h in self._open:
            self._open.remove(h)
        if h.errors and h.push_clock is not None and not h.pushed and \
                self.clock == h.push_clock + 1:
            self.clock -= 1   # the push did not happen
        elif h.errors and h.push_clock is not None and self.out_of_step is None:
            # some shards took the push (and count this worker's clock on), others did not:
            # no later push can be accepted everywhere, and a pull might wait for a round
            # that never closes
            self.out_of_step = (f"the push at clock {h.push_clock} was accepted for some "
                                f"shards and rejected for others, so the servers' clocks for "
                                f"this worker are out of step: later pushes and pulls are "
                                f"refused (close() works; restore from a checkpoint)")
            h.errors.append(self.out_of_step)

    def _check_in_step(self) -> None:
        """Raise :class:`PSError` once a partly rejected push put the clocks out of step."""
        if self.out_of_step is not None:
            raise PSError(self.out_of_step)

    def wait_all(self) -> None:
        """Complete every outstanding handle (errors are raised by their own wait())."""
        for h in list(self._open):
            with contextlib.suppress(PSError):
                h.wait()

    # ------------------------------------------------------------------ receiving
    def sends_done(self, handle: Handle) -> bool:
        """Whether every send of ``handle`` completed (a failure counts as not yet)."""
        return bool(guarded(self.watch, lambda: MPI.Request.Testall(
            [r for r, _ in handle._sends]), self.on_failure))

    def progress(self) -> bool:
        """Receive every reply that has arrived; return whether any did (under the failure
        watch, if there is one: a failure is ``False``)."""
        return bool(guarded(self.watch, self._progress, self.on_failure))

    def on_failure(self, failed: list[int]) -> None:
        """Ranks failed (ULFM): fatal without replicas (every survivor raises
        :class:`~mpicoll.ProcessFailedError`); with replicas re-send every unanswered
        request of a failed server to the slot's new primary (dead workers change
        nothing here)."""
        if not failed:
            return
        if self.routing is None:
            self.watch.fatal()
        dead = set(failed)
        self.routing.fail(dead)
        if self.routing.lost():
            self.watch.fatal()
        self._notify_servers()
        for h in self._open:
            h.forget_sends_to(dead)
        for handle, _, _, _, request in list(self._pending.values()):
            if request[1] in dead:
                self._transmit(handle, request)

    @staticmethod
    def _sent(req: MPI.Request) -> bool:
        """Whether a fire-and-forget send is done (failed counts as done; kept, not freed)."""
        try:
            return req.Test()
        except MPI.Exception:
            failures.keep_requests([req])
            return True

    def _notify_servers(self) -> None:
        """Tell every live server which servers died: Open MPI may tell a server late
        (or only when it next talks to the dead rank), and a primary waiting for its
        dead backup's acknowledgement would wait for good while this worker waits for
        the primary (a NOTICE request; no reply)."""
        mask = sum(1 << r for r in self.routing.dead)
        self._notices = [(r, h) for r, h in self._notices if not self._sent(r)]
        for rank in range(self.routing.num_servers):
            if rank in self.routing.dead:
                continue
            h = P.new_header(P.Op.NOTICE, aux=mask)
            self._notices.append((self.comm.Isend([h, MPI.INT64_T], rank, P.TAG_REQUEST), h))

    def _progress(self) -> bool:
        comm, status, hdr = self.comm, self._status, self._hdr
        got = False
        while comm.Iprobe(MPI.ANY_SOURCE, P.TAG_REPLY, status):
            src = status.Get_source()
            comm.Recv([hdr, MPI.INT64_T], src, P.TAG_REPLY)
            got = True
            seq, nbytes = int(hdr[P.SEQ]), int(hdr[P.NBYTES])
            entry = self._pending.get(seq)
            if entry is None or entry[4][1] != src:   # a dead primary's late reply
                P.drain_payload(comm, nbytes, src, P.TAG_REPLY_DATA, self.chunk_bytes)
                continue
            handle, dest, what, decoder, _ = entry
            coded = bool(hdr[P.CODED])
            if hdr[P.STATUS] != 0:
                text = P.drain_payload(comm, nbytes, src, P.TAG_REPLY_DATA, self.chunk_bytes)
                handle.errors.append(f"{what}: {text.decode('utf-8', 'replace')}")
            elif nbytes:
                expected = None if dest is None else (
                    decoder.wire_bytes() if coded and decoder is not None else
                    None if coded else dest.nbytes)
                if expected != nbytes:
                    P.drain_payload(comm, nbytes, src, P.TAG_REPLY_DATA, self.chunk_bytes)
                    handle.errors.append(f"{what}: reply of {nbytes} bytes does not fit")
                else:
                    self._receive_reply(src, nbytes, dest, coded, decoder)
            if hdr[P.STATUS] == 0:
                self._note_reply(hdr)
                if hdr[P.OP] == P.Op.PUSH:
                    handle.pushed += 1
            del self._pending[seq]
            handle.remaining -= 1
        return got

    def _receive_reply(self, src: int, nbytes: int, dest: np.ndarray, coded: bool,
                       decoder: PullDecoder | None) -> None:
        """Receive a reply's payload into ``dest`` (decoding a compressed one)."""
        comm = self.comm
        if coded:
            raw = P.scratch(self._raw, (int(self._hdr[P.KEY]), int(self._hdr[P.SHARD])), nbytes)
            P.recv_payload(comm, raw, src, P.TAG_REPLY_DATA, self.chunk_bytes)
            decoder.apply(raw, True, dest)
        else:
            P.recv_payload(comm, dest, src, P.TAG_REPLY_DATA, self.chunk_bytes)
            if decoder is not None:
                decoder.apply(dest, False, dest)
        P.count_bytes(self.counters, "bytes_received", nbytes, dest.nbytes)

    def _note_reply(self, hdr: np.ndarray) -> None:
        """Counters (staleness of a pull, a dropped late push) and, with backup workers,
        the clock a pull's version allows."""
        c = self.counters
        if hdr[P.OP] == P.Op.PULL:
            stale = int(hdr[P.AUX])
            c["staleness_max"] = max(c["staleness_max"], stale)
            c["staleness_sum"] += stale
            c["staleness_count"] += 1
            if self.adopt_version:
                self.clock = max(self.clock, int(hdr[P.CLOCK]))
        elif hdr[P.OP] == P.Op.PUSH and hdr[P.AUX]:
            c["late_pushes_dropped"] += 1
