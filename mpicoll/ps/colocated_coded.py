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

The owner's value stays exact; unlike the uncompressed path, a shard's payloads are decoded
whole before it is reduced (not as its segments arrive), since an encoded payload cannot be
decoded in parts.
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
    ``counters``, ``worker_counters``, ``_coded_bufs``, ``_scratch_for`` and
    ``_update_shard``, and the codec state of :class:`~mpicoll.ps.compressed.Coders`.
    """

    def _coded_step(self, busy: list[int], pushing: bool, pulling: bool,
                    grads_flat: dict[str, np.ndarray],
                    out_flat: dict[str, np.ndarray] | None) -> Steps:
        """One compressed push, pull or push_pull (see the module docstring)."""
        me = self.rank
        contributors = busy if pushing else []
        pullers = busy if pulling else []
        recvs = self._post_coded_gradient_recvs(contributors)     # receives first
        pending, pull_recvs = self._post_coded_pull_recvs(out_flat) if me in pullers \
            else ([], [])
        mine, sends = self._send_mine(grads_flat) if me in contributors else ({}, [])
        for state in self.states.values():
            ident = state.shard.ident
            if pushing:
                if recvs.get(ident):
                    yield recvs[ident]
                yield from self._coded_update(state, contributors, mine)
            if pulling:
                sends += self._send_coded_pulls(state, pullers, out_flat)
        yield pull_recvs + sends
        for sh, buf, coded, dec in pending:
            dec.apply(buf, coded, out_flat[sh.spec.name][sh.lo:sh.hi])

    def _send_mine(self, grads_flat: dict[str, np.ndarray]
                   ) -> tuple[dict[tuple[int, int], tuple[np.ndarray, np.ndarray]],
                              list[MPI.Request]]:
        """This rank's gradient, every shard encoded with its residual (ident -> (payload
        bytes, decoded)), and the sends of the payloads of the shards other ranks own."""
        mine, sends = {}, []
        for sh in self.order:
            part = grads_flat[sh.spec.name][sh.lo:sh.hi]
            mine[sh.ident] = self.push_encoder.encode((sh.spec.name, sh.index), part)
            if sh.server != self.rank and sh.count:
                sends += P.send_payload(self.comm, mine[sh.ident][0], sh.server,
                                        P.TAG_SCATTER, self.chunk_bytes)
                P.count_bytes(self.worker_counters, "bytes_sent", mine[sh.ident][0].nbytes,
                              sh.nbytes)
        return mine, sends

    def _post_coded_gradient_recvs(self, contributors: list[int]
                                   ) -> dict[tuple[int, int], list[MPI.Request]]:
        """Receives of the other contributors' encoded shards this rank owns."""
        recvs: dict[tuple[int, int], list[MPI.Request]] = {}
        for state in self.states.values():
            sh = state.shard
            nbytes = self.codec.wire_bytes(sh.count, sh.spec.dtype)
            for src in contributors:
                if src != self.rank and sh.count:
                    buf = P.scratch(self._coded_bufs, ("grad", sh.ident, src), nbytes)
                    recvs.setdefault(sh.ident, []).extend(
                        P.post_recv_payload(self.comm, buf, src, P.TAG_SCATTER, self.chunk_bytes))
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
            coded = dec.pulled
            buf = P.scratch(self._coded_bufs, ("pull", sh.ident), dec.wire_bytes()) if coded \
                else out_flat[sh.spec.name][sh.lo:sh.hi]
            reqs += P.post_recv_payload(self.comm, buf, sh.server, P.TAG_GATHER, self.chunk_bytes)
            pending.append((sh, buf, coded, dec))
            P.count_bytes(self.worker_counters, "bytes_received", buf.nbytes, sh.nbytes)
        return pending, reqs

    def _coded_update(self, state: ShardState, contributors: list[int],
                      mine: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]]) -> Steps:
        """Decode an owned shard's contributions (each whole), then sum them in rank order
        and apply the optimizer as the uncompressed path does (``_update_shard``)."""
        sh = state.shard
        nbytes = self.codec.wire_bytes(sh.count, sh.spec.dtype)
        parts = []
        for src in contributors:
            if src == self.rank:
                parts.append(mine[sh.ident][1])
            else:
                raw = P.scratch(self._coded_bufs, ("grad", sh.ident, src), nbytes)
                parts.append(self.codec.decode_into(raw, sh.count, self._scratch_for(sh, src)))
                P.count_bytes(self.counters, "bytes_in", nbytes if sh.count else 0, sh.nbytes)
        yield from self._update_shard(state, parts, contributors, [], {}, None, False)
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
            data, coded = enc.payload(dst, state.param, state.version)
            if dst == self.rank:
                if out_flat is not None:
                    dest = out_flat[sh.spec.name][sh.lo:sh.hi]
                    if enc.delta:
                        np.copyto(dest, enc.value_of(dst))
                    elif coded:
                        self.codec.decode_into(data, sh.count, dest)
                    else:
                        np.copyto(dest, data)
            elif sh.count:
                sends += P.send_payload(self.comm, data, dst, P.TAG_GATHER, self.chunk_bytes)
                P.count_bytes(self.counters, "bytes_out", data.nbytes, sh.nbytes)
        return sends
