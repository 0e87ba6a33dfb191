"""``compression="auto"``: compress only where the model predicts it pays.

``compression="auto"`` (or ``"auto:none,int8"`` to choose among other candidates, or an
:class:`Auto` object with the link given and a margin) is accepted by the compressed
collectives (:func:`mpicoll.compression.allreduce`, ``reduce_scatter``, ``allgather``)
and by the torch adapter (``Compression.auto``). At each call it resolves to one codec
of its candidates (default :data:`~.cost_model.DEFAULT_CANDIDATES`: ``none``, ``bf16``,
``int8``, ``topk:0.01``), the one with the least predicted time
(:func:`~.cost_model.choose`), from:

- the link's latency and bandwidth: given to :class:`Auto`, else the active tuning
  table's ``meta.link`` (``{"latency_s": ..., "bandwidth_bytes_per_s": ...}``), else
  measured once per communicator at its first ``auto`` call (:func:`.probe.measure_link`,
  a few ring steps of 8 B and 4 MiB: milliseconds on a fast link, ~0.2 s at 1 Gb/s), and
  for the node layout once more on the rings between nodes, all of them at once (as its
  second phase runs them);
- each candidate's encode and decode speed on this machine (:func:`.probe.codec_speeds`,
  measured once per process, on every rank at once, about 0.2-0.5 s).

The figures are agreed across the ranks (one ``Allreduce(MAX)``, once per communicator:
the slowest rank and link set a ring's pace) before anything is chosen, so every rank
holds the same numbers and makes the same choice from them, whatever it measured itself.
The measurement and agreement run after the collective's own argument agreement, when
every rank is known to take part. :func:`~mpicoll.compression.last_stats` then names the
chosen codec (``codec``) and carries the :class:`~.cost_model.Choice` (``choice``:
predicted seconds per candidate, the inputs, the reason).

To override: pass a codec (``compression="int8"``) to fix the choice; ``Auto(latency=,
bandwidth=)`` or the tuning table's ``meta.link`` to skip the link probe;
``Auto(candidates=...)``/``"auto:..."`` to restrict it; ``Auto(margin=0.1)`` to compress
only when predicted at least 10% faster.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import numpy as np

from ..context import CommContext, get_context
from .codecs import Codec, get_codec
from .cost_model import DEFAULT_CANDIDATES, Choice, Layout, ModelInputs, choose
from . import namespace, probe

__all__ = ["Auto", "AUTO", "codec_from_spec", "is_auto", "model_layout", "resolve"]

#: The spec's name.
AUTO = "auto"


class Auto(Codec):
    """``compression="auto"``: a placeholder codec that each collective call resolves to
    one of ``candidates`` (see the module docstring); it never encodes anything itself.

    Args:
        candidates: codec names to choose among, the default choice first (default
            ``("none", "bf16", "int8", "topk:0.01")``).
        latency: the link's seconds per message; with ``bandwidth``, skips the probe
            (both or neither).
        bandwidth: the link's bytes per second.
        margin: choose a compressing candidate only when it is predicted faster than the
            first candidate by more than this fraction (default 0).
    Raises:
        ValueError: an unknown or repeated candidate, ``auto`` among them, no candidate,
            only one of latency/bandwidth, values out of range.
        TypeError: a candidate that is not a name, numbers that are not numbers.
    """

    lossy = True
    dense = True

    def __init__(self, candidates: Sequence[str] = DEFAULT_CANDIDATES,
                 latency: float | None = None, bandwidth: float | None = None,
                 margin: float = 0.0) -> None:
        if isinstance(candidates, str) or not isinstance(candidates, Sequence):
            raise TypeError("compression='auto': candidates must be a sequence of codec "
                            "names")
        codecs = []
        for c in candidates:
            if not isinstance(c, str):
                raise TypeError(f"compression='auto': candidates are codec names, not "
                                f"{type(c).__name__}")
            if c.strip().lower().startswith(AUTO):
                raise ValueError("compression='auto': 'auto' cannot be its own candidate")
            codecs.append(get_codec(c, "compression"))
        if not codecs:
            raise ValueError("compression='auto' needs at least one candidate codec")
        names = [c.name for c in codecs]
        if len(set(names)) != len(names):
            raise ValueError(f"compression='auto': repeated candidates {names}")
        if (latency is None) != (bandwidth is None):
            raise ValueError("compression='auto': give both latency and bandwidth, or "
                             "neither (then the link is measured)")
        if latency is not None:
            latency, bandwidth = _number(latency, "latency"), _number(bandwidth, "bandwidth")
            if latency < 0 or not bandwidth > 0 or math.isinf(latency):
                raise ValueError(f"compression='auto': latency must be >= 0 and bandwidth "
                                 f"> 0, got {latency!r} and {bandwidth!r}")
        margin = _number(margin, "margin")
        if not 0.0 <= margin < 1.0:
            raise ValueError(f"compression='auto': margin must be in [0, 1), got {margin!r}")
        self.candidates = tuple(names)
        self.latency, self.bandwidth, self.margin = latency, bandwidth, margin
        self._codecs = {c.name: c for c in codecs}
        # the name carries every option, so the agreement of the collectives catches
        # ranks whose options differ (they would otherwise probe differently)
        self.name = AUTO if self.candidates == DEFAULT_CANDIDATES else \
            f"{AUTO}:{','.join(self.candidates)}"
        if latency is not None:
            self.name += f"[latency={latency:g},bandwidth={bandwidth:g}]"
        if margin:
            self.name += f"[margin={margin:g}]"

    def codec(self, name: str) -> Codec:
        """This object's codec for candidate ``name`` (one object per candidate, so a
        stateful one, random-k, advances from call to call)."""
        return self._codecs[name]

    def layout(self, count: int, dtype: Any = np.float32) -> tuple:
        raise TypeError(self._unresolved())

    def encode(self, x: Any, out: tuple | None = None) -> tuple:
        raise TypeError(self._unresolved())

    def decode(self, payload: Any, count: int, dtype: Any = np.float32,
               out: Any = None) -> Any:
        raise TypeError(self._unresolved())

    def _unresolved(self) -> str:
        return (f"compression={self.name!r} is resolved to a codec by the compressed "
                f"collectives (mpicoll.compression.allreduce, reduce_scatter, allgather; "
                f"DistributedOptimizer, hvd.allreduce); here pass a codec "
                f"({', '.join(self.candidates)})")

    def state_dict(self) -> dict:
        """The candidates' states (random-k's step...), by name; empty ones left out."""
        return {n: c.state_dict() for n, c in self._codecs.items() if c.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (checked first: on error nothing changes).

        Raises:
            ValueError: not a dict of this object's candidates' states.
        """
        if not isinstance(state, dict) or not set(state) <= set(self._codecs):
            raise ValueError(f"codec state {state!r} does not belong to compression="
                             f"{self.name!r}")
        for n, s in state.items():
            get_codec(n).load_state_dict(s)          # check on a fresh codec first
        for n, s in state.items():
            self._codecs[n].load_state_dict(s)


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer,
                                                          np.floating)):
        raise TypeError(f"compression='auto': {what} must be a number, not "
                        f"{type(value).__name__}")
    return float(value)


