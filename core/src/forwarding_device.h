// Copyright 2026 The tflms Authors. Licensed under the Apache License 2.0.
//
// ForwardingDevice: a Device that passes every call to another one.
//
// A backend that changes one behaviour of an existing device derives from it
// and overrides just that: the tfcpu harness's HostComputeDevice (waiting on
// the compute stream blocks the kernel's thread), tests that hold a thread
// at a chosen call. It keeps the contract of device.h as long as the target
// does and the overrides do.
//
// Thread safety: as the target's; it holds no state of its own.
#ifndef TFLMS_CORE_SRC_FORWARDING_DEVICE_H_
#define TFLMS_CORE_SRC_FORWARDING_DEVICE_H_

#include <cstddef>

#include "tflms/device.h"

namespace tflms {

class ForwardingDevice : public Device {
 public:
  // `target` is not owned and must outlive this device.
  explicit ForwardingDevice(Device* target) : target_(target) {}

  const char* Name() const override { return target_->Name(); }
  void* AllocateDeviceMemory(size_t bytes, size_t alignment) override {
    return target_->AllocateDeviceMemory(bytes, alignment);
  }
  void FreeDeviceMemory(void* ptr, size_t bytes) override {
    target_->FreeDeviceMemory(ptr, bytes);
  }
  void* AllocateHostMemory(size_t bytes) override {
    return target_->AllocateHostMemory(bytes);
  }
  void FreeHostMemory(void* ptr, size_t bytes) override {
    target_->FreeHostMemory(ptr, bytes);
  }
  double NowSeconds() override { return target_->NowSeconds(); }
  void NoteLayoutLook(int64_t events, int64_t ranges_scanned) override {
    target_->NoteLayoutLook(events, ranges_scanned);
  }
  Stream* GetStream(StreamKind kind) override {
    return target_->GetStream(kind);
  }
  Status CopyDeviceToHost(Stream* stream, void* host_dst,
                          const void* device_src, size_t bytes) override {
    return target_->CopyDeviceToHost(stream, host_dst, device_src, bytes);
  }
  Status CopyHostToDevice(Stream* stream, void* device_dst,
                          const void* host_src, size_t bytes) override {
    return target_->CopyHostToDevice(stream, device_dst, host_src, bytes);
  }
  Status CopyDeviceToDevice(Stream* stream, void* device_dst,
                            const void* device_src, size_t bytes) override {
    return target_->CopyDeviceToDevice(stream, device_dst, device_src, bytes);
  }
  EventRef RecordEvent(Stream* stream, Status* status) override {
    return target_->RecordEvent(stream, status);
  }
  Status WaitEvent(Stream* stream, const EventRef& event) override {
    return target_->WaitEvent(stream, event);
  }
  Status SynchronizeEvent(const EventRef& event) override {
    return target_->SynchronizeEvent(event);
  }
  bool EventDone(const EventRef& event) override {
    return target_->EventDone(event);
  }
  Status ReadDeviceSync(void* host_dst, const void* device_src,
                        size_t bytes) override {
    return target_->ReadDeviceSync(host_dst, device_src, bytes);
  }
  Status WriteDeviceSync(void* device_dst, const void* host_src,
                         size_t bytes) override {
    return target_->WriteDeviceSync(device_dst, host_src, bytes);
  }
  size_t VmGranularity() const override { return target_->VmGranularity(); }
  Status ReserveAddressRange(size_t bytes, size_t page_size,
                             void** base) override {
    return target_->ReserveAddressRange(bytes, page_size, base);
  }
  Status ReleaseAddressRange(void* base, size_t bytes) override {
    return target_->ReleaseAddressRange(base, bytes);
  }
  Status MapPages(void* addr, size_t bytes) override {
    return target_->MapPages(addr, bytes);
  }
  Status UnmapPages(void* addr, size_t bytes) override {
    return target_->UnmapPages(addr, bytes);
  }

 protected:
  Device* target() const { return target_; }

 private:
  Device* const target_;
};

}  // namespace tflms

#endif  // TFLMS_CORE_SRC_FORWARDING_DEVICE_H_
