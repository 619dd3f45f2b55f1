// Copyright 2026 The tflms Authors. Licensed under the Apache License 2.0.
//
// Stands in for the patch's tensor.cc hunk (03-tensor-allocate-movable) in a
// stock TensorFlow process.
//
// The wheel's tensor.cc is compiled without the hunk, so its allocating
// constructors never ask for a movable buffer and its SubBuffer never keeps
// the root in place. Every call to those functions from TensorFlow's shared
// libraries goes through their PLT (each library imports the symbols, even
// libtensorflow_framework.so.2 for its own), so rewriting the GOT slots of
// every loaded library redirects them here. The replacements do exactly what
// the hunk adds, by calling the patch's own MovableTensorBufferUtil, and fall
// back to the original function for everything else.
//
// Invariant: the hooks are installed once, before any tensor is allocated
// from an LMS allocator, and never removed (a tensor's buffer kind must not
// change under it).
#include <dlfcn.h>
#include <elf.h>
#include <link.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <new>
#include <string>

#include "tensorflow/core/framework/allocation_description.pb.h"
#include "tensorflow/core/framework/allocator.h"
#include "tensorflow/core/framework/movable_tensor_buffer.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/framework/types.pb.h"

namespace tflms_tfcpu {

bool WritePointer(void** slot, void* value);

namespace {

using tensorflow::AllocationAttributes;
using tensorflow::Allocator;
using tensorflow::DataType;
using tensorflow::MovableTensorBufferUtil;
using tensorflow::Tensor;
using tensorflow::TensorBuffer;
using tensorflow::TensorShape;

using CtorFn = void (*)(Tensor*, Allocator*, DataType, const TensorShape&);
using CtorAttrFn = void (*)(Tensor*, Allocator*, DataType, const TensorShape&,
                            const AllocationAttributes&);
using SliceFn = void (*)(Tensor*, const Tensor*, int64_t, int64_t);
using SubSliceFn = void (*)(Tensor*, const Tensor*, int64_t);

constexpr char kCtor[] =
    "_ZN10tensorflow6TensorC1EPN3tsl9AllocatorENS_8DataTypeERKNS_"
    "11TensorShapeE";
constexpr char kCtor2[] =
    "_ZN10tensorflow6TensorC2EPN3tsl9AllocatorENS_8DataTypeERKNS_"
    "11TensorShapeE";
constexpr char kCtorAttr[] =
    "_ZN10tensorflow6TensorC1EPN3tsl9AllocatorENS_8DataTypeERKNS_"
    "11TensorShapeERKNS1_20AllocationAttributesE";
constexpr char kCtorAttr2[] =
    "_ZN10tensorflow6TensorC2EPN3tsl9AllocatorENS_8DataTypeERKNS_"
    "11TensorShapeERKNS1_20AllocationAttributesE";
constexpr char kSlice[] = "_ZNK10tensorflow6Tensor5SliceEll";
constexpr char kSubSlice[] = "_ZNK10tensorflow6Tensor8SubSliceEl";

CtorFn original_ctor = nullptr;
CtorAttrFn original_ctor_attr = nullptr;
SliceFn original_slice = nullptr;
SubSliceFn original_sub_slice = nullptr;

// What the hunk makes of `Tensor(a, type, shape[, attr])`: a movable buffer
// when MaybeAllocate gives one, otherwise the stock constructor.
bool ConstructMovable(Tensor* self, Allocator* a, DataType type,
                      const TensorShape& shape,
                      const AllocationAttributes& attr) {
  if (!MovableTensorBufferUtil::Enabled() || a == nullptr) return false;
  TensorBuffer* buf = MovableTensorBufferUtil::MaybeAllocate(
      a, type, shape.num_elements(), attr);
  if (buf == nullptr) return false;
  // An allocation that failed leaves data() null: IsInitialized() is then
  // false and the caller reports out-of-memory, as for a stock buffer.
  new (self) Tensor(type, shape, buf);
  buf->Unref();  // The tensor holds the only reference now.
  return true;
}

void HookedCtor(Tensor* self, Allocator* a, DataType type,
                const TensorShape& shape) {
  if (!ConstructMovable(self, a, type, shape, AllocationAttributes())) {
    original_ctor(self, a, type, shape);
  }
}

void HookedCtorAttr(Tensor* self, Allocator* a, DataType type,
                    const TensorShape& shape,
                    const AllocationAttributes& attr) {
  if (!ConstructMovable(self, a, type, shape, attr)) {
    original_ctor_attr(self, a, type, shape, attr);
  }
}

// Stands in for the hunk's SubBuffer, which lives in tensor.cc and cannot be
// changed in the wheel: a slice of a movable root gets this buffer instead,
// which pins the root (in place) for as long as the slice lives, through the
// same MovableTensorBufferUtil calls the hunk adds to SubBuffer.
class PinningSlice : public TensorBuffer {
 public:
  PinningSlice(TensorBuffer* root, void* data, size_t bytes)
      : TensorBuffer(data), root_(root), bytes_(bytes) {
    root_->Ref();
    MovableTensorBufferUtil::PinRootForSlice(root_);
  }
  size_t size() const override { return bytes_; }
  TensorBuffer* root_buffer() override { return root_; }
  bool GetAllocatedBytes(size_t* out_bytes) const override {
    return root_->GetAllocatedBytes(out_bytes);
  }
  void FillAllocationDescription(
      tensorflow::AllocationDescription* proto) const override {
    root_->FillAllocationDescription(proto);
  }

