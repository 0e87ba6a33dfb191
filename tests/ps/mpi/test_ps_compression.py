"""Compressed pushes and pulls (``ParameterServer(..., compression=...)``).

Against a one-process replay of the same codec and the same error feedback (bsp, so the
order of operations is fixed): the values every worker pulls, the exact parameters the
servers hold (read from a checkpoint, which stores the true values) and every worker's
residuals, bit for bit. Every layout at some world size; bad input on every rank.
"""
from __future__ import annotations

import copy
import json
import os

import numpy as np
import pytest

from mpicoll.compression import get_codec
from mpicoll.ps import COLOCATED, ParameterServer, PSError
from mpicoll.ps import checkpoint as ckpt
from mpicoll.ps.protocol import wait_all

from ps_cases import (COMM, RANK, SIZE, adam_update, assert_params_equal, make_grads,
                      momentum_update, remove_shared, run_ps, sgd_update, shared_tmpdir)

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]

STEPS = 3
UPDATES = {"sgd": (sgd_update(0.125), dict(lr=0.125)),
           "momentum": (lambda: momentum_update(0.1, 0.8), dict(lr=0.1, momentum=0.8)),
           "adam": (lambda: adam_update(0.01, 0.9, 0.99, 1e-6),
                    dict(lr=0.01, beta1=0.9, beta2=0.99, eps=1e-6)),
           "sum": (None, {})}

#: (layout, codec, optimizer) per world size: every layout, codec and optimizer somewhere
CASES = {
    2: [(1, "int8", "adam"), (COLOCATED, "onebit", "momentum"), (COLOCATED, "topk:0.2", "sum")],
    3: [(2, "topk:0.2", "sgd"), (COLOCATED, "int8:8", "sgd"), (1, "randomk:0.3", "sum")],
    4: [(2, "onebit:8", "momentum"), (1, "bf16", "sgd"), (COLOCATED, "randomk:0.3", "adam")],
    5: [(2, "int8", "adam"), (COLOCATED, "fp16", "sum"), (1, "onebit", "sgd")],
}
CASES_ELSEWHERE = CASES[5]   # at other world sizes (8, by hand)


def _params() -> dict[str, np.ndarray]:
    """Float tensors only (codecs need float32/float64): one split over servers (odd
    size), one whole, a 0-d one and an empty one."""
    return {"w": (np.arange(23 * 5, dtype=np.float64).reshape(23, 5) / 8.0 - 3.0),
            "v": np.linspace(-1, 1, 29).astype(np.float32),
            "s": np.array(0.75, dtype=np.float64),
            "e": np.zeros((0, 4), dtype=np.float32)}


def _update(optimizer: str):
    update, hyper = UPDATES[optimizer]
    if optimizer in ("momentum", "adam"):
        update = update()       # fresh state per case
    return update, hyper


def _encode(codec, residual: np.ndarray | None, x: np.ndarray) -> np.ndarray:
    """Error feedback, written out: send ``y = residual + x``, keep ``y - sent``
    (``residual=None``: no error feedback, send ``x``)."""
    if residual is None:
        return codec.decode(codec.encode(x), x.size, x.dtype)
    y = np.add(residual, x)
    sent = codec.decode(codec.encode(y), y.size, y.dtype)
    np.subtract(y, sent, out=residual)
    return sent


