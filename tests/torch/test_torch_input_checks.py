"""Checks of user input in mpicoll.torch that one process reaches: tensors, dtypes and ops
the adapter and the torch.distributed backend refuse, bad arguments of ``hvd.*``
functions, optimizers, process sets, SyncBatchNorm and the DDP hooks' state, and the
answers Horovod's ``*_built()`` queries give."""
from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import mpicoll.torch as hvd
from mpicoll.torch import hooks
from mpicoll.torch.distributed import tensors
from mpicoll.torch.distributed.options import Options
from mpicoll.torch.distributed.work import completed
from mpicoll.torch.engine import dtypes
from mpicoll.torch.engine.settings import from_environment
from mpicoll.torch.ops import check_op_dtype
from mpicoll.torch.optim_wrapping import check_named_parameters


@pytest.fixture
def session():
    """mpicoll.torch started on this one process for the test, shut down after it."""
    if hvd.is_initialized():
        pytest.skip("already initialized in this process")
    hvd.init()
    yield hvd
    hvd.shutdown()


# ------------------------------------------------------------------ without an engine
def test_horovod_build_queries():
    """Horovod's build queries: MPI only (no Gloo, NCCL, DDL, oneCCL, CUDA or ROCm)."""
    assert hvd.mpi_built() and hvd.mpi_enabled()
    assert not any(q() for q in (hvd.gloo_built, hvd.gloo_enabled, hvd.nccl_built,
                                 hvd.ddl_built, hvd.ccl_built, hvd.cuda_built, hvd.rocm_built))


def test_adapter_refuses_meta_sparse_and_unsupported_tensors():
    """The engine's tensor check names the argument and what is wrong with it."""
    with pytest.raises(TypeError, match="tensor is on meta; .*CPU and CUDA"):
        dtypes.check_supported(torch.empty(2, device="meta"))
    with pytest.raises(TypeError, match="has dtype torch.float8_e5m2"):
        dtypes.check_supported(torch.zeros(2, dtype=torch.float8_e5m2))
    with pytest.raises(TypeError, match="x is sparse"):
        dtypes.check_supported(torch.ones(2).to_sparse(), "x")
    assert dtypes.from_name(dtypes.dtype_name(torch.bfloat16)) is torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype name 'nope'"):
        dtypes.from_name("nope")


def test_ops_refuse_min_max_on_complex():
    """Min/Max have no order on complex numbers; Sum does."""
    for op in (hvd.Min, hvd.Max):
        with pytest.raises(TypeError, match="does not apply to complex tensors"):
            check_op_dtype(op, torch.complex64, 1.0, 1.0)
    check_op_dtype(hvd.Sum, torch.complex64, 1.0, 1.0)


def test_backend_tensor_checks():
    """The torch.distributed backend's checks: a tensor, strided, and an op that applies
    to its dtype."""
    with pytest.raises(TypeError, match="input must be a torch.Tensor, not list"):
        tensors.check_tensor([1], "input")
    with pytest.raises(TypeError, match="input is a torch.sparse_coo tensor"):
        tensors.check_tensor(torch.ones(2).to_sparse(), "input")
    with pytest.raises(TypeError, match="reduce op max is not defined for complex out"):
        tensors.check_reduce_dtype(torch.ones(2, dtype=torch.complex64), "max", "out")


def test_options_repr_and_completed_work():
    """An Options' repr shows its settings; a completed work's synchronize() returns and
    its result is the one given."""
    text = repr(Options())
    assert text.startswith("Options(algorithm=") and "group_name=" in text
    work = completed("allreduce", [torch.ones(1)])
    work.synchronize()
    assert work.is_completed() and torch.equal(work.result()[0], torch.ones(1))


def test_overlap_setting_must_be_auto_0_or_1(monkeypatch):
    monkeypatch.setenv("MPICOLL_OVERLAP", "sometimes")
    with pytest.raises(ValueError, match="MPICOLL_OVERLAP='sometimes'; use auto, 1 or 0"):
        from_environment()


def test_sync_batch_norm_channel_count():
    """An input whose dimension 1 is not ``num_features`` is refused before any exchange."""
    with pytest.raises(ValueError, match=r"expected 3 channels \(dimension 1\), got input "
                                         r"of shape \(2, 4\)"):
        hvd.SyncBatchNorm(3)(torch.ones(2, 4))


def test_named_parameters_must_be_pairs():
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"sequence of \(name, parameter\) tuples"):
        check_named_parameters(list(model.parameters()), opt.param_groups, "p")


