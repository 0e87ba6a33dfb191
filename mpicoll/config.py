"""Every ``MPICOLL_*`` environment variable of the library, in one place: :data:`VARIABLES`.

Keyword arguments always win; these variables only supply defaults where a launcher makes
arguments awkward. Each is read on first use and cached; :func:`refresh` re-reads them.

:data:`VARIABLES` lists the variables the installed library reads: the core's, those of
``mpicoll.gpu`` and those the PyTorch adapter reads in ``mpicoll.torch.init()``. It is the
source of the library's table in ``docs/variables.md`` (:func:`markdown_table`); the
checkout's job scripts, CI recipe, test bed, benchmark drivers and tests declare their own
variables in ``.ci/variables.py``, which writes the whole page
(``tests/test_repository.py`` checks it).
"""
from __future__ import annotations

import math
import os
from typing import Any, Callable, NamedTuple

from . import fastpath

__all__ = ["refresh", "env_bool", "env_choice", "env_int", "env_float", "env_str",
           "segment_bytes", "check_enabled", "check_wanted", "lane_wait_sleeps", "Variable",
           "VARIABLES", "markdown_table"]


class Variable(NamedTuple):
    """One environment variable: who reads it, its default and what it means."""

    name: str
    read_by: str
    default: str
    meaning: str


