// hfreduce's C++ door: an allreduce from the process group straight to the compiled core.
//
// HFReduceProcessGroup.allreduce hands each call to Door::run first (backend/cpp_door.py builds and
// loads this file). A synchronous allreduce of a small contiguous CPU tensor on one node goes to the
// compiled core (hfr_node_run, _core/node.c) as the Python fast door's does (engine/fast_door.py),
// whose four steps it shares: the slot and the bookkeeping before and after stay in Python
// (FastDoor.slot, enter, done: one short call each), the options, the descriptor, the core's run
// (without the GIL) and the Work are here. Whatever the core hands back (a mismatch to finish, a
// failure, Ctrl-C) is settled by the group (_door_settle) as the Python door settles it, and every
// other allreduce is left to the Python door (run returns None), so the two give the same bits,
// records and errors.
#include <torch/extension.h>

#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <cstring>
#include <map>
#include <tuple>
#include <vector>

extern "C" {
#include "node.h"
}

namespace py = pybind11;

namespace {

using NodeRun = int (*)(const hfr_comm*, const hfr_job*, hfr_where*, hfr_interrupt_hook, void*);

// An allreduce the core finished in the caller's thread: nothing to wait for.
class DoneWork : public c10d::Work {
 public:
  explicit DoneWork(std::vector<at::Tensor> result)
      : c10d::Work(-1, c10d::OpType::ALLREDUCE), result_(std::move(result)) {}
  bool isCompleted() override { return true; }
  bool isSuccess() const override { return true; }
  bool wait(std::chrono::milliseconds /*timeout*/) override { return true; }
  void synchronize() override {}
  std::vector<at::Tensor> result() override { return result_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    auto future = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
    future->markCompleted(c10::IValue(result_));
    return future;
  }

 private:
  std::vector<at::Tensor> result_;
};

// What the door keeps of one FastDoor.slot: the Python slot, its packed descriptor and its job.
struct Slot {
  py::object slot;  // None: the Python door declines this dtype and shape
  std::string packed;
  hfr_job job{};
};

// Between futex slices: take the GIL back for a moment and run pending signal handlers (Python runs them
// on its main thread only); one that raised (Ctrl-C) stops the run, its exception left set.
struct Released {
  PyThreadState* save;
};

int signal_pending(void* arg) {
  auto* released = static_cast<Released*>(arg);
  PyEval_RestoreThread(released->save);
  int raised = PyErr_CheckSignals() != 0;
  released->save = PyEval_SaveThread();
  return raised;
}

class Door {
 public:
  // door: the group's FastDoor, or None (several nodes, no compiled core: run always declines); group: a
  // weak reference to the HFReduceProcessGroup; ops: torch's RedOpType -> hfreduce's Op (-1: not the door's);
  // run: the core's hfr_node_run (a capsule).
  Door(py::object door, py::object group, std::vector<int64_t> ops, py::object run)
      : door_(std::move(door)), group_(std::move(group)), ops_(std::move(ops)) {
    if (door_.is_none()) return;
    run_ = reinterpret_cast<NodeRun>(run.cast<py::capsule>().get_pointer());
    TORCH_CHECK(run_ != nullptr, "hfreduce door: no hfr_node_run");
    std::string comm = py::bytes(door_.attr("core_comm"));
    TORCH_CHECK(comm.size() == sizeof comm_, "hfreduce door: hfr_comm is ", sizeof comm_, " bytes, got ",
                comm.size());
    std::memcpy(&comm_, comm.data(), sizeof comm_);
    auto where = door_.attr("descriptor_address").cast<std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t>>();
    std::tie(desc_base_, desc_bytes_, desc_ranks_, local_rank_, depth_) = where;
    enter_ = door_.attr("enter");
    done_ = door_.attr("done");
  }

