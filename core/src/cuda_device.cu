// Copyright 2026 The tflms Authors. Licensed under the Apache License 2.0.
#include "cuda_device.h"

#include <cuda.h>  // driver API types only; entry points come at run time
#include <cuda_runtime.h>

#include <string>

namespace tflms {
namespace {

Status FromCuda(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return Status::Ok();
  return Internal(std::string(what) + ": " + cudaGetErrorString(err));
}

}  // namespace

class CudaDevice::CudaStream : public Stream {
 public:
  explicit CudaStream(cudaStream_t s, bool owned = true)
      : stream(s), owned(owned) {}
  ~CudaStream() override {
    if (stream != nullptr && owned) cudaStreamDestroy(stream);
  }
  cudaStream_t stream;
  const bool owned;  // false: the caller's stream (UseComputeStream)
};

class CudaDevice::CudaEvent : public Event {
 public:
  explicit CudaEvent(cudaEvent_t e) : event(e) {}
  ~CudaEvent() override { cudaEventDestroy(event); }
  cudaEvent_t event;
};

struct CudaDevice::Vmm {
  decltype(&cuMemAddressReserve) address_reserve = nullptr;
  decltype(&cuMemAddressFree) address_free = nullptr;
  decltype(&cuMemCreate) create = nullptr;
  decltype(&cuMemRelease) release = nullptr;
  decltype(&cuMemMap) map = nullptr;
  decltype(&cuMemUnmap) unmap = nullptr;
  decltype(&cuMemSetAccess) set_access = nullptr;
  decltype(&cuMemGetAllocationGranularity) granularity = nullptr;
  CUmemAllocationProp prop = {};
  CUmemAccessDesc access = {};
};

namespace {

Status FromDriver(CUresult r, const char* what) {
  if (r == CUDA_SUCCESS) return Status::Ok();
  const Code code = r == CUDA_ERROR_OUT_OF_MEMORY ? Code::kResourceExhausted
                                                   : Code::kInternal;
  return Status(code, std::string(what) + ": CUDA driver error " +
                          std::to_string(static_cast<int>(r)));
}

#ifdef TFLMS_CUDA_LINKED_DRIVER
// The library links the driver's entry points (see cuda_device.h).
#define TFLMS_RESOLVE(name, fn) (*(fn) = &name, true)
#else
#define TFLMS_RESOLVE(name, fn) Resolve(#name, fn)
#endif

template <typename F>
[[maybe_unused]] bool Resolve(const char* name, F* fn) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult q;
  if (cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault,
                                       &q) != cudaSuccess ||
      q != cudaDriverEntryPointSuccess || p == nullptr) {
    cudaGetLastError();
    return false;
  }
  *fn = reinterpret_cast<F>(p);
  return true;
}

}  // namespace

CudaDevice::CudaDevice(int ordinal) : ordinal_(ordinal) {}

CudaDevice::~CudaDevice() {
  cudaSetDevice(ordinal_);
  for (auto& s : streams_) {
    if (s) cudaStreamSynchronize(s->stream);
    s.reset();
  }
  if (external_compute_) cudaStreamSynchronize(external_compute_->stream);
  std::lock_guard<std::mutex> lock(vm_mu_);
  if (vmm_) {
    for (const auto& m : vm_mapped_) {
      vmm_->unmap(static_cast<CUdeviceptr>(m.first), vm_page_);
      vm_pool_.push_back(m.second);
    }
    for (unsigned long long h : vm_pool_) vmm_->release(h);
  }
}