def _replay(params, grads, shards, codec_spec, optimizer, workers, feedback=True):
    """One process: what every worker pulls at each step, the true parameters after the
    last step, and every worker's residuals (``feedback=False``: none kept, and parameter
    pulls still send ``param - replica``)."""
    proto = get_codec(codec_spec)
    update, _ = _update(optimizer)
    w = {k: v.copy() for k, v in params.items()}
    push_codec = {(i, n, s.index): copy.deepcopy(proto) for i in range(workers)
                  for n in shards for s in shards[n]}
    residual = {(i, n, s.index): np.zeros(s.hi - s.lo, dtype=params[n].dtype)
                for i in range(workers) for n in shards for s in shards[n]}
    pull_codec = {(n, s.index): copy.deepcopy(proto) for n in shards for s in shards[n]}
    server_res = {(n, s.index): np.zeros(s.hi - s.lo, dtype=params[n].dtype)
                  for n in shards for s in shards[n]}
    replica: dict = {}

    def pull(first: bool = False):
        out = {}
        for n, p in w.items():
            flat = np.empty(p.size, dtype=p.dtype)
            for s in shards[n]:
                key, value = (n, s.index), p.reshape(-1)[s.lo:s.hi]
                if optimizer == "sum" and first:  # the initial values, exact
                    flat[s.lo:s.hi] = value
                    continue
                if optimizer == "sum":          # the aggregate plus the server's residual
                    flat[s.lo:s.hi] = _encode(pull_codec[key],
                                              server_res[key] if feedback else None, value)
                    continue
                if key not in replica:          # first pull: the values themselves
                    replica[key] = value.copy()
                else:                           # the change since the last pull
                    c = pull_codec[key]
                    d = np.subtract(value, replica[key])
                    replica[key] = np.add(replica[key], c.decode(c.encode(d), d.size, d.dtype))
                flat[s.lo:s.hi] = replica[key]
            out[n] = flat.reshape(p.shape)
        return out

    pulled = [pull(first=True)]
    for t in range(STEPS):
        for n in sorted(w):
            sent = []
            for i in range(workers):
                g = grads[t][i][n].reshape(-1)
                dec = np.empty_like(g)
                for s in shards[n]:
                    key = (i, n, s.index)
                    dec[s.lo:s.hi] = _encode(push_codec[key], residual[key] if feedback
                                             else None, g[s.lo:s.hi])
                sent.append(dec.reshape(w[n].shape))
            acc = sent[0].copy()
            for g in sent[1:]:
                acc += g
            if optimizer == "sum":
                w[n] = acc
            else:
                if workers > 1:
                    np.divide(acc, workers, out=acc)
                update(n, w[n], acc, t + 1)
        pulled.append(pull())
    return pulled, w, residual


def _read_checkpoint(path: str, params: dict) -> dict[str, np.ndarray]:
    """The parameters a checkpoint holds, assembled from every server's file."""
    manifest = ckpt.read_manifest(path)
    out = {n: np.empty(p.size, dtype=p.dtype) for n, p in params.items()}
    for f in manifest["files"]:
        with np.load(os.path.join(path, f), allow_pickle=False) as npz:
            meta = json.loads(npz["meta"].tobytes().decode("utf-8"))
            for i, m in enumerate(meta["shards"]):
                out[m["name"]][m["lo"]:m["hi"]] = npz[f"s{i}.param"]
    return {n: out[n].reshape(p.shape) for n, p in params.items()}


