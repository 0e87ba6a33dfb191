"""Validation of one rank's buffers, per collective: the one implementation every path calls.

The host collectives (:mod:`mpicoll.collectives`), the staged device path
(:mod:`mpicoll.gpu.staging`) and the compressed collectives (:mod:`mpicoll.compression`)
see buffers differently (numpy or CuPy flat views, device arrays behind a copies object,
arrays of a registered module), so each passes its *view* function, ``view(obj, argname,
writable)``: the flat contiguous view of one buffer, raising ``TypeError``/``ValueError``
that name the argument (``mpicoll.buffers.flat_view`` on the host). Everything else is
checked here, once: in place needs a ``recvbuf``, only the root of a reduce may work in
place, the root is an int in range, ``recvbuf`` has ``sendbuf``'s dtype and the count the
collective needs and does not overlap ``sendbuf`` (an elementwise reduction whose
``recvbuf`` is ``sendbuf``'s memory works in place), an in-place all-gather's ``recvbuf``
divides among the ranks. Errors name the argument, before any message is sent.

What stays with each path: allocating the outputs not given, and the checks of what only
that path has (the op or the codec against the dtype, the host/device side of a
compressed call's buffers), which it passes as ``check_input(dtype, argname)`` (run on the
input's dtype as soon as it is viewed) and ``check_pair(recv, send)`` (run first among
the checks of a given ``recvbuf``).
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import numpy as np

from .buffers import array_module, is_in_place
from .partition import block_bounds

__all__ = ["View", "Buffers", "check_int", "check_root", "require_recvbuf", "check_output",
           "elementwise", "reduce", "reduce_scatter", "allgather", "broadcast",
           "gathered_shape", "own_block"]

#: ``view(obj, argname, writable)``: the flat contiguous view of one buffer (raises
#: ``TypeError``/``ValueError`` naming ``argname``).
View = Callable[[Any, str, bool], Any]


class Buffers(NamedTuple):
    """The flat views of one call's buffers.

    Attributes:
        send: what this rank contributes: ``recv`` itself in place (for an in-place
            reduce-scatter, the whole of ``recvbuf``; for an in-place all-gather, this
            rank's block of it).
        recv: the output's flat view; ``None`` when the call passed none (the caller
            allocates it) and off the root of a reduce.
        in_place: the call works in place (``IN_PLACE``/``None`` as ``sendbuf``, or an
            elementwise reduction whose ``recvbuf`` is ``sendbuf``'s memory).
    """

    send: Any
    recv: Any
    in_place: bool


def check_int(name: str, value: Any, minimum: int) -> int:
    """``value`` (the argument ``name``) as an int of at least ``minimum``.

    Raises:
        TypeError: not an int (``bool`` included).
        ValueError: below ``minimum``.
    """
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, not {type(value).__name__} ({value!r})")
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, not {value}")
    return int(value)


def check_root(root: Any, size: int) -> int:
    """``root`` as an int.

    Raises:
        TypeError: not an int (``bool`` included).
        ValueError: not in ``[0, size)``.
    """
    if isinstance(root, bool) or not isinstance(root, (int, np.integer)):
        raise TypeError(f"root must be an int, not {type(root).__name__}")
    if not 0 <= root < size:
        raise ValueError(f"root={root} is out of range for a communicator of {size} ranks")
    return int(root)


def require_recvbuf(recvbuf: Any) -> Any:
    """``recvbuf`` of a call whose ``sendbuf`` is ``IN_PLACE``/``None``.

    Raises:
        ValueError: ``recvbuf`` is ``None`` too.
    """
    if recvbuf is None:
        raise ValueError("recvbuf is required when sendbuf is IN_PLACE/None")
    return recvbuf


def _address(a: Any) -> int:
    interface = getattr(a, "__array_interface__", None) or a.__cuda_array_interface__
    return interface["data"][0]


def check_order(sendbuf: Any, recvbuf: Any) -> None:
    """Raise when ``sendbuf`` and ``recvbuf`` (arrays of several dimensions) have no memory
    order in common (one C-ordered, the other Fortran-ordered or transposed): their
    elements would be paired by memory position, not by index.

    Raises:
        ValueError: they do.
    """
    a, b = getattr(sendbuf, "flags", None), getattr(recvbuf, "flags", None)
    if a is None or b is None or (a.c_contiguous and b.c_contiguous) or \
            (a.f_contiguous and b.f_contiguous):
        return
    raise ValueError("sendbuf and recvbuf have different memory orders (one C-ordered, "
                     "the other Fortran-ordered or transposed): pass them in the same "
                     "order (np.ascontiguousarray or np.asfortranarray)")


def check_output(recv: Any, send: Any, count: int, why: str, *,
                 same_is_in_place: bool = False) -> bool:
    """Check the flat view ``recv`` of ``recvbuf`` against ``send``'s (of ``sendbuf``).

    Args:
        count: the elements ``recv`` must have; ``why``: that count in words.
        same_is_in_place: an elementwise reduction: ``recv`` on exactly ``send``'s memory
            means in place (else any overlap is an error).
    Returns:
        Whether ``recv`` is ``send``'s memory (only with ``same_is_in_place``).
    Raises:
        TypeError: another dtype.
        ValueError: another count, or memory in common with ``send``.
    """
    if recv.dtype != send.dtype:
        raise TypeError(f"recvbuf has dtype {recv.dtype} but sendbuf has dtype {send.dtype}")
    if recv.size != count:
        raise ValueError(f"recvbuf has {recv.size} elements but {count} are needed ({why})")
    if same_is_in_place and recv is send:
        return True
    if recv.size and array_module(send).may_share_memory(send, recv):
        if same_is_in_place and (_address(recv) == _address(send)
                                 and recv.nbytes == send.nbytes):
            return True
        detail = " without being the same buffer" if same_is_in_place else ""
        raise ValueError(f"sendbuf and recvbuf overlap{detail}; pass mpicoll.IN_PLACE as "
                         f"sendbuf to work in place")
    return False


def _input(view: View, buf: Any, argname: str, writable: bool,
           check_input: Callable[[Any, str], Any] | None) -> Any:
    flat = view(buf, argname, writable)
    if check_input is not None:
        check_input(flat.dtype, argname)
    return flat


def _output(view: View, recvbuf: Any, send: Any,
            check_pair: Callable[[Any, Any], Any] | None) -> Any:
    recv = view(recvbuf, "recvbuf", True)
    if check_pair is not None:
        check_pair(recv, send)
    return recv


def elementwise(sendbuf: Any, recvbuf: Any, view: View, *,
                check_input: Callable[[Any, str], Any] | None = None,
                check_pair: Callable[[Any, Any], Any] | None = None) -> Buffers:
    """The buffers of an elementwise reduction (all-reduce; a reduce on its root).

    ``recvbuf`` has as many elements as ``sendbuf`` and its dtype; in place when
    ``sendbuf`` is ``IN_PLACE``/``None`` or ``recvbuf`` is its memory.

    Raises:
        TypeError, ValueError: as :func:`check_output`, :func:`require_recvbuf` and
            ``view``, ``check_input``, ``check_pair``.
    """
    if is_in_place(sendbuf):
        recv = _input(view, require_recvbuf(recvbuf), "recvbuf", True, check_input)
        return Buffers(recv, recv, True)
    send = _input(view, sendbuf, "sendbuf", False, check_input)
    if recvbuf is None:
        return Buffers(send, None, False)
    recv = _output(view, recvbuf, send, check_pair)
    check_order(sendbuf, recvbuf)
    same = check_output(recv, send, send.size, "as many as sendbuf", same_is_in_place=True)
    return Buffers(recv if same else send, recv, same)


def reduce(sendbuf: Any, recvbuf: Any, root: Any, rank: int, size: int, view: View, *,
           check_input: Callable[[Any, str], Any] | None = None) -> tuple[int, Buffers]:
    """``(root, buffers)`` of a reduce: :func:`elementwise` on the root; elsewhere
    ``sendbuf`` only (``recvbuf`` is ignored).

    Raises:
        TypeError, ValueError: a bad root (:func:`check_root`), ``IN_PLACE``/``None`` off
            the root, and as :func:`elementwise`.
    """
    r = check_root(root, size)
    if rank == r:
        return r, elementwise(sendbuf, recvbuf, view, check_input=check_input)
    if is_in_place(sendbuf):
        raise ValueError(f"sendbuf is IN_PLACE/None on rank {rank}, which is not the root "
                         f"({r}); only the root may reduce in place")
    return r, Buffers(_input(view, sendbuf, "sendbuf", False, check_input), None, False)


def reduce_scatter(sendbuf: Any, recvbuf: Any, rank: int, size: int, view: View, *,
                   check_input: Callable[[Any, str], Any] | None = None,
                   check_pair: Callable[[Any, Any], Any] | None = None) -> Buffers:
    """The buffers of a reduce-scatter: ``recvbuf`` holds block ``rank`` of ``sendbuf``
    (``numpy.array_split``'s blocks). In place, ``send`` is the whole of ``recvbuf`` and
    ``recv`` its first elements, the block.

    Raises:
        TypeError, ValueError: as :func:`check_output` (overlap is an error),
            :func:`require_recvbuf` and ``view``, ``check_input``, ``check_pair``.
    """
    if is_in_place(sendbuf):
        full = _input(view, require_recvbuf(recvbuf), "recvbuf", True, check_input)
        return Buffers(full, full[:own_block(full.size, rank, size)], True)
    send = _input(view, sendbuf, "sendbuf", False, check_input)
    if recvbuf is None:
        return Buffers(send, None, False)
    recv = _output(view, recvbuf, send, check_pair)
    check_output(recv, send, own_block(send.size, rank, size),
                 f"block {rank} of {send.size} elements over {size} ranks")
    return Buffers(send, recv, False)


def allgather(sendbuf: Any, recvbuf: Any, rank: int, size: int, view: View, *,
              check_input: Callable[[Any, str], Any] | None = None,
              check_pair: Callable[[Any, Any], Any] | None = None) -> Buffers:
    """The buffers of an all-gather: ``recvbuf`` holds ``size`` blocks of ``sendbuf``'s
    size. In place, ``send`` is block ``rank`` of ``recvbuf``.

    Raises:
        TypeError, ValueError: an in-place ``recvbuf`` that does not divide among the
            ranks, and as :func:`reduce_scatter`.
    """
    if is_in_place(sendbuf):
        recv = _input(view, require_recvbuf(recvbuf), "recvbuf", True, check_input)
        if recv.size % size:
            raise ValueError(f"recvbuf has {recv.size} elements, not a multiple of the "
                             f"{size} ranks")
        block = recv.size // size
        return Buffers(recv[rank * block:(rank + 1) * block], recv, True)
    send = _input(view, sendbuf, "sendbuf", False, check_input)
    if recvbuf is None:
        return Buffers(send, None, False)
    recv = _output(view, recvbuf, send, check_pair)
    check_order(sendbuf, recvbuf)
    check_output(recv, send, send.size * size, f"{size} ranks x {send.size}")
    return Buffers(send, recv, False)


def broadcast(buf: Any, root: Any, rank: int, size: int, view: View) -> tuple[int, Any]:
    """``(root, flat view of buf)`` of a broadcast (``buf`` written off the root).

    Raises:
        TypeError, ValueError: as :func:`check_root` and ``view``.
    """
    r = check_root(root, size)
    return r, view(buf, "buf", rank != r)


def gathered_shape(shape: tuple, size: int) -> tuple:
    """The shape of an all-gather's allocated output: ``(size * shape[0], *shape[1:])``,
    ``(size,)`` for a 0-d block."""
    return (size * shape[0],) + tuple(shape[1:]) if shape else (size,)


def own_block(count: int, rank: int, size: int) -> int:
    """Elements of block ``rank`` of ``count`` over ``size`` ranks (a reduce-scatter's
    output: ``numpy.array_split``'s blocks)."""
    bounds = block_bounds(count, size)
    return bounds[rank + 1] - bounds[rank]
