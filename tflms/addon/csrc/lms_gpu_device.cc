// Copyright 2026 The tflms Authors. Licensed under the Apache License 2.0.
//
// The LMS add-on for the stock TensorFlow GPU wheel: Large Model Support
// without rebuilding TensorFlow.
//
// What the patch does with hunks in TensorFlow's GPU runtime, this library
// does from outside, through what libtensorflow_framework.so.2 exports
// (shared/reference/stock-wheel-addon.md; docs/addon.md):
//
//   * GPUProcessState: a subclass installed as the process's singleton
//     before anything asks for it. With LMS on, its GetGPUAllocator returns
//     the patch's LmsAllocator (common_runtime/lms) over the engine's CUDA
//     backend in fixed-address mode; with LMS off it is the stock one.
//   * The GPU device factory: a BaseGPUDeviceFactory subclass registered
//     above the stock factory's priority (which replaces, and deletes, the
//     stock factory), creating LmsGpuDevice, a BaseGPUDevice that does what
//     the stock GPUDevice does plus the patch's pin sites: Compute,
//     ComputeAsync and CopyTensorInSameDevice call the shared pin rule
//     (common_runtime/lms/kernel_pins.h, the same code the patch's hunks
//     call), and the device context it hands out pins both sides of every
//     copy.
//   * Tensor's allocating constructors: redirected to the patch's movable
//     buffers (tflms/tfcpu/csrc/tensor_hooks.cc, shared with the CPU
//     harness), which is what the patch's tensor.cc hunk does.
//
// Why fixed addresses: on the stock wheel a tensor's data pointer is read
// inline by every compiled kernel and copied into slices, queued kernels and
// DMA descriptors, so a buffer must keep its address for life. The engine's
// fixed-address mode gives that: addresses come from a reserved CUDA virtual
// range, and evicting a buffer unmaps its physical pages after its bytes
// reached pinned host memory; a page-in maps pages back at the same address.
//
// Life cycle: tflms_addon_install() runs once, when Python imports
// tflms.addon, after TensorFlow's libraries are loaded and before its
// devices exist. LMS settings (tflms_addon_set_options) are read when a
// GPU's allocator is created, i.e. when TensorFlow creates its devices.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "cuda_device.h"
#include "tensorflow/core/common_runtime/device_factory.h"
#include "tensorflow/core/common_runtime/gpu/gpu_device.h"
#include "tensorflow/core/common_runtime/gpu/gpu_id_manager.h"
#include "tensorflow/core/common_runtime/gpu/gpu_process_state.h"
#include "tensorflow/core/common_runtime/gpu_device_context.h"
#include "tensorflow/core/common_runtime/lms/kernel_pins.h"
#include "tensorflow/core/common_runtime/lms/lms_allocator.h"
#include "tensorflow/core/common_runtime/lms/lms_options.h"
#include "tensorflow/core/framework/allocator.h"
#include "tensorflow/core/framework/device_base.h"
#include "tensorflow/core/framework/movable_tensor_buffer.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/platform/logging.h"
#include "tensorflow/core/protobuf/config.pb.h"
#include "tensorflow/core/public/session_options.h"
#include "tensorflow/core/public/version.h"
#include "tf_version.h"  // after version.h: refuses an unsupported TensorFlow
#include "tflms/engine.h"
#include "xla/stream_executor/stream.h"

// The patch's tensor.h hunk keeps TensorBuffer's layout: the stock wheel's
// compiled code and ours must agree on where a buffer's data pointer is.
static_assert(sizeof(tensorflow::TensorBuffer) == 24,
              "TensorBuffer layout differs from the stock wheel's");

namespace tflms_tfcpu {
// tflms/tfcpu/csrc/tensor_hooks.cc (shared with the CPU harness).
std::string InstallTensorHooks();
int PatchedSlots();
}  // namespace tflms_tfcpu

