"""DistributedOptimizer's compression state in one process: what compression_state_dict()
holds, and the errors of load_compression_state_dict() (nothing changes on error)."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from mpicoll.torch import Compression  # noqa: E402


@pytest.fixture
def hvd():
    import mpicoll.torch as hvd

    hvd.init()
    try:
        if hvd.size() != 1:
            pytest.skip("one process only")
        yield hvd
    finally:
        hvd.shutdown()


def _optimizer(hvd, comp):
    """Parameters w (5x3) and b (3, float64) after one step with seeded gradients."""
    w = torch.nn.Parameter(torch.zeros(5, 3))
    b = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([w, b], lr=0.1),
                                   named_parameters=[("w", w), ("b", b)], compression=comp)
    g = torch.Generator().manual_seed(0)
    ((w * torch.randn(5, 3, generator=g)).sum()
     + (b * torch.randn(3, generator=g, dtype=torch.float64)).sum()).backward()
    opt.step()
    return opt


def test_state_holds_residuals_momenta_and_codec_state(hvd):
    opt = _optimizer(hvd, Compression.randomk(0.5, momentum=0.9))
    state = opt.compression_state_dict()
    assert state["codec"] == "randomk:0.5" and state["momentum"] == 0.9
    assert state["codec_state"] == {"step": 2}            # one encoding per flat buffer
    assert state["steps"] == 1                            # reductions (for warm-ups)
    for part in ("residuals", "local_momentum", "reduced_momentum"):
        assert sorted(state[part]) == ["b", "w"]
        assert state[part]["w"].dtype == torch.float32 and state[part]["w"].numel() == 15
        assert state[part]["b"].dtype == torch.float64 and state[part]["b"].numel() == 3
    assert np.array_equal(state["residuals"]["w"].numpy(), opt.error_feedback.residual("w"))
    state["residuals"]["w"].fill_(7.0)                    # a copy, not the live residual
    assert not np.array_equal(opt.error_feedback.residual("w"), state["residuals"]["w"])
    # Horovod-style compressors keep nothing
    plain = _optimizer(hvd, Compression.fp16)
    assert plain.compression_state_dict() == {}
    plain.load_compression_state_dict({})
    with pytest.raises(ValueError, match="has no codec compressor"):
        plain.load_compression_state_dict(state)


def test_bad_states_are_refused_and_change_nothing(hvd):
    opt = _optimizer(hvd, Compression.int8)
    good = opt.compression_state_dict()
    before = {k: opt.error_feedback.residual(k).copy() for k in ("w", "b")}

    def variant(**changes):
        state = dict(good, residuals=dict(good["residuals"]))
        for key, value in changes.items():
            if key in ("w", "b", "nope"):
                state["residuals"][key] = value
            else:
                state[key] = value
        return state

    for state, error, words in (
            ([], TypeError, "must be a dict, not list"),
            ({"codec": "int8"}, ValueError, "needs the keys"),
            (variant(codec="onebit"), ValueError, "saved with compression='onebit'"),
            (variant(momentum=0.9), ValueError, ("momentum 0.9; this optimizer has 'int8', "
                                                 "momentum 0")),
            (variant(nope=torch.zeros(3)), ValueError, "does not have: 'nope'"),
            (variant(w=torch.zeros(14)), ValueError, (r"residuals\['w'\] is 14 torch.float32; "
                                                      "the parameter has 15 float32")),
            (variant(b=torch.zeros(3)), ValueError, "the parameter has 3 float64"),
            (variant(w=np.zeros(15, np.float32)), ValueError, "is ndarray"),
            (variant(codec_state={"step": 1}), ValueError, "does not belong"),
            (variant(local_momentum={"w": torch.zeros(15)}), ValueError, "holds momentum"),
            (variant(steps=-1), ValueError, "steps must be an int >= 0, not -1"),
            (variant(steps=1.0), ValueError, "steps must be an int >= 0, not 1.0")):
        with pytest.raises(error, match=words):
            opt.load_compression_state_dict(state)
        for k in ("w", "b"):
            assert np.array_equal(opt.error_feedback.residual(k), before[k]), words
    # a state without a parameter's residual: it starts from zero
    opt.load_compression_state_dict(dict(good, residuals={"w": good["residuals"]["w"]}))
    assert opt.error_feedback.keys() == ["w"]
    # the step count comes back; a state saved before warm-ups existed counts from 0
    opt.load_compression_state_dict(dict(good, steps=7))
    assert opt.compression_state_dict()["steps"] == 7
    opt.load_compression_state_dict({k: v for k, v in good.items() if k != "steps"})
    assert opt.compression_state_dict()["steps"] == 0
