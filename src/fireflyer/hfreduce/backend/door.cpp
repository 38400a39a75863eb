// hfreduce's C++ door: an allreduce from the process group straight to the compiled core.
//
// HFReduceProcessGroup.allreduce hands each call to Door::run first (backend/cpp_door.py builds and
// loads this file). A synchronous allreduce of a small contiguous CPU tensor on one node goes to the
// compiled core (hfr_node_run, _core/node.c) as the Python fast door's does (engine/fast_door.py),
// whose four steps it follows. FastDoor.slot (once per dtype, shape and op) stays in Python. The
// rest is here, without a Python frame on a call that the core finishes:
// - the claim: the engine's jobs are taken as Jobs.claim takes them, with the same locks and
//   numbers (Jobs.submit_lock, exec_lock, pending, seq; the node stage's chunk counter);
// - the flight record: the door keeps its own ring of the collectives it ran (the ledger below),
//   which the group's FlightRecorder reads and merges into what it reports and dumps;
// - the descriptor, the core's run (without the GIL) and the Work.
// Whatever the core hands back (a mismatch to finish, a failure, Ctrl-C) is handed to Python: the
// collective's record moves to the FlightRecorder (FastDoor.adopt) and the group settles it
// (_door_settle) as the Python door settles it. A group with registered buffers, or whose recorder
// keeps Python stacks, takes FastDoor.enter and done instead of the claim and ledger here; every other
// allreduce is left to the Python door (run returns None), so the two give the same bits, records and
// errors.
#include <torch/extension.h>

#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <time.h>

#include <algorithm>
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
  py::object trace;  // its flight record's sizes and dtypes
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

