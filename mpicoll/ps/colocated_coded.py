"""The co-located layout's data step with compression (``compression=`` and
``num_servers="colocated"``); a mixin of :class:`~mpicoll.ps.colocated.ColocatedEngine`.

One step, for the ranks taking part (``busy``), every message size known on both sides
(there are no headers in the co-located layout):

1. every contributing rank encodes **every** shard of its gradient with its own error
   feedback (:class:`~mpicoll.ps.compressed.PushEncoder`), the shards it owns included,
   so each contribution goes through the codec exactly as with separate servers and the
   result does not depend on the placement;
2. the encoded shards go to their owners (:data:`TAG_SCATTER`, ``chunk_bytes`` messages);
   pull receives are posted (:data:`TAG_GATHER`): a shard's first pull arrives as values,
   later ones as the codec's payload (the receiver knows which: it holds a replica or not);
3. each owner waits for a shard's payloads, decodes them, sums them in rank order, applies
   the optimizer to the whole shard, then encodes the pull for every puller
   (:class:`~mpicoll.ps.compressed.PullEncoder`: the change since the puller's last pull
   with server-side error feedback, or the aggregate plus a residual with ``"sum"``) and
   sends it; its own ``out`` gets what the other pullers decode, so every rank holds the
   same values;
4. the pulled payloads are decoded into ``out`` (through this rank's replicas).

The owner's value stays exact; unlike the uncompressed path, a shard is reduced whole (not
segment by segment), since an encoded payload cannot be decoded in parts.
"""
from __future__ import annotations

from typing import Any, Generator

import numpy as np
from mpi4py import MPI

from . import protocol as P
from .compressed import Coders
from .server import ShardState

__all__ = ["CodedExchange"]

Steps = Generator[list, None, Any]


