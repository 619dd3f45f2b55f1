"""The compile check judges the patch's C++ against the tensorflow-cpu wheel's headers.

It compiles the LMS allocator adapter's header, laid out with the patched
tsl allocator.h exactly as `build_overlay` lays out the whole C++ half, and
shows that the check fails on a file with an error, on a file whose only
fault is a warning (-Werror), and names the header a file cannot find.

It also links the new MovableTensorBuffer against the wheel's
libtensorflow_framework and runs the pin protocol with TensorFlow's real
Tensor class. That works because the patch only appends a virtual to
TensorBuffer and keeps data_'s size and offset, so TensorFlow's own code
handles a MovableTensorBuffer unchanged; only buffers TensorFlow creates
itself (unpatched tensor.cc) are left out of the harness.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tflms.patch.compile_check import (
    CompileResult,
    build_overlay,
    compile_check,
    wheel_compile_flags,
)

REPO = Path(__file__).resolve().parent.parent
VERSION = "2.21.0"
ADAPTER_HEADER = "tensorflow/core/common_runtime/lms/lms_allocator.h"

pytestmark = pytest.mark.tf


@pytest.fixture(scope="module")
def overlay(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path]]:
    dest = tmp_path_factory.mktemp("patched_include")
    return dest, build_overlay(VERSION, REPO, dest)


def test_overlay_holds_new_files_and_patched_wheel_headers(
    overlay: tuple[Path, list[Path]],
) -> None:
    dest, targets = overlay
    rel = {t.relative_to(dest).as_posix() for t in targets}
    assert ADAPTER_HEADER in rel
    assert "tensorflow/core/framework/movable_tensor_buffer.cc" in rel
    # The patched wheel headers: tensor.h (atomic data_, no new virtual) and
    # tensor_array.h; tsl's allocator.h is left as it is (ABI).
    tensor_h = (dest / "tensorflow/core/framework/tensor.h").read_text()
    assert "std::atomic<void*> data_;" in tensor_h
    assert "virtual MovableTensorBuffer" not in tensor_h
    assert "xla/tsl/framework/allocator.h" not in rel
    assert "ForEachTensor" in (dest / "tensorflow/core/kernels/tensor_array.h").read_text()
    # The engine goes in verbatim and is compiled like every added file.
    assert "tensorflow/core/common_runtime/gpu/lms/core/include/tflms/engine.h" in rel


def test_adapter_header_compiles_and_broken_files_fail(
    overlay: tuple[Path, list[Path]], tmp_path: Path
) -> None:
    dest, _ = overlay
    syntax_error = tmp_path / "syntax_error.cc"
    syntax_error.write_text("int f() { return NoSuchThing(); }\n")
    # Valid C++; only -Werror makes it fail, so warnings are really judged.
    warning_only = tmp_path / "warning_only.cc"
    warning_only.write_text("int f() { int unused = 1; return 0; }\n")
    missing = tmp_path / "missing_header.cc"
    missing.write_text('#include "xla/stream_executor/no_such_header.h"\n')

    files = [dest / ADAPTER_HEADER, syntax_error, warning_only, missing]
    results = compile_check(dest, files, cuda=False, jobs=2)
    by_name = {r.path.name: r for r in results}
    assert [r.path for r in results] == files

    adapter: CompileResult = by_name["lms_allocator.h"]
    assert adapter.ok, adapter.stderr
    assert adapter.missing_header is None
    assert adapter.seconds > 0

    assert not by_name["syntax_error.cc"].ok
    assert "NoSuchThing" in by_name["syntax_error.cc"].stderr

    assert not by_name["warning_only.cc"].ok
    assert "unused" in by_name["warning_only.cc"].stderr

    assert not by_name["missing_header.cc"].ok
    assert by_name["missing_header.cc"].missing_header == ("xla/stream_executor/no_such_header.h")


# A movable allocator over host memory that moves every unpinned buffer on its
# next pin and poisons the old bytes, so a stale address cannot go unnoticed.
RUNTIME_HARNESS = r"""
// Runtime smoke test: MovableTensorBuffer + ScopedTensorPins with TensorFlow's
// real Tensor class from the wheel's libtensorflow_framework.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "tensorflow/core/framework/movable_tensor_buffer.h"
#include "tensorflow/core/framework/tensor.h"

// Tensor requires EIGEN_MAX_ALIGN_BYTES alignment, as the LMS engine gives.
inline void* Alloc64(size_t n) {
  return std::aligned_alloc(64, (n + 63) / 64 * 64);
}