int64_t clock_ns(clockid_t clock) {
  struct timespec ts;
  clock_gettime(clock, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

// The collectives the door ran, as the group's FlightRecorder would have recorded them: a ring of the
// last `capacity` (none when recording is off) and the counts the recorder reports. Touched only with
// the GIL held, so the recorder's readers (any thread) see it whole.
class Ledger {
 public:
  struct Record {
    int64_t record_id = 0, seq = 0, created_ns = 0, started_ns = 0, completed_ns = -1, timeout_ms = 0;
    uint64_t thread_id = 0;
    py::object trace;  // the Slot's (input sizes, input dtypes, output sizes, output dtypes)
  };

  explicit Ledger(size_t capacity) : ring_(capacity) {}

  // Collective `seq` entered and started now; record_id -1 where recording is off.
  void open(int64_t record_id, int64_t seq, int64_t timeout_ms, const py::object& trace) {
    int64_t now = clock_ns(CLOCK_REALTIME);
    recorded_++;
    in_flight_ = 1;
    current_ = seq;
    last_scheduled_ = std::max(last_scheduled_, seq);
    last_started_ = std::max(last_started_, seq);
    if (ring_.empty()) return;
    Record& r = ring_[next_];
    r.record_id = record_id;
    r.seq = seq;
    r.created_ns = r.started_ns = now;
    r.completed_ns = -1;
    r.timeout_ms = timeout_ms;
    r.thread_id = PyThread_get_thread_ident();
    r.trace = trace;
    next_ = next_ + 1 == ring_.size() ? 0 : next_ + 1;
    held_ = std::min(held_ + 1, ring_.size());
  }

  // The collective opened last completed.
  void complete() {
    in_flight_ = 0;
    settled_++;
    last_completed_ = std::max(last_completed_, current_);
    if (!ring_.empty()) ring_[last()].completed_ns = clock_ns(CLOCK_REALTIME);
  }

  // The collective opened last leaves the ledger (the FlightRecorder takes it over): as if never opened.
  void withdraw() {
    in_flight_ = 0;
    recorded_--;
    if (ring_.empty() || held_ == 0) return;
    next_ = last();
    ring_[next_].trace = py::object();
    held_--;
  }

  py::tuple counts() const { return py::make_tuple(in_flight_, settled_, recorded_); }
  py::tuple lasts() const { return py::make_tuple(last_scheduled_, last_started_, last_completed_); }
  py::list open_collectives() const {
    py::list out;
    if (in_flight_) out.append(py::make_tuple(current_, "allreduce"));
    return out;
  }
  // Oldest first: (record_id, seq, created_ns, started_ns, completed_ns or None, timeout_ms, thread_id, trace).
  py::list records() const {
    py::list out;
    size_t first = (next_ + ring_.size() - held_) % std::max<size_t>(ring_.size(), 1);
    for (size_t i = 0; i < held_; i++) {
      const Record& r = ring_[(first + i) % ring_.size()];
      py::object completed = r.completed_ns < 0 ? py::object(py::none()) : py::object(py::int_(r.completed_ns));
      out.append(py::make_tuple(r.record_id, r.seq, r.created_ns, r.started_ns, completed, r.timeout_ms,
                                r.thread_id, r.trace));
    }
    return out;
  }

 private:
  size_t last() const { return (next_ + ring_.size() - 1) % ring_.size(); }

  std::vector<Record> ring_;
  size_t next_ = 0, held_ = 0;
  int64_t in_flight_ = 0, settled_ = 0, recorded_ = 0, current_ = -1;
  int64_t last_scheduled_ = -1, last_started_ = -1, last_completed_ = -1;
};

// Python names the door reads and writes, made once.
struct Names {
  py::str closed{"closed"}, error{"error"}, shared{"shared"}, pending{"pending"}, seq{"seq"}, chunk{"chunk"},
      acquire{"acquire"}, release{"release"}, version{"version"}, spans{"spans"};
};

class Door {
 public:
  // door: the group's FastDoor, or None (several nodes, no compiled core: run always declines); group: a
  // weak reference to the HFReduceProcessGroup; ops: torch's RedOpType -> hfreduce's Op (-1: not the door's);
  // run: the core's hfr_node_run (a capsule).
  Door(py::object door, py::object group, std::vector<int64_t> ops, py::object run)
      : door_(std::move(door)), group_(std::move(group)), ops_(std::move(ops)), ledger_(0) {
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
    adopt_ = door_.attr("adopt");
    default_timeout_ = door_.attr("default_timeout");
    auto parts = door_.attr("parts").cast<py::tuple>();  // jobs, failures, node stage, flight recorder
    jobs_ = parts[0];
    failures_ = parts[1];
    node_ = parts[2];
    py::object flight = parts[3];
    submit_lock_ = jobs_.attr("submit_lock");
    exec_lock_ = jobs_.attr("exec_lock");
    own_records_ = !flight.attr("keeps_stacks").cast<bool>();
    ids_ = flight.attr("record_ids");
    ledger_ = Ledger(flight.attr("capacity").cast<size_t>());
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
    bool own = own_records_ && !registered(reinterpret_cast<intptr_t>(ptr), t.nbytes());
    py::object ticket;
    int64_t seq, g, deadline_ns;
    double seconds = 0;
    if (own) {
      // FastDoor.enter's checks, then Jobs.claim, here.
      if (PyObject_IsTrue(jobs_.attr(names_.closed).ptr()) || !failures_.attr(names_.error).is_none())
        return py::none();
      seconds = timeout.is_none() ? default_timeout_().cast<double>() : timeout_ms / 1000.0;
      if (!claim(slot, seconds, &seq)) return py::none();
      g = node_.attr(names_.chunk).cast<int64_t>();
      node_.attr(names_.chunk) = py::int_(g + 1);
      deadline_ns = clock_ns(CLOCK_MONOTONIC) + static_cast<int64_t>(seconds * 1e9);
    } else {
      ticket = enter_(slot->slot, reinterpret_cast<intptr_t>(ptr), t.nbytes(), timeout);
      if (ticket.is_none()) return py::none();
      auto numbers = ticket.cast<py::tuple>();
      seq = numbers[0].cast<int64_t>();
      g = numbers[1].cast<int64_t>();
      deadline_ns = numbers[2].cast<int64_t>();
    }

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
      if (own) {
        ledger_.complete();
        release();
      } else {
        done_(seq);
      }
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
    if (own) {
      // The record moves to the FlightRecorder, where the settle marks it failed (or completed).
      ledger_.withdraw();
      adopt_(kept, seq, seconds);
      ticket = py::make_tuple(seq, g, deadline_ns, timeout, seconds);
    }
    py::object group = group_();
    if (group.is_none()) throw std::runtime_error("hfreduce: the process group is gone");
    return group.attr("_door_settle")(tensors, kept, ticket, rc, where.stage, where.local_rank, where.chunk,
                                      interrupt);
  }

  int64_t ran() const { return ran_; }
  const Ledger& ledger() const { return ledger_; }

 private:
  // Jobs.claim: take the engine when nothing is pending, number the collective and record it. False (nothing
  // taken) where the engine is busy, or its submit lock is held by another thread: then the caller goes the
  // Python door's way, which waits for that lock.
  bool claim(Slot* slot, double seconds, int64_t* seq) {
    if (!submit_lock_.attr(names_.acquire)(false).cast<bool>()) return false;
    bool taken = false;
    try {
      if (jobs_.attr(names_.pending).cast<int64_t>() == 0) {
        *seq = jobs_.attr(names_.seq).cast<int64_t>();
        jobs_.attr(names_.seq) = py::int_(*seq + 1);
        int64_t record_id = -1;
        if (!ids_.is_none()) record_id = py::reinterpret_steal<py::object>(PyIter_Next(ids_.ptr())).cast<int64_t>();
        ledger_.open(record_id, *seq, static_cast<int64_t>(seconds * 1000), slot->trace);
        jobs_.attr(names_.pending) = py::int_(1);
        exec_lock_.attr(names_.acquire)();  // free: nothing is pending, so the engine thread is idle
        taken = true;
      }
    } catch (...) {
      submit_lock_.attr(names_.release)();
      throw;
    }
    submit_lock_.attr(names_.release)();
    return taken;
  }

  // Whether the bytes at ptr lie in one of this rank's registered buffers (SharedBuffers.locate_bytes), whose
  // spans the door keeps until their version changes. A registered tensor takes FastDoor.enter, which gives it
  // to the general path.
  bool registered(intptr_t ptr, size_t nbytes) {
    py::object shared = node_.attr(names_.shared);
    if (shared.is_none()) return false;
    int64_t version = shared.attr(names_.version).cast<int64_t>();
    if (version != spans_version_) {
      spans_ = shared.attr(names_.spans)().cast<std::vector<std::pair<int64_t, int64_t>>>();
      spans_version_ = version;
    }
    for (const auto& span : spans_)
      if (span.first <= ptr && ptr + static_cast<int64_t>(nbytes) <= span.first + span.second) return true;
    return false;
  }

  // Jobs.release.
  void release() {
    exec_lock_.attr(names_.release)();
    submit_lock_.attr(names_.acquire)();  // a blocking acquire lets the GIL go while it waits
    jobs_.attr(names_.pending) = py::int_(jobs_.attr(names_.pending).cast<int64_t>() - 1);
    submit_lock_.attr(names_.release)();
  }

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
      made.trace = made.slot.attr("trace");
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

  py::object door_, group_, enter_, done_, adopt_, default_timeout_;
  py::object jobs_, failures_, node_, submit_lock_, exec_lock_, ids_;
  bool own_records_ = false;
  std::vector<std::pair<int64_t, int64_t>> spans_;
  int64_t spans_version_ = -1;
  Names names_;
  std::vector<int64_t> ops_;
  NodeRun run_ = nullptr;
  hfr_comm comm_{};
  int64_t desc_base_ = 0, desc_bytes_ = 0, desc_ranks_ = 0, local_rank_ = 0, depth_ = 1;
  int64_t ran_ = 0;
  Key key_;  // reused: a lookup allocates nothing once its sizes' capacity is there
  std::map<Key, Slot> slots_;
  Ledger ledger_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "hfreduce's C++ door: small one-node allreduces from the process group to the compiled core, claimed and recorded without Python.";
  py::module_::import("torch.distributed");  // c10d::Work and AllreduceOptions, registered there
  py::class_<DoneWork, c10d::Work, c10::intrusive_ptr<DoneWork>>(m, "DoneWork");
  py::class_<Door>(m, "Door")
      .def(py::init<py::object, py::object, std::vector<int64_t>, py::object>(), py::arg("door"), py::arg("group"),
           py::arg("ops"), py::arg("run"))
      .def("run", &Door::run, py::arg("tensors"), py::arg("opts"),
           "The allreduce's Work where the door ran it, None where the Python door is to.")
      .def_property_readonly("ran", &Door::ran, "How many allreduces the door has taken to the core.")
      // The ledger, as diagnosis.flight.Ledger reads it.
      .def("counts", [](const Door& d) { return d.ledger().counts(); },
           "(in flight, settled, recorded) of the collectives the door ran itself.")
      .def("last", [](const Door& d) { return d.ledger().lasts(); },
           "The last (scheduled, started, completed) collective numbers among them, -1 for none.")
      .def("open_collectives", [](const Door& d) { return d.ledger().open_collectives(); },
           "[(seq, op)] of the one in flight, if any.")
      .def("records", [](const Door& d) { return d.ledger().records(); },
           "Its records, oldest first: (record_id, seq, created_ns, started_ns, completed_ns or None, timeout_ms, "
           "thread_id, trace).");
}