def test_process_set_constructor_checks_and_unregistered_answers():
    with pytest.raises(ValueError, match="initialized with a list of process ranks"):
        hvd.ProcessSet(3)
    with pytest.raises(ValueError, match=r"ranks must be ints, not \[0, 1.5\]"):
        hvd.ProcessSet([0, 1.5])
    unregistered = hvd.ProcessSet([0])
    assert unregistered.rank() is None and unregistered.included() is None


def test_init_refuses_a_list_of_ranks_as_comm():
    if hvd.is_initialized():
        pytest.skip("already initialized in this process")
    with pytest.raises(ValueError, match=r"init\(comm=\[ranks\]\) is not supported"):
        hvd.init(comm=[0])
    assert not hvd.is_initialized()


def test_init_refuses_bad_process_sets():
    """``init(process_sets=...)`` takes ProcessSet objects; an empty set is an error too
    (only a duplicate is skipped, as Horovod does)."""
    if hvd.is_initialized():
        pytest.skip("already initialized in this process")
    for sets, error, message in (([[0]], TypeError, "must hold ProcessSet objects, not list"),
                                 ([hvd.ProcessSet([])], ValueError, "at least one rank")):
        try:
            with pytest.raises(error, match=message):
                hvd.init(process_sets=sets)
        finally:
            hvd.shutdown()


def test_compression_state_checks_repr_and_state_dict():
    """CompressionState refuses a non-bool error_feedback; its state_dict round-trips the
    iteration and the residuals into another state."""
    with pytest.raises(TypeError, match="error_feedback must be True or False, not int"):
        hooks.CompressionState(error_feedback=1)
    state = hooks.CompressionState(codec="int8")
    assert repr(state) == ("<CompressionState codec=int8 error_feedback=True iteration=0 "
                           "residuals=0>")
    assert "codec=unset" in repr(hooks.CompressionState())
    state.iteration = 7
    state.feedback.store(2, np.arange(3, dtype=np.float32))
    saved = state.state_dict()
    assert saved["codec"] == "int8" and saved["iteration"] == 7
    other = hooks.CompressionState(codec="int8")
    other.feedback.store(5, np.ones(2, dtype=np.float32))
    other.load_state_dict(saved)
    assert other.iteration == 7 and list(other.feedback.keys()) == [2]
    assert np.array_equal(other.feedback.residual(2), np.arange(3, dtype=np.float32))
    # tensors: torch.load takes the checkpoint with its default weights_only=True
    import io

    buffer = io.BytesIO()
    torch.save({"hook": saved}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)["hook"]
    assert isinstance(loaded["residuals"][2], torch.Tensor)
    fresh = hooks.CompressionState()          # no codec: takes the saved one
    fresh.load_state_dict(loaded)
    assert fresh.codec.name == "int8"
    assert np.array_equal(fresh.feedback.residual(2), np.arange(3, dtype=np.float32))
    with pytest.raises(ValueError, match="residuals of codec 'int8'; this "
                                         "CompressionState's codec is 'onebit'"):
        hooks.CompressionState(codec="onebit").load_state_dict(saved)


def test_compression_hook_on_a_rank_outside_its_group_says_so():
    """A rank that is not in the state's process_group (torch's NON_GROUP_MEMBER) gets
    a ValueError saying so (it got torch's 'Invalid process group specified' from the
    message of another error)."""
    import torch.distributed as dist

    with pytest.raises(ValueError, match="not a member of the CompressionState's "
                                         "process_group"):
        hooks._mpicoll_group(dist.GroupMember.NON_GROUP_MEMBER)


class _Bucket:
    """What the hooks read of DDP's ``GradBucket``."""

    def __init__(self, buffer, params=(), index=0):
        self.buf, self.params, self.i = buffer, list(params), index

    def buffer(self):
        return self.buf

    def parameters(self):
        return self.params

    def index(self):
        return self.i

    def is_last(self):
        return True


