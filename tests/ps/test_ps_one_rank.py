"""A one-rank co-located parameter server (``MPI.COMM_SELF``, no mpirun): the constructor's
checks of the parameters, handles, calls after close(), and checkpoints that cannot be
written or read back."""
from __future__ import annotations

import json
import logging
import os

import numpy as np
import pytest
from mpi4py import MPI

from mpicoll.ps import ParameterServer, PSError


def _params() -> dict[str, np.ndarray]:
    return {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(4)}


def _ps(params: dict | None = None, **kwargs) -> ParameterServer:
    return ParameterServer(_params() if params is None else params, comm=MPI.COMM_SELF,
                           num_servers="colocated", lr=0.5, **kwargs)


def _done(ps: ParameterServer) -> None:
    ps.close()
    ps.free()


def _ones() -> dict[str, np.ndarray]:
    return {k: np.ones_like(v) for k, v in _params().items()}


class _Shrinks:
    """Claims a shape and dtype, but numpy reads another shape."""

    shape = (3,)
    dtype = np.dtype(np.float64)

    def __array__(self, *args, **kwargs):
        return np.zeros(2)


def test_constructor_checks_the_parameters():
    """Integer parameters with an optimizer that needs floats, and a value numpy reads as
    another shape than it claims, raise ValueError naming the parameter."""
    with pytest.raises(ValueError, match=r"optimizer='sgd' needs floating parameters; \['n'\]"):
        _ps({"n": np.zeros(3, dtype=np.int32)})
    with pytest.raises(ValueError, match=r"params\['x'\] reads as a float64 array of shape "
                                         r"\(2,\), not float64 \(3,\)"):
        _ps({"x": _Shrinks()})
    ps = _ps({"n": np.arange(3, dtype=np.int32)}, optimizer="sum")   # sum: any dtype
    try:
        np.testing.assert_array_equal(ps.pull()["n"], np.arange(3))
    finally:
        _done(ps)


def test_handle_test_polls_to_completion():
    """``handle.test()`` on a co-located handle makes progress until the call is done;
    ``wait()`` then returns its result."""
    ps = _ps()
    try:
        h = ps.push_pull_async(_ones())
        while not h.test():
            pass
        assert h.test()
        got = h.wait()
        for k, v in _params().items():
            np.testing.assert_array_equal(got[k], v - 0.5)
    finally:
        _done(ps)


def test_calls_after_close_are_refused():
    """Every worker call after close() raises PSError naming the call; close() again is a
    no-op."""
    ps = _ps()
    _done(ps)
    ps.close()
    for call, name in ((ps.pull, "pull()"), (lambda: ps.push(_ones()), "push()"),
                       (ps.stats, "stats()"), (lambda: ps.save("x"), "save()")):
        with pytest.raises(PSError, match=rf"{name[:-2]}\(\) after close\(\)"):
            call()


def test_save_keeps_the_error_of_an_outstanding_call(tmp_path):
    """save() completes an outstanding call first; that call's error stays with its handle
    (raised by its wait()), the checkpoint is written."""
    ps = _ps()
    try:
        h = ps.push_async({"nope": np.ones(3)})
        ps.save(str(tmp_path))
        with pytest.raises(PSError, match="unknown key 'nope'"):
            h.wait()
        assert ps.clock == 0
    finally:
        _done(ps)
    assert os.path.exists(tmp_path / "manifest.json")


def test_save_into_a_file_fails(tmp_path):
    """A checkpoint path that is a regular file: PSError naming the path and the reason;
    the engine goes on working."""
    path = tmp_path / "file"
    path.write_text("x")
    ps = _ps()
    try:
        with pytest.raises(PSError, match=r"save\(.*file'\) failed: rank 0: writing the "
                                          r"checkpoint failed"):
            ps.save(str(path))
        np.testing.assert_array_equal(ps.push_pull(_ones())["b"], np.full(4, 0.5))
    finally:
        _done(ps)


def _saved(tmp_path, **kwargs) -> tuple[str, dict]:
    ps = _ps(**kwargs)
    try:
        ps.push_pull(_ones())
        ps.save(str(tmp_path))
    finally:
        _done(ps)
    with open(tmp_path / "manifest.json") as f:
        return str(tmp_path), json.load(f)


def test_restore_with_a_missing_server_file_fails(tmp_path):
    """A checkpoint whose shard file is gone: PSError naming the path."""
    path, manifest = _saved(tmp_path)
    os.unlink(os.path.join(path, manifest["files"][0]))
    with pytest.raises(PSError, match=r"restoring from .*: .*No such file"):
        _ps(restore=path)


def test_restore_with_a_missing_codec_file_fails(tmp_path):
    """Compression state announced by the manifest but missing: PSError naming it."""
    path, manifest = _saved(tmp_path, compression="int8")
    os.unlink(os.path.join(path, manifest["codec_files"][0]))
    with pytest.raises(PSError, match="restoring the compression state from"):
        _ps(restore=path, compression="int8")


def test_restore_drops_compression_state_that_does_not_fit(tmp_path, caplog):
    """The compression state is dropped (with a warning saying why) when the codec changed,
    or when the workers were grouped otherwise; the values are restored either way."""
    path, manifest = _saved(tmp_path, compression="int8")
    want = _params()["b"] - 0.5
    cases = [({"compression": "bf16"}, "saved with compression='int8', feedback=True"),
             ({"compression": "int8", "feedback": False}, "feedback=True"),
             ({"compression": "int8"}, "local aggregation groups the workers otherwise")]
    for kwargs, why in cases:
        if why.startswith("local"):
            manifest["node_groups"] = [[0]]
            (tmp_path / "manifest.json").write_text(json.dumps(manifest))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="mpicoll.ps"):
            ps = _ps(restore=path, **kwargs)
        try:
            np.testing.assert_array_equal(ps.pull()["b"], want)
        finally:
            _done(ps)
        assert any("compression state dropped" in r.message and why in r.message
                   for r in caplog.records), (why, caplog.text)