def is_auto(spec: Any) -> bool:
    """Whether ``spec`` asks for automatic choice (``"auto"``, ``"auto:..."``, Auto)."""
    return isinstance(spec, Auto) or (isinstance(spec, str)
                                      and spec.strip().lower().partition(":")[0] == AUTO)


def codec_from_spec(spec: Any, argname: str = "compression") -> Codec:
    """:func:`~.codecs.get_codec`, plus ``"auto"`` and ``"auto:NAME,NAME,..."``
    (:class:`Auto` with those candidates).

    Raises:
        ValueError, TypeError: as :func:`get_codec` and :class:`Auto`.
    """
    if isinstance(spec, str) and is_auto(spec):
        _, colon, rest = spec.strip().partition(":")
        return Auto(rest.split(",")) if colon else Auto()  # ("auto:": no candidate)
    return get_codec(spec, argname)


# ---------------------------------------------------------------------------------------
# resolution (collective on a communicator's first use)

@dataclass
class _State:
    """A communicator's agreed model inputs and the choices made from them."""

    inputs: ModelInputs
    choices: dict = field(default_factory=dict)
    #: The inputs of the node layout when the link is measured: the rings between nodes
    #: probed all at once (made on the first node-layout call).
    node: ModelInputs | None = None


def _table_link() -> tuple[float, float, str] | None:
    """``(latency, bandwidth, source)`` from the active tuning table's ``meta.link``."""
    from .. import tuning  # noqa: PLC0415

    table = tuning.active_table()
    link = None if table is None else table.meta.get("link")
    if not isinstance(link, dict):
        return None
    try:
        latency = float(link["latency_s"])
        bandwidth = float(link["bandwidth_bytes_per_s"])
    except (KeyError, TypeError, ValueError):
        return None
    if latency < 0 or not bandwidth > 0:
        return None
    return latency, bandwidth, f"tuning table {table.source}"


