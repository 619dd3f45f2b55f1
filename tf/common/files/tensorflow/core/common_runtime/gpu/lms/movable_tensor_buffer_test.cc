/* Copyright 2026 The TensorFlow Authors. All Rights Reserved.

Licensed under the Apache License, Version 2.0 (the "License");
you may not use this file except in compliance with the License.
You may obtain a copy of the License at

    http://www.apache.org/licenses/LICENSE-2.0

Unless required by applicable law or agreed to in writing, software
distributed under the License is distributed on an "AS IS" BASIS,
WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
See the License for the specific language governing permissions and
limitations under the License.
==============================================================================*/

// MovableTensorBuffer and the pin protocol, over a host-memory movable
// allocator that moves every unpinned buffer on its next pin (the worst case
// the LMS allocator is allowed), so any use of a stale address shows.

#include "tensorflow/core/framework/movable_tensor_buffer.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "tensorflow/core/framework/allocator.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/framework/types.pb.h"
#include "tensorflow/core/platform/test.h"

// Tensor requires EIGEN_MAX_ALIGN_BYTES alignment, as the LMS engine gives.
inline void* Alloc64(size_t n) {
  return std::aligned_alloc(64, (n + 63) / 64 * 64);
}

namespace tensorflow {
namespace {

// As strict as the LMS engine: freeing a pinned buffer or unpinning one that
// is not pinned is counted as a violation, and every test expects none.
class MovingAllocator : public Allocator, public MovableAllocator {
 public:
  struct Block {
    void* ptr;
    size_t size;
    int pins;
    bool unmovable;
  };

  MovingAllocator() { RegisterMovableAllocator(this, this); }
  ~MovingAllocator() override {
    UnregisterMovableAllocator(this);
    EXPECT_EQ(violations_, 0);
  }

  std::string Name() override { return "moving"; }
  void* AllocateRaw(size_t alignment, size_t num_bytes) override {
    return Alloc64(num_bytes);
  }
  void DeallocateRaw(void* ptr) override { std::free(ptr); }
  void* AllocateMovable(size_t alignment, size_t num_bytes,
                        const AllocationAttributes& attr,
                        void** data) override {
    absl::MutexLock lock(&mu_);
    auto* b = new Block{Alloc64(num_bytes), num_bytes, 1, false};
    *data = b->ptr;
    ++live_;
    return b;
  }
  void DeallocateMovable(void* handle) override {
    absl::MutexLock lock(&mu_);
    auto* b = static_cast<Block*>(handle);
    if (b->pins != 0) ++violations_;  // The engine refuses this.
    std::free(b->ptr);
    delete b;
    --live_;
  }
  absl::Status PinMovable(void* handle, void** data) override {
    absl::MutexLock lock(&mu_);
    auto* b = static_cast<Block*>(handle);
    if (b->pins == 0 && !b->unmovable) Move(b);
    ++b->pins;
    *data = b->ptr;
    return absl::OkStatus();
  }
  void UnpinMovable(void* handle) override {
    absl::MutexLock lock(&mu_);
    auto* b = static_cast<Block*>(handle);
    if (b->pins <= 0) ++violations_;
    --b->pins;
  }
  absl::Status MakeUnmovable(void* handle, void** data) override {
    absl::MutexLock lock(&mu_);
    auto* b = static_cast<Block*>(handle);
    if (b->pins == 0 && !b->unmovable) Move(b);
    b->unmovable = true;
    *data = b->ptr;
    return absl::OkStatus();
  }
  size_t MovableSize(const void* handle) const override {
    return static_cast<const Block*>(handle)->size;
  }

  int live() {
    absl::MutexLock lock(&mu_);
    return live_;
  }

 private:
  void Move(Block* b) {
    void* fresh = Alloc64(b->size);
    std::memcpy(fresh, b->ptr, b->size);
    std::memset(b->ptr, 0xAB, b->size);  // Stale readers see garbage.
    std::free(b->ptr);
    b->ptr = fresh;
  }

