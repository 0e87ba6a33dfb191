// mpicoll's torch.distributed backend as a real c10d::Backend.
//
// torch binds c10d::Backend to Python without a constructor and without a trampoline, so
// a Python class cannot subclass it. This extension adds both, in the way torch's own
// PyProcessGroup (torch/csrc/distributed/c10d/PyProcessGroup.hpp) does for ProcessGroup
// and Work:
//
// - `Backend` (Python: `<module>.Backend(rank, size, name)`): a concrete c10d::Backend whose
//   name is given at construction. Its trampoline `PyBackend` sends every virtual operation
//   (allreduce, broadcast, ..., send, recv, barrier, monitoredBarrier, setTimeout, abort,
//   shutdown, shrink, split, ...) to the Python method of the same torch name, when the
//   Python subclass defines one; otherwise c10d::Backend's own (which says the operation
//   is not supported).
// - `WorkHandle`: the c10d::Work that C++ callers (torch's ProcessGroup, DDP's reducer)
//   get for a Python work (a torch.distributed.Work subclass). It keeps the Python object
//   alive and asks it for everything: wait, completion, success, exception, source rank,
//   result, future, future result. In Python it forwards every attribute it does not
//   have to that object (`handle.py_work` is the object itself).
//
// mpicoll/torch/distributed/extension.py builds and loads it (torch's JIT, cached).

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/pybind.h>

#include <pybind11/chrono.h>
#include <pybind11/stl.h>

#include <chrono>
#include <exception>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace py = pybind11;

// hidden, as pybind11's own symbols are
namespace mpicoll __attribute__((visibility("hidden"))) {

using c10d::OpType;

// Whether the interpreter is finalizing (Python 3.13 made the test public).
inline bool finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

// The C++ face of a Python work (a torch.distributed.Work subclass).
class WorkHandle : public c10d::Work {
 public:
  WorkHandle(py::object work, OpType type)
      : c10d::Work(-1, type), work_(std::move(work)) {}

  ~WorkHandle() override {
    // The interpreter is gone or going: leave the object. A thread other than the main
    // one that waits for the GIL while the interpreter finalizes is ended by Python
    // (pthread_exit), which inside this noexcept destructor is std::terminate: "terminate
    // called without an active exception" at exit.
    if (!Py_IsInitialized() || finalizing()) {
      work_.release();
      return;
    }
    py::gil_scoped_acquire gil;
    work_ = py::object();
  }

  const py::object& pyWork() const {
    return work_;
  }

  bool isCompleted() override {
    py::gil_scoped_acquire gil;
    return work_.attr("is_completed")().cast<bool>();
  }

  bool isSuccess() const override {
    py::gil_scoped_acquire gil;
    return work_.attr("is_success")().cast<bool>();
  }

  std::exception_ptr exception() const override {
    py::gil_scoped_acquire gil;
    py::object error = work_.attr("exception")();
    if (error.is_none()) {
      return nullptr;
    }
    return std::make_exception_ptr(std::runtime_error(py::str(error).cast<std::string>()));
  }

  int sourceRank() const override {
    py::gil_scoped_acquire gil;
    return work_.attr("_source_rank")().cast<int>();
  }

  std::vector<at::Tensor> result() override {
    py::gil_scoped_acquire gil;
    py::object value = work_.attr("result")();
    try {
      return value.cast<std::vector<at::Tensor>>();
    } catch (const py::cast_error&) {
      return {};  // a list of lists (all_gather's): C++ callers get no tensors
    }
  }

  void synchronize() override {
    py::gil_scoped_acquire gil;
    work_.attr("synchronize")();
  }

  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override {
    py::gil_scoped_acquire gil;
    return work_.attr("wait")(timeout).cast<bool>();
  }

  void abort() override {
    py::gil_scoped_acquire gil;
    if (py::hasattr(work_, "abort")) {
      work_.attr("abort")();
    }
  }

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    return future("get_future");
  }

  c10::intrusive_ptr<c10::ivalue::Future> getFutureResult() override {
    return future("get_future_result");
  }

 private:
  c10::intrusive_ptr<c10::ivalue::Future> future(const char* method) {
    py::gil_scoped_acquire gil;
    py::object fut = work_.attr(method)();
    return fut.cast<std::shared_ptr<torch::jit::PythonFutureWrapper>>()->fut;
  }

  py::object work_;
};

// What a Python operation returned, as the c10d::Work torch hands on.
inline c10::intrusive_ptr<c10d::Work> toWork(py::object work, OpType type) {
  if (py::isinstance<WorkHandle>(work)) {
    return work.cast<c10::intrusive_ptr<c10d::Work>>();
  }
  return c10::make_intrusive<WorkHandle>(std::move(work), type);
}

