"""Compressed pushes and pulls: the codec state each side of the parameter server keeps.

With ``ParameterServer(..., compression="int8")`` (any codec of
:func:`mpicoll.compression.get_codec`):

- **push** (worker -> server): a worker encodes each shard of its gradient with error
  feedback (:class:`PushEncoder`: one residual and one codec object per shard it pushes);
  the server decodes the payload and aggregates the decoded gradients as before.
- **pull** (server -> worker), with a server-side optimizer (values are *parameters*): the
  server sends the **delta since that worker's last pull**, compressed, with error feedback
  (BytePS-style server-side error feedback, applied to the parameters' change). It keeps,
  per worker and shard, an exact copy of what the worker holds (its *replica*): the delta
  is ``param - replica`` (the newest change plus everything earlier deltas dropped, i.e.
  the residual), both sides add ``decode(payload)`` to their replica with the same numpy
  operation, so they stay bit-identical. A worker's first pull of a shard (no replica yet,
  e.g. after a restore without the compression state) is sent uncompressed (:class:`PullEncoder`).
  Replicas are shared between workers with the same pull history (the same versions
  pulled from the same replica), so under ``bsp`` a shard is encoded once per round,
  whatever the number of workers, and the server keeps one or two replicas per shard.
- **pull** with ``optimizer="sum"`` (values are the round's *aggregated gradient*): the
  server encodes ``value + residual`` with one residual per shard (server-side error
  feedback over the stream of aggregates, as BytePS compresses its summed gradients) once
  per version; every worker pulling that version gets the same bytes. A worker's first
  pull of a shard is uncompressed here too (the initial values are parameters, not an
  aggregate: compressed, they reached the workers changed, and what the codec dropped
  joined the first aggregate through the residual).

``feedback=False`` (``ParameterServer(..., feedback=False)``) drops the residuals: a push
encodes the gradient alone, an ``optimizer="sum"`` pull the aggregate alone. Pulls of
parameters keep encoding ``param - replica``: the replica is not a feedback buffer but the
worker's copy of the parameters, which the server must know to send a change at all, and
what an earlier pull dropped is still in ``param - replica``. Encoding instead the exact
change since the last pulled version (dropping the error for good) would let every
worker's parameters drift from the server's by a random walk of codec errors, never
corrected: workers would train on weights nobody holds, and with a second codec state per
shard to keep. So with parameter pulls ``feedback`` switches off the pushes' error
feedback only.

Every shard has its own copy of the codec (``copy.deepcopy``), so stateful codecs
(``randomk``'s step counter, stochastic ``int8``'s generator) advance per shard and the
result does not depend on the order in which shards happen to be served.
"""
from __future__ import annotations

import copy
from typing import Any, Hashable

import numpy as np

from ..compression import Codec, ErrorFeedback, NoneCodec, get_codec, new_payload
from ..compression.auto import Auto
from .placement import ParamSpec
from .protocol import scratch

__all__ = ["resolve_codec", "check_compressible", "PushEncoder", "PullEncoder",
           "PullDecoder", "State", "Coders"]

#: a coder's checkpointed state: JSON-able metadata and named arrays
State = tuple[dict, dict[str, np.ndarray]]


def resolve_codec(spec: Any) -> Codec | None:
    """The codec of a ``compression=`` argument; ``None`` for no compression.

    Args:
        spec: ``None``, ``"none"``, a codec name (``"int8"``, ``"topk:0.01"`` ...) or a
            :class:`~mpicoll.compression.Codec`.
    Raises:
        ValueError: unknown name, a ratio outside (0, 1], a malformed parameter.
        TypeError: neither a name nor a codec; ``compression="auto"``
            (:class:`mpicoll.compression.Auto`: the choice is per all-reduce call).
    """
    codec = get_codec(spec, argname="compression")
    if isinstance(codec, Auto):
        raise TypeError("the parameter server takes a fixed codec, not compression='auto' "
                        "(mpicoll.compression.Auto); pass 'none', 'bf16', 'int8', ...")
    return None if isinstance(codec, NoneCodec) else codec


def check_compressible(specs: list[ParamSpec], codec: Codec | None) -> None:
    """Raise ``TypeError`` naming the first parameter ``codec`` cannot encode.

    Raises:
        TypeError: a parameter is not float32/float64 (integers, float16, complex, bool).
    """
    if codec is None:
        return
    for spec in specs:
        codec.check_dtype(spec.dtype, f"parameter {spec.name!r}")


