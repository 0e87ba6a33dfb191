"""Checkpoint files: one ``.npz`` per server plus a JSON manifest, all written atomically.

Layout of a checkpoint directory::

    manifest.json                 what the checkpoint holds and which files make it up
    <id>.server<i>.npz            server i's shards: values, optimizer state, metadata
    <id>.codec<r>.npz             with compression: rank r's codec state (push residuals,
                                  pull replicas and residuals, codec states)

Each file is written to a temporary name in the same directory, flushed, ``fsync``-ed and
moved into place with ``os.replace``. The manifest is written last, so a crash mid-save
leaves the previous checkpoint intact (the manifest still names the previous ``<id>``'s
files, which are only deleted after the new manifest is in place). ``.npz`` files hold only
numeric arrays (loaded with ``allow_pickle=False``); metadata is JSON stored as bytes.

Restoring reads, for each shard of the *current* layout, every saved shard of the same
tensor that overlaps its range, so the same code restores the same layout or reshards to a
different number of servers or split threshold.
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
from typing import Any, Iterable

import numpy as np

__all__ = ["MANIFEST", "FORMAT", "server_file", "write_server_file", "write_manifest",
           "read_manifest", "remove_stale", "ShardLoader", "codec_file", "write_codec_file",
           "read_codec_file"]

MANIFEST = "manifest.json"
FORMAT = "mpicoll.ps/1"


def server_file(ckpt_id: str, server: int) -> str:
    """File name of server ``server``'s part of checkpoint ``ckpt_id``."""
    return f"{ckpt_id}.server{server}.npz"


def codec_file(ckpt_id: str, rank: int) -> str:
    """File name of rank ``rank``'s compression state in checkpoint ``ckpt_id``."""
    return f"{ckpt_id}.codec{rank}.npz"


def _atomic_write(path: str, write: Any) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_server_file(directory: str, ckpt_id: str, server: int, states: Iterable[Any]) -> str:
    """Write one server's shards (values, optimizer state, versions, clocks) atomically.

    Args:
        directory: checkpoint directory (created if missing).
        ckpt_id: the checkpoint's id (agreed by the workers).
        server: server index.
        states: the server's :class:`~mpicoll.ps.server.ShardState` objects.
    Returns:
        The path written.
    """
    arrays: dict[str, np.ndarray] = {}
    meta = []
    for i, st in enumerate(states):
        sh = st.shard
        entry = {"name": sh.spec.name, "index": sh.index, "lo": sh.lo, "hi": sh.hi,
                 "initialized": st.param is not None, "version": st.version,
                 "steps": st.opt.steps if st.opt is not None else 0,
                 "clocks": {str(w): c for w, c in st.clocks.items()},
                 "state_names": sorted(st.opt.state) if st.opt is not None else []}
        meta.append(entry)
        if st.param is not None:
            arrays[f"s{i}.param"] = st.param
            for k, v in st.opt.state.items():
                arrays[f"s{i}.{k}"] = v
    return _write_npz(os.path.join(directory, server_file(ckpt_id, server)), arrays,
                      {"format": FORMAT, "server": server, "shards": meta})