 private:
  ~PinningSlice() override {
    MovableTensorBufferUtil::UnpinRootForSlice(root_);
    root_->Unref();
  }
  TensorBuffer* const root_;
  const size_t bytes_;
};

// Slices of nothing (empty ranges) share no bytes and need nothing.
void PinRootWhileSliceLives(Tensor* slice) {
  if (!MovableTensorBufferUtil::Enabled() || slice->NumElements() == 0) return;
  tensorflow::MovableTensorBuffer* root = MovableTensorBufferUtil::Get(*slice);
  if (root == nullptr) return;
  auto* buf = new PinningSlice(
      root, const_cast<char*>(slice->tensor_data().data()),
      slice->TotalBytes());
  Tensor pinned(slice->dtype(), slice->shape(), buf);
  buf->Unref();  // `pinned` holds the only reference now.
  *slice = std::move(pinned);  // drops the wheel's SubBuffer
}

// Tensor::Slice returns a Tensor by value: the Itanium ABI passes the
// result's address first.
void HookedSlice(Tensor* result, const Tensor* self, int64_t start,
                 int64_t limit) {
  original_slice(result, self, start, limit);
  PinRootWhileSliceLives(result);
}

void HookedSubSlice(Tensor* result, const Tensor* self, int64_t index) {
  original_sub_slice(result, self, index);
  PinRootWhileSliceLives(result);
}

struct Hook {
  const char* symbol;
  void* replacement;
  int patched;
};

Hook hooks[] = {
    {kCtor, reinterpret_cast<void*>(&HookedCtor), 0},
    {kCtor2, reinterpret_cast<void*>(&HookedCtor), 0},
    {kCtorAttr, reinterpret_cast<void*>(&HookedCtorAttr), 0},
    {kCtorAttr2, reinterpret_cast<void*>(&HookedCtorAttr), 0},
    {kSlice, reinterpret_cast<void*>(&HookedSlice), 0},
    {kSubSlice, reinterpret_cast<void*>(&HookedSubSlice), 0},
};

uintptr_t Adjust(const dl_phdr_info* info, uintptr_t ptr) {
  // glibc relocates these dynamic entries in place for loaded objects; the
  // vDSO's are left as link-time addresses.
  return ptr < info->dlpi_addr ? ptr + info->dlpi_addr : ptr;
}

void PatchRelocations(const dl_phdr_info* info, const Elf64_Rela* rela,
                      size_t count, const Elf64_Sym* symtab,
                      const char* strtab) {
  for (size_t i = 0; i < count; ++i) {
    const uint32_t type = ELF64_R_TYPE(rela[i].r_info);
    if (type != R_X86_64_JUMP_SLOT && type != R_X86_64_GLOB_DAT) continue;
    const char* name = strtab + symtab[ELF64_R_SYM(rela[i].r_info)].st_name;
    if (name[0] != '_' || name[1] != 'Z') continue;
    for (Hook& h : hooks) {
      if (std::strcmp(name, h.symbol) != 0) continue;
      void** slot = reinterpret_cast<void**>(info->dlpi_addr + rela[i].r_offset);
      if (WritePointer(slot, h.replacement)) ++h.patched;
    }
  }
}

int PatchObject(dl_phdr_info* info, size_t, void*) {
  const Elf64_Dyn* dynamic = nullptr;
  for (int i = 0; i < info->dlpi_phnum; ++i) {
    if (info->dlpi_phdr[i].p_type == PT_DYNAMIC) {
      dynamic = reinterpret_cast<const Elf64_Dyn*>(info->dlpi_addr +
                                                   info->dlpi_phdr[i].p_vaddr);
    }
  }
  if (dynamic == nullptr) return 0;
  const Elf64_Sym* symtab = nullptr;
  const char* strtab = nullptr;
  const Elf64_Rela* jmprel = nullptr;
  const Elf64_Rela* rela = nullptr;
  size_t jmprel_size = 0, rela_size = 0;
  for (const Elf64_Dyn* d = dynamic; d->d_tag != DT_NULL; ++d) {
    switch (d->d_tag) {
      case DT_SYMTAB:
        symtab = reinterpret_cast<const Elf64_Sym*>(Adjust(info, d->d_un.d_ptr));
        break;
      case DT_STRTAB:
        strtab = reinterpret_cast<const char*>(Adjust(info, d->d_un.d_ptr));
        break;
      case DT_JMPREL:
        jmprel =
            reinterpret_cast<const Elf64_Rela*>(Adjust(info, d->d_un.d_ptr));
        break;
      case DT_PLTRELSZ:
        jmprel_size = d->d_un.d_val;
        break;
      case DT_RELA:
        rela = reinterpret_cast<const Elf64_Rela*>(Adjust(info, d->d_un.d_ptr));
        break;
      case DT_RELASZ:
        rela_size = d->d_un.d_val;
        break;
      default:
        break;
    }
  }
  if (symtab == nullptr || strtab == nullptr) return 0;
  if (jmprel != nullptr) {
    PatchRelocations(info, jmprel, jmprel_size / sizeof(Elf64_Rela), symtab,
                     strtab);
  }
  if (rela != nullptr) {
    PatchRelocations(info, rela, rela_size / sizeof(Elf64_Rela), symtab,
                     strtab);
  }
  return 0;
}

template <typename Fn>
bool Resolve(void* framework, const char* symbol, Fn* out) {
  *out = reinterpret_cast<Fn>(dlsym(framework, symbol));
  return *out != nullptr;
}

}  // namespace

// Writes a function pointer into a table another library owns (a GOT slot, a
// type's slot table). RELRO may have made it read-only; it stays writable
// afterwards, which is no worse than a lazily bound PLT.
bool WritePointer(void** slot, void* value) {
  const long page = sysconf(_SC_PAGESIZE);
  uintptr_t start = reinterpret_cast<uintptr_t>(slot) & ~(page - 1);
  if (mprotect(reinterpret_cast<void*>(start), page, PROT_READ | PROT_WRITE) !=
      0) {
    return false;
  }
  __atomic_store_n(slot, value, __ATOMIC_RELEASE);
  return true;
}

// Installs the hooks; returns "" or what went wrong. The definitions are
// taken from libtensorflow_framework.so.2 itself, never from a GOT slot that
// may already point here.
std::string InstallTensorHooks() {
  void* framework =
      dlopen("libtensorflow_framework.so.2", RTLD_NOW | RTLD_NOLOAD);
  if (framework == nullptr) {
    return "libtensorflow_framework.so.2 is not loaded (import tensorflow "
           "first)";
  }
  const bool ok = Resolve(framework, kCtor, &original_ctor) &&
                  Resolve(framework, kCtorAttr, &original_ctor_attr) &&
                  Resolve(framework, kSlice, &original_slice) &&
                  Resolve(framework, kSubSlice, &original_sub_slice);
  dlclose(framework);
  if (!ok) {
    return "libtensorflow_framework.so.2 lacks Tensor's allocating "
           "constructors or Slice: not the TensorFlow this was built for";
  }
  dl_iterate_phdr(&PatchObject, nullptr);
  if (hooks[0].patched + hooks[1].patched == 0 ||
      hooks[2].patched + hooks[3].patched == 0) {
    return "no library calls Tensor's allocating constructors through its "
           "PLT: cannot redirect them";
  }
  return "";
}

// How many GOT slots each hook rewrote (for the harness's self-check).
int PatchedSlots() {
  int n = 0;
  for (const Hook& h : hooks) n += h.patched;
  return n;
}

}  // namespace tflms_tfcpu