def _encode_with_feedback(codec: Codec, residual: np.ndarray | None, x: np.ndarray,
                          sent: np.ndarray) -> np.ndarray:
    """Encode ``y = residual + x``; leave ``y - sent`` in ``residual`` and what the receiver
    decodes in ``sent``. Without a residual (``None``: error feedback off) encode ``x``.
    Returns the payload bytes (a fresh buffer, safe to send)."""
    if residual is not None:
        x = np.add(residual, x, out=residual)
    raw, parts = new_payload(codec, x.size, x.dtype)
    codec.encode(x, out=parts)
    codec.decode(parts, x.size, x.dtype, out=sent)
    if residual is not None:
        np.subtract(residual, sent, out=residual)
    return raw


class PushEncoder:
    """Worker side of compressed pushes: a residual and a codec copy per pushed shard.

    Args:
        codec: the agreed codec.
        feedback: keep a residual per shard (error feedback); ``False``: send each
            gradient's own encoding and keep nothing.
    """

    def __init__(self, codec: Codec, feedback: bool = True) -> None:
        self.codec = codec
        self._codecs: dict[Hashable, Codec] = {}
        #: the residual of every shard pushed so far (key: ``(name, shard index)``);
        #: ``None`` with error feedback off
        self.feedback = ErrorFeedback() if feedback else None
        self._sent: dict[Hashable, np.ndarray] = {}

    def encode(self, key: Hashable, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Compress gradient shard ``x`` (flat) plus its residual; keep the new residual.

        Returns:
            ``(payload bytes, decoded)``: the bytes to send (a fresh buffer) and what the
            server will decode from them (valid until this key's next ``encode``).
        """
        residual = None if self.feedback is None else self.feedback.buffer(key, x)
        sent = scratch(self._sent, key, x.size, x.dtype)
        return _encode_with_feedback(self.codec_for(key), residual, x, sent), sent

    def codec_for(self, key: Hashable) -> Codec:
        """The copy of the codec of shard ``key`` (one per shard, made on first use)."""
        c = self._codecs.get(key)
        if c is None:
            c = self._codecs[key] = copy.deepcopy(self.codec)
        return c

    def wire_bytes(self, count: int, dtype: Any) -> int:
        """Payload bytes of a shard of ``count`` elements."""
        return self.codec.wire_bytes(count, dtype)

    def state(self) -> State:
        """Residuals and codec states, for checkpoints (see :func:`load_state`)."""
        keys = sorted(self._codecs, key=repr)
        residuals = [] if self.feedback is None else [self.feedback.residual(k) for k in keys]
        arrays = {f"r{i}": res for i, res in enumerate(residuals) if res is not None}
        return {"keys": [list(k) for k in keys],
                "codecs": [self._codecs[k].state_dict() for k in keys]}, arrays

    def load_state(self, meta: dict, arrays: dict[str, np.ndarray]) -> None:
        """Take back what :meth:`state` returned."""
        for i, (k, cs) in enumerate(zip(meta["keys"], meta["codecs"])):
            key = tuple(k)
            self.codec_for(key).load_state_dict(cs)
            if self.feedback is not None and f"r{i}" in arrays:
                self.feedback.store(key, arrays[f"r{i}"].copy())


class PullEncoder:
    """Server side of compressed pulls of one shard.

    Args:
        codec: the agreed codec (this shard gets its own copy).
        count, dtype: the shard's elements.
        delta: ``True`` for parameters (send the delta since each puller's last pull,
            against a replica of what it holds); ``False`` for ``optimizer="sum"``
            (send ``value + residual``, one residual per shard, once per version).
        feedback: value mode only: keep the residual (``False``: encode each version's
            value alone). Delta mode always sends ``param - replica``: see the module
            docstring.
    """

    def __init__(self, codec: Codec, count: int, dtype: Any, delta: bool,
                 feedback: bool = True) -> None:
        self.codec = copy.deepcopy(codec)
        self.count = int(count)
        self.dtype = np.dtype(dtype)
        self.delta = delta
        #: value mode's residual (``None`` with error feedback off)
        self.residual = np.zeros(self.count, dtype=self.dtype) if feedback else None
        self._cached: tuple[int, np.ndarray] | None = None        # value mode: (version, raw)
        self.pulled: set[int] = set()          # value mode: pullers past their first pull
        # delta mode: replica id -> array; puller -> replica id; (from id, version) ->
        # (to id, payload, coded)
        self.replicas: dict[int, np.ndarray] = {}
        self.holders: dict[int, int] = {}
        self._moves: dict[tuple[int | None, int], tuple[int, np.ndarray, bool]] = {}
        self._next_id = 0

    def payload(self, puller: int, value: np.ndarray, version: int) -> tuple[np.ndarray, bool]:
        """What to send ``puller`` for ``value`` (the shard at ``version``).

        Returns:
            ``(data, coded)``: the codec's payload bytes (``coded``), or the values
            themselves for a first pull (an array the encoder never modifies again).
        """
        if not self.delta:
            if puller not in self.pulled:  # a first pull: the values, exact and outside the
                self.pulled.add(puller)  # residual (the initial ones would join the first
                return value.copy(), False  # aggregate's)
            return self._value_payload(value, version), True
        src = self.holders.get(puller)
        move = self._moves.get((src, version))
        if move is None:
            move = self._moves[(src, version)] = self._new_move(src, value)
        to, data, coded = move
        self.holders[puller] = to
        self._prune()
        return data, coded

    def value_of(self, puller: int) -> np.ndarray | None:
        """The replica ``puller`` holds (what its last pull delivered), or ``None``."""
        rid = self.holders.get(puller)
        return None if rid is None else self.replicas[rid]

    def forget(self, puller: int) -> None:
        """``puller`` will not pull again (it closed): drop its replica."""
        self.pulled.discard(puller)
        if self.holders.pop(puller, None) is not None:
            self._prune()

    def state(self) -> State:
        """Replicas, holders, residual and codec state, for checkpoints."""
        arrays = {f"rep{r}": a for r, a in self.replicas.items()}
        if self.residual is not None:
            arrays["residual"] = self.residual
        if self._cached is not None:
            arrays["cached"] = self._cached[1]
        return {"holders": {str(p): r for p, r in self.holders.items()},
                "pulled": sorted(self.pulled),
                "next_id": self._next_id, "codec": self.codec.state_dict(),
                "cached_version": None if self._cached is None else self._cached[0]}, arrays

    def load_state(self, meta: dict, arrays: dict[str, np.ndarray]) -> None:
        """Take back what :meth:`state` returned."""
        self.codec.load_state_dict(meta["codec"])
        self.holders = {int(p): r for p, r in meta["holders"].items()}
        self.pulled = set(meta.get("pulled", ()))
        self.replicas = {r: arrays[f"rep{r}"].copy() for r in set(self.holders.values())}
        self._next_id = meta["next_id"]
        self._moves = {}
        if self.residual is not None:
            self.residual = arrays["residual"].copy()
        if meta["cached_version"] is not None:
            self._cached = (meta["cached_version"], arrays["cached"].copy())

    def _value_payload(self, value: np.ndarray, version: int) -> np.ndarray:
        if self._cached is None or self._cached[0] != version:
            sent = np.empty(self.count, dtype=self.dtype)
            raw = _encode_with_feedback(self.codec, self.residual, value, sent)
            self._cached = (version, raw)
        return self._cached[1]

    def _new_move(self, src: int | None, value: np.ndarray) -> tuple[int, np.ndarray, bool]:
        rid = self._next_id
        self._next_id += 1
        if src is None:                      # first pull: the values, uncompressed
            new = value.copy()
            self.replicas[rid] = new
            return rid, new, False
        old = self.replicas[src]
        delta = np.subtract(value, old)
        raw = _encode_with_feedback(self.codec, None, delta, delta)
        self.replicas[rid] = np.add(old, delta, out=delta)
        return rid, raw, True

    def _prune(self) -> None:
        """Drop replicas no puller holds or can still move to, and moves nobody can make."""
        held = set(self.holders.values())
        live = held | {to for (src, _), (to, _, _) in self._moves.items() if src in held}
        self._moves = {k: m for k, m in self._moves.items()
                       if k[0] in held or (k[0] is None and m[0] in live)}
        self.replicas = {r: a for r, a in self.replicas.items() if r in live}


class PullDecoder:
    """Worker side of compressed pulls of one shard: its replica (delta mode).

    Args:
        codec: the agreed codec (decoding never depends on the codec's state).
        count, dtype: the shard's elements.
        delta: as :class:`PullEncoder`.
    """

    def __init__(self, codec: Codec, count: int, dtype: Any, delta: bool) -> None:
        self.codec = codec
        self.count = int(count)
        self.dtype = np.dtype(dtype)
        self.delta = delta
        self.replica: np.ndarray | None = None
        #: past the first pull, which is uncompressed (delta mode: holds a replica)
        self.pulled = False

    def wire_bytes(self) -> int:
        """Bytes of a compressed pull of this shard."""
        return self.codec.wire_bytes(self.count, self.dtype)

    def state(self) -> State:
        """The replica (value mode: whether the first pull came), for checkpoints."""
        return {"pulled": self.pulled}, {} if self.replica is None else {"replica": self.replica}

    def load_state(self, meta: dict, arrays: dict[str, np.ndarray]) -> None:
        """Take back what :meth:`state` returned."""
        replica = arrays.get("replica")
        self.replica = None if replica is None else replica.copy()
        self.pulled = bool(meta.get("pulled")) or replica is not None

    def apply(self, data: np.ndarray, coded: bool, dest: np.ndarray) -> None:
        """Turn a received pull into values in flat ``dest``.

        Args:
            data: the payload bytes (``coded``) or the values (an uncompressed first pull;
                may be ``dest`` itself).
        """
        self.pulled = True
        if not coded:
            if data is not dest:
                np.copyto(dest, data)
            if self.delta:
                self.replica = dest.copy()
            return
        if self.delta and self.replica is None:
            raise ValueError("a compressed pull arrived before the uncompressed first one")
        self.codec.decode_into(data, self.count, dest)
        if self.delta:
            np.add(self.replica, dest, out=self.replica)
            np.copyto(dest, self.replica)


class Coders:
    """The compression state of one rank of the parameter server (a mixin of the server,
    the worker client and the co-located engine): its push encoder, the pull encoders of
    the shards it serves and the pull decoders of the shards it pulls, each made on first
    use. Users call :meth:`_setup_coders`; they have ``placement`` and, where they serve
    shards, ``states`` (ident -> :class:`~mpicoll.ps.server.ShardState`)."""

    #: the shards served here (a worker client serves none: this empty default)
    states: dict = {}

    def _setup_coders(self, codec: Codec | None, feedback: bool, pull_deltas: bool,
                      pushes: bool) -> None:
        self.codec = codec
        #: error feedback of compressed pushes (and ``optimizer="sum"`` pulls)
        self.feedback = feedback
        #: compressed pulls carry the change since the last pull (parameters), not the
        #: value itself (``optimizer="sum"``)
        self.pull_deltas = pull_deltas
        self.push_encoder = PushEncoder(codec, feedback) if codec is not None and pushes \
            else None
        self._encoders: dict[tuple[int, int], PullEncoder] = {}
        self._decoders: dict[tuple[int, int], PullDecoder] = {}

    def _pull_encoder(self, state: Any) -> PullEncoder:
        """The compressed-pull state of a shard served here (server-side error feedback)."""
        sh = state.shard
        enc = self._encoders.get(sh.ident)
        if enc is None:
            enc = self._encoders[sh.ident] = PullEncoder(self.codec, sh.count, sh.spec.dtype,
                                                         delta=state.opt.name != "sum",
                                                         feedback=self.feedback)
        return enc

    def _pull_decoder(self, sh: Any) -> PullDecoder | None:
        """The decoder of compressed pulls of shard ``sh`` (``None`` without a codec)."""
        if self.codec is None:
            return None
        dec = self._decoders.get(sh.ident)
        if dec is None:
            dec = self._decoders[sh.ident] = PullDecoder(self.codec, sh.count, sh.spec.dtype,
                                                         self.pull_deltas)
        return dec

    def codec_state(self) -> dict[str, State]:
        """This rank's compression state (push residuals, the pull encoders' replicas and
        residuals of the shards it serves, the pull decoders' replicas of the shards it
        pulls), as checkpoint parts."""
        parts = {} if self.push_encoder is None else {"push": self.push_encoder.state()}
        for kind, coders in (("enc", self._encoders), ("dec", self._decoders)):
            parts.update({f"{kind}:{a},{b}": c.state() for (a, b), c in coders.items()})
        return parts

    def load_codec_state(self, parts: dict[str, State]) -> None:
        """Take back what :meth:`codec_state` returned (same rank, same layout); the pull
        encoders and decoders are made on first use.

        Raises:
            ValueError: a part this rank has no use for (another layout).
        """
        for name, (meta, arrays) in parts.items():
            if name == "push" and self.push_encoder is None:
                raise ValueError("the checkpoint holds push state for a rank that pushes none")
            if name == "push":
                coder = self.push_encoder
            else:
                kind, _, ident = name.partition(":")
                a, b = (int(v) for v in ident.split(","))
                coder = self._pull_encoder(self.states[(a, b)]) if kind == "enc" else \
                    self._pull_decoder(self.placement.by_ident[(a, b)])
            coder.load_state(meta, arrays)

    def forget_pullers(self, ranks: list[int]) -> None:
        """Closed ranks pull no more: drop their replicas."""
        for enc in self._encoders.values():
            for r in ranks:
                enc.forget(r)