#: Every ``MPICOLL_*`` variable the library reads, grouped by the package reading it.
VARIABLES: tuple[Variable, ...] = (
    Variable("MPICOLL_CHECK", "mpicoll", "`0`",
             "`1` runs the cross-rank agreement step before every collective "
             "(`mpicoll.checked`): bad arguments or disagreeing ranks raise the same error "
             "on every rank instead of hanging"),
    Variable("MPICOLL_SEGMENT_BYTES", "mpicoll", "1 MiB",
             "largest message of a segmented algorithm (ring, tree, pipelined broadcast), "
             "in bytes"),
    Variable("MPICOLL_SHM_CHUNK_BYTES", "mpicoll", "1 MiB",
             "bytes per rank of the shared-memory window of `algorithm=\"shm\"` (a message "
             "goes through in chunks of this size; read when a communicator first uses shm, "
             "the largest value on a node wins; at least 64)"),
    Variable("MPICOLL_NODE_WAIT", "mpicoll", "`kernel`",
             "how a node's ranks wait for each other in the shared-memory window (the `shm` "
             "all-reduce's barriers, the agreement step on one node): `kernel` sleeps in "
             "the kernel until the peer arrives (Linux on x86-64, not under ULFM), `mpi` "
             "waits in `MPI_Barrier` and agrees by `MPI_Allgather` (another value: "
             "`ValueError`)"),
    Variable("MPICOLL_RANKS_PER_NODE", "mpicoll", "real nodes",
             "emulate nodes of this many consecutive ranks of the world (the last may hold "
             "fewer) instead of the shared-memory nodes; a subcommunicator's ranks keep "
             "their nodes"),
    Variable("MPICOLL_TUNING_FILE", "mpicoll", "shipped table",
             "JSON tuning table for `algorithm=\"auto\"` (`none`: built-in rules only); "
             "made by `python -m bench.tune`; a rule naming an algorithm or collective "
             "mpicoll does not have is skipped, and its collective keeps the built-in "
             "rules"),
    Variable("MPICOLL_ALGORITHM", "mpicoll", "unset",
             "force one algorithm wherever `auto` is asked for (a name not registered for a "
             "collective is ignored there)"),
    Variable("MPICOLL_STALL_WARN_SECONDS", "mpicoll", "60",
             "the stall inspector (`mpicoll.watchdog`) logs, on every rank, why a collective "
             "has waited this long: ranks that have not entered it, are in another one, "
             "disagree on its arguments or do not answer (`0`: inspector, and the "
             "announcement of a rank's exit to its peers, off)"),
    Variable("MPICOLL_STALL_ABORT_SECONDS", "mpicoll", "0 (off)",
             "abort the job (`MPI_Abort`, after the inspector's report) when a collective "
             "has waited this long"),
    Variable("MPICOLL_TIMELINE", "mpicoll", "unset",
             "write a Chrome-trace timeline of every collective (and of the PyTorch "
             "adapter's operations; not the compressed collectives of "
             "`mpicoll.compression`) to this file, merged across ranks at exit "
             "(`mpicoll.timeline`); a directory or an unwritable place raises `ValueError` "
             "at the first collective"),
    Variable("MPICOLL_LANE_WAIT", "mpicoll", "`auto`",
             "how the runtime's communication threads wait for MPI: `sleep` polls, "
             "yielding the core and then sleeping once a peer is late (`mpicoll.waiting`: "
             "the core goes to computation); `spin` blocks inside MPI, which polls on the "
             "core (a lane with a timeout, such as a torch.distributed group's, polls on "
             "the core itself, to notice its deadline); `auto`: `sleep` for "
             "torch.distributed groups and the other lanes, `spin` for the Horovod engine "
             "(measured faster so). The caller's thread always blocks in MPI"),
    Variable("MPICOLL_ELASTIC_DIR", "mpicoll.elastic", "unset",
             "set by `python -m mpicoll.elastic.launch` for each launch of the job: the "
             "commit directory (`mpicoll.elastic.disk`); rank 0 writes each commit there "
             "and a relaunched job starts from it"),
    Variable("MPICOLL_ELASTIC_RESTART", "mpicoll.elastic", "0",
             "set by `python -m mpicoll.elastic.launch`: how many times the job has been "
             "relaunched (0 for the first launch)"),
    Variable("MPICOLL_ELASTIC_DISCOVERY", "mpicoll.elastic", "unset",
             "host discovery command of `mpicoll.elastic.run` / `hvd.elastic.run` when they "
             "are given no `discovery=` (horovodrun's script format: one `hostname[:slots]` "
             "a line); rank 0 polls it and the job grows when it reports more slots "
             "(docs/elastic.md, Growing)"),
    Variable("MPICOLL_ELASTIC_MAX_NP", "mpicoll.elastic", "the launch size",
             "the most ranks a growing elastic job grows to, when `run` is given no "
             "`max_np=`"),
    Variable("MPICOLL_ELASTIC_MIN_NP", "mpicoll.elastic", "1",
             "the least number of ranks an elastic job goes on with, when `run` is given "
             "no `min_np=` (horovodrun's `--min-np`)"),
    Variable("MPICOLL_ELASTIC_TIMEOUT", "mpicoll.elastic", "600",
             "seconds a job launched with fewer than `min_np` ranks and a discovery waits "
             "for the discovery to offer `min_np` slots before its function first runs "
             "(then `TooFewRanksError` on every rank; horovodrun's `--elastic-timeout`)"),
    Variable("MPICOLL_ELASTIC_RESET_LIMIT", "mpicoll.elastic", "unset (no limit)",
             "the most resets (shrinks and growths) an elastic job goes through, when `run` "
             "is given no `reset_limit=` (horovodrun's `--reset-limit`)"),
    Variable("MPICOLL_ELASTIC_END_WAIT_S", "mpicoll.elastic", "300",
             "under ULFM, seconds a rank whose elastic function ended waits for the others' "
             "to end before it leaves as a lost rank when no peer asked it to (0: no bound; "
             "a peer stuck on it asks within about a second)"),
    Variable("MPICOLL_ELASTIC_HOST_UPDATES", "mpicoll.elastic", "0",
             "`1`: every commit checks rank 0's host update messages "
             "(`State.on_hosts_updated`, Horovod's listener) with one small broadcast, also "
             "without a discovery; `0`: only with a discovery active (the commit stays "
             "local otherwise)"),
    Variable("MPICOLL_CUDA_AWARE", "mpicoll.gpu", "detect",
             "`1`: the MPI library takes device pointers (device arrays go straight to "
             "MPI); `0`: stage them through pinned host memory; unset or `auto`: detect "
             "(`mpi_memory_alloc_kinds`, then `MPIX_GPU_query_support` / "
             "`MPIX_Query_cuda_support`; unknown means not aware). Read once per process"),
    Variable("MPICOLL_STAGING_BYTES", "mpicoll.gpu", "64 MiB",
             "bound of the pinned host memory of the staged path (device arrays with an MPI "
             "that is not CUDA-aware), per process (the core's: per calling thread): its three "
             "chunk slots fit in it"),
    Variable("MPICOLL_STAGING_CHUNK_BYTES", "mpicoll.gpu", "`auto`",
             "bytes of one pinned slot of the staged path (`auto`: about 1/8 of the "
             "message, at least 256 KiB); must be equal on every rank"),
    Variable("MPICOLL_DEVICE", "mpicoll.gpu", "`auto`",
             "GPU of each rank in `mpicoll.gpu.device.select_device()`: `auto` (local rank "
             "modulo the visible GPUs; ranks may share one), an ordinal, a comma-separated "
             "list indexed by local rank, or `none` (leave the current device)"),
    Variable("MPICOLL_FUSION_THRESHOLD", "mpicoll.torch", "64 MiB",
             "largest fused all-reduce buffer in bytes (`0`: one all-reduce per tensor)"),
    Variable("MPICOLL_CYCLE_TIME_MS", "mpicoll.torch", "0.5",
             "shortest time between two negotiation rounds, in ms: requests arriving within "
             "one cycle are negotiated, and fused, together"),
    Variable("MPICOLL_ALLREDUCE_ALGORITHM", "mpicoll.torch", "`auto`",
             "mpicoll all-reduce algorithm for tensors (a name of "
             "`mpicoll.algorithms(\"allreduce\")`)"),
    Variable("MPICOLL_STALL_CHECK_TIME_SECONDS", "mpicoll.torch", "60",
             "log (rank 0) the requests some ranks submitted and others did not after this "
             "many seconds (`0` disables the inspector)"),
    Variable("MPICOLL_OVERLAP", "mpicoll.torch", "`auto`",
             "`1`: negotiate and reduce as soon as requests arrive (communication overlaps "
             "backward); `0`: start a round only once the user thread waits for a result "
             "(or 50 ms after the latest request); `auto`: `1` when the node has a spare "
             "core per rank"),
    Variable("MPICOLL_TORCH_THREADS", "mpicoll.torch", "`auto`",
             "torch threads per rank, set by `mpicoll.torch.init()` and "
             "`init_process_group(\"mpicoll\")`: `auto` gives each rank `cores // ranks on "
             "the node` (at least 1) when the user set neither `OMP_NUM_THREADS` nor torch's "
             "count and the node's ranks times torch's threads exceed its cores (torchrun's "
             "policy); `keep` leaves torch's count; a number sets it"),
)