def _state(ctx: CommContext, auto: Auto, like: Any) -> _State:
    """The agreed model inputs of ``auto``'s candidates on ``ctx`` (collective the first
    time per communicator, candidate list, link source and array module of ``like``, an
    array of the module the collective runs in; cached)."""
    module = namespace.array_module(like).__name__
    given = None if auto.latency is None else (auto.latency, auto.bandwidth, "given")
    key = ("compression.auto", module, auto.candidates, given)

    def build() -> _State:
        link = given or _table_link()
        ctx.p2p.Barrier()              # every rank measures at once (shared cores)
        enc, dec, add = probe.codec_speeds(auto.candidates, like)
        if link is None:
            figures, source = probe.measure_link(ctx.p2p), "measured"
        else:
            figures, source = (link[0], 1.0 / link[1]), link[2]
        share = probe.cpu_share(module)
        return _State(probe.agree_inputs(ctx.p2p, enc, dec, add, figures, source, share))

    return ctx.resource(key, build)


def model_layout(ctx: CommContext, shape: str) -> Layout:
    """The model's :class:`~.cost_model.Layout` of ``ctx`` run in ``shape`` (``"flat"``
    or ``"node"``, what ``layout=`` resolved to)."""
    if shape != "node":
        return Layout(ctx.size)
    sizes = list(ctx.topology.node_sizes)
    if len(set(sizes)) == 1:
        return Layout(ctx.size, len(sizes), sizes[0])
    return Layout(len(sizes))           # uneven nodes: the leaders' ring on the whole vector


def resolve(ctx: CommContext, auto: Auto, x: Any, shape: str, seg_bytes: int,
            feedback: Any, collective: str = "allreduce") -> tuple[Codec, Choice]:
    """The codec ``auto`` resolves to for this call, and why (collective the first time
    per communicator: run it on every rank, after the arguments' agreement).

    Args:
        x: this rank's flat input (count, dtype and array module matter).
        shape: ``"flat"`` or ``"node"``.
        feedback: the call's ``feedback=`` (``False``: off; anything else: on for lossy
            codecs).
    """
    like = x[:0]
    state = _state(ctx, auto, like)
    layout = model_layout(ctx, shape)
    inputs = state.inputs
    if shape == "node" and inputs.source == "measured":
        if state.node is None:      # collective: every rank resolved layout="node" alike
            cross = get_context(ctx.topology.cross_comm)
            state.node = replace(probe.agree_inputs(
                ctx.p2p, inputs.encode, inputs.decode, inputs.add,
                probe.measure_link(cross.p2p), "measured (node layout: every ring between "
                "nodes at once)", inputs.cpu_share), per_ring=True)
        inputs = state.node
    fb = feedback is not False
    key = (x.size, str(x.dtype), layout, seg_bytes, fb, collective, auto.margin)
    choice = state.choices.get(key)
    if choice is None:
        if len(state.choices) > 1024:
            state.choices.clear()
        choice = state.choices[key] = choose(inputs, auto.candidates, x.size, x.dtype,
                                             layout, seg_bytes, fb, collective,
                                             auto.margin)
    return auto.codec(choice.codec), choice