  // The allreduce's Work where the door ran it (its failure settled by the group: a Work that raises), None
  // where it is not the door's (the caller takes the Python door). Called with the GIL held.
  py::object run(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) {
    if (run_ == nullptr || tensors.size() != 1 || opts.asyncOp || opts.sparseIndices.has_value()) return py::none();
    at::Tensor& t = tensors[0];
    if (!t.device().is_cpu() || t.layout() != c10::kStrided || !t.is_contiguous() || !t.has_storage())
      return py::none();
    auto red = static_cast<size_t>(opts.reduceOp.op_);
    if (red >= ops_.size() || ops_[red] < 0) return py::none();
    int64_t timeout_ms = opts.timeout.count();
    if (timeout_ms != c10d::kUnsetTimeout.count() && timeout_ms <= 0) return py::none();

    Slot* slot = find(t, red);
    if (slot == nullptr) return py::none();
    auto* ptr = static_cast<char*>(t.data_ptr());
    py::object timeout = timeout_ms == c10d::kUnsetTimeout.count() ? py::object(py::none())
                                                                     : py::object(py::float_(timeout_ms / 1000.0));
    py::object ticket = enter_(slot->slot, reinterpret_cast<intptr_t>(ptr), t.nbytes(), timeout);
    if (ticket.is_none()) return py::none();
    auto numbers = ticket.cast<py::tuple>();
    int64_t seq = numbers[0].cast<int64_t>(), g = numbers[1].cast<int64_t>();
    int64_t deadline_ns = numbers[2].cast<int64_t>();

    char* desc = reinterpret_cast<char*>(desc_base_) + ((g % depth_) * desc_ranks_ + local_rank_) * desc_bytes_;
    std::memcpy(desc, &seq, sizeof seq);  // x86-64 and aarch64 Linux: little-endian, as the Python side packs it
    std::memcpy(desc + sizeof seq, slot->packed.data(), slot->packed.size());
    hfr_job job = slot->job;
    job.first_chunk = g;
    job.src = job.dst = reinterpret_cast<int64_t>(ptr);
    job.deadline_ns = job.late_deadline_ns = deadline_ns;
    job.seq = seq;
    hfr_where where{0, 0, 0, 0};
    py::object kept = slot->slot;  // another thread may start the table again while the GIL is let go
    Released released{PyEval_SaveThread()};
    int rc = run_(&comm_, &job, &where, signal_pending, &released);
    PyEval_RestoreThread(released.save);

    ran_++;
    if (rc == HFR_DONE) {
      done_(seq);
      return py::cast(c10::intrusive_ptr<c10d::Work>(c10::make_intrusive<DoneWork>(tensors)));
    }
    py::object interrupt = py::none();
    if (rc == HFR_INTERRUPTED) {
      if (PyErr_Occurred()) {
        PyObject *type = nullptr, *value = nullptr, *trace = nullptr;
        PyErr_Fetch(&type, &value, &trace);
        PyErr_NormalizeException(&type, &value, &trace);
        if (trace != nullptr && value != nullptr) PyException_SetTraceback(value, trace);
        Py_XDECREF(type);
        Py_XDECREF(trace);
        interrupt = py::reinterpret_steal<py::object>(value);
      } else {
        interrupt = py::module_::import("builtins").attr("KeyboardInterrupt")("hfreduce: interrupted inside a collective");
      }
    }
    py::object group = group_();
    if (group.is_none()) throw std::runtime_error("hfreduce: the process group is gone");
    return group.attr("_door_settle")(tensors, kept, ticket, rc, where.stage, where.local_rank, where.chunk,
                                      interrupt);
  }

  int64_t ran() const { return ran_; }

 private:
  // The door's Slot for t's dtype, shape and op (asking FastDoor.slot the first time); nullptr where the
  // Python door declines them.
  Slot* find(const at::Tensor& t, size_t red) {
    key_.scalar = static_cast<int>(t.scalar_type());
    key_.red = static_cast<int>(red);
    key_.sizes.assign(t.sizes().begin(), t.sizes().end());
    auto it = slots_.find(key_);
    if (it != slots_.end()) return it->second.slot.is_none() ? nullptr : &it->second;
    if (slots_.size() >= kMaxSlots) slots_.clear();
    py::object op = py::module_::import("fireflyer.hfreduce.plans.plan").attr("Op")(ops_[red]);
    Slot made;
    made.slot = door_.attr("slot")(t, op);
    if (!made.slot.is_none()) {
      made.packed = py::bytes(made.slot.attr("packed"));
      std::string job = py::bytes(made.slot.attr("job"));
      TORCH_CHECK(job.size() == sizeof made.job, "hfreduce door: hfr_job is ", sizeof made.job, " bytes, got ",
                  job.size());
      TORCH_CHECK(sizeof(int64_t) + made.packed.size() <= static_cast<size_t>(desc_bytes_),
                  "hfreduce door: a descriptor of ", made.packed.size(), " bytes does not fit its slot");
      std::memcpy(&made.job, job.data(), sizeof made.job);
    }
    auto& kept = slots_[key_] = std::move(made);
    return kept.slot.is_none() ? nullptr : &kept;
  }

  struct Key {
    int scalar = 0, red = 0;
    std::vector<int64_t> sizes;
    bool operator<(const Key& o) const { return std::tie(scalar, red, sizes) < std::tie(o.scalar, o.red, o.sizes); }
  };
  static constexpr size_t kMaxSlots = 1024;

  py::object door_, group_, enter_, done_;
  std::vector<int64_t> ops_;
  NodeRun run_ = nullptr;
  hfr_comm comm_{};
  int64_t desc_base_ = 0, desc_bytes_ = 0, desc_ranks_ = 0, local_rank_ = 0, depth_ = 1;
  int64_t ran_ = 0;
  Key key_;  // reused: a lookup allocates nothing once its sizes' capacity is there
  std::map<Key, Slot> slots_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "hfreduce's C++ door: small one-node allreduces from the process group to the compiled core.";
  py::module_::import("torch.distributed");  // c10d::Work and AllreduceOptions, registered there
  py::class_<DoneWork, c10d::Work, c10::intrusive_ptr<DoneWork>>(m, "DoneWork");
  py::class_<Door>(m, "Door")
      .def(py::init<py::object, py::object, std::vector<int64_t>, py::object>(), py::arg("door"), py::arg("group"),
           py::arg("ops"), py::arg("run"))
      .def("run", &Door::run, py::arg("tensors"), py::arg("opts"),
           "The allreduce's Work where the door ran it, None where the Python door is to.")
      .def_property_readonly("ran", &Door::ran, "How many allreduces the door has taken to the core.");
}