namespace tflms_addon {
namespace {

using tensorflow::Allocator;
using tensorflow::AllocatorAttributes;
using tensorflow::BaseGPUDevice;
using tensorflow::Device;
using tensorflow::DeviceLocality;
using tensorflow::GPUDeviceContext;
using tensorflow::GPUOptions;
using tensorflow::GPUProcessState;
using tensorflow::OpKernelContext;
using tensorflow::SessionOptions;
using tensorflow::StatusCallback;
using tensorflow::Tensor;
using tensorflow::lms::LmsAllocator;

// The stock GPU factory registers at 210 (GPUCompatibleCPU is 70): a higher
// priority makes DeviceFactory::Register keep ours and delete the stock one.
constexpr int kFactoryPriority = 220;
// TensorFlow's default for TF_GPU_HOST_MEM_LIMIT_IN_MB (64 GiB).
constexpr int64_t kDefaultHostLimitMb = int64_t{1} << 16;
// CUDA's mapping granularity on current GPUs; raised to the device's own
// granularity when that is larger.
constexpr size_t kPageSize = size_t{2} << 20;

// The settings Python sets before devices exist; read when a GPU's allocator
// is created. Guarded by g_mu, like everything below.
struct Settings {
  bool lms_enabled = false;
  bool defrag_enabled = false;
  int64_t lms_limit = 0;
  // -1: never set from Python, so
  // tensorflow::lms::kFixedAddressPrefetchEnabledDefault applies (as the
  // patch's unset lms_prefetch_enabled does kPrefetchEnabledDefault); 0 or 1:
  // set.
  int prefetch_enabled = -1;
  int prefetch_lookahead = 0;  // 0: the engine's default
};

// Lock order: g_mu is a leaf. It is never held while calling into
// TensorFlow code that may take GPUProcessState's own lock, nor across a
// CUDA call that could block for long (allocator creation runs under it
// once per GPU, at device creation, which TensorFlow serializes anyway).
std::mutex g_mu;
Settings g_settings;           // guarded by g_mu
bool g_settings_used = false;  // guarded by g_mu: an allocator was asked for
bool g_hooks_installed = false;  // guarded by g_mu
std::string g_last_error;        // guarded by g_mu
// TensorFlow GPU id -> its LMS allocator. Entries live as long as the
// process, like TensorFlow's own GPU allocators (owned by the process state).
std::map<int, LmsAllocator*> g_allocators;  // guarded by g_mu
// The LMS allocator's engine device, per GPU: for attaching the stream.
std::map<int, tflms::CudaDevice*> g_cuda_devices;  // guarded by g_mu

// Prefetch as the patch's lms_options.cc resolves the fixed-address mode's
// setting: the Python setting, or kFixedAddressPrefetchEnabledDefault where
// Python never set it, TF_LMS_PREFETCH overriding either.
bool PrefetchEnabled(int setting, int tf_device_id) {
  return tensorflow::lms::FixedAddressPrefetchEnabled(
      setting, absl::StrCat("GPU:", tf_device_id));
}

size_t HostLimitBytes() {
  int64_t mb = kDefaultHostLimitMb;
  if (const char* env = std::getenv("TF_GPU_HOST_MEM_LIMIT_IN_MB")) {
    char* end = nullptr;
    const long long v = std::strtoll(env, &end, 10);
    if (end != env && v > 0) mb = v;
  }
  return static_cast<size_t>(mb) << 20;
}

// The GPU process state: LMS allocators when LMS is on, else the stock ones.
class LmsGpuProcessState : public GPUProcessState {
 public:
  LmsGpuProcessState() = default;

  Allocator* GetGPUAllocator(
      const GPUOptions& options, tsl::TfDeviceId tf_device_id,
      size_t total_bytes,
      const std::vector<tsl::TfDeviceId>& peer_gpu_ids) override {
    {
      std::lock_guard<std::mutex> lock(g_mu);
      g_settings_used = true;
      auto it = g_allocators.find(tf_device_id.value());
      if (it != g_allocators.end()) return it->second;
      // total_bytes == 0: a lookup of an allocator made earlier (the
      // one-argument overload), which for a stock GPU is the base's.
      if (g_settings.lms_enabled && total_bytes > 0) {
        LmsAllocator* lms = CreateLocked(options, tf_device_id, total_bytes);
        if (lms != nullptr) return lms;
      }
    }
    return GPUProcessState::GetGPUAllocator(options, tf_device_id, total_bytes,
                                            peer_gpu_ids);
  }

