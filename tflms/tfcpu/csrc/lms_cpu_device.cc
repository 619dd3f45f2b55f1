// Copyright 2026 The tflms Authors. Licensed under the Apache License 2.0.
//
// The tflms.tfcpu harness: the patch's TensorFlow side, running in a stock
// tensorflow-cpu process.
//
// An LMS "CPU" device takes the place of TensorFlow's thread-pool device: its
// allocator is the patch's LmsAllocator (common_runtime/lms) over the engine's
// simulated device, whose "device memory" is a host arena, so TensorFlow's own
// CPU kernels read and write it. Its Compute, ComputeAsync and same-device
// copies call the patch's pin rule (common_runtime/lms/kernel_pins.h), the
// same code the GPU device's hunks call; tensor buffers are the patch's
// MovableTensorBuffer, created through tensor_hooks.cc. What this stands in
// for, and what it does not exercise, is listed in docs/verification.md.
//
// Life cycle: tflms_tfcpu_enable() runs once, after TensorFlow's libraries are
// loaded and before its devices exist. It creates one allocator for the
// process (every device the factory creates shares it, as every GPU:0 device
// object shares GPU 0's allocator) and registers the factory above the stock
// CPU factory (priority 70).
#include <Python.h>  // the buffer protocol of EagerTensor (first: Python's rule)
#include <dlfcn.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "tensorflow/c/eager/c_api.h"
#include "tensorflow/c/tf_status.h"
#include "tensorflow/c/tf_tensor.h"
#include "tensorflow/core/common_runtime/lms/kernel_pins.h"
#include "tensorflow/core/common_runtime/lms/lms_allocator.h"
#include "tensorflow/core/common_runtime/lms/lms_options.h"
#include "tensorflow/core/common_runtime/threadpool_device.h"
#include "tensorflow/core/framework/device_attributes.pb.h"
#include "tensorflow/core/framework/device_factory.h"
#include "tensorflow/core/framework/movable_tensor_buffer.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/protobuf/config.pb.h"
#include "tensorflow/core/public/session_options.h"
#include "tflms/engine.h"

#include "host_compute_device.h"

TFE_TensorHandle* EagerTensor_Handle(const PyObject* o);
namespace tensorflow {
// Exported by libtensorflow_framework; declared in a header the wheel lacks.
absl::Status TF_TensorToTensor(const TF_Tensor* src, Tensor* dst);
}  // namespace tensorflow

namespace tflms_tfcpu {

std::string InstallTensorHooks();
int PatchedSlots();
bool WritePointer(void** slot, void* value);

namespace {

constexpr int kFactoryPriority = 100;  // above the stock CPU factory's 70

// Set once by Enable, then read-only: the process-wide LMS allocator.
tensorflow::lms::LmsAllocator* g_allocator = nullptr;
HostComputeDevice* g_device = nullptr;  // owned by g_allocator
bool g_prefetch_enabled = false;        // the engine's, set with g_allocator
std::mutex g_enable_mu;                 // serializes Enable and Rehook

class LmsCpuDevice : public tensorflow::ThreadPoolDevice {
 public:
  LmsCpuDevice(const tensorflow::SessionOptions& options,
               const std::string& name, tensorflow::Allocator* allocator)
      : ThreadPoolDevice(options, name, tensorflow::Bytes(256 << 20),
                         tensorflow::DeviceLocality(), allocator),
        allocator_(allocator) {}

  // Every allocation, host-memory arguments included: on a GPU those come
  // from the host allocator and never move, so this is the stricter choice.
  tensorflow::Allocator* GetAllocator(
      tensorflow::AllocatorAttributes attr) override {
    return allocator_;
  }

  void Compute(tensorflow::OpKernel* op_kernel,
               tensorflow::OpKernelContext* context) override {
    if (unpinned_op_ != nullptr && op_kernel->type_string() == unpinned_op_) {
      // The detection test: this op's pin site removed (its outputs'
      // creation pins are still released, as the pin site would).
      ThreadPoolDevice::Compute(op_kernel, context);
      tensorflow::lms::ReleaseOutputCreationPins(context);
      return;
    }
    tensorflow::lms::KernelPins pins(context);
    if (!pins.ok()) return;
    ThreadPoolDevice::Compute(op_kernel, context);
  }

  void ComputeAsync(tensorflow::AsyncOpKernel* op_kernel,
                    tensorflow::OpKernelContext* context,
                    tensorflow::AsyncOpKernel::DoneCallback done) override {
    if (!tensorflow::lms::PinAsyncKernelInputs(context, &done)) return;
    ThreadPoolDevice::ComputeAsync(op_kernel, context, std::move(done));
  }

