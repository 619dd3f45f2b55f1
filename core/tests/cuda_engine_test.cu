// Copyright 2026 The tflms Authors. Licensed under the Apache License 2.0.
//
// The engine over CudaDevice on a real GPU: an oversubscribed working set is
// written, paged out and in, defragmented, and read back byte for byte; then
// again in fixed-address mode (CUDA virtual memory management), checking that
// every buffer comes back at its own address.
// Without a GPU it prints why and exits 0 ("skipped"), so `make cuda-test`
// builds and links everywhere nvcc exists.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "cuda_device.h"
#include "tflms/engine.h"

int main() {
  using namespace tflms;
  Status status;
  std::unique_ptr<CudaDevice> device = CudaDevice::Create(0, &status);
  if (!device) {
    std::printf("skipped: %s\n", status.ToString().c_str());
    return 0;
  }
  EngineOptions options;
  options.memory_limit = size_t{64} << 20;
  options.host_memory_limit = size_t{1} << 30;
  options.defrag_enabled = true;
  options.verify_moves = true;
  Engine engine(device.get(), options);
  if (!(status = engine.Init()).ok()) {
    std::printf("init failed: %s\n", status.ToString().c_str());
    return 1;
  }
  const size_t size = size_t{4} << 20;
  std::vector<Buffer*> buffers;
  std::vector<std::string> data;
  for (int i = 0; i < 128; ++i) {  // 512 MiB live on a 64 MiB device
    Buffer* b = engine.AllocateBuffer(size, false, &status);
    if (b == nullptr) {
      std::printf("allocate %d failed: %s\n", i, status.ToString().c_str());
      return 1;
    }
    data.emplace_back(size, static_cast<char>(i * 7 + 1));
    if (!(status = engine.WriteBuffer(b, 0, data.back().data(), size)).ok()) {
      std::printf("write failed: %s\n", status.ToString().c_str());
      return 1;
    }
    buffers.push_back(b);
  }
  int corrupt = 0;
  std::string got(size, '\0');
  for (size_t i = 0; i < buffers.size(); ++i) {
    status = engine.ReadBuffer(buffers[i], 0, &got[0], size);
    if (!status.ok() || got != data[i]) ++corrupt;
  }
  size_t moved = 0;
  engine.Defragment(&moved);
  EngineStats st = engine.GetStats();
  for (Buffer* b : buffers) engine.FreeBuffer(b);
  std::printf("cuda engine: %d corrupt, %lld bytes reclaimed, %lld paged in\n",
              corrupt, static_cast<long long>(st.bytes_reclaimed),
              static_cast<long long>(st.bytes_paged_in));
  const bool invariants_ok = engine.CheckInvariants().ok();

  // Fixed-address mode over CUDA virtual memory management: the same
  // oversubscribed working set, every address the same after eviction.
  int fixed_bad = 0;
  if (device->VmGranularity() == 0) {
    std::printf("fixed-address mode skipped: no CUDA VMM on this device\n");
  } else {
    EngineOptions fo = options;
    fo.fixed_addresses = true;
    fo.page_size = std::max<size_t>(device->VmGranularity(), size_t{2} << 20);
    Engine fixed(device.get(), fo);
    if (!(status = fixed.Init()).ok()) {
      std::printf("fixed init failed: %s\n", status.ToString().c_str());
      return 1;
    }
    std::vector<Buffer*> fb;
    std::vector<void*> addrs;
    for (int i = 0; i < 64; ++i) {  // 256 MiB live on 64 MiB of pages
      void* addr = nullptr;
      Buffer* b = fixed.AllocateBuffer(size, false, &status, &addr);
      if (b == nullptr) {
        std::printf("fixed allocate %d failed: %s\n", i,
                    status.ToString().c_str());
        return 1;
      }
      if (!fixed.WriteBuffer(b, 0, data[i].data(), size).ok()) ++fixed_bad;
      fb.push_back(b);
      addrs.push_back(addr);
    }
    for (int round = 0; round < 2; ++round) {
      for (size_t i = 0; i < fb.size(); ++i) {
        void* p = nullptr;
        if (!fixed.Pin(fb[i], &p).ok() || p != addrs[i]) ++fixed_bad;
        fixed.Unpin(fb[i]);
        status = fixed.ReadBuffer(fb[i], 0, &got[0], size);
        if (!status.ok() || got != data[i]) ++fixed_bad;
      }
    }
    EngineStats fs = fixed.GetStats();
    if (!fixed.CheckInvariants().ok()) ++fixed_bad;
    for (Buffer* b : fb) fixed.FreeBuffer(b);
    std::printf("cuda fixed-address engine: %d bad, %lld pages mapped, %lld "
                "unmapped, %lld bytes reclaimed\n",
                fixed_bad, static_cast<long long>(fs.num_pages_mapped),
                static_cast<long long>(fs.num_pages_unmapped),
                static_cast<long long>(fs.bytes_reclaimed));
  }
  corrupt += fixed_bad;
  std::printf("%d passed, %d failed\n", corrupt == 0 ? 1 : 0,
              corrupt == 0 ? 0 : 1);
  return corrupt == 0 && invariants_ok ? 0 : 1;
}
