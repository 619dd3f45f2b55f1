// Copyright 2026 The tflms Authors. Licensed under the Apache License 2.0.
#include "cuda_device.h"

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
  explicit CudaStream(cudaStream_t s) : stream(s) {}
  ~CudaStream() override {
    if (stream != nullptr) cudaStreamDestroy(stream);
  }
  cudaStream_t stream;
};

class CudaDevice::CudaEvent : public Event {
 public:
  explicit CudaEvent(cudaEvent_t e) : event(e) {}
  ~CudaEvent() override { cudaEventDestroy(event); }
  cudaEvent_t event;
};

CudaDevice::CudaDevice(int ordinal) : ordinal_(ordinal) {}

CudaDevice::~CudaDevice() {
  cudaSetDevice(ordinal_);
  for (auto& s : streams_) {
    if (s) cudaStreamSynchronize(s->stream);
    s.reset();
  }
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
  cudaStream_t compute = streams_[0]->stream;
  TFLMS_RETURN_IF_ERROR(FromCuda(
      cudaMemcpyAsync(host_dst, device_src, bytes, cudaMemcpyDeviceToHost,
                      compute),
      "read"));
  return FromCuda(cudaStreamSynchronize(compute), "read synchronize");
}

Status CudaDevice::WriteDeviceSync(void* device_dst, const void* host_src,
                                   size_t bytes) {
  cudaSetDevice(ordinal_);
  cudaStream_t compute = streams_[0]->stream;
  TFLMS_RETURN_IF_ERROR(FromCuda(
      cudaMemcpyAsync(device_dst, host_src, bytes, cudaMemcpyHostToDevice,
                      compute),
      "write"));
  return FromCuda(cudaStreamSynchronize(compute), "write synchronize");
}

}  // namespace tflms