  void CopyTensorInSameDevice(const tensorflow::Tensor* input_tensor,
                              tensorflow::Tensor* output_tensor,
                              const tensorflow::DeviceContext* device_context,
                              tensorflow::StatusCallback done) override {
    if (!tensorflow::lms::PinForCopy({input_tensor, output_tensor}, &done)) {
      return;
    }
    ThreadPoolDevice::CopyTensorInSameDevice(input_tensor, output_tensor,
                                             device_context, std::move(done));
  }

 private:
  tensorflow::Allocator* const allocator_;
  // TFLMS_TFCPU_UNPINNED_OP names one op type whose kernels run without their
  // inputs pinned: in fixed-address mode a read of an evicted input must
  // fault (tests/test_tfcpu.py). Read once; never set outside that test.
  const char* const unpinned_op_ = std::getenv("TFLMS_TFCPU_UNPINNED_OP");
};

class LmsCpuDeviceFactory : public tensorflow::DeviceFactory {
 public:
  absl::Status ListPhysicalDevices(std::vector<std::string>* devices) override {
    devices->push_back("/physical_device:CPU:0");
    return absl::OkStatus();
  }

  absl::Status CreateDevices(
      const tensorflow::SessionOptions& options, const std::string& name_prefix,
      std::vector<std::unique_ptr<tensorflow::Device>>* devices) override {
    int n = 1;
    auto iter = options.config.device_count().find("CPU");
    if (iter != options.config.device_count().end()) n = iter->second;
    for (int i = 0; i < n; ++i) {
      devices->push_back(std::make_unique<LmsCpuDevice>(
          options, name_prefix + "/device:CPU:" + std::to_string(i),
          g_allocator));
    }
    return absl::OkStatus();
  }
};

void SetError(const std::string& message, char* error, int error_len) {
  if (error != nullptr && error_len > 0) {
    std::snprintf(error, static_cast<size_t>(error_len), "%s", message.c_str());
  }
}

}  // namespace
}  // namespace tflms_tfcpu