namespace tensorflow {
// As strict as the engine: freeing a pinned buffer or unpinning an unpinned
// one is counted, and the test fails on any.
class MovingAllocator : public Allocator, public MovableAllocator {
 public:
  struct Block {
    void* ptr;
    size_t size;
    int pins;
    bool unmovable;
  };
  std::string Name() override { return "moving"; }
  void* AllocateRaw(size_t, size_t n) override { return Alloc64(n); }
  void DeallocateRaw(void* p) override { std::free(p); }
  void* AllocateMovable(size_t, size_t n, const AllocationAttributes&,
                        void** data) override {
    auto* b = new Block{Alloc64(n), n, 1, false};
    *data = b->ptr;
    ++live;
    return b;
  }
  void DeallocateMovable(void* h) override {
    auto* b = static_cast<Block*>(h);
    if (b->pins != 0) ++violations;
    std::free(b->ptr);
    delete b;
    --live;
  }
  absl::Status PinMovable(void* h, void** data) override {
    auto* b = static_cast<Block*>(h);
    if (b->pins == 0 && !b->unmovable) Move(b);
    ++b->pins;
    *data = b->ptr;
    return absl::OkStatus();
  }
  void UnpinMovable(void* h) override {
    auto* b = static_cast<Block*>(h);
    if (b->pins <= 0) ++violations;
    --b->pins;
  }
  absl::Status MakeUnmovable(void* h, void** data) override {
    auto* b = static_cast<Block*>(h);
    if (b->pins == 0 && !b->unmovable) Move(b);
    b->unmovable = true;
    *data = b->ptr;
    return absl::OkStatus();
  }
  size_t MovableSize(const void* h) const override {
    return static_cast<const Block*>(h)->size;
  }
  static void Move(Block* b) {
    void* f = Alloc64(b->size);
    std::memcpy(f, b->ptr, b->size);
    std::memset(b->ptr, 0xAB, b->size);
    std::free(b->ptr);
    b->ptr = f;
  }
  int live = 0;
  int violations = 0;
};
}  // namespace tensorflow

using namespace tensorflow;
#define EXPECT(c)                                      \
  do {                                                 \
    if (!(c)) {                                        \
      std::printf("FAIL line %d: %s\n", __LINE__, #c); \
      return 1;                                        \
    }                                                  \
  } while (0)

int main() {
  MovingAllocator a;
  EXPECT(RegisterMovableAllocator(&a, &a));
  {
    AllocationAttributes attr;
    TensorBuffer* buf =
        MovableTensorBufferUtil::MaybeAllocate(&a, DT_INT32, 64, attr);
    EXPECT(buf != nullptr);
    EXPECT(MovableTensorBufferUtil::MaybeAllocate(&a, DT_STRING, 4, attr) ==
           nullptr);
    Tensor t(DT_INT32, TensorShape({64}), buf);  // takes its own ref
    buf->Unref();
    for (int i = 0; i < 64; ++i) t.flat<int32_t>()(i) = i;
    const void* created = t.data();
    {
      ScopedTensorPins p;
      EXPECT(p.Pin(t).ok());
      EXPECT(t.data() == created);
    }
    Tensor alias = t;
    ScopedTensorPins p;
    EXPECT(p.Pin(alias).ok());
    EXPECT(t.data() != created);  // moved on the first pin after release
    EXPECT(t.data() == alias.data());
    for (int i = 0; i < 64; ++i) EXPECT(t.flat<int32_t>()(i) == i);
    p.Release();
    EXPECT(MakeTensorUnmovable(t).ok());
    const void* escaped = t.data();
    for (int r = 0; r < 3; ++r) {
      ScopedTensorPins q;
      EXPECT(q.Pin(t).ok());
      EXPECT(t.data() == escaped);
    }
    EXPECT(a.live == 1);
  }
  EXPECT(a.live == 0);
  EXPECT(a.violations == 0);
  UnregisterMovableAllocator(&a);
  std::printf("runtime smoke test passed\n");
  return 0;
}
"""


def test_pin_protocol_runs_with_the_wheels_tensor(
    overlay: tuple[Path, list[Path]], tmp_path: Path
) -> None:
    dest, _ = overlay
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("no g++")
    import tensorflow as tf  # noqa: PLC0415

    src = tmp_path / "harness.cc"
    src.write_text(RUNTIME_HARNESS)
    exe = tmp_path / "harness"
    lib_dir = Path(tf.sysconfig.get_lib())
    build = subprocess.run(
        [
            compiler,
            "-O1",
            "-isystem",
            str(dest),
            *wheel_compile_flags(),
            str(src),
            str(dest / "tensorflow/core/framework/movable_tensor_buffer.cc"),
            "-o",
            str(exe),
            *tf.sysconfig.get_link_flags(),
            f"-Wl,-rpath,{lib_dir}",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert build.returncode == 0, build.stderr[-4000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, check=False, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr[-2000:]
    assert "runtime smoke test passed" in run.stdout