 private:
  // REQUIRES: g_mu held. Returns nullptr (the reason logged and kept for
  // Python) when LMS cannot run on this GPU; TensorFlow then gets the stock
  // allocator, so the program still runs, without LMS.
  LmsAllocator* CreateLocked(const GPUOptions& options,
                             tsl::TfDeviceId tf_device_id,
                             size_t total_bytes) {
    auto fail = [&](const std::string& why) -> LmsAllocator* {
      g_last_error = absl::StrCat("GPU:", tf_device_id.value(), ": ", why);
      LOG(ERROR) << "Large Model Support (tflms.addon) is off for GPU:"
                 << tf_device_id.value() << ": " << why
                 << ". The stock GPU allocator is used instead.";
      return nullptr;
    };
    if (!g_hooks_installed) {
      std::string hooks = tflms_tfcpu::InstallTensorHooks();
      if (!hooks.empty()) return fail(hooks);
      g_hooks_installed = true;
    }
    tsl::PlatformDeviceId platform_id;
    absl::Status s = tensorflow::GpuIdManager::TfToPlatformDeviceId(
        tf_device_id, &platform_id);
    if (!s.ok()) return fail(std::string(s.message()));
    tflms::Status status;
    std::unique_ptr<tflms::CudaDevice> device =
        tflms::CudaDevice::Create(platform_id.value(), &status);
    if (device == nullptr) return fail(status.ToString());
    if (device->VmGranularity() == 0) {
      return fail(
          "the add-on needs CUDA virtual memory management (tensors must keep "
          "their addresses on the stock wheel), which this GPU or driver "
          "lacks; use the patch (tflms patch) on this machine");
    }
    tflms::CudaDevice* device_ptr = device.get();
    tflms::EngineOptions engine;
    engine.name = absl::StrCat("GPU_", tf_device_id.value(), "_lms");
    engine.memory_limit = total_bytes;
    engine.allow_growth = options.allow_growth();
    engine.fragmentation_fraction =
        options.experimental().internal_fragmentation_fraction();
    engine.lms_enabled = true;
    engine.defrag_enabled = g_settings.defrag_enabled;  // a no-op here
    engine.lms_limit = g_settings.lms_limit < 0
                           ? 0
                           : static_cast<size_t>(g_settings.lms_limit);
    if (engine.lms_limit >= total_bytes) engine.lms_limit = 0;
    engine.prefetch_enabled =
        PrefetchEnabled(g_settings.prefetch_enabled, tf_device_id.value());
    engine.run_ahead_epochs = tensorflow::lms::RunAheadEpochs(
        absl::StrCat("GPU:", tf_device_id.value()));
    if (g_settings.prefetch_lookahead > 0) {
      engine.prefetch_lookahead = g_settings.prefetch_lookahead;
    }
    engine.host_memory_limit = HostLimitBytes();
    engine.fixed_addresses = true;
    const size_t g = device->VmGranularity();
    engine.page_size = kPageSize % g == 0 ? kPageSize : g;
    // Evicted buffers keep their addresses: the range must hold device and
    // host bytes of live buffers. Address space is cheap on a GPU.
    const size_t pages =
        (std::max(total_bytes * 4, total_bytes + engine.host_memory_limit) +
         engine.page_size - 1) /
        engine.page_size;
    engine.virtual_address_bytes = pages * engine.page_size;
    auto created = LmsAllocator::Create(std::move(device), engine);
    if (!created.ok()) return fail(std::string(created.status().message()));
    LmsAllocator* lms = created->release();  // lives as long as the process
    g_allocators[tf_device_id.value()] = lms;
    g_cuda_devices[tf_device_id.value()] = device_ptr;
    LOG(INFO) << "Large Model Support (tflms.addon) is on for GPU:"
              << tf_device_id.value() << ": " << (total_bytes >> 20)
              << " MiB of device memory in " << (engine.page_size >> 20)
              << " MiB pages, up to " << (engine.host_memory_limit >> 20)
              << " MiB of pinned host memory (TF_GPU_HOST_MEM_LIMIT_IN_MB), "
              << "prefetch "
              << (engine.prefetch_enabled
                      ? absl::StrCat("on, ", engine.prefetch_lookahead,
                                     " tensor uses ahead")
                      : std::string("off"))
              << ".";
    return lms;
  }
};

// The GPU device context: the stock one, plus pins on the GPU side of every
// copy until the copy's done callback (the patch's hunk in
// gpu_device_context's copies). Host tensors are never movable, so pinning
// them is a no-op.
class LmsGpuDeviceContext : public GPUDeviceContext {
 public:
  using GPUDeviceContext::GPUDeviceContext;

  void CopyCPUTensorToDevice(const Tensor* cpu_tensor, Device* device,
                             Tensor* device_tensor, StatusCallback done,
                             bool sync_dst_compute) const override {
    if (!tensorflow::lms::PinForCopy({device_tensor}, &done)) return;
    GPUDeviceContext::CopyCPUTensorToDevice(
        cpu_tensor, device, device_tensor, std::move(done), sync_dst_compute);
  }