extern "C" {

// Returns 0 on success; otherwise writes the reason to `error`.
// With lms == 0 the device and its allocator are the same but no tensor gets
// a movable buffer: stock TensorFlow's behaviour over the engine's BFC (the
// baseline tests compare allocation counts against).
// fixed_page_size > 0 selects the engine's fixed-address mode with pages of
// that many bytes (the add-on's mode: addresses never change, evicted pages
// are unmapped, so a read no pin covers faults). prefetch: 0 or 1 as asked;
// -1 resolves it as the GPU allocator the mode stands for resolves a program
// that never set it (lms_options.h): the patch's lms::PrefetchEnabled over
// GPUOptions with lms_prefetch_enabled unset, or with fixed addresses the
// add-on's kFixedAddressPrefetchEnabledDefault, TF_LMS_PREFETCH overriding
// either; off with lms == 0, where nothing moves. prefetch_guard: the
// engine's guard (EngineOptions::prefetch_guard), timing steps in real time.
int tflms_tfcpu_enable(int64_t device_memory, int64_t host_memory, int lms,
                       int defrag, int prefetch, int prefetch_guard,
                       int verify_moves, int verify_pins,
                       int64_t fixed_page_size, char* error, int error_len) {
  using namespace tflms_tfcpu;  // NOLINT
  std::lock_guard<std::mutex> lock(g_enable_mu);
  if (g_allocator != nullptr) {
    SetError("tflms.tfcpu is already enabled in this process", error,
             error_len);
    return 1;
  }
  if (device_memory < (1 << 20)) {
    SetError("device_memory must be at least 1 MiB", error, error_len);
    return 1;
  }
  if (lms != 0) {
    std::string hooks = InstallTensorHooks();
    if (!hooks.empty()) {
      SetError(hooks, error, error_len);
      return 1;
    }
  }
  tflms::SimOptions sim_options;
  sim_options.device_memory = static_cast<size_t>(device_memory);
  sim_options.store_data = true;
  auto device = std::make_unique<HostComputeDevice>(
      std::make_unique<tflms::SimDevice>(sim_options));
  HostComputeDevice* device_ptr = device.get();
  tflms::EngineOptions options;
  options.name = "tfcpu_lms";
  options.memory_limit = static_cast<size_t>(device_memory);
  // TensorFlow's GPU default (GPUOptions.allow_growth = false): one region
  // of the whole memory limit, taken on first use.
  options.allow_growth = false;
  options.host_memory_limit = static_cast<size_t>(host_memory);
  options.lms_enabled = lms != 0;
  options.defrag_enabled = defrag != 0;
  options.verify_moves = verify_moves != 0;
  options.verify_pins = verify_pins != 0;
  constexpr const char* kDevice = "tflms.tfcpu's CPU:0";
  if (prefetch >= 0) {
    options.prefetch_enabled = prefetch != 0;
  } else if (lms == 0) {
    options.prefetch_enabled = false;
  } else if (fixed_page_size > 0) {
    options.prefetch_enabled =
        tensorflow::lms::FixedAddressPrefetchEnabled(/*setting=*/-1, kDevice);
  } else {
    options.prefetch_enabled = tensorflow::lms::PrefetchEnabled(
        tensorflow::GPUOptions(), tensorflow::lms::kPrefetchEnabledDefault,
        kDevice);
  }
  options.prefetch_guard = prefetch_guard != 0;
  options.run_ahead_epochs = tensorflow::lms::RunAheadEpochs(kDevice);
  if (fixed_page_size > 0) {
    options.fixed_addresses = true;
    options.page_size = static_cast<size_t>(fixed_page_size);
    // Address space is cheap (host reservations): evicted buffers keep
    // theirs, so reserve far more than the device.
    options.virtual_address_bytes = static_cast<size_t>(device_memory) * 64;
  }
  auto allocator =
      tensorflow::lms::LmsAllocator::Create(std::move(device), options);
  if (!allocator.ok()) {
    SetError(std::string(allocator.status().message()), error, error_len);
    return 1;
  }
  // Lives as long as the process, like a GPU's allocator.
  g_allocator = allocator->release();
  g_device = device_ptr;
  g_prefetch_enabled = options.prefetch_enabled;
  tensorflow::DeviceFactory::Register(
      "CPU", std::make_unique<LmsCpuDeviceFactory>(), kFactoryPriority,
      /*is_pluggable_device=*/false);
  return 0;
}

// Whether the engine prefetches, as enable resolved it: 1 or 0; -1 before
// enable.
int tflms_tfcpu_prefetch_enabled() {
  using namespace tflms_tfcpu;  // NOLINT
  std::lock_guard<std::mutex> lock(g_enable_mu);
  if (g_allocator == nullptr) return -1;
  return g_prefetch_enabled ? 1 : 0;
}

// Rewrites the GOT of libraries loaded since enable (custom-op libraries).
int tflms_tfcpu_rehook() {
  using namespace tflms_tfcpu;  // NOLINT
  std::lock_guard<std::mutex> lock(g_enable_mu);
  if (g_allocator == nullptr) return 0;
  InstallTensorHooks();
  return PatchedSlots();
}

// "name value" lines of the engine's statistics into `out`; returns the
// length needed (call again with a larger buffer when it exceeds `len`).
int tflms_tfcpu_stats(char* out, int len) {
  using namespace tflms_tfcpu;  // NOLINT
  if (g_allocator == nullptr) return -1;
  std::string text;
  for (const auto& [name, value] : g_allocator->GetLmsStats().Items()) {
    text += name + " " + std::to_string(value) + "\n";
  }
  if (out != nullptr && len > 0) {
    std::snprintf(out, static_cast<size_t>(len), "%s", text.c_str());
  }
  return static_cast<int>(text.size()) + 1;
}

// Moves every inactive buffer to host memory now; returns the bytes moved or
// -1 on error.
int64_t tflms_tfcpu_reclaim_inactive() {
  using namespace tflms_tfcpu;  // NOLINT
  if (g_allocator == nullptr) return -1;
  absl::StatusOr<size_t> bytes = g_allocator->ReclaimInactive();
  return bytes.ok() ? static_cast<int64_t>(*bytes) : -1;
}

// Compacts device memory now; returns the bytes moved or -1 on error.
int64_t tflms_tfcpu_defragment() {
  using namespace tflms_tfcpu;  // NOLINT
  if (g_allocator == nullptr) return -1;
  absl::StatusOr<size_t> bytes = g_allocator->Defragment();
  return bytes.ok() ? static_cast<int64_t>(*bytes) : -1;
}

// Every later copy on the host-to-device stream sleeps this long first.
void tflms_tfcpu_delay_page_ins(int microseconds) {
  using namespace tflms_tfcpu;  // NOLINT
  if (g_device != nullptr) {
    g_device->sim()->DelayCopies(tflms::StreamKind::kHostToDevice,
                                 microseconds);
  }
}

// Both copy streams run at `bytes_per_second` in real time from now on (0:
// memcpy speed), so kernels wait for late page-ins as on a GPU.
void tflms_tfcpu_model_link(double bytes_per_second) {
  using namespace tflms_tfcpu;  // NOLINT
  if (g_device == nullptr) return;
  g_device->sim()->PaceCopies(tflms::StreamKind::kDeviceToHost,
                              bytes_per_second);
  g_device->sim()->PaceCopies(tflms::StreamKind::kHostToDevice,
                              bytes_per_second);
}

// Nanoseconds kernels spent blocked on the copies they were ordered after;
// -1 before enable.
int64_t tflms_tfcpu_kernel_wait_ns() {
  using namespace tflms_tfcpu;  // NOLINT
  return g_device == nullptr ? -1 : g_device->kernel_wait_ns();
}

// What TFE_TensorHandleDevicePointer does with the patch's hunk (20): the
// address of an EagerTensor's buffer escapes to Python (numpy views, DLPack),
// so it becomes unmovable, with its bytes resident. Returns 0, or -1 with the
// reason in `error`.
int tflms_tfcpu_make_unmovable(const PyObject* eager_tensor, char* error,
                               int error_len) {
  using namespace tflms_tfcpu;  // NOLINT
  if (g_allocator == nullptr) return 0;
  TFE_TensorHandle* h = EagerTensor_Handle(eager_tensor);
  if (h == nullptr) return 0;
  // Resolving a host tensor shares its buffer: `t` names the same bytes.
  TF_Status* status = TF_NewStatus();
  TF_Tensor* resolved = TFE_TensorHandleResolve(h, status);
  absl::Status s = absl::OkStatus();
  if (TF_GetCode(status) != TF_OK) {
    s = absl::InternalError(TF_Message(status));
  } else {
    tensorflow::Tensor t;
    s = tensorflow::TF_TensorToTensor(resolved, &t);
    if (s.ok()) s = tensorflow::MakeTensorUnmovable(t);
  }
  if (resolved != nullptr) TF_DeleteTensor(resolved);
  TF_DeleteStatus(status);
  if (!s.ok()) {
    SetError(std::string(s.message()), error, error_len);
    return -1;
  }
  return 0;
}

}  // extern "C"