class CodedExchange(Coders):
    """Compressed push/pull steps of a :class:`~mpicoll.ps.colocated.ColocatedEngine`.

    Uses the engine's ``comm``, ``rank``, ``order``, ``states``, ``chunk_bytes``,
    ``counters``, ``worker_counters``, ``_scratch_for``, ``_acc_for``, ``_reduce`` and
    ``_acc``, and the codec state of :class:`~mpicoll.ps.compressed.Coders`.
    """

    def _bytes(self, key: tuple[Any, ...], nbytes: int) -> np.ndarray:
        """A reusable byte buffer (one per shard and peer: used once per step)."""
        return P.scratch(self._coded_bufs, key, nbytes)

    def _messages(self, data: np.ndarray, peer: int, tag: int, send: bool) -> list[MPI.Request]:
        """Post the ``chunk_bytes`` messages of a payload (bytes or values)."""
        post = P.send_payload if send else P.post_recv_payload
        return post(self.comm, data, peer, tag, self.chunk_bytes)

    def _coded_step(self, busy: list[int], pushing: bool, pulling: bool,
                    grads_flat: dict[str, np.ndarray],
                    out_flat: dict[str, np.ndarray] | None) -> Steps:
        """One compressed push, pull or push_pull (see the module docstring)."""
        me = self.rank
        contributors = busy if pushing else []
        pullers = busy if pulling else []
        mine = self._encode_mine(grads_flat) if me in contributors else {}
        recvs = self._post_coded_gradient_recvs(contributors)
        pending, pull_recvs = self._post_coded_pull_recvs(out_flat) if me in pullers \
            else ([], [])
        sends: list[MPI.Request] = []
        for sh in self.order:
            if sh.server != me and sh.count and me in contributors:
                sends += self._messages(mine[sh.ident][0], sh.server, P.TAG_SCATTER, True)
        for state in self.states.values():
            ident = state.shard.ident
            if pushing:
                if recvs.get(ident):
                    yield recvs[ident]
                self._coded_update(state, contributors, mine)
            if pulling:
                sends += self._send_coded_pulls(state, pullers, out_flat)
        yield pull_recvs + sends
        for sh, buf, coded, dec in pending:
            dec.apply(buf, coded, out_flat[sh.spec.name][sh.lo:sh.hi])

    def _encode_mine(self, grads_flat: dict[str, np.ndarray]
                     ) -> dict[tuple[int, int], tuple[np.ndarray, np.ndarray]]:
        """This rank's gradient, every shard encoded with its residual:
        ident -> (payload bytes, decoded)."""
        mine = {}
        for sh in self.order:
            part = grads_flat[sh.spec.name][sh.lo:sh.hi]
            mine[sh.ident] = self.push_encoder.encode((sh.spec.name, sh.index), part)
            if sh.server != self.rank and sh.count:
                P.count_bytes(self.worker_counters, "bytes_sent", mine[sh.ident][0].nbytes,
                              sh.nbytes)
        return mine

    def _post_coded_gradient_recvs(self, contributors: list[int]
                                   ) -> dict[tuple[int, int], list[MPI.Request]]:
        """Receives of the other contributors' encoded shards this rank owns."""
        recvs: dict[tuple[int, int], list[MPI.Request]] = {}
        for state in self.states.values():
            sh = state.shard
            nbytes = self.codec.wire_bytes(sh.count, sh.spec.dtype)
            for src in contributors:
                if src != self.rank and sh.count:
                    buf = self._bytes(("grad", sh.ident, src), nbytes)
                    recvs.setdefault(sh.ident, []).extend(
                        self._messages(buf, src, P.TAG_SCATTER, False))
        return recvs

    def _post_coded_pull_recvs(self, out_flat: dict[str, np.ndarray]
                               ) -> tuple[list[tuple], list[MPI.Request]]:
        """Receives of every shard this rank does not own: into a byte buffer when
        compressed, else (a first pull) straight into ``out``."""
        pending, reqs = [], []
        for sh in self.order:
            if sh.server == self.rank or not sh.count:
                continue
            dec = self._pull_decoder(sh)
            coded = not dec.delta or dec.replica is not None
            buf = self._bytes(("pull", sh.ident), dec.wire_bytes()) if coded \
                else out_flat[sh.spec.name][sh.lo:sh.hi]
            reqs += self._messages(buf, sh.server, P.TAG_GATHER, False)
            pending.append((sh, buf, coded, dec))
            P.count_bytes(self.worker_counters, "bytes_received", buf.nbytes, sh.nbytes)
        return pending, reqs

    def _coded_update(self, state: ShardState, contributors: list[int],
                      mine: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]]) -> None:
        """Decode an owned shard's contributions, sum them in rank order, apply the
        optimizer (the whole shard at once)."""
        sh = state.shard
        nbytes = self.codec.wire_bytes(sh.count, sh.spec.dtype)
        parts = []
        for src in contributors:
            if src == self.rank:
                parts.append(mine[sh.ident][1])
            else:
                raw = self._bytes(("grad", sh.ident, src), nbytes)
                parts.append(self.codec.decode_into(raw, sh.count, self._scratch_for(sh, src)))
                P.count_bytes(self.counters, "bytes_in", nbytes if sh.count else 0, sh.nbytes)
        acc = self._acc_for(sh)
        if sh.count and parts:
            self._reduce(acc, parts, contributors, sh)
        if state.opt.name == "sum":
            state.opt.steps += 1
            state.param, self._acc[sh.ident] = acc, state.param
        else:
            state.opt.apply(state.param, acc)
        state.version += 1
        self.counters["updates"] += 1
        self.counters["pushes"] += len(contributors)

    def _send_coded_pulls(self, state: ShardState, pullers: list[int],
                          out_flat: dict[str, np.ndarray] | None) -> list[MPI.Request]:
        """Encode an owned shard's pull for every puller and send it; this rank's own
        ``out`` gets what the others decode."""
        sh = state.shard
        enc = self._pull_encoder(state)
        sends: list[MPI.Request] = []
        for dst in pullers:
            self.counters["pulls"] += 1
            data, _ = enc.payload(dst, state.param, state.version)
            if dst == self.rank:
                if out_flat is not None:
                    dest = out_flat[sh.spec.name][sh.lo:sh.hi]
                    if enc.delta:
                        np.copyto(dest, enc.value_of(dst))
                    else:
                        self.codec.decode_into(data, sh.count, dest)
            elif sh.count:
                sends += self._messages(data, dst, P.TAG_GATHER, True)
                P.count_bytes(self.counters, "bytes_out", data.nbytes, sh.nbytes)
        return sends
