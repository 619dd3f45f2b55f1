// Copyright 2026 The tflms Authors. Licensed under the Apache License 2.0.
//
// The training workload's kernels (training_workload.h) as CUDA kernels on
// the engine's compute stream: the caller's stream, handed to the engine
// with CudaDevice::UseComputeStream as TensorFlow's GPU device would hand its
// own. Errors are counted on the GPU and read once per Errors() call; a
// failed launch counts as an error too, so a run that launched nothing
// cannot pass.
#ifndef TFLMS_CORE_TESTS_CUDA_KERNELS_CUH_
#define TFLMS_CORE_TESTS_CUDA_KERNELS_CUH_

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

#include "training_workload.h"

namespace tflms {
namespace workload {

__global__ void FillKernel(uint32_t* w, size_t n, uint32_t seed) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    w[i] = Pattern(seed, i);
  }
}

__global__ void CheckKernel(const uint32_t* w, size_t n, uint32_t seed,
                            unsigned long long* errors) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  unsigned long long bad = 0;
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    bad += w[i] != Pattern(seed, i);
  }
  if (bad != 0) atomicAdd(errors, bad);
}

__device__ inline uint64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// One thread spinning: the stream is busy for `ns`, the copy engines and
// the other multiprocessors stay free (as in a layer that overlaps copies).
__global__ void SpinKernel(uint64_t ns) {
  const uint64_t start = GlobalTimerNs();
  while (GlobalTimerNs() - start < ns) {
  }
}

class CudaKernels : public Kernels {
 public:
  // `stream` is the engine's compute stream; not owned.
  explicit CudaKernels(cudaStream_t stream) : stream_(stream) {
    if (cudaMalloc(&errors_, sizeof(*errors_)) != cudaSuccess ||
        cudaMemset(errors_, 0, sizeof(*errors_)) != cudaSuccess) {
      ++launch_failures_;
      errors_ = nullptr;
    }
  }
  ~CudaKernels() override {
    if (errors_ != nullptr) cudaFree(errors_);
  }

  void Fill(void* p, size_t bytes, uint32_t seed) override {
    FillKernel<<<Blocks(bytes), kThreads, 0, stream_>>>(
        static_cast<uint32_t*>(p), bytes / 4, seed);
    Launched("fill");
  }
  void Check(const void* p, size_t bytes, uint32_t seed) override {
    if (errors_ == nullptr) return;
    CheckKernel<<<Blocks(bytes), kThreads, 0, stream_>>>(
        static_cast<const uint32_t*>(p), bytes / 4, seed, errors_);
    Launched("check");
  }
  void Busy(double seconds) override {
    if (seconds <= 0) return;
    SpinKernel<<<1, 1, 0, stream_>>>(static_cast<uint64_t>(seconds * 1e9));
    Launched("spin");
  }
  void Synchronize() override {
    const cudaError_t e = cudaStreamSynchronize(stream_);
    if (e != cudaSuccess) {
      std::fprintf(stderr, "synchronize: %s\n", cudaGetErrorString(e));
      ++launch_failures_;
    }
  }
  int64_t Errors() override {
    unsigned long long n = 0;
    Synchronize();  // cudaMemcpy below does not wait for a non-blocking stream
    if (errors_ == nullptr ||
        cudaMemcpy(&n, errors_, sizeof(n), cudaMemcpyDeviceToHost) !=
            cudaSuccess) {
      return launch_failures_ + 1;
    }
    return static_cast<int64_t>(n) + launch_failures_;
  }

 private:
  static constexpr int kThreads = 256;
  static unsigned Blocks(size_t bytes) {
    const size_t words = bytes / 4;
    const size_t blocks = (words + kThreads - 1) / kThreads;
    return static_cast<unsigned>(blocks < 2048 ? (blocks ? blocks : 1) : 2048);
  }
  void Launched(const char* what) {
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) {
      if (launch_failures_ < 5) {
        std::fprintf(stderr, "%s launch: %s\n", what, cudaGetErrorString(e));
      }
      ++launch_failures_;
    }
  }

  cudaStream_t stream_;
  unsigned long long* errors_ = nullptr;
  int64_t launch_failures_ = 0;
};

}  // namespace workload
}  // namespace tflms

#endif  // TFLMS_CORE_TESTS_CUDA_KERNELS_CUH_
