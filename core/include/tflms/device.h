// Copyright 2026 The tflms Authors. Licensed under the Apache License 2.0.
//
// The engine's view of an accelerator: memory, streams, events, copies.
//
// This is the only place the engine touches hardware. Backends:
//   * SimDevice (sim_device.h): device memory is a host arena, each stream is
//     a worker thread, copies are memcpy. It also keeps a *modelled* clock per
//     stream (link bandwidth, latency, compute time) so the planner predicts
//     step times with the same engine code that runs inside TensorFlow.
//   * CudaDevice (cuda_device.h): cudaMalloc / cudaHostAlloc /
//     cudaMemcpyAsync on dedicated streams, ordered with cudaEvents.
//   * Inside TensorFlow the adapter in tf/ implements Device over
//     StreamExecutor.
//
// Contract every backend keeps:
//   * Work enqueued on one stream runs in order.
//   * An Event records "everything enqueued on that stream so far". Waiting
//     for it on another stream (WaitEvent) orders later work on that stream
//     after it without blocking the host; SynchronizeEvent blocks the host.
//   * A copy that fails poisons the events recorded after it on that stream:
//     SynchronizeEvent returns the copy's error. This is how the engine learns
//     that a page-out failed, and why it never frees a chunk before the event
//     that proves its bytes reached the host has been synchronized OK.
//   * All methods are thread-safe.
//
// Virtual memory (optional; the engine's fixed-address mode needs it, see
// engine.h). A backend that offers it reserves an address range with no
// memory behind it and backs pages of it with physical memory on demand:
//   * ReserveAddressRange fixes the page size of the range (a multiple of
//     VmGranularity()); every later MapPages/UnmapPages names whole pages
//     of it.
//   * MapPages backs each page of [addr, addr + bytes) with its own
//     physical page, so ANY page the engine mapped can later be unmapped on
//     its own (CUDA's cuMemUnmap must cover exactly what one cuMemMap
//     mapped; mapping page by page is what makes per-page unmapping legal).
//     All or nothing: on failure no page of the call stays mapped. A page
//     already mapped is an error (kInvalidArgument).
//   * UnmapPages discards the bytes and makes the pages inaccessible again
//     (an access faults). All or nothing as far as the backend can make it;
//     the caller must have proven that no queued work still touches them
//     (unmapping does not wait for streams).
//   * Physical pages come from the device's memory; MapPages fails with
//     kResourceExhausted when it has none left.
// The defaults return kUnimplemented, so backends without it still compile
// and the engine refuses fixed_addresses at Init with that message.
#ifndef TFLMS_CORE_DEVICE_H_
#define TFLMS_CORE_DEVICE_H_

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>

#include "tflms/status.h"

namespace tflms {

// A point in a stream's work queue. Backends subclass it.
class Event {
 public:
  virtual ~Event() = default;
};

using EventRef = std::shared_ptr<Event>;

class Stream {
 public:
  virtual ~Stream() = default;
};

enum class StreamKind { kCompute = 0, kDeviceToHost = 1, kHostToDevice = 2 };

class Device {
 public:
  virtual ~Device() = default;

  virtual const char* Name() const = 0;

  // Device memory for allocator regions (the BFC "sub-allocator"). Returns
  // nullptr when the device refuses; the allocator then backs off.
  virtual void* AllocateDeviceMemory(size_t bytes, size_t alignment) = 0;
  virtual void FreeDeviceMemory(void* ptr, size_t bytes) = 0;

  // Page-locked host memory that the copy streams can DMA from/to.
  virtual void* AllocateHostMemory(size_t bytes) = 0;
  virtual void FreeHostMemory(void* ptr, size_t bytes) = 0;

  virtual Stream* GetStream(StreamKind kind) = 0;

  // Asynchronous copies, enqueued on `stream`.
  virtual Status CopyDeviceToHost(Stream* stream, void* host_dst,
                                  const void* device_src, size_t bytes) = 0;
  virtual Status CopyHostToDevice(Stream* stream, void* device_dst,
                                  const void* host_src, size_t bytes) = 0;
  virtual Status CopyDeviceToDevice(Stream* stream, void* device_dst,
                                    const void* device_src, size_t bytes) = 0;

  // Records an event on `stream`; nullptr with *status set on failure.
  virtual EventRef RecordEvent(Stream* stream, Status* status) = 0;
  // Later work on `stream` runs after `event`. Does not block the host.
  virtual Status WaitEvent(Stream* stream, const EventRef& event) = 0;
  // Blocks the calling thread until `event` has completed; returns the error
  // of any failed work before it on its stream.
  virtual Status SynchronizeEvent(const EventRef& event) = 0;
  // True once `event` has completed (successfully or not).
  virtual bool EventDone(const EventRef& event) = 0;

  // Synchronous host access to device memory for callers outside kernels
  // (Python's read/write, tests). Runs after all work already enqueued on the
  // compute stream.
  virtual Status ReadDeviceSync(void* host_dst, const void* device_src,
                                size_t bytes) = 0;
  virtual Status WriteDeviceSync(void* device_dst, const void* host_src,
                                 size_t bytes) = 0;

  // The host's clock in seconds, for timing training steps (the prefetch
  // guard, prefetch_guard.cc): a steady clock. The simulated device answers
  // with its modelled host time, so that the planner's replays time steps
  // as the host of the GPU they model would.
  virtual double NowSeconds() {
    return std::chrono::duration<double>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }

  // Host work of the engine's own that a modelled device charges to its
  // host clock: one layout look (EngineOptions::layout_lookahead) on the
  // thread that pinned, which modelled `events` step events and scanned
  // `ranges_scanned` free ranges for best fits. A real device ignores it;
  // its host's clock runs by itself.
  virtual void NoteLayoutLook(int64_t events, int64_t ranges_scanned) {
    (void)events;
    (void)ranges_scanned;
  }

  // ---- Virtual memory (optional) ----
  // Smallest page size the backend can map (0: no virtual memory support).
  virtual size_t VmGranularity() const { return 0; }
  virtual Status ReserveAddressRange(size_t bytes, size_t page_size,
                                     void** base) {
    (void)bytes;
    (void)page_size;
    *base = nullptr;
    return Unimplemented(std::string(Name()) +
                         " has no virtual memory management (needed for "
                         "fixed_addresses)");
  }
  // Every page must be unmapped before the range is released.
  virtual Status ReleaseAddressRange(void* base, size_t bytes) {
    (void)base;
    (void)bytes;
    return Unimplemented("no virtual memory management");
  }
  virtual Status MapPages(void* addr, size_t bytes) {
    (void)addr;
    (void)bytes;
    return Unimplemented("no virtual memory management");
  }
  virtual Status UnmapPages(void* addr, size_t bytes) {
    (void)addr;
    (void)bytes;
    return Unimplemented("no virtual memory management");
  }
};

}  // namespace tflms

#endif  // TFLMS_CORE_DEVICE_H_
