// Copyright 2026 The tflms Authors. Licensed under the Apache License 2.0.
//
// Python binding of the engine over the sim backend (module tflms._core).
//
// Ownership: a Python Buffer keeps its EngineHolder alive (shared_ptr), so a
// buffer outliving its Engine object is safe; freeing marks the Python
// handle dead first, so use-after-free and double free raise instead of
// touching freed memory. The GIL is released around every engine call:
// engine calls may block on copies, and tests drive one engine from many
// Python threads.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <limits>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>

#include "sim_device.h"
#include "tflms/engine.h"

namespace py = pybind11;

namespace tflms {
namespace {

struct OutOfMemory : std::runtime_error {
  using std::runtime_error::runtime_error;
};

[[noreturn]] void Raise(const Status& s) {
  switch (s.code()) {
    case Code::kResourceExhausted:
      throw OutOfMemory(s.message());
    case Code::kInvalidArgument:
      throw py::value_error(s.message());
    default:
      throw std::runtime_error(s.message());
  }
}

void Check(const Status& s) {
  if (!s.ok()) Raise(s);
}

struct EngineHolder {
  std::unique_ptr<SimDevice> device;
  std::unique_ptr<Engine> engine;
  bool lms = true;
};

class PyBuffer {
 public:
  PyBuffer(std::shared_ptr<EngineHolder> holder, Buffer* buffer, size_t size)
      : holder_(std::move(holder)), buffer_(buffer), size_(size) {}

  Buffer* Get(const char* what) const {
    std::lock_guard<std::mutex> lock(mu_);
    if (buffer_ == nullptr) {
      throw std::runtime_error(std::string("cannot ") + what +
                               ": the buffer was freed");
    }
    return buffer_;
  }
  // Marks the handle dead; returns the buffer to free, or throws.
  Buffer* Release() {
    std::lock_guard<std::mutex> lock(mu_);
    if (buffer_ == nullptr) {
      throw std::runtime_error("double free: the buffer was already freed");
    }
    Buffer* b = buffer_;
    buffer_ = nullptr;
    return b;
  }
  void Restore(Buffer* b) {
    std::lock_guard<std::mutex> lock(mu_);
    buffer_ = b;
  }
  bool freed() const {
    std::lock_guard<std::mutex> lock(mu_);
    return buffer_ == nullptr;
  }
  size_t size() const { return size_; }
  EngineHolder* holder() const { return holder_.get(); }

  py::bytes Read() {
    Buffer* b = Get("read");
    std::string out(size_, '\0');
    Status s;
    {
      py::gil_scoped_release release;
      s = holder_->engine->ReadBuffer(b, 0, &out[0], size_);
    }
    Check(s);
    return py::bytes(out);
  }

  void Write(const py::buffer& data, int64_t offset) {
    Buffer* b = Get("write");
    py::buffer_info info = data.request();
    const size_t n = static_cast<size_t>(info.size * info.itemsize);
    if (offset < 0) throw py::value_error("offset must be >= 0");
    Status s;
    {
      py::gil_scoped_release release;
      s = holder_->engine->WriteBuffer(b, static_cast<size_t>(offset),
                                       info.ptr, n);
    }
    Check(s);
  }

  bool Resident() {
    Buffer* b = Get("query residency");
    return holder_->engine->GetBufferState(b) == BufferState::kResident;
  }
  int PinCount() { return holder_->engine->PinCount(Get("query pins")); }