  absl::Mutex mu_;
  int live_ = 0;
  int violations_ = 0;
};

Tensor Iota(Allocator* a, int n) {
  Tensor t(a, DT_INT32, TensorShape({n}));
  auto flat = t.flat<int32_t>();
  for (int i = 0; i < n; ++i) flat(i) = i;
  return t;
}

TEST(MovableTensorBufferTest, PlainBytesTypesGetMovableBuffers) {
  MovingAllocator a;
  Tensor t(&a, DT_FLOAT, TensorShape({4}));
  ASSERT_NE(MovableTensorBufferUtil::Get(t), nullptr);
  EXPECT_EQ(a.live(), 1);
  Tensor s(&a, DT_STRING, TensorShape({2}));
  EXPECT_EQ(MovableTensorBufferUtil::Get(s), nullptr);
  EXPECT_EQ(a.live(), 1);
}

TEST(MovableTensorBufferTest,
     CreatorKeepsTheAddressUntilTheFirstConsumerIsDone) {
  MovingAllocator a;
  Tensor t = Iota(&a, 64);
  const void* created_at = t.data();
  {
    ScopedTensorPins pins;
    ASSERT_TRUE(pins.Pin(t).ok());
    // Pinned twice (creator and consumer): nothing may move it.
    EXPECT_EQ(t.data(), created_at);
  }
  // The consumer was the first: the creation pin is gone, so the next pin
  // moves the buffer, and the tensor sees the new address and the old bytes.
  ScopedTensorPins pins;
  ASSERT_TRUE(pins.Pin(t).ok());
  EXPECT_NE(t.data(), created_at);
  auto flat = t.flat<int32_t>();
  for (int i = 0; i < 64; ++i) EXPECT_EQ(flat(i), i);
}

TEST(MovableTensorBufferTest, CopiesShareOnePinState) {
  MovingAllocator a;
  Tensor t = Iota(&a, 16);
  Tensor alias = t;  // Shares the buffer.
  {
    ScopedTensorPins release_creation;
    ASSERT_TRUE(release_creation.Pin(t).ok());
  }
  ScopedTensorPins pins;
  ASSERT_TRUE(pins.Pin(alias).ok());
  EXPECT_EQ(t.data(), alias.data());
  EXPECT_EQ(t.flat<int32_t>()(15), 15);
}

TEST(MovableTensorBufferTest, EscapedAddressesNeverMove) {
  MovingAllocator a;
  Tensor t = Iota(&a, 8);
  {
    ScopedTensorPins release_creation;
    ASSERT_TRUE(release_creation.Pin(t).ok());
  }
  ASSERT_TRUE(MakeTensorUnmovable(t).ok());
  const void* escaped = t.data();
  for (int round = 0; round < 3; ++round) {
    ScopedTensorPins pins;
    ASSERT_TRUE(pins.Pin(t).ok());
    EXPECT_EQ(t.data(), escaped);
  }
}

TEST(MovableTensorBufferTest, SlicingKeepsTheRootInPlace) {
  MovingAllocator a;
  Tensor t(&a, DT_INT32, TensorShape({4, 2}));
  for (int i = 0; i < 8; ++i) t.flat<int32_t>()(i) = i;
  Tensor row = t.Slice(2, 3);
  const void* root_at = t.data();
  {
    ScopedTensorPins release_creation;
    ASSERT_TRUE(release_creation.Pin(t).ok());
  }
  ScopedTensorPins pins;
  ASSERT_TRUE(pins.Pin(row).ok());
  EXPECT_EQ(t.data(), root_at);
  EXPECT_EQ(row.flat<int32_t>()(0), 4);
}

TEST(MovableTensorBufferTest, TheRootMovesAgainOnceItsSlicesAreGone) {
  MovingAllocator a;
  Tensor t(&a, DT_INT32, TensorShape({4, 2}));
  for (int i = 0; i < 8; ++i) t.flat<int32_t>()(i) = i;
  const void* root_at = t.data();
  {
    Tensor row = t.Slice(1, 2);
    // The slice's unpin must not end the creator's pin: still in place.
  }
  EXPECT_EQ(t.data(), root_at);
  {
    ScopedTensorPins release_creation;
    ASSERT_TRUE(release_creation.Pin(t).ok());
  }
  ScopedTensorPins pins;
  ASSERT_TRUE(pins.Pin(t).ok());  // unpinned everywhere: the double moves it
  EXPECT_NE(t.data(), root_at);
  EXPECT_EQ(t.flat<int32_t>()(5), 5);
}

TEST(MovableTensorBufferTest, TemporariesFreedBeforeAnyConsumerAreReleased) {
  MovingAllocator a;
  {
    // allocate_temp, or an output nobody consumes: still creation-pinned.
    Tensor scratch = Iota(&a, 32);
  }
  EXPECT_EQ(a.live(), 0);  // ~MovingAllocator checks it was unpinned first.
}

TEST(MovableTensorBufferTest, PinsLeaveBufferForwardingPossible) {
  MovingAllocator a;
  Tensor t = Iota(&a, 8);
  ScopedTensorPins pins;
  ASSERT_TRUE(pins.Pin(t).ok());
  // OpKernelContext::forward_input reuses an input only when its buffer has
  // one reference; a pin must not add one.
  EXPECT_TRUE(t.RefCountIsOne());
}

TEST(MovableTensorBufferTest, BuffersAreFreedWithTheirLastTensor) {
  MovingAllocator a;
  {
    Tensor t = Iota(&a, 8);
    ScopedTensorPins pins;
    ASSERT_TRUE(pins.Pin(t).ok());
    EXPECT_EQ(a.live(), 1);
  }
  EXPECT_EQ(a.live(), 0);
}

}  // namespace
}  // namespace tensorflow