def _run_case(layout, codec_spec, optimizer, feedback=True):
    params = _params()
    workers = SIZE if layout == COLOCATED else SIZE - layout
    grads = [[make_grads(params, i, t) for i in range(workers)] for t in range(STEPS)]
    _, hyper = UPDATES[optimizer]
    path = shared_tmpdir()

    def worker(ps):
        shards = {n: ps.placement.shards[n] for n in params}
        seen = [ps.pull()]
        for t in range(STEPS):
            g = grads[t][ps.worker_index]
            if t == 1:   # in place: the pull overwrites the gradients being pushed
                mine = {k: v.copy() for k, v in g.items()}
                seen.append(ps.push_pull(mine, out=mine))
            else:
                seen.append(ps.push_pull(g))
        ps.save(path)
        fb = (ps._engine or ps._client).push_encoder.feedback
        res = {} if fb is None else {(n, s.index): fb.residual((n, s.index)) for n in shards
                                     for s in shards[n]}
        return seen, shards, res, ps.stats()

    try:
        ps, result = run_ps(params, worker, layout, optimizer=optimizer,
                            compression=codec_spec, split_bytes=64, chunk_bytes=40,
                            feedback=feedback, **hyper)
        COMM.Barrier()
        saved = _read_checkpoint(path, params)
    finally:
        remove_shared(path)
    if ps.is_server:
        return
    seen, shards, res, stats = result
    what = f"{layout}/{codec_spec}/{optimizer}/feedback={feedback}"
    assert bool(res) == feedback, what
    pulled, want, want_res = _replay(params, grads, shards, codec_spec, optimizer, workers,
                                     feedback)
    for t in range(STEPS + 1):
        assert_params_equal(seen[t], pulled[t], f"{what}: pull {t}:")
    if not feedback:    # the switch changes something
        with_fb = _replay(params, grads, shards, codec_spec, optimizer, workers)[0]
        assert any(not np.array_equal(seen[-1][n], with_fb[-1][n]) for n in params), what
    assert_params_equal(saved, want, f"{what}: checkpointed (true) parameters:")
    me = RANK - (0 if layout == COLOCATED else layout)
    for (n, i), r in res.items():
        if r is not None and r.size:
            np.testing.assert_array_equal(r, want_res[(me, n, i)], err_msg=f"{what}: {n}")
    # bytes: what went out is the codec's size, the uncompressed count what it stands for
    wk = stats["worker"]
    assert 0 < wk["bytes_sent"] < wk["bytes_sent_uncompressed"], (what, wk)
    assert stats["compression"] == get_codec(codec_spec).name


def test_compressed_bsp_equals_one_process_replay():
    """Per world size, three (layout, codec, optimizer) cases (see CASES)."""
    for layout, codec_spec, optimizer in CASES.get(SIZE, CASES_ELSEWHERE):
        _run_case(layout, codec_spec, optimizer)


#: error feedback off (``feedback=False``), per world size: pushes and ``sum`` pulls
NO_FEEDBACK = {2: [(COLOCATED, "int8:8", "sum")], 3: [(1, "onebit:8", "sum"),
                                                     (COLOCATED, "topk:0.2", "sgd")],
               4: [(2, "int8:8", "sgd")]}


def test_feedback_off_equals_one_process_replay():
    """``feedback=False``: no residuals on the workers, none on the servers' ``sum``
    pulls; the result equals the replay without error feedback (and differs from the one
    with it, so the switch does something)."""
    for layout, codec_spec, optimizer in NO_FEEDBACK.get(SIZE, []):
        _run_case(layout, codec_spec, optimizer, feedback=False)
    layout = COLOCATED if SIZE % 2 else 1
    with pytest.raises(PSError, match="other settings"):   # ranks disagree: every rank
        ParameterServer(_params(), comm=COMM, num_servers=layout, compression="int8",
                        feedback=RANK != SIZE - 1)
    with pytest.raises(ValueError, match="feedback='no' must be True or False"):
        ParameterServer(_params(), comm=COMM, num_servers=layout, compression="int8",
                        feedback="no" if RANK == 0 else True)


def test_async_modes_and_restore():
    """asp/ssp with compression train (no hang); a final pull is close to the servers'
    exact values; restoring without the compression state starts with zero residuals, so
    the first pull is the checkpointed values exactly (sent uncompressed)."""
    if SIZE < 3:
        pytest.skip("needs two workers")
    consistency = "ssp" if SIZE % 2 else "asp"
    params = _params()
    path = shared_tmpdir()
    try:
        def train(ps):
            for t in range(STEPS):
                ps.push_pull(make_grads(params, ps.worker_index, t))
            wait_all([ps.worker_comm.Ibarrier()])      # every push applied
            last = ps.pull()
            ps.save(path)
            return last

        ps, last = run_ps(params, train, 1, consistency=consistency, staleness=1,
                          optimizer="sgd", lr=0.125, compression="int8", split_bytes=64)
        COMM.Barrier()
        saved = _read_checkpoint(path, params)
        if ps.is_worker:
            for n, v in saved.items():
                np.testing.assert_allclose(last[n], v, rtol=0, atol=0.02 * (1 + np.abs(v).max()
                                                                           if v.size else 1))
        if RANK == 0:      # without the compression state the first pull is exact
            manifest = ckpt.read_manifest(path)
            ckpt.write_manifest(path, dict(manifest, codec_files=[]))
        COMM.Barrier()
        _, first = run_ps(params, lambda ps: ps.pull(), 1, consistency=consistency,
                          staleness=1, optimizer="sgd", compression="int8", restore=path,
                          split_bytes=64)
        if ps.is_worker:
            assert_params_equal(first, saved, "restored, first pull:")
    finally:
        remove_shared(path)