 private:
  std::shared_ptr<EngineHolder> holder_;
  mutable std::mutex mu_;
  Buffer* buffer_;  // guarded by mu_; nullptr once freed
  size_t size_;
};

class PyEngine {
 public:
  PyEngine(int64_t device_memory, int64_t host_memory, bool lms, bool defrag,
           bool prefetch, int64_t prefetch_budget, int prefetch_lookahead,
           bool allow_growth, int64_t lms_limit, bool store_data,
           double link_gbps, double link_latency_us, double device_gbps,
           bool verify_moves, bool fixed_addresses, int64_t page_size,
           int64_t virtual_address_bytes, double map_us_per_page,
           double unmap_us_per_page, int launch_queue_depth, bool verify_pins,
           bool prefetch_guard, int run_ahead_epochs, bool unfragmented,
           bool layout_lookahead, double layout_look_ns_per_event,
           double layout_look_ns_per_range) {
    if (device_memory <= 0) {
      throw py::value_error("device_memory must be a positive byte count");
    }
    if (host_memory < 0) throw py::value_error("host_memory must be >= 0");
    if (lms_limit < 0) throw py::value_error("lms_limit must be >= 0");
    if (prefetch_budget < 0) {
      throw py::value_error("prefetch_budget must be >= 0");
    }
    if (page_size <= 0 || virtual_address_bytes < 0) {
      throw py::value_error(
          "page_size must be positive, virtual_address_bytes >= 0");
    }
    if (link_gbps <= 0 || device_gbps <= 0 || link_latency_us < 0) {
      throw py::value_error(
          "link_gbps and device_gbps must be positive, link_latency_us >= 0");
    }
    SimOptions sim;
    sim.device_memory = static_cast<size_t>(device_memory);
    // The addresses the unfragmented arena manages (the engine's LMS limit
    // holds its bytes to device_memory).
    if (unfragmented &&
        sim.device_memory <= std::numeric_limits<size_t>::max() /
                                 kUnfragmentedAddressFactor) {
      sim.device_memory *= kUnfragmentedAddressFactor;
    }
    sim.store_data = store_data;
    sim.link_bytes_per_second = link_gbps * 1e9;
    sim.link_latency_seconds = link_latency_us * 1e-6;
    sim.device_bytes_per_second = device_gbps * 1e9;
    if (map_us_per_page < 0 || unmap_us_per_page < 0) {
      throw py::value_error("map_us_per_page and unmap_us_per_page must be >= 0");
    }
    sim.map_seconds_per_page = map_us_per_page * 1e-6;
    sim.unmap_seconds_per_page = unmap_us_per_page * 1e-6;
    if (launch_queue_depth < 0) {
      throw py::value_error("launch_queue_depth must be >= 0 (0: unlimited)");
    }
    sim.launch_queue_depth = launch_queue_depth;
    if (layout_look_ns_per_event < 0 || layout_look_ns_per_range < 0) {
      throw py::value_error(
          "layout_look_ns_per_event and layout_look_ns_per_range must be >= 0");
    }
    sim.layout_look_seconds_per_event = layout_look_ns_per_event * 1e-9;
    sim.layout_look_seconds_per_range = layout_look_ns_per_range * 1e-9;
    EngineOptions opt;
    opt.name = "sim:0";
    opt.memory_limit = static_cast<size_t>(device_memory);
    opt.allow_growth = allow_growth;
    opt.lms_enabled = lms;
    opt.lms_limit = static_cast<size_t>(lms_limit);
    opt.host_memory_limit = static_cast<size_t>(host_memory);
    opt.defrag_enabled = defrag;
    opt.verify_moves = verify_moves;
    opt.verify_pins = verify_pins;
    opt.prefetch_enabled = prefetch;
    opt.prefetch_budget_bytes = static_cast<size_t>(prefetch_budget);
    opt.prefetch_lookahead = prefetch_lookahead;
    opt.prefetch_guard = prefetch_guard;
    opt.run_ahead_epochs = run_ahead_epochs;
    opt.fixed_addresses = fixed_addresses;
    opt.page_size = static_cast<size_t>(page_size);
    opt.virtual_address_bytes = static_cast<size_t>(virtual_address_bytes);
    opt.unfragmented = unfragmented;
    opt.layout_lookahead = layout_lookahead;
    holder_ = std::make_shared<EngineHolder>();
    holder_->lms = lms;
    holder_->device = std::make_unique<SimDevice>(sim);
    holder_->engine = std::make_unique<Engine>(holder_->device.get(), opt);
    Check(holder_->engine->Init());
  }

  std::shared_ptr<PyBuffer> Allocate(int64_t nbytes, bool pinned) {
    if (nbytes <= 0) {
      throw py::value_error("allocation size must be a positive byte count, "
                            "got " + std::to_string(nbytes));
    }
    Status s;
    Buffer* b;
    {
      py::gil_scoped_release release;
      b = holder_->engine->AllocateBuffer(static_cast<size_t>(nbytes), pinned,
                                          &s);
    }
    if (b == nullptr) Raise(s);
    return std::make_shared<PyBuffer>(holder_, b, static_cast<size_t>(nbytes));
  }

  void Own(const PyBuffer& buf) const {
    if (buf.holder() != holder_.get()) {
      throw py::value_error("the buffer belongs to another engine");
    }
  }

  void Free(PyBuffer& buf) {
    Own(buf);
    Buffer* b = buf.Release();
    Status s;
    {
      py::gil_scoped_release release;
      s = holder_->engine->FreeBuffer(b);
    }
    if (!s.ok()) {
      buf.Restore(b);  // e.g. still pinned: the buffer stays usable
      Raise(s);
    }
  }

  uintptr_t Pin(PyBuffer& buf) {
    Own(buf);
    Buffer* b = buf.Get("pin");
    void* ptr = nullptr;
    Status s;
    {
      py::gil_scoped_release release;
      s = holder_->engine->Pin(b, &ptr);
    }
    Check(s);
    return reinterpret_cast<uintptr_t>(ptr);
  }