// A concrete c10d::Backend with a name; the Python subclass implements the operations.
class Backend : public c10d::Backend {
 public:
  Backend(int rank, int size, std::string name)
      : c10d::Backend(rank, size), name_(std::move(name)) {
    init();
  }

  const std::string getBackendName() const override {
    return name_;
  }

  // See ProcessGroupAccess below.
  void setRankSize(int rank, int size) {
    const_cast<int&>(rank_) = rank;
    const_cast<int&>(size_) = size;
  }

 private:
  std::string name_;
};

// Rank and size after an elastic reconfiguration (mpicoll/torch/distributed/reconfigure.py):
// c10d keeps both as members set at construction, which ProcessGroup::getRank/getSize (DDP's
// reducer reads getSize at every backward) and torch's dist.get_rank/get_world_size return.
// The objects are heap objects built non-const, so writing the members through a
// derived-class pointer to member changes what every later call returns.
struct ProcessGroupAccess : c10d::ProcessGroup {
  static void setRankSize(c10d::ProcessGroup& pg, int rank, int size) {
    const_cast<int&>(pg.*(&ProcessGroupAccess::rank_)) = rank;
    const_cast<int&>(pg.*(&ProcessGroupAccess::size_)) = size;
  }
};

// The trampoline: each virtual operation calls the Python subclass's method `pyname`.
#define MPICOLL_WORK(type, cname, pyname, ...)                             \
  do {                                                                     \
    py::gil_scoped_acquire gil;                                            \
    py::function fn =                                                      \
        py::get_override(static_cast<const Backend*>(this), pyname);       \
    if (fn) {                                                              \
      return toWork(fn(__VA_ARGS__), type);                                \
    }                                                                      \
  } while (false);                                                         \
  return Backend::cname(__VA_ARGS__)

#define MPICOLL_CALL(rtype, cname, pyname, ...)                            \
  do {                                                                     \
    py::gil_scoped_acquire gil;                                            \
    py::function fn =                                                      \
        py::get_override(static_cast<const Backend*>(this), pyname);       \
    if (fn) {                                                              \
      return py::cast<rtype>(fn(__VA_ARGS__));                             \
    }                                                                      \
  } while (false);                                                         \
  return Backend::cname(__VA_ARGS__)

#define MPICOLL_VOID(cname, pyname, ...)                                   \
  do {                                                                     \
    py::gil_scoped_acquire gil;                                            \
    py::function fn =                                                      \
        py::get_override(static_cast<const Backend*>(this), pyname);       \
    if (fn) {                                                              \
      fn(__VA_ARGS__);                                                     \
      return;                                                              \
    }                                                                      \
  } while (false);                                                         \
  Backend::cname(__VA_ARGS__)

// A timeout torch leaves unset (kUnsetTimeout) as Python's None.
inline py::object timeoutOrNone(std::chrono::milliseconds timeout) {
  if (timeout == c10d::kUnsetTimeout) {
    return py::none();
  }
  return py::cast(timeout);
}

class PyBackend : public Backend {
 public:
  using Backend::Backend;

  // --- collectives -------------------------------------------------------------------
  c10::intrusive_ptr<c10d::Work> broadcast(
      std::vector<at::Tensor>& tensors,
      const c10d::BroadcastOptions& opts) override {
    MPICOLL_WORK(OpType::BROADCAST, broadcast, "broadcast", tensors, opts);
  }

  c10::intrusive_ptr<c10d::Work> allreduce(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceOptions& opts) override {
    MPICOLL_WORK(OpType::ALLREDUCE, allreduce, "allreduce", tensors, opts);
  }

