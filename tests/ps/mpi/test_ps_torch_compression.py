"""The parameter-server torch optimizer's compression options: a codec compressor's
``feedback`` flag reaches the server, compressors it cannot honour (local momentum, warm-up,
a flag that contradicts ``feedback=``) are refused on every rank, and ``save()`` /
``restore=`` carry the compression state (training continues bit for bit).

Runs only at world size 3 (torch's import is slow on the shared cores).
"""
from __future__ import annotations

import copy

import pytest
from ps_cases import COMM, RANK, SIZE, remove_shared, shared_tmpdir

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]

if SIZE != 3:
    pytest.skip("torch test runs at n=3 only", allow_module_level=True)
torch = pytest.importorskip("torch")

import mpicoll.torch as hvd
from mpicoll.ps import COLOCATED
from mpicoll.ps import checkpoint as ckpt
from mpicoll.torch.ps_optimizer import distributed_optimizer, feedback_option

Compression = hvd.Compression


def _model(state: dict | None = None) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    if state is not None:
        model.load_state_dict(state)
    return model


def _train(opt, model, first: int, steps: int) -> None:
    """Steps ``first .. first + steps - 1`` on rank-dependent data."""
    for step in range(first, first + steps):
        gen = torch.Generator().manual_seed(100 * RANK + step)
        x, y = torch.randn(8, 5, generator=gen), torch.randn(8, 2, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _weights(model) -> bytes:
    return b"".join(p.detach().numpy().tobytes() for p in model.parameters())


def _run(front: str, steps: int = 2, **options) -> tuple[bytes, object]:
    """Train ``steps`` co-located steps (SGD, server_optimizer='sum'); (weights, ps)."""
    model = _model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    if front == "hvd":
        opt = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters(),
                                       backend="ps", num_servers=COLOCATED, **options)
    else:
        opt = distributed_optimizer(sgd, named_parameters=model.named_parameters(),
                                    num_servers=COLOCATED, **options)
    try:
        _train(opt, model, 0, steps)
    finally:
        opt.close()
        opt.free()
    return _weights(model), opt.ps


def test_a_compressors_feedback_flag_reaches_the_server():
    """Compression.from_codec("int8", feedback=False) with backend='ps' trains exactly as
    compression="int8", feedback=False (and not as with error feedback)."""
    off = Compression.from_codec("int8", feedback=False)
    assert feedback_option(off) is False and feedback_option(Compression.int8) is True
    assert feedback_option(off, False) is False and feedback_option("int8", False) is False
    assert feedback_option(Compression.fp16) is True and feedback_option(None) is True
    assert feedback_option(Compression.from_codec("none"), True) is True   # lossless
    got, ps = _run("hvd", compression=off)
    assert ps.feedback is False and ps.compression.name == "int8"
    want, _ = _run("ps", compression="int8", feedback=False)
    with_feedback, ps_on = _run("hvd", compression=Compression.int8)
    assert ps_on.feedback is True
    assert got == want
    assert got != with_feedback
    for other in COMM.allgather(got):      # every rank holds the same weights
        assert other == got


@pytest.mark.parametrize("compression,options,words", [
    (Compression.int8.with_warmup(2), {},
     ("int8 with a warm-up of 2 steps: the parameter server compresses from the first "
      "step")),
    (Compression.onebit.with_momentum(0.9), {}, "onebit with momentum"),
    (Compression.from_codec("int8", feedback=False), {"feedback": True},
     "beside feedback=True"),
])
def test_what_it_cannot_honour_is_refused_on_every_rank(compression, options, words):
    for front in ("hvd", "ps"):
        with pytest.raises(ValueError, match=words):
            _run(front, compression=compression, **options)
    # one rank alone: every rank raises, naming it
    with pytest.raises(ValueError, match=f"rank {SIZE - 1}:"):
        _run("hvd", compression=compression if RANK == SIZE - 1 else Compression.int8,
             **(options if RANK == SIZE - 1 else {}))


def test_save_and_restore_carry_the_compression_state():
    """Two steps, save (the PS's checkpoint with its compression state, the model and the
    torch optimizer), two more; a new optimizer restored from it repeats the last two steps
    bit for bit, and without the compression state (dropped from the manifest) it does
    not."""
    path = shared_tmpdir()
    kw = {"num_servers": COLOCATED, "compression": Compression.onebit, "split_bytes": 64}

    def build(state=None, **more):
        model = _model(None if state is None else state["model"])
        sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
        if state is not None:
            sgd.load_state_dict(state["optimizer"])
        return model, distributed_optimizer(sgd, named_parameters=model.named_parameters(),
                                            **kw, **more)
    try:
        model, opt = build()
        _train(opt, model, 0, 2)
        opt.save(path)
        saved = copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict()})
        _train(opt, model, 2, 2)
        opt.close()
        opt.free()
        whole = _weights(model)
        COMM.Barrier()
        runs = {}
        for label in ("restored", "without state"):
            if label == "without state" and RANK == 0:
                ckpt.write_manifest(path, dict(ckpt.read_manifest(path), codec_files=[]))
            COMM.Barrier()
            model, opt = build(saved, restore=path)
            _train(opt, model, 2, 2)
            opt.close()
            opt.free()
            runs[label] = _weights(model)
    finally:
        remove_shared(path)
    assert runs["restored"] == whole
    assert runs["without state"] != whole