  // A kernel about to pin `bufs` and allocate an output as large as all of
  // them (Engine::GatherForConcat).
  void GatherForConcat(const std::vector<PyBuffer*>& bufs) {
    std::vector<Buffer*> group;
    group.reserve(bufs.size());
    for (PyBuffer* buf : bufs) {
      if (buf == nullptr) throw py::value_error("buffers must not be None");
      Own(*buf);
      group.push_back(buf->Get("gather"));
    }
    py::gil_scoped_release release;
    holder_->engine->GatherForConcat(group.data(), group.size());
  }

  void Unpin(PyBuffer& buf) {
    Own(buf);
    Buffer* b = buf.Get("unpin");
    Status s;
    {
      py::gil_scoped_release release;
      s = holder_->engine->Unpin(b);
    }
    Check(s);
  }

  py::dict Stats() {
    EngineStats st;
    {
      py::gil_scoped_release release;
      st = holder_->engine->GetStats();
    }
    py::dict d;
    for (const auto& item : st.Items()) d[py::str(item.first)] = item.second;
    return d;
  }

  int64_t Defragment() {
    size_t moved = 0;
    Status s;
    {
      py::gil_scoped_release release;
      s = holder_->engine->Defragment(&moved);
    }
    Check(s);
    return static_cast<int64_t>(moved);
  }

  int64_t ReclaimInactive() {
    size_t bytes = 0;
    Status s;
    {
      py::gil_scoped_release release;
      s = holder_->engine->ReclaimInactive(&bytes);
    }
    Check(s);
    return static_cast<int64_t>(bytes);
  }

  void SetLmsLimit(int64_t bytes) {
    if (bytes < 0) throw py::value_error("lms_limit must be >= 0");
    Check(holder_->engine->SetLmsLimit(static_cast<size_t>(bytes)));
  }

  void CheckInvariants() { Check(holder_->engine->CheckInvariants()); }

  py::tuple FreeSpace() {
    size_t largest = 0, total = 0;
    holder_->engine->GetFreeSpace(&largest, &total);
    return py::make_tuple(largest, total);
  }

  py::dict Timeline() {
    SimTimeline t = holder_->device->GetTimeline();
    py::dict d;
    d["host_time"] = t.host_time;
    d["compute_time"] = t.compute_time;
    d["d2h_time"] = t.d2h_time;
    d["h2d_time"] = t.h2d_time;
    d["d2h_busy"] = t.d2h_busy;
    d["h2d_busy"] = t.h2d_busy;
    d["compute_busy"] = t.compute_busy;
    d["compute_stall"] = t.compute_stall;
    d["host_sync_wait"] = t.host_sync_wait;
    d["host_launch_wait"] = t.host_launch_wait;
    d["d2h_bytes"] = t.d2h_bytes;
    d["h2d_bytes"] = t.h2d_bytes;
    d["d2d_bytes"] = t.d2d_bytes;
    return d;
  }

  EngineHolder& holder() { return *holder_; }

 private:
  std::shared_ptr<EngineHolder> holder_;
};

StreamKind ParseKind(const std::string& kind) {
  if (kind == "d2h") return StreamKind::kDeviceToHost;
  if (kind == "h2d") return StreamKind::kHostToDevice;
  if (kind == "compute") return StreamKind::kCompute;
  throw py::value_error("stream kind must be 'd2h', 'h2d' or 'compute'");
}

}  // namespace
}  // namespace tflms