def markdown_table(variables: tuple[Variable, ...] = VARIABLES) -> str:
    """The docs' table of ``variables`` (Markdown; default :data:`VARIABLES`)."""
    rows = ["| variable | read by | default | meaning |", "|---|---|---|---|"]
    rows += [f"| `{v.name}` | {v.read_by} | {v.default} | {v.meaning} |" for v in variables]
    return "\n".join(rows) + "\n"


DEFAULT_SEGMENT_BYTES = 1 << 20


_cache: dict[str, str | None] = {}


def refresh() -> None:
    """Forget cached values: the next read of each variable looks at the environment again.

    Values are cached on first read (reading ``os.environ`` costs about a microsecond, too
    much on every collective call); call this after changing a variable at run time.
    """
    _cache.clear()
    fastpath.invalidate()  # cached calls hold algorithm choices made from these values


def env_str(name: str, default: str | None = None) -> str | None:
    """Return the variable's value (cached, see :func:`refresh`), or ``default`` if unset."""
    try:
        value = _cache[name]
    except KeyError:
        raw = os.environ.get(name, "")
        value = _cache[name] = raw if raw.strip() else None
    return default if value is None else value


def _env_number(name: str, default: Any, minimum: Any, parse: Callable[[str], Any],
                what: str) -> Any:
    raw = env_str(name)
    if raw is None:
        return default
    try:
        value = parse(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not {what}") from None
    if math.isnan(value):     # every comparison false: every limit off
        raise ValueError(f"{name}={raw!r} is not {what}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}={value} must be >= {minimum}")
    return value


def env_int(name: str, default: int, minimum: int | None = None) -> int:
    """Return the variable as an int.

    Raises:
        ValueError: the value is not an integer or is below ``minimum``.
    """
    return _env_number(name, default, minimum, int, "an integer")


def env_float(name: str, default: float, minimum: float | None = None) -> float:
    """Return the variable as a float.

    Raises:
        ValueError: the value is not a number or is below ``minimum``.
    """
    return _env_number(name, default, minimum, float, "a number")


def env_bool(name: str, default: bool) -> bool:
    """Return the variable as a bool (1/0, true/false, yes/no, on/off)."""
    raw = env_str(name)
    if raw is None:
        return default
    low = raw.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={raw!r} is not a boolean (use 1 or 0)")


def segment_bytes() -> int:
    """Segment size of segmented algorithms, in bytes (``MPICOLL_SEGMENT_BYTES``)."""
    return env_int("MPICOLL_SEGMENT_BYTES", DEFAULT_SEGMENT_BYTES, minimum=1)


def env_choice(name: str, choices: tuple[str, ...]) -> str:
    """The variable, one of ``choices`` (case and spaces ignored; unset or empty: the
    first).

    Raises:
        ValueError: another value, naming the variable and the choices.
    """
    value = (env_str(name, choices[0]) or choices[0]).strip().lower()
    if value not in choices:
        quoted = [repr(c) for c in choices]
        raise ValueError(f"{name}={value!r}: use {', '.join(quoted[:-1])} or {quoted[-1]}")
    return value


def lane_wait_sleeps(auto: bool) -> bool:
    """Whether a runtime lane waits for MPI with sleeps (``MPICOLL_LANE_WAIT``; ``auto``:
    the lane's own default)."""
    value = env_choice("MPICOLL_LANE_WAIT", ("auto", "sleep", "spin"))
    return auto if value == "auto" else value == "sleep"


def check_enabled() -> bool:
    """Whether collectives run the agreement check by default (``MPICOLL_CHECK``)."""
    return env_bool("MPICOLL_CHECK", False)


def check_wanted(check: Any) -> bool:
    """Whether a call given ``check`` runs the agreement step (``None``: the default,
    :func:`check_enabled`)."""
    return check_enabled() if check is None else bool(check)

