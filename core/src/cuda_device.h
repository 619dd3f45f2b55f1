// Copyright 2026 The tflms Authors. Licensed under the Apache License 2.0.
//
// CudaDevice: tflms::Device over the CUDA runtime, for running the engine on a
// real GPU outside TensorFlow (C++ tests, benchmarks on a GPU machine).
// Inside TensorFlow the adapter in tf/ implements Device over StreamExecutor
// instead; this backend is the reference for what that adapter must do.
//
//   * device memory: cudaMalloc per region (the BFC arena pools it);
//   * host memory:   cudaHostAlloc (page-locked, so copies are real DMA);
//   * streams:       a compute stream (created, or the caller's: see
//                    UseComputeStream), and dedicated non-blocking D2H and H2D
//                    streams;
//   * events:        cudaEventDisableTiming events, one per RecordEvent.
// A failed asynchronous copy surfaces as the error of the next
// cudaEventSynchronize on that stream, which is the contract device.h asks.
//
//   * virtual memory (fixed-address mode): CUDA virtual memory management,
//     cuMemAddressReserve for the range; each page is its own physical
//     allocation (cuMemCreate, pinned device memory on this GPU) mapped with
//     its own cuMemMap, because cuMemUnmap must cover exactly what one
//     cuMemMap mapped and the engine unmaps page by page; cuMemSetAccess
//     after every map (an unmapped range is a bare reservation again).
//     Unmapped pages' physical handles are kept in a pool and mapped again
//     elsewhere instead of released and recreated (cuMemCreate is the slow
//     call); they still hold GPU memory, which is what the engine's page
//     budget counts. The driver entry points are resolved through the
//     runtime (cudaGetDriverEntryPointByVersion), so nothing links against
//     libcuda directly. Unmapping does not wait for streams: the engine
//     proves the pages idle first (device.h).
//
// Built with TFLMS_CUDA_LINKED_DRIVER (the stock-wheel add-on), the driver
// entry points are linked instead: TensorFlow's libtensorflow_framework
// exports lazily loading stubs for them, and its runtime stubs lack
// cudaGetDriverEntryPointByVersion.
//
// Thread safety: the CUDA runtime is thread-safe; this class keeps no mutable
// state after construction besides the device selection, which every method
// re-applies (cudaSetDevice) because CUDA's current device is per thread,
// the compute stream (an atomic pointer, set once by UseComputeStream), and
// the virtual memory bookkeeping, guarded by vm_mu_.
#ifndef TFLMS_CORE_SRC_CUDA_DEVICE_H_
#define TFLMS_CORE_SRC_CUDA_DEVICE_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "tflms/device.h"

namespace tflms {

class CudaDevice : public Device {
 public:
  // Creates streams on `device_ordinal`. nullptr with *status on failure
  // (no GPU, driver missing).
  static std::unique_ptr<CudaDevice> Create(int device_ordinal,
                                            Status* status);
  ~CudaDevice() override;

  // Makes `cuda_stream` (a cudaStream_t the caller owns and keeps alive as
  // long as this device, e.g. TensorFlow's compute stream for this GPU) the
  // compute stream: the kernels that use the engine's buffers run there, so
  // page-outs must wait for it and it must wait for page-ins. Work already
  // ordered on the previous compute stream stays ordered before it. Once
  // only: InvalidArgument on a second call. Not concurrently with itself
  // (its one caller is the GPU device that owns the stream, after Init);
  // concurrent users of the device see the old or the new stream, both valid.
  Status UseComputeStream(void* cuda_stream);

  const char* Name() const override { return "cuda"; }
  void* AllocateDeviceMemory(size_t bytes, size_t alignment) override;
  void FreeDeviceMemory(void* ptr, size_t bytes) override;
  void* AllocateHostMemory(size_t bytes) override;
  void FreeHostMemory(void* ptr, size_t bytes) override;
  Stream* GetStream(StreamKind kind) override;
  Status CopyDeviceToHost(Stream* stream, void* host_dst,
                          const void* device_src, size_t bytes) override;
  Status CopyHostToDevice(Stream* stream, void* device_dst,
                          const void* host_src, size_t bytes) override;
  Status CopyDeviceToDevice(Stream* stream, void* device_dst,
                            const void* device_src, size_t bytes) override;
  EventRef RecordEvent(Stream* stream, Status* status) override;
  Status WaitEvent(Stream* stream, const EventRef& event) override;
  Status SynchronizeEvent(const EventRef& event) override;
  bool EventDone(const EventRef& event) override;
  Status ReadDeviceSync(void* host_dst, const void* device_src,
                        size_t bytes) override;
  Status WriteDeviceSync(void* device_dst, const void* host_src,
                         size_t bytes) override;

  size_t VmGranularity() const override { return vm_granularity_; }
  Status ReserveAddressRange(size_t bytes, size_t page_size,
                             void** base) override;
  Status ReleaseAddressRange(void* base, size_t bytes) override;
  Status MapPages(void* addr, size_t bytes) override;
  Status UnmapPages(void* addr, size_t bytes) override;

  class CudaStream;
  class CudaEvent;
  struct Vmm;  // driver entry points

 private:
  explicit CudaDevice(int ordinal);
  Status Init();
  Status InitVmm();  // leaves vm_granularity_ 0 when VMM is unsupported

  const int ordinal_;
  std::unique_ptr<CudaStream> streams_[3];
  // The caller's compute stream (UseComputeStream), not destroyed with us.
  std::unique_ptr<CudaStream> external_compute_;
  std::atomic<CudaStream*> compute_{nullptr};  // streams_[0] or the caller's
  std::unique_ptr<Vmm> vmm_;
  size_t vm_granularity_ = 0;  // constant after Init

  std::mutex vm_mu_;
  size_t vm_page_ = 0;  // guarded by vm_mu_
  // Mapped page address -> its physical handle; unmapped handles, kept for
  // reuse. Handles are CUmemGenericAllocationHandle (unsigned long long).
  std::unordered_map<uintptr_t, unsigned long long> vm_mapped_;  // vm_mu_
  std::vector<unsigned long long> vm_pool_;                      // vm_mu_
};

}  // namespace tflms

#endif  // TFLMS_CORE_SRC_CUDA_DEVICE_H_