  void CopyDeviceTensorToCPU(const Tensor* device_tensor,
                             absl::string_view edge_name, Device* device,
                             Tensor* cpu_tensor, StatusCallback done) override {
    if (!tensorflow::lms::PinForCopy({device_tensor}, &done)) return;
    GPUDeviceContext::CopyDeviceTensorToCPU(device_tensor, edge_name, device,
                                            cpu_tensor, std::move(done));
  }

  void CopyTensorInSameDevice(const Tensor* input_tensor, Device* device,
                              Tensor* output_tensor,
                              StatusCallback done) const override {
    if (!tensorflow::lms::PinForCopy({input_tensor, output_tensor}, &done)) {
      return;
    }
    GPUDeviceContext::CopyTensorInSameDevice(input_tensor, device,
                                             output_tensor, std::move(done));
  }
};

// What the stock GPUDevice is (its GetAllocator), plus the pin sites.
class LmsGpuDevice : public BaseGPUDevice {
 public:
  LmsGpuDevice(const SessionOptions& options, const std::string& name,
               tensorflow::Bytes memory_limit, const DeviceLocality& locality,
               tsl::TfDeviceId tf_device_id,
               const std::string& physical_device_desc,
               Allocator* gpu_allocator, Allocator* cpu_allocator)
      : BaseGPUDevice(options, name, memory_limit, locality, tf_device_id,
                      physical_device_desc, gpu_allocator, cpu_allocator,
                      /*sync_every_op=*/false),
        gpu_options_(options.config.gpu_options()),
        tf_device_id_(tf_device_id.value()) {}

  ~LmsGpuDevice() override {
    if (context_ != nullptr) context_->Unref();
  }

  Allocator* GetAllocator(AllocatorAttributes attr) override {
    if (!attr.on_host()) return gpu_allocator_;
    if (attr.gpu_compatible() || gpu_options_.force_gpu_compatible()) {
      return GPUProcessState::singleton()->GetGpuHostAllocator(gpu_options_,
                                                               /*numa_node=*/0);
    }
    return cpu_allocator_;
  }

  void Compute(tensorflow::OpKernel* op_kernel,
               OpKernelContext* context) override {
    tensorflow::lms::KernelPins pins(context);
    if (!pins.ok()) return;
    BaseGPUDevice::Compute(op_kernel, context);
  }

  void ComputeAsync(tensorflow::AsyncOpKernel* op_kernel,
                    OpKernelContext* context,
                    tensorflow::AsyncOpKernel::DoneCallback done) override {
    if (!tensorflow::lms::PinAsyncKernelInputs(context, &done)) return;
    BaseGPUDevice::ComputeAsync(op_kernel, context, std::move(done));
  }

  void CopyTensorInSameDevice(const Tensor* input_tensor, Tensor* output_tensor,
                              const tensorflow::DeviceContext* device_context,
                              StatusCallback done) override {
    if (!tensorflow::lms::PinForCopy({input_tensor, output_tensor}, &done)) {
      return;
    }
    BaseGPUDevice::CopyTensorInSameDevice(input_tensor, output_tensor,
                                          device_context, std::move(done));
  }

  // After Init (the streams exist): hands the compute stream to the engine
  // and puts the pinning device context where every copy finds it. Only for
  // a device whose allocator is LMS: otherwise the device stays stock.
  absl::Status AttachLms() {
    tflms::CudaDevice* cuda = nullptr;
    {
      std::lock_guard<std::mutex> lock(g_mu);
      auto it = g_allocators.find(tf_device_id_);
      if (it == g_allocators.end() || it->second != gpu_allocator_) {
        return absl::OkStatus();
      }
      cuda = g_cuda_devices[tf_device_id_];
    }
    // Page-outs wait for the kernels on TensorFlow's compute stream, and
    // kernels there wait for page-ins.
    tflms::Status s =
        cuda->UseComputeStream(compute_stream()->platform_specific_handle().stream);
    // Several TensorFlow devices may share a GPU's streams (virtual GPUs
    // each have their own allocator, so this is the first attach for it).
    if (!s.ok()) return absl::InternalError(s.ToString());
    const tensorflow::DeviceBase::AcceleratorDeviceInfo* stock =
        tensorflow_accelerator_device_info();
    if (stock == nullptr || stock->default_context == nullptr) {
      return absl::InternalError("the GPU device has no device context");
    }
    auto* gpu = static_cast<GPUDeviceContext*>(stock->default_context);
    const int d2d = std::max(
        1, gpu_options_.experimental().num_dev_to_dev_copy_streams());
    absl::InlinedVector<stream_executor::Stream*, 4UL> d2d_streams;
    for (int i = 0; i < d2d; ++i) {
      d2d_streams.push_back(gpu->device_to_device_stream(i));
    }
    context_ = new LmsGpuDeviceContext(
        gpu->stream_id(), gpu->stream(), gpu->host_to_device_stream(),
        gpu->device_to_host_stream(), d2d_streams,
        gpu->host_memory_allocator());
    // Executors, eager copies and kernels find the device context here
    // (OpKernelContext::op_device_context falls back to it).
    info_ = *stock;
    info_.default_context = context_;
    set_tensorflow_accelerator_device_info(&info_);
    return absl::OkStatus();
  }