namespace tflms_tfcpu {
namespace {

getbufferproc original_getbuffer = nullptr;

// numpy reads a CPU EagerTensor through the buffer protocol (before
// __array__): a zero-copy view, so the address escapes like a DLPack export.
int GetBufferOfUnmovable(PyObject* o, Py_buffer* view, int flags) {
  char error[512] = {0};
  if (tflms_tfcpu_make_unmovable(o, error, sizeof(error)) != 0) {
    // Python's symbols come from the interpreter at run time; the library is
    // linked with --no-undefined, so they are looked up, not linked.
    using SetString = void (*)(PyObject*, const char*);
    auto set_string =
        reinterpret_cast<SetString>(dlsym(RTLD_DEFAULT, "PyErr_SetString"));
    auto* runtime_error = static_cast<PyObject**>(
        dlsym(RTLD_DEFAULT, "PyExc_RuntimeError"));
    if (set_string != nullptr && runtime_error != nullptr) {
      set_string(*runtime_error, error);
    }
    return -1;
  }
  return original_getbuffer(o, view, flags);
}

}  // namespace
}  // namespace tflms_tfcpu

extern "C" {

// Routes EagerTensor's buffer protocol through MakeTensorUnmovable. `type` is
// the EagerTensor type object. Returns 0, or -1 if it has no buffer protocol.
int tflms_tfcpu_hook_buffer_protocol(PyObject* type) {
  using namespace tflms_tfcpu;  // NOLINT
  auto* t = reinterpret_cast<PyTypeObject*>(type);
  PyBufferProcs* procs = t->tp_as_buffer;
  if (procs == nullptr || procs->bf_getbuffer == nullptr) return -1;
  if (procs->bf_getbuffer == &GetBufferOfUnmovable) return 0;
  original_getbuffer = procs->bf_getbuffer;
  // The table may sit in relocated read-only data, like a GOT.
  if (!WritePointer(reinterpret_cast<void**>(&procs->bf_getbuffer),
                    reinterpret_cast<void*>(&GetBufferOfUnmovable))) {
    return -1;
  }
  return 0;
}

}  // extern "C"