  c10::intrusive_ptr<c10d::Work> allreduce_sparse(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceOptions& opts) override {
    MPICOLL_WORK(
        OpType::_ALLREDUCE_SPARSE, allreduce_sparse, "allreduce_sparse", tensors, opts);
  }

  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceCoalescedOptions& opts) override {
    MPICOLL_WORK(
        OpType::ALLREDUCE_COALESCED, allreduce_coalesced, "allreduce_coalesced", tensors,
        opts);
  }

  c10::intrusive_ptr<c10d::Work> reduce(
      std::vector<at::Tensor>& tensors,
      const c10d::ReduceOptions& opts) override {
    MPICOLL_WORK(OpType::REDUCE, reduce, "reduce", tensors, opts);
  }

  c10::intrusive_ptr<c10d::Work> allgather(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override {
    MPICOLL_WORK(OpType::ALLGATHER, allgather, "allgather", outputs, inputs, opts);
  }

  c10::intrusive_ptr<c10d::Work> _allgather_base(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::AllgatherOptions& opts) override {
    MPICOLL_WORK(
        OpType::_ALLGATHER_BASE, _allgather_base, "_allgather_base", output, input, opts);
  }

  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override {
    MPICOLL_WORK(
        OpType::ALLGATHER_COALESCED, allgather_coalesced, "allgather_coalesced", outputs,
        inputs, opts);
  }

  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override {
    MPICOLL_WORK(
        OpType::COALESCED, allgather_into_tensor_coalesced,
        "allgather_into_tensor_coalesced", outputs, inputs, opts);
  }

  c10::intrusive_ptr<c10d::Work> gather(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::GatherOptions& opts) override {
    MPICOLL_WORK(OpType::GATHER, gather, "gather", outputs, inputs, opts);
  }

  c10::intrusive_ptr<c10d::Work> scatter(
      std::vector<at::Tensor>& outputs,
      std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ScatterOptions& opts) override {
    MPICOLL_WORK(OpType::SCATTER, scatter, "scatter", outputs, inputs, opts);
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter(
      std::vector<at::Tensor>& outputs,
      std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ReduceScatterOptions& opts) override {
    MPICOLL_WORK(
        OpType::REDUCE_SCATTER, reduce_scatter, "reduce_scatter", outputs, inputs, opts);
  }

  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::ReduceScatterOptions& opts) override {
    MPICOLL_WORK(
        OpType::_REDUCE_SCATTER_BASE, _reduce_scatter_base, "_reduce_scatter_base",
        output, input, opts);
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override {
    MPICOLL_WORK(
        OpType::REDUCE_SCATTER_TENSOR_COALESCED, reduce_scatter_tensor_coalesced,
        "reduce_scatter_tensor_coalesced", outputs, inputs, opts);
  }

  c10::intrusive_ptr<c10d::Work> alltoall_base(
      at::Tensor& output,
      at::Tensor& input,
      std::vector<int64_t>& outputSplitSizes,
      std::vector<int64_t>& inputSplitSizes,
      const c10d::AllToAllOptions& opts) override {
    MPICOLL_WORK(
        OpType::ALLTOALL_BASE, alltoall_base, "alltoall_base", output, input,
        outputSplitSizes, inputSplitSizes, opts);
  }

  c10::intrusive_ptr<c10d::Work> alltoall(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllToAllOptions& opts) override {
    MPICOLL_WORK(OpType::ALLTOALL, alltoall, "alltoall", outputs, inputs, opts);
  }

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override {
    MPICOLL_WORK(OpType::BARRIER, barrier, "barrier", opts);
  }

  void monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) override {
    {
      py::gil_scoped_acquire gil;
      py::function fn =
          py::get_override(static_cast<const Backend*>(this), "monitored_barrier");
      if (fn) {
        fn(timeoutOrNone(opts.timeout), waitAllRanks);
        return;
      }
    }
    Backend::monitoredBarrier(opts, waitAllRanks);
  }

  // --- point-to-point ----------------------------------------------------------------
  c10::intrusive_ptr<c10d::Work> send(
      std::vector<at::Tensor>& tensors, int dstRank, int tag) override {
    MPICOLL_WORK(OpType::SEND, send, "send", tensors, dstRank, tag);
  }

  c10::intrusive_ptr<c10d::Work> recv(
      std::vector<at::Tensor>& tensors, int srcRank, int tag) override {
    MPICOLL_WORK(OpType::RECV, recv, "recv", tensors, srcRank, tag);
  }

  c10::intrusive_ptr<c10d::Work> recvAnysource(
      std::vector<at::Tensor>& tensors, int tag) override {
    MPICOLL_WORK(OpType::RECVANYSOURCE, recvAnysource, "recv_anysource", tensors, tag);
  }

  // --- life cycle and capabilities ----------------------------------------------------
  void setTimeout(std::chrono::milliseconds timeout) override {
    MPICOLL_VOID(setTimeout, "set_timeout", timeout);
  }

  void abort() override {
    MPICOLL_VOID(abort, "abort");
  }

  void shutdown() override {
    MPICOLL_VOID(shutdown, "shutdown");
  }

  bool supportsSplitting() const override {
    MPICOLL_CALL(bool, supportsSplitting, "supportsSplitting");
  }

  bool supportsCoalescing() const override {
    MPICOLL_CALL(bool, supportsCoalescing, "supportsCoalescing");
  }

  bool supportsShrinking() const override {
    MPICOLL_CALL(bool, supportsShrinking, "supportsShrinking");
  }

  c10::intrusive_ptr<c10d::Backend::Options> getBackendOptions() override {
    MPICOLL_CALL(
        c10::intrusive_ptr<c10d::Backend::Options>, getBackendOptions,
        "getBackendOptions");
  }

  c10::intrusive_ptr<c10d::Backend> shrink(
      const std::vector<int64_t>& ranks_to_exclude,
      int shrink_flags,
      const c10::intrusive_ptr<c10d::Backend::Options>& opts_override) override {
    MPICOLL_CALL(
        c10::intrusive_ptr<c10d::Backend>, shrink, "shrink", ranks_to_exclude,
        shrink_flags, opts_override);
  }

  c10::intrusive_ptr<c10d::Backend> split(
      const c10::intrusive_ptr<c10d::Store>& store,
      const std::vector<int>& ranks,
      const c10::intrusive_ptr<c10d::Backend::Options>& opts) override {
    MPICOLL_CALL(c10::intrusive_ptr<c10d::Backend>, split, "split", store, ranks, opts);
  }

  void startCoalescing() override {
    MPICOLL_VOID(startCoalescing, "_start_coalescing");
  }

  c10::intrusive_ptr<c10d::Work> endCoalescing() override {
    MPICOLL_WORK(OpType::COALESCED, endCoalescing, "_end_coalescing");
  }

  void setSequenceNumberForGroup() override {
    MPICOLL_VOID(setSequenceNumberForGroup, "_set_sequence_number_for_group");
  }

  uint64_t getSequenceNumberForGroup() override {
    MPICOLL_CALL(
        uint64_t, getSequenceNumberForGroup, "_get_sequence_number_for_group");
  }
};

