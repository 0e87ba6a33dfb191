"""DiLoCo's settings, fragment layout and step schedule (pure: no MPI, no tensors).

Used by :class:`mpicoll.torch.diloco.DiLoCo`; unit-tested on their own.

With ``sync_every=H``, ``fragments=F`` and ``overlap=tau`` (``h = H / F``), counting the
inner steps ``t = 1, 2, ...`` (``t`` is the number of inner steps taken so far):

- fragment ``p`` (``0 <= p < F``) *arrives* (its outer step is taken) after the inner steps
  ``t = (p + 1) h + k H``, ``k = 0, 1, ...``: the fragments take turns, ``h`` steps apart,
  each every ``H`` steps (torchft's ``DiLoCo``: the fragment of sync number ``j`` is
  ``j mod F``, one sync every ``h`` inner steps);
- it is *sent* (its pseudo-gradient computed and its all-reduce started) ``tau`` steps
  earlier, after inner step ``t - tau``; ``0 <= tau < h``, so one all-reduce at most is in
  flight and each arrives before the next one is sent.

``F = 1, tau = 0``: every ``H``-th step sends and takes the outer step at once
(DiLoCo's Algorithm 1).
"""
from __future__ import annotations

from itertools import accumulate
from typing import Any, NamedTuple, Sequence

import numpy as np

from ..validation import check_int

__all__ = ["DiLoCoSettings", "check_settings", "balanced_runs", "fragment_sizes",
           "DiLoCoSchedule"]


class DiLoCoSettings(NamedTuple):
    """Validated settings (see :func:`check_settings`)."""

    sync_every: int
    fragments: int
    overlap: int
    alpha: float

    @property
    def period(self) -> int:
        """``h = H / F``: inner steps between two fragments' outer steps."""
        return self.sync_every // self.fragments


def check_settings(sync_every: Any, fragments: Any = 1, overlap: Any = 0,
                   alpha: Any = 0.5) -> DiLoCoSettings:
    """Validate DiLoCo's settings on this rank (no communication).

    Args:
        sync_every: ``H >= 1`` inner steps between two outer steps of each fragment.
        fragments: ``F >= 1`` fragments; ``H`` must be a multiple of ``F``.
        overlap: ``tau`` inner steps a fragment's all-reduce runs behind;
            ``0 <= tau < H / F``.
        alpha: the weight of this rank's parameters in ``lerp(global, local, alpha)``
            when an overlapped fragment arrives; ``0 <= alpha <= 1``.
    Returns:
        The settings.
    Raises:
        TypeError: a setting of the wrong type.
        ValueError: a setting out of range, ``H`` not a multiple of ``F``, or
            ``tau >= H / F``.
    """
    h = check_int("sync_every", sync_every, 1)
    f = check_int("fragments", fragments, 1)
    tau = check_int("overlap", overlap, 0)
    if h % f:
        raise ValueError(f"sync_every ({h}) must be a multiple of fragments ({f}): each "
                         f"fragment syncs every sync_every steps, one every "
                         f"sync_every / fragments steps")
    if tau >= h // f:
        raise ValueError(f"overlap ({tau}) must be smaller than sync_every / fragments "
                         f"({h} / {f} = {h // f}): a fragment's all-reduce must arrive "
                         f"before the next fragment's starts")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float, np.integer,
                                                         np.floating)):
        raise TypeError(f"alpha must be a float, not {type(alpha).__name__} ({alpha!r})")
    a = float(alpha)
    if not (0.0 <= a <= 1.0):           # (NaN fails too)
        raise ValueError(f"alpha must be in [0, 1], not {alpha!r}")
    return DiLoCoSettings(h, f, tau, a)


def balanced_runs(sizes: Sequence[int], fragments: int) -> list[tuple[int, int]]:
    """Cut a list of tensors (their element counts ``sizes``, in order) into ``fragments``
    contiguous, non-empty runs balanced by element count.

    Cut ``k`` (``k = 1 .. F-1``) is placed after the tensor where the running element
    count comes closest to ``k / F`` of the total (the earlier tensor on a tie), each run
    keeping at least one tensor.

    Returns:
        ``(start, stop)`` index ranges, in order, covering ``range(len(sizes))``.
    Raises:
        ValueError: fewer tensors than fragments.
    """
    count = len(sizes)
    if fragments > count:
        raise ValueError(f"fragments ({fragments}) must not exceed the number of parameter "
                         f"tensors ({count}): each fragment holds at least one")
    cum = list(accumulate(map(int, sizes), initial=0))
    total = cum[-1]
    cuts = [0]
    for k in range(1, fragments):
        target = k * total / fragments
        lo, hi = cuts[-1] + 1, count - (fragments - k)
        cuts.append(min(range(lo, hi + 1), key=lambda b: (abs(cum[b] - target), b)))
    cuts.append(count)
    return [(cuts[i], cuts[i + 1]) for i in range(fragments)]


class DiLoCoSchedule:
    """Which fragment is sent and which arrives after each inner step (see the module
    docstring)."""

    def __init__(self, settings: DiLoCoSettings) -> None:
        self.settings = settings

    def arrives(self, step: int) -> int | None:
        """The fragment whose outer step is taken after inner step ``step`` (or ``None``)."""
        h = self.settings.period
        if step < h or step % h:
            return None
        return (step // h - 1) % self.settings.fragments

    def sends(self, step: int) -> int | None:
        """The fragment whose all-reduce starts after inner step ``step`` (or ``None``)."""
        return self.arrives(step + self.settings.overlap)

    def next_arrival(self, step: int) -> int:
        """The first step after ``step`` at which a fragment arrives."""
        h = self.settings.period
        return (step // h + 1) * h

    def syncs_of(self, fragment: int, steps: int) -> int:
        """How many outer steps ``fragment`` has taken after ``steps`` inner steps."""
        h, f = self.settings.period, self.settings.fragments
        first = (fragment + 1) * h
        return 0 if steps < first else 1 + (steps - first) // (f * h)


def fragment_sizes(runs: list[tuple[int, int]], sizes: Sequence[int]) -> list[int]:
    """Element count of each run of :func:`balanced_runs`."""
    return [sum(int(s) for s in sizes[a:b]) for a, b in runs]