def test_bad_compression_raises_on_every_rank():
    params = _params()
    layout = COLOCATED if SIZE % 2 else 1
    for spec, fragment in [("lz4", "unknown compression='lz4'"),
                           ("topk:1.5", "ratio must be in (0, 1]"),
                           ("randomk:0", "ratio must be in (0, 1]"),
                           ("topk", "needs a ratio"),
                           (3, "compression must be a codec name or a Codec")]:
        with pytest.raises(ValueError) as info:
            ParameterServer(params, comm=COMM, num_servers=layout, compression=spec)
        assert fragment in str(info.value), str(info.value)
    # integer parameters with a float codec (optimizer="sum" takes integers uncompressed)
    ints = {"g": np.zeros(5, dtype=np.int64), "h": np.zeros(3, dtype=np.float32)}
    with pytest.raises(ValueError) as info:
        ParameterServer(ints, comm=COMM, num_servers=layout, optimizer="sum",
                        compression="onebit")
    assert "parameter 'g' has dtype int64" in str(info.value), str(info.value)
    assert "needs float32 or float64" in str(info.value)
    # one rank alone passes a bad codec: every rank raises, naming it
    with pytest.raises(ValueError) as info:
        ParameterServer(params, comm=COMM, num_servers=layout,
                        compression="topk:2" if RANK == SIZE - 1 else "int8")
    assert f"rank {SIZE - 1}:" in str(info.value) and "(0, 1]" in str(info.value)
    # ranks that disagree on the codec
    with pytest.raises(PSError, match="other settings"):
        ParameterServer(params, comm=COMM, num_servers=layout,
                        compression="int8" if RANK == 0 else "onebit")
    # "none" and None are uncompressed; afterwards the communicator still works
    _, got = run_ps(params, lambda ps: ps.push_pull(make_grads(params, ps.worker_index, 0)),
                    layout, optimizer="sum", compression="none")
    assert got is not None


def test_torch_front_ends_take_compression():
    """codec names, codecs and torch compressors; distributed_optimizer co-located with
    server_optimizer='sum': every rank ends with the same weights, bytes compressed."""
    if SIZE != 3:
        pytest.skip("torch runs at n=3 only (slow import)")
    torch = pytest.importorskip("torch")
    from mpicoll.torch.ps_optimizer import codec_option, distributed_optimizer
    from mpicoll.torch.compression.compressors import Compression

    assert codec_option(None) is None and codec_option("int8") == "int8"
    assert codec_option(Compression.none) is None and codec_option(Compression.fp16) in (
        "fp16", getattr(Compression.fp16, "codec", "fp16"))
    int8 = getattr(Compression, "int8", None)
    compression = "int8" if int8 is None else int8
    if int8 is not None:
        assert codec_option(int8).name == "int8"
    from mpicoll.torch import DistributedOptimizer

    for front in ("mpicoll.ps", "hvd.DistributedOptimizer(backend='ps')"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(),
                                    torch.nn.Linear(4, 2))
        sgd = torch.optim.SGD(model.parameters(), lr=0.1)
        if front == "mpicoll.ps":
            opt = distributed_optimizer(sgd, named_parameters=model.named_parameters(),
                                        num_servers=COLOCATED, compression=compression)
        else:  # Horovod's front end passes compression= through to the server
            opt = DistributedOptimizer(sgd, named_parameters=model.named_parameters(),
                                       backend="ps", num_servers=COLOCATED,
                                       compression=compression)
        try:
            gen = torch.Generator().manual_seed(10 + RANK)
            for _ in range(2):
                x, y = torch.randn(8, 5, generator=gen), torch.randn(8, 2, generator=gen)
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
            stats = opt.stats()
        finally:
            opt.close()
            opt.free()
        mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
        for other in COMM.allgather(mine):
            np.testing.assert_array_equal(other, mine)
        assert stats["compression"] == "int8", front
        assert stats["worker"]["bytes_sent"] < stats["worker"]["bytes_sent_uncompressed"]


