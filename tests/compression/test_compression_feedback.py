"""Error feedback: the identity, key handling, and the default per-array store."""
from __future__ import annotations

import gc

import numpy as np
import pytest

from mpicoll.compression import ErrorFeedback, get_codec, tensor_feedback

LOSSY = ["fp16", "bf16", "int8", "int8:8", "onebit", "onebit:8", "topk:0.1", "randomk:0.2"]


def data(count: int, rep: int, dtype=np.float32) -> np.ndarray:
    return np.random.default_rng([count, rep]).standard_normal(count).astype(dtype)


@pytest.mark.parametrize("spec", LOSSY)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sent_plus_new_residual_is_input_plus_old_residual(spec, dtype):
    codec = get_codec(spec)
    fb = ErrorFeedback()
    count = 1001
    old = np.zeros(count, dtype)
    for rep in range(4):
        x = data(count, rep, dtype)
        payload = fb.encode(codec, x, key="w")
        sent = codec.decode(payload, count, dtype)
        new = fb.residual("w")
        eps = np.finfo(dtype).eps
        y = x + old
        # exact up to the rounding of one subtraction and one addition
        np.testing.assert_allclose(sent + new, y, rtol=0, atol=4 * eps * np.abs(y).max())
        old = new.copy()


def test_feedback_recovers_what_onebit_drops():
    """Over many steps the sum of what was sent tracks the sum of the inputs."""
    codec = get_codec("onebit")
    fb = ErrorFeedback()
    total_in = np.zeros(512)
    total_sent = np.zeros(512)
    for rep in range(200):
        x = data(512, rep)
        total_in += x
        total_sent += codec.decode(fb.encode(codec, x), 512)
    # the difference is exactly the residual still held
    np.testing.assert_allclose(total_in - total_sent, fb.residual(), atol=1e-3)
    assert np.abs(fb.residual()).max() < 10  # bounded, not growing like the inputs' sum


def test_keys_are_separate_and_checked():
    fb = ErrorFeedback()
    codec = get_codec("int8")
    fb.encode(codec, data(10, 0), key="a")
    fb.encode(codec, data(20, 0), key="b")
    assert sorted(fb.keys()) == ["a", "b"] and len(fb) == 2 and "a" in fb
    with pytest.raises(ValueError, match="residual stored for key='a' has 10 float32"):
        fb.encode(codec, data(11, 0), key="a")
    with pytest.raises(ValueError, match="has 20 float32 elements but the tensor has 20 float64"):
        fb.compensate("b", data(20, 0, np.float64))
    fb.reset("a")
    assert "a" not in fb and "b" in fb
    fb.reset()
    assert len(fb) == 0


def test_compensate_leaves_input_alone():
    fb = ErrorFeedback()
    fb.store("k", np.ones(4, np.float32))
    x = np.arange(4, dtype=np.float32)
    y = fb.compensate("k", x)
    assert np.array_equal(y, x + 1) and np.array_equal(x, np.arange(4))


def test_tensor_feedback_follows_the_array():
    store = tensor_feedback()
    a = np.zeros(3, np.float32)
    k = store.key_for(a)
    store.store(k, np.ones(3, np.float32))
    assert store.key_for(a) == k and store.residual(k) is not None
    del a
    gc.collect()
    assert store.residual(k) is None