Status CudaDevice::InitVmm() {
  auto v = std::make_unique<Vmm>();
  if (!TFLMS_RESOLVE(cuMemAddressReserve, &v->address_reserve) ||
      !TFLMS_RESOLVE(cuMemAddressFree, &v->address_free) ||
      !TFLMS_RESOLVE(cuMemCreate, &v->create) ||
      !TFLMS_RESOLVE(cuMemRelease, &v->release) ||
      !TFLMS_RESOLVE(cuMemMap, &v->map) ||
      !TFLMS_RESOLVE(cuMemUnmap, &v->unmap) ||
      !TFLMS_RESOLVE(cuMemSetAccess, &v->set_access) ||
      !TFLMS_RESOLVE(cuMemGetAllocationGranularity, &v->granularity)) {
    return Status::Ok();  // no VMM: fixed_addresses will be refused
  }
  decltype(&cuDeviceGet) device_get = nullptr;
  decltype(&cuDeviceGetAttribute) get_attribute = nullptr;
  CUdevice dev = 0;
  int supported = 0;
  if (!TFLMS_RESOLVE(cuDeviceGet, &device_get) ||
      !TFLMS_RESOLVE(cuDeviceGetAttribute, &get_attribute) ||
      device_get(&dev, ordinal_) != CUDA_SUCCESS ||
      get_attribute(&supported,
                    CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                    dev) != CUDA_SUCCESS ||
      !supported) {
    return Status::Ok();
  }
  v->prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  v->prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  v->prop.location.id = ordinal_;
  v->access.location = v->prop.location;
  v->access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  size_t g = 0;
  TFLMS_RETURN_IF_ERROR(FromDriver(
      v->granularity(&g, &v->prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
      "cuMemGetAllocationGranularity"));
  vm_granularity_ = g;
  vmm_ = std::move(v);
  return Status::Ok();
}

Status CudaDevice::ReserveAddressRange(size_t bytes, size_t page_size,
                                       void** base) {
  *base = nullptr;
  if (!vmm_) return Unimplemented("this GPU or driver has no CUDA VMM");
  if (page_size == 0 || page_size % vm_granularity_ != 0 ||
      bytes % page_size != 0) {
    return InvalidArgument("reserve: page size must be a multiple of the "
                           "allocation granularity");
  }
  cudaSetDevice(ordinal_);
  CUdeviceptr p = 0;
  TFLMS_RETURN_IF_ERROR(FromDriver(
      vmm_->address_reserve(&p, bytes, page_size, 0, 0),
      "cuMemAddressReserve"));
  std::lock_guard<std::mutex> lock(vm_mu_);
  vm_page_ = page_size;
  *base = reinterpret_cast<void*>(p);
  return Status::Ok();
}

Status CudaDevice::ReleaseAddressRange(void* base, size_t bytes) {
  if (!vmm_) return Unimplemented("no CUDA VMM");
  cudaSetDevice(ordinal_);
  return FromDriver(
      vmm_->address_free(reinterpret_cast<CUdeviceptr>(base), bytes),
      "cuMemAddressFree");
}

Status CudaDevice::MapPages(void* addr, size_t bytes) {
  if (!vmm_) return Unimplemented("no CUDA VMM");
  cudaSetDevice(ordinal_);
  std::lock_guard<std::mutex> lock(vm_mu_);
  const uintptr_t start = reinterpret_cast<uintptr_t>(addr);
  if (vm_page_ == 0 || bytes == 0 || bytes % vm_page_ != 0) {
    return InvalidArgument("map: not whole pages");
  }
  std::vector<uintptr_t> done;  // mapped by this call, undone on failure
  Status status;
  for (uintptr_t a = start; a < start + bytes; a += vm_page_) {
    if (vm_mapped_.count(a) != 0) {
      status = InvalidArgument("map: page already mapped");
      break;
    }
    CUmemGenericAllocationHandle h;
    if (!vm_pool_.empty()) {
      h = vm_pool_.back();
      vm_pool_.pop_back();
    } else {
      status = FromDriver(vmm_->create(&h, vm_page_, &vmm_->prop, 0),
                          "cuMemCreate");
      if (!status.ok()) break;
    }
    status = FromDriver(vmm_->map(static_cast<CUdeviceptr>(a), vm_page_, 0,
                                  h, 0),
                        "cuMemMap");
    if (!status.ok()) {
      vm_pool_.push_back(h);
      break;
    }
    vm_mapped_[a] = h;
    done.push_back(a);
  }
  if (status.ok()) {
    // One call for the run: each page is its own mapping, access is set on
    // the range they cover.
    status = FromDriver(vmm_->set_access(static_cast<CUdeviceptr>(start),
                                         bytes, &vmm_->access, 1),
                        "cuMemSetAccess");
  }
  if (!status.ok()) {
    for (uintptr_t a : done) {
      vmm_->unmap(static_cast<CUdeviceptr>(a), vm_page_);
      vm_pool_.push_back(vm_mapped_[a]);
      vm_mapped_.erase(a);
    }
  }
  return status;
}

Status CudaDevice::UnmapPages(void* addr, size_t bytes) {
  if (!vmm_) return Unimplemented("no CUDA VMM");
  cudaSetDevice(ordinal_);
  std::lock_guard<std::mutex> lock(vm_mu_);
  const uintptr_t start = reinterpret_cast<uintptr_t>(addr);
  if (vm_page_ == 0 || bytes == 0 || bytes % vm_page_ != 0) {
    return InvalidArgument("unmap: not whole pages");
  }
  for (uintptr_t a = start; a < start + bytes; a += vm_page_) {
    if (vm_mapped_.count(a) == 0) {
      return InvalidArgument("unmap: page not mapped");
    }
  }
  std::vector<uintptr_t> done;
  Status status;
  for (uintptr_t a = start; a < start + bytes; a += vm_page_) {
    status = FromDriver(vmm_->unmap(static_cast<CUdeviceptr>(a), vm_page_),
                        "cuMemUnmap");
    if (!status.ok()) break;
    done.push_back(a);
  }
  if (!status.ok()) {
    // All or nothing: a physical handle keeps its bytes while unmapped, so
    // mapping the same handles back restores the pages exactly.
    for (uintptr_t a : done) {
      vmm_->map(static_cast<CUdeviceptr>(a), vm_page_, 0, vm_mapped_[a], 0);
      vmm_->set_access(static_cast<CUdeviceptr>(a), vm_page_, &vmm_->access,
                       1);
    }
    return status;
  }
  for (uintptr_t a : done) {
    vm_pool_.push_back(vm_mapped_[a]);
    vm_mapped_.erase(a);
  }
  return Status::Ok();
}

std::unique_ptr<CudaDevice> CudaDevice::Create(int device_ordinal,
                                               Status* status) {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || device_ordinal < 0 || device_ordinal >= count) {
    *status = Unavailable("no CUDA device " + std::to_string(device_ordinal) +
                          " (" + cudaGetErrorString(err) + ", " +
                          std::to_string(count) + " device(s))");
    return nullptr;
  }
  std::unique_ptr<CudaDevice> device(new CudaDevice(device_ordinal));
  *status = device->Init();
  if (!status->ok()) return nullptr;
  return device;
}