#: (layout, codec, optimizer) of the restore cases per world size
RESTORE = {2: [(1, "int8", "adam"), (COLOCATED, "onebit", "momentum")],
           3: [(1, "onebit", "sgd"), (COLOCATED, "int8", "adam")],
           4: [(2, "onebit:8", "sgd")]}


def _steps(params, first, last, path=None):
    """A worker function: push_pull steps ``first..last-1``, then save to ``path``."""
    def worker(ps):
        got = [ps.push_pull(make_grads(params, ps.worker_index, t)) for t in range(first, last)]
        if path is not None:
            ps.save(path)
        return got
    return worker


def test_restore_continues_bit_identically():
    """Checkpoints carry the compression state (residuals, replicas, codec states): k
    steps, save, restore into a new ParameterServer, more steps: every pull equals the
    uninterrupted run's bit for bit; without the state (dropped from the manifest) they
    differ."""
    params = _params()
    k, more = 2, 2
    for layout, codec_spec, optimizer in RESTORE.get(SIZE, []):
        what = f"{layout}/{codec_spec}/{optimizer}"
        kw = dict(optimizer=optimizer, compression=codec_spec, split_bytes=64,
                  **UPDATES[optimizer][1])
        ps, whole = run_ps(params, _steps(params, 0, k + more), layout, **kw)
        path = shared_tmpdir()
        try:
            run_ps(params, _steps(params, 0, k, path), layout, **kw)
            COMM.Barrier()
            _, resumed = run_ps(params, _steps(params, k, k + more), layout, restore=path,
                                **kw)
            manifest = ckpt.read_manifest(path) if RANK == 0 else None
            if RANK == 0:      # the same checkpoint without its compression state
                ckpt.write_manifest(path, dict(manifest, codec_files=[]))
            manifest = COMM.bcast(manifest)
            assert len(manifest["codec_files"]) == SIZE, (what, manifest)
            _, cold = run_ps(params, _steps(params, k, k + more), layout, restore=path, **kw)
        finally:
            remove_shared(path)
        if ps.is_server:
            continue
        for t in range(more):
            assert_params_equal(resumed[t], whole[k + t], f"{what}: step {k + t}:")
        assert any(not np.array_equal(cold[-1][n], whole[-1][n]) for n in params), what


def test_restore_on_another_layout_drops_the_compression_state(caplog):
    """reshard=True onto another layout (one server and 2 workers -> 3 co-located ranks):
    the parameters come back, the compression state (kept per rank of the old layout) is
    dropped, and the first rank says so."""
    if SIZE != 3:
        pytest.skip("one layout change, at n=3")
    params = _params()
    kw = dict(optimizer="sgd", compression="int8", split_bytes=64, **UPDATES["sgd"][1])
    path = shared_tmpdir()
    try:
        run_ps(params, _steps(params, 0, 2, path), 1, **kw)
        COMM.Barrier()
        with caplog.at_level("WARNING", logger="mpicoll.ps"):
            ps, got = run_ps(params, _steps(params, 2, 3), COLOCATED, restore=path,
                             reshard=True, **kw)
    finally:
        remove_shared(path)
    assert ps.is_worker and len(got) == 1 and set(got[0]) == set(params)
    dropped = "compression state dropped (the layout changed" in caplog.text
    assert dropped == (RANK == 0), caplog.text