 private:
  const GPUOptions gpu_options_;
  const int tf_device_id_;
  LmsGpuDeviceContext* context_ = nullptr;  // one reference owned
  AcceleratorDeviceInfo info_;
};

class LmsGpuDeviceFactory : public tensorflow::BaseGPUDeviceFactory {
 public:
  absl::Status CreateDevices(
      const SessionOptions& options, const std::string& name_prefix,
      std::vector<std::unique_ptr<Device>>* devices) override {
    const size_t first = devices->size();
    absl::Status s =
        BaseGPUDeviceFactory::CreateDevices(options, name_prefix, devices);
    if (!s.ok()) return s;
    for (size_t i = first; i < devices->size(); ++i) {
      auto* d = dynamic_cast<LmsGpuDevice*>((*devices)[i].get());
      if (d == nullptr) continue;
      s = d->AttachLms();
      if (!s.ok()) return s;
    }
    return absl::OkStatus();
  }

 private:
  std::unique_ptr<BaseGPUDevice> CreateGPUDevice(
      const SessionOptions& options, const std::string& name,
      tensorflow::Bytes memory_limit, const DeviceLocality& dev_locality,
      tsl::TfDeviceId tf_device_id, const std::string& physical_device_desc,
      Allocator* gpu_allocator, Allocator* cpu_allocator) override {
    return std::make_unique<LmsGpuDevice>(
        options, name, memory_limit, dev_locality, tf_device_id,
        physical_device_desc, gpu_allocator, cpu_allocator);
  }
};

void SetError(const std::string& message, char* error, int error_len) {
  if (error != nullptr && error_len > 0) {
    std::snprintf(error, static_cast<size_t>(error_len), "%s", message.c_str());
  }
}

LmsAllocator* FindAllocator(int tf_gpu_id) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_allocators.find(tf_gpu_id);
  return it == g_allocators.end() ? nullptr : it->second;
}

}  // namespace
}  // namespace tflms_addon

extern "C" {

// Installs the GPU process state and the device factory. Returns 0, or 1
// with the reason in `error` (TensorFlow already created its GPU state).
int tflms_addon_install(char* error, int error_len) {
  using namespace tflms_addon;  // NOLINT
  static std::once_flag once;
  static int result = 0;
  static std::string reason;
  std::call_once(once, [] {
    auto* state = new LmsGpuProcessState();  // the process's, never freed
    // The singleton is fixed by its first call: if TensorFlow already made
    // its own, ours is ignored (and leaked, harmlessly).
    if (GPUProcessState::singleton(state) != state) {
      result = 1;
      reason =
          "TensorFlow's GPU process state already exists: import tflms.addon "
          "before TensorFlow creates its devices (before the first op)";
      return;
    }
    tensorflow::DeviceFactory::Register(
        "GPU", std::make_unique<LmsGpuDeviceFactory>(), kFactoryPriority,
        /*is_pluggable_device=*/false);
  });
  if (result != 0) SetError(reason, error, error_len);
  return result;
}

// LMS settings for GPUs whose allocators are created from now on;
// prefetch_enabled -1 leaves prefetch to its default. Returns 1
// when an allocator was already asked for (the settings in force stay).
int tflms_addon_set_options(int lms_enabled, int defrag_enabled,
                            int64_t lms_limit, int prefetch_enabled,
                            int prefetch_lookahead) {
  using namespace tflms_addon;  // NOLINT
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_settings_used) return 1;
  g_settings.lms_enabled = lms_enabled != 0;
  g_settings.defrag_enabled = defrag_enabled != 0;
  g_settings.lms_limit = lms_limit;
  g_settings.prefetch_enabled =
      prefetch_enabled < 0 ? -1 : (prefetch_enabled != 0 ? 1 : 0);
  g_settings.prefetch_lookahead =
      prefetch_lookahead < 0 ? 0 : prefetch_lookahead;
  return 0;
}