Status CudaDevice::Init() {
  TFLMS_RETURN_IF_ERROR(FromCuda(cudaSetDevice(ordinal_), "cudaSetDevice"));
  for (int i = 0; i < 3; ++i) {
    cudaStream_t s = nullptr;
    TFLMS_RETURN_IF_ERROR(FromCuda(
        cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream"));
    streams_[i] = std::make_unique<CudaStream>(s);
  }
  compute_.store(streams_[0].get(), std::memory_order_release);
  return InitVmm();
}

Status CudaDevice::UseComputeStream(void* cuda_stream) {
  if (cuda_stream == nullptr || external_compute_ != nullptr) {
    return InvalidArgument("UseComputeStream: once, with a stream");
  }
  cudaSetDevice(ordinal_);
  auto external = std::make_unique<CudaStream>(
      static_cast<cudaStream_t>(cuda_stream), /*owned=*/false);
  // What was ordered on our own compute stream stays ahead of the new one.
  Status status;
  EventRef before = RecordEvent(streams_[0].get(), &status);
  if (!status.ok()) return status;
  TFLMS_RETURN_IF_ERROR(WaitEvent(external.get(), before));
  compute_.store(external.get(), std::memory_order_release);
  external_compute_ = std::move(external);
  return Status::Ok();
}

void* CudaDevice::AllocateDeviceMemory(size_t bytes, size_t) {
  cudaSetDevice(ordinal_);
  void* ptr = nullptr;
  if (cudaMalloc(&ptr, bytes) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error so later calls work
    return nullptr;
  }
  return ptr;
}

void CudaDevice::FreeDeviceMemory(void* ptr, size_t) {
  cudaSetDevice(ordinal_);
  cudaFree(ptr);
}

void* CudaDevice::AllocateHostMemory(size_t bytes) {
  void* ptr = nullptr;
  if (cudaHostAlloc(&ptr, bytes, cudaHostAllocPortable) != cudaSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  return ptr;
}

void CudaDevice::FreeHostMemory(void* ptr, size_t) { cudaFreeHost(ptr); }

Stream* CudaDevice::GetStream(StreamKind kind) {
  if (kind == StreamKind::kCompute) {
    return compute_.load(std::memory_order_acquire);
  }
  return streams_[static_cast<int>(kind)].get();
}

Status CudaDevice::CopyDeviceToHost(Stream* stream, void* host_dst,
                                    const void* device_src, size_t bytes) {
  cudaSetDevice(ordinal_);
  return FromCuda(
      cudaMemcpyAsync(host_dst, device_src, bytes, cudaMemcpyDeviceToHost,
                      static_cast<CudaStream*>(stream)->stream),
      "device-to-host copy");
}

Status CudaDevice::CopyHostToDevice(Stream* stream, void* device_dst,
                                    const void* host_src, size_t bytes) {
  cudaSetDevice(ordinal_);
  return FromCuda(
      cudaMemcpyAsync(device_dst, host_src, bytes, cudaMemcpyHostToDevice,
                      static_cast<CudaStream*>(stream)->stream),
      "host-to-device copy");
}

Status CudaDevice::CopyDeviceToDevice(Stream* stream, void* device_dst,
                                      const void* device_src, size_t bytes) {
  cudaSetDevice(ordinal_);
  return FromCuda(
      cudaMemcpyAsync(device_dst, device_src, bytes, cudaMemcpyDeviceToDevice,
                      static_cast<CudaStream*>(stream)->stream),
      "device-to-device copy");
}

EventRef CudaDevice::RecordEvent(Stream* stream, Status* status) {
  cudaSetDevice(ordinal_);
  cudaEvent_t e = nullptr;
  *status = FromCuda(cudaEventCreateWithFlags(&e, cudaEventDisableTiming),
                     "cudaEventCreate");
  if (!status->ok()) return nullptr;
  auto event = std::make_shared<CudaEvent>(e);
  *status = FromCuda(
      cudaEventRecord(e, static_cast<CudaStream*>(stream)->stream),
      "cudaEventRecord");
  if (!status->ok()) return nullptr;
  return event;
}

Status CudaDevice::WaitEvent(Stream* stream, const EventRef& event) {
  cudaSetDevice(ordinal_);
  return FromCuda(
      cudaStreamWaitEvent(static_cast<CudaStream*>(stream)->stream,
                          static_cast<CudaEvent*>(event.get())->event, 0),
      "cudaStreamWaitEvent");
}

Status CudaDevice::SynchronizeEvent(const EventRef& event) {
  cudaSetDevice(ordinal_);
  return FromCuda(
      cudaEventSynchronize(static_cast<CudaEvent*>(event.get())->event),
      "cudaEventSynchronize");
}

bool CudaDevice::EventDone(const EventRef& event) {
  cudaSetDevice(ordinal_);
  return cudaEventQuery(static_cast<CudaEvent*>(event.get())->event) !=
         cudaErrorNotReady;
}

Status CudaDevice::ReadDeviceSync(void* host_dst, const void* device_src,
                                  size_t bytes) {
  cudaSetDevice(ordinal_);
  cudaStream_t compute = compute_.load(std::memory_order_acquire)->stream;
  TFLMS_RETURN_IF_ERROR(FromCuda(
      cudaMemcpyAsync(host_dst, device_src, bytes, cudaMemcpyDeviceToHost,
                      compute),
      "read"));
  return FromCuda(cudaStreamSynchronize(compute), "read synchronize");
}

Status CudaDevice::WriteDeviceSync(void* device_dst, const void* host_src,
                                   size_t bytes) {
  cudaSetDevice(ordinal_);
  cudaStream_t compute = compute_.load(std::memory_order_acquire)->stream;
  TFLMS_RETURN_IF_ERROR(FromCuda(
      cudaMemcpyAsync(device_dst, host_src, bytes, cudaMemcpyHostToDevice,
                      compute),
      "write"));
  return FromCuda(cudaStreamSynchronize(compute), "write synchronize");
}

}  // namespace tflms