PYBIND11_MODULE(_core, m) {
  using namespace tflms;
  m.doc() = "tflms LMS engine (C++), sim backend";
  m.attr("DEFAULT_PREFETCH_LOOKAHEAD") = EngineOptions{}.prefetch_lookahead;
  m.attr("MAX_RUN_AHEAD_EPOCHS") = kMaxRunAheadEpochs;
  static py::exception<OutOfMemory> oom(m, "OutOfMemoryError",
                                        PyExc_MemoryError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const OutOfMemory& e) {
      py::set_error(oom, e.what());
    }
  });

  py::class_<PyBuffer, std::shared_ptr<PyBuffer>>(m, "Buffer")
      .def_property_readonly("nbytes", &PyBuffer::size)
      .def_property_readonly("resident", &PyBuffer::Resident)
      .def_property_readonly("pin_count", &PyBuffer::PinCount)
      .def_property_readonly("freed", &PyBuffer::freed)
      .def("read", &PyBuffer::Read)
      .def("write", &PyBuffer::Write, py::arg("data"), py::arg("offset") = 0);

  py::class_<PyEngine>(m, "Engine")
      .def(py::init<int64_t, int64_t, bool, bool, bool, int64_t, int, bool,
                    int64_t, bool, double, double, double, bool, bool, int64_t,
                    int64_t, double, double, int, bool, bool, int, bool, bool,
                    double, double>(),
           py::arg("device_memory"), py::arg("host_memory"), py::arg("lms"),
           py::arg("defrag"), py::arg("prefetch"), py::arg("prefetch_budget"),
           py::arg("prefetch_lookahead"), py::arg("allow_growth"),
           py::arg("lms_limit"), py::arg("store_data"), py::arg("link_gbps"),
           py::arg("link_latency_us"), py::arg("device_gbps"),
           py::arg("verify_moves"), py::arg("fixed_addresses") = false,
           py::arg("page_size") = int64_t{2} << 20,
           py::arg("virtual_address_bytes") = 0,
           py::arg("map_us_per_page") = 0.0,
           py::arg("unmap_us_per_page") = 0.0,
           py::arg("launch_queue_depth") = 0,
           py::arg("verify_pins") = false, py::arg("prefetch_guard") = false,
           py::arg("run_ahead_epochs") = 0, py::arg("unfragmented") = false,
           py::arg("layout_lookahead") = false,
           py::arg("layout_look_ns_per_event") = 0.0,
           py::arg("layout_look_ns_per_range") = 0.0)
      .def("allocate", &PyEngine::Allocate, py::arg("nbytes"),
           py::arg("pinned") = false)
      .def("free", &PyEngine::Free)
      .def("pin", &PyEngine::Pin)
      .def("unpin", &PyEngine::Unpin)
      .def("gather_for_concat", &PyEngine::GatherForConcat)
      .def("stats", &PyEngine::Stats)
      .def("clear_stats",
           [](PyEngine& e) {
             py::gil_scoped_release release;
             e.holder().engine->ClearStats();
           })
      .def("defragment", &PyEngine::Defragment)
      .def("reclaim_inactive", &PyEngine::ReclaimInactive)
      .def("step_begin",
           [](PyEngine& e) { e.holder().engine->StepBegin(); })
      .def("note_step_id",
           [](PyEngine& e, int64_t id) {
             e.holder().engine->NoteStepId(id);
           })
      .def("note_allocation_site",
           [](PyEngine& e, uint64_t site) {
             e.holder().engine->NoteAllocationSite(site);
           })
      .def("set_lms_limit", &PyEngine::SetLmsLimit)
      .def("check_invariants", &PyEngine::CheckInvariants)
      .def("free_space", &PyEngine::FreeSpace)
      .def("compute",
           [](PyEngine& e, double s) {
             if (s < 0) throw py::value_error("seconds must be >= 0");
             e.holder().device->Compute(s);
           })
      .def("host_advance",
           [](PyEngine& e, double s) {
             if (s < 0) throw py::value_error("seconds must be >= 0");
             e.holder().device->HostAdvance(s);
           })
      .def("synchronize",
           [](PyEngine& e) {
             py::gil_scoped_release release;
             e.holder().device->SynchronizeAll();
           })
      .def("timeline", &PyEngine::Timeline)
      .def("record_copies",
           [](PyEngine& e, bool on) { e.holder().device->RecordCopies(on); })
      .def("take_copies",
           [](PyEngine& e) {
             // (direction, start, end, bytes) per host link copy recorded
             // since the last call; modelled seconds on timeline()'s clock.
             py::list out;
             for (const SimCopy& c : e.holder().device->TakeCopies()) {
               const char* kind =
                   c.stream == StreamKind::kDeviceToHost ? "d2h" : "h2d";
               out.append(py::make_tuple(kind, c.start, c.end, c.bytes));
             }
             return out;
           })
      .def("fail_next_maps",
           [](PyEngine& e, int n) { e.holder().device->FailNextMaps(n); })
      .def("fail_next_unmaps",
           [](PyEngine& e, int n) { e.holder().device->FailNextUnmaps(n); })
      .def_property_readonly("mapped_bytes",
                             [](PyEngine& e) {
                               return e.holder().device->mapped_bytes();
                             })
      .def("fail_next_copies",
           [](PyEngine& e, const std::string& kind, int n) {
             e.holder().device->FailNextCopies(ParseKind(kind), n);
           })
      .def("refuse_device_allocations",
           [](PyEngine& e, bool refuse) {
             e.holder().device->RefuseDeviceAllocations(refuse);
           })
      .def("refuse_host_allocations",
           [](PyEngine& e, bool refuse) {
             e.holder().device->RefuseHostAllocations(refuse);
           })
      .def_property_readonly("host_bytes_allocated", [](PyEngine& e) {
        return e.holder().device->host_bytes_allocated();
      });
}