def test_codec_hooks_refuse_integer_buckets_and_need_a_process_group():
    """A codec hook refuses a bucket of integers (the codecs encode float32 or float64),
    and, before ``dist.init_process_group('mpicoll')``, says it needs one."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a default process group exists in this process")
    with pytest.raises(TypeError, match=r"DDP bucket 3 holds torch.int64 gradients; "
                                        r"compression='int8' encodes float32 or float64"):
        hooks.int8_hook(hooks.CompressionState(), _Bucket(torch.zeros(4, dtype=torch.long),
                                                          index=3))
    with pytest.raises(RuntimeError, match=r"need dist.init_process_group\('mpicoll'\) first"):
        hooks.int8_hook(hooks.CompressionState(), _Bucket(torch.zeros(4)))


def test_compression_state_drops_the_residual_of_a_bucket_not_laid_out_by_parameter():
    """A bucket whose buffer is not its parameters end to end (padded) gets no residual
    assembled from its parameters' parts: its residual starts afresh."""
    state = hooks.CompressionState(codec="int8")
    a, b = torch.zeros(2), torch.zeros(3)
    state._follow_layout(0, [a, b], torch.zeros(5))
    state.feedback.store(0, np.arange(5, dtype=np.float32))
    state._follow_layout(0, [b, a], torch.zeros(8))      # 5 elements of parameters in 8
    assert state.feedback.residual(0) is None and 0 not in state.feedback
    state.feedback.store(0, np.ones(8, dtype=np.float32))
    state._follow_layout(0, [b, a], torch.zeros(8))      # unchanged since: kept
    assert state.feedback.residual(0).tolist() == [1.0] * 8


# --------------------------------------------------------------------- with an engine
def test_operation_argument_errors(session):
    """hvd.* operations refuse a non-string name, a non-int root, bad splits and
    reducescatter ops other than Average/Sum, naming what is wrong."""
    x = torch.ones(2)
    with pytest.raises(TypeError, match="name must be a string, not int"):
        hvd.allreduce(x, name=3)
    with pytest.raises(TypeError, match="root_rank must be an int, not str"):
        hvd.broadcast(x, "0")
    with pytest.raises(TypeError, match=r"splits must be one-dimensional, not of shape "
                                        r"\(1, 1\)"):
        hvd.alltoall(x, splits=torch.tensor([[2]]))
    with pytest.raises(TypeError, match="splits must be a list, tuple or integer tensor, "
                                        "not str"):
        hvd.alltoall(x, splits="2")
    with pytest.raises(ValueError, match="reducescatter supports op=Average or op=Sum"):
        hvd.reducescatter(x, op=hvd.Max)
    with pytest.raises(TypeError, match="feedback= needs a codec compressor"):
        hvd.grouped_allreduce([x], feedback=object())
    scalar = torch.sparse_coo_tensor(torch.zeros(0, 1, dtype=torch.long), torch.ones(1), (),
                                     check_invariants=True)
    with pytest.raises(TypeError, match="at least one sparse dimension"):
        hvd.sparse_allreduce_async(scalar)


def test_broadcast_parameters_argument_errors(session):
    with pytest.raises(ValueError, match="params must be a dict .* not int"):
        hvd.broadcast_parameters(3, root_rank=0)
    with pytest.raises(ValueError, match="parameter 'w' is a float, not a tensor"):
        hvd.broadcast_parameters({"w": 1.0}, root_rank=0)


def test_distributed_optimizer_argument_errors(session):
    """Horovod's ``groups`` (None, an int >= 1 or lists of the optimizer's parameters)
    and ``gradient_predivide_factor`` (with op=Average only)."""
    model = torch.nn.Linear(2, 1)

    def wrap(**kwargs):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        return hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                        **kwargs)

    with pytest.raises(ValueError, match="groups must be >= 1, not 0"):
        wrap(groups=0)
    with pytest.raises(ValueError, match="not an optimizer parameter"):
        wrap(groups=[[torch.nn.Parameter(torch.ones(1))]])
    with pytest.raises(ValueError, match="groups must be None, an int or a list"):
        wrap(groups="all")
    with pytest.raises(ValueError, match="gradient_predivide_factor not supported"):
        wrap(gradient_predivide_factor=2.0, op=hvd.Sum)
    wrap(groups=2)
    wrap(groups=[[model.weight], [model.bias]])


def test_a_copy_of_the_global_process_set_is_the_global_set(session):
    """A copy of ``global_process_set`` (a deep-copied module or optimizer holds one)
    runs operations on every rank, as the set itself."""
    everyone = copy.deepcopy(hvd.global_process_set)
    x = torch.arange(3.0)
    assert torch.equal(hvd.allreduce(x, op=hvd.Sum, process_set=everyone), x)


def test_adding_an_empty_process_set_is_refused(session):
    with pytest.raises(ValueError, match="a process set needs at least one rank"):
        hvd.add_process_set([])