def _write_npz(path: str, arrays: dict[str, np.ndarray], meta: dict) -> str:
    """Write ``arrays`` plus ``meta`` (JSON, as the bytes array ``"meta"``) atomically (the
    directory created if missing)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode("utf-8"), dtype=np.uint8)
    _atomic_write(path, lambda f: np.savez(f, **arrays))
    return path


def write_codec_file(directory: str, ckpt_id: str, rank: int,
                     parts: dict[str, tuple[dict, dict[str, np.ndarray]]]) -> str:
    """Write one rank's compression state atomically.

    Args:
        parts: part name -> ``(JSON-able metadata, named arrays)`` (the ``state()`` of the
            coders in :mod:`mpicoll.ps.compressed`).
    Returns:
        The path written.
    """
    arrays: dict[str, np.ndarray] = {}
    meta = []
    for i, (name, (part_meta, part_arrays)) in enumerate(sorted(parts.items())):
        meta.append({"part": name, "meta": part_meta, "arrays": sorted(part_arrays)})
        for k, v in part_arrays.items():
            arrays[f"p{i}.{k}"] = v
    return _write_npz(os.path.join(directory, codec_file(ckpt_id, rank)), arrays,
                      {"format": FORMAT, "rank": rank, "parts": meta})


def read_codec_file(directory: str, ckpt_id: str, rank: int
                    ) -> dict[str, tuple[dict, dict[str, np.ndarray]]]:
    """Read back what :func:`write_codec_file` wrote for ``rank``."""
    with np.load(os.path.join(directory, codec_file(ckpt_id, rank)), allow_pickle=False) as npz:
        meta = json.loads(npz["meta"].tobytes().decode("utf-8"))
        return {m["part"]: (m["meta"], {k: npz[f"p{i}.{k}"] for k in m["arrays"]})
                for i, m in enumerate(meta["parts"])}


def write_manifest(directory: str, manifest: dict) -> None:
    """Write ``manifest.json`` atomically (the commit point of a checkpoint)."""
    data = json.dumps(manifest, indent=1, sort_keys=True).encode("utf-8")
    _atomic_write(os.path.join(directory, MANIFEST), lambda f: f.write(data))


def remove_stale(directory: str, keep_id: str) -> None:
    """Delete server files of checkpoints other than ``keep_id`` (after the manifest moved)."""
    for name in os.listdir(directory):
        if name.endswith(".npz") and (".server" in name or ".codec" in name) and \
                not name.startswith(keep_id + "."):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(directory, name))


def read_manifest(directory: str) -> dict:
    """Read a checkpoint's manifest.

    Raises:
        OSError, ValueError: missing or unreadable manifest, or a different format.
    """
    with open(os.path.join(directory, MANIFEST), "rb") as f:
        manifest = json.loads(f.read().decode("utf-8"))
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{directory}: checkpoint format {manifest.get('format')!r}, "
                         f"expected {FORMAT!r}")
    return manifest


class ShardLoader:
    """Reads saved shards back, for any current layout (same, or resharded).

    Args:
        directory: checkpoint directory.
        manifest: its manifest (as read by :func:`read_manifest`).
    """

    def __init__(self, directory: str, manifest: dict) -> None:
        self.directory = directory
        self.manifest = manifest
        self._files: dict[int, tuple[Any, list[dict]]] = {}

    def _file(self, server: int) -> tuple[Any, list[dict]]:
        if server not in self._files:
            path = os.path.join(self.directory, server_file(self.manifest["id"], server))
            npz = np.load(path, allow_pickle=False)
            meta = json.loads(npz["meta"].tobytes().decode("utf-8"))
            self._files[server] = (npz, meta["shards"])
        return self._files[server]

    def load(self, state: Any, worker_clock: dict[int, int] | None) -> None:
        """Fill ``state`` (a ShardState) from every overlapping saved shard.

        Args:
            state: the shard to fill; its ``param`` is allocated here.
            worker_clock: when not ``None``, the clock to give each worker (the number of
                workers changed); otherwise the saved per-worker clocks are kept.
        Raises:
            ValueError: the checkpoint does not cover the shard's range.
        """
        sh = state.shard
        state.initialize()
        covered = 0
        versions, steps, clocks = [], [], None
        for name, index, server, lo, hi in self.manifest["layout"]["shards"]:
            if name != sh.spec.name:
                continue
            # an empty shard (a tensor smaller than the number of servers, or of size 0)
            # takes its version and clocks from the tensor's first saved shard
            empty_match = sh.count == 0 and not versions
            if not empty_match and (hi <= sh.lo or lo >= sh.hi or hi == lo):
                continue
            npz, metas = self._file(server)
            pos = next(i for i, m in enumerate(metas) if m["name"] == name and m["index"] == index)
            meta = metas[pos]
            if not meta["initialized"]:
                raise ValueError(f"{name!r} was not initialized when the checkpoint was saved")
            a, b = max(lo, sh.lo), min(hi, sh.hi)
            if b > a:
                state.param[a - sh.lo:b - sh.lo] = npz[f"s{pos}.param"][a - lo:b - lo]
                for k, arr in state.opt.state.items():
                    arr[a - sh.lo:b - sh.lo] = npz[f"s{pos}.{k}"][a - lo:b - lo]
                covered += b - a
            versions.append(meta["version"])
            steps.append(meta["steps"])
            if clocks is None:
                clocks = {int(w): c for w, c in meta["clocks"].items()}
        if covered != sh.count:
            raise ValueError(f"checkpoint covers {covered} of {sh.count} elements of {sh.label()}")
        state.version = max(versions)
        state.opt.steps = max(steps)
        if worker_clock is not None:
            state.clocks = dict(worker_clock)
        else:
            state.clocks = {w: clocks.get(w, 0) for w in state.clocks}

    def close(self) -> None:
        """Close the open files."""
        for npz, _ in self._files.values():
            npz.close()
        self._files.clear()