#undef MPICOLL_WORK
#undef MPICOLL_CALL
#undef MPICOLL_VOID

}  // namespace mpicoll

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "mpicoll's torch.distributed backend as a c10d::Backend (a Python trampoline)";
  // torch's Python module binds c10d::Backend and c10d::Work (their base types here)
  py::module_::import("torch._C._distributed_c10d");

  py::class_<mpicoll::Backend, c10d::Backend, c10::intrusive_ptr<mpicoll::Backend>,
             mpicoll::PyBackend>(
      m, "Backend",
      "A c10d::Backend whose operations are the Python subclass's methods (torch's names: "
      "allreduce, broadcast, _allgather_base, ..., recv_anysource, monitored_barrier, "
      "set_timeout, abort, shutdown, shrink; supportsSplitting, getBackendOptions, ...).")
      .def(py::init<int, int, std::string>(), py::arg("rank"), py::arg("size"),
           py::arg("name"))
      .def_property_readonly(
          "group_uid", [](const mpicoll::Backend& self) { return self.getGroupUid(); },
          "The name torch gave the group (ProcessGroup._set_group_name).")
      .def("_set_rank_size", &mpicoll::Backend::setRankSize, py::arg("rank"),
           py::arg("size"), "Make rank() and size() these (an elastic reconfiguration).");

  m.def(
      "set_process_group_rank_size",
      [](const c10::intrusive_ptr<c10d::ProcessGroup>& pg, int rank, int size) {
        mpicoll::ProcessGroupAccess::setRankSize(*pg, rank, size);
      },
      py::arg("process_group"), py::arg("rank"), py::arg("size"),
      "Make a torch ProcessGroup's rank() and size() these (an elastic reconfiguration).");

  auto handle =
      py::class_<mpicoll::WorkHandle, c10d::Work, c10::intrusive_ptr<mpicoll::WorkHandle>>(
          m, "WorkHandle",
          "The c10d::Work of a Python work: asks that object for everything; in Python "
          "its methods are that object's, and so is any attribute it does not have.");
  handle.def_property_readonly(
      "py_work", [](const mpicoll::WorkHandle& self) { return self.pyWork(); },
      "The Python work this handle stands for.");
  // Python callers get the Python work's own methods (its errors, its future object)
  for (const char* name :
       {"wait", "is_completed", "is_success", "exception", "result", "get_future",
        "get_future_result", "synchronize", "_source_rank"}) {
    std::string method(name);
    handle.def(name, [method](const mpicoll::WorkHandle& self, py::args args,
                              py::kwargs kwargs) {
      return self.pyWork().attr(method.c_str())(*args, **kwargs);
    });
  }
  handle.def("__getattr__", [](const mpicoll::WorkHandle& self, const std::string& name) {
    return self.pyWork().attr(name.c_str());
  });
  handle.def("__repr__", [](const mpicoll::WorkHandle& self) {
    return "<WorkHandle of " + py::repr(self.pyWork()).cast<std::string>() + ">";
  });
}