// tensorflow::lms::kFixedAddressPrefetchEnabledDefault, for
// get_lms_prefetch_enabled while Python has not set prefetch: the header's
// constant, not a Python copy.
int tflms_addon_prefetch_default() {
  return tensorflow::lms::kFixedAddressPrefetchEnabledDefault ? 1 : 0;
}

// 1 when a GPU allocator created now would prefetch: the settings resolved
// exactly as CreateLocked resolves them (the default where
// Python left prefetch unset, TF_LMS_PREFETCH over either). Lets the tests
// check the resolution on machines without a GPU.
int tflms_addon_prefetch_resolved() {
  using namespace tflms_addon;  // NOLINT
  std::lock_guard<std::mutex> lock(g_mu);
  return PrefetchEnabled(g_settings.prefetch_enabled, -1) ? 1 : 0;
}

// 1 once TensorFlow asked for a GPU allocator (settings are then in force).
int tflms_addon_settings_in_force() {
  using namespace tflms_addon;  // NOLINT
  std::lock_guard<std::mutex> lock(g_mu);
  return g_settings_used ? 1 : 0;
}

// Why LMS could not be set up on a GPU ("" if it could); returns the length
// needed.
int tflms_addon_last_error(char* out, int len) {
  using namespace tflms_addon;  // NOLINT
  std::lock_guard<std::mutex> lock(g_mu);
  SetError(g_last_error, out, len);
  return static_cast<int>(g_last_error.size()) + 1;
}

// "name value" lines of a GPU's LMS statistics into `out`; returns the
// length needed, or -1 when that GPU has no LMS allocator.
int tflms_addon_stats(int tf_gpu_id, char* out, int len) {
  using namespace tflms_addon;  // NOLINT
  LmsAllocator* a = FindAllocator(tf_gpu_id);
  if (a == nullptr) return -1;
  std::string text;
  for (const auto& [name, value] : a->GetLmsStats().Items()) {
    text += name + " " + std::to_string(value) + "\n";
  }
  SetError(text, out, len);
  return static_cast<int>(text.size()) + 1;
}

// Moves every inactive tensor of a GPU to host memory now; the bytes moved,
// -1 without an LMS allocator, -2 on error.
int64_t tflms_addon_reclaim_inactive(int tf_gpu_id) {
  using namespace tflms_addon;  // NOLINT
  LmsAllocator* a = FindAllocator(tf_gpu_id);
  if (a == nullptr) return -1;
  absl::StatusOr<size_t> bytes = a->ReclaimInactive();
  return bytes.ok() ? static_cast<int64_t>(*bytes) : -2;
}

// Changes a GPU's LMS limit at run time; 0, -1 without an LMS allocator, or
// -2 with the reason in `error`.
int tflms_addon_set_lms_limit(int tf_gpu_id, int64_t bytes, char* error,
                              int error_len) {
  using namespace tflms_addon;  // NOLINT
  LmsAllocator* a = FindAllocator(tf_gpu_id);
  if (a == nullptr) return -1;
  absl::Status s = a->SetLmsLimit(static_cast<size_t>(bytes));
  if (!s.ok()) {
    SetError(std::string(s.message()), error, error_len);
    return -2;
  }
  return 0;
}

// What is installed, for tests on machines without a GPU: bit 0, the "GPU"
// device factory TensorFlow uses is ours; bit 1, so is the GPU process state.
int tflms_addon_self_check() {
  using namespace tflms_addon;  // NOLINT
  int bits = 0;
  if (dynamic_cast<LmsGpuDeviceFactory*>(
          tensorflow::DeviceFactory::GetFactory("GPU")) != nullptr) {
    bits |= 1;
  }
  if (dynamic_cast<LmsGpuProcessState*>(GPUProcessState::singleton()) !=
      nullptr) {
    bits |= 2;
  }
  return bits;
}

// Redirects Tensor's constructors in libraries loaded since LMS started
// (custom-op libraries); returns the GOT slots rewritten so far.
int tflms_addon_rehook() {
  using namespace tflms_addon;  // NOLINT
  std::lock_guard<std::mutex> lock(g_mu);
  if (!g_hooks_installed) return 0;
  tflms_tfcpu::InstallTensorHooks();
  return tflms_tfcpu::PatchedSlots();
}

}  // extern "C"
