// Copyright 2026 The tflms Authors. Licensed under the Apache License 2.0.
//
// A custom-op library built against the *stock* TensorFlow 2.21.0 headers, as
// users build theirs: TensorBuffer here has the stock layout and vtable. Used
// by tests/test_tfcpu.py to show that LMS kernels accept its tensors.
#include <cstring>
#include <vector>

#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor.h"

namespace {

using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;

// A buffer this library owns: its vtable is the stock one.
class OwnBuffer : public tensorflow::TensorBuffer {
 public:
  explicit OwnBuffer(size_t bytes)
      : TensorBuffer(Allocate(bytes)), bytes_(bytes) {}
  ~OwnBuffer() override { operator delete(data(), std::align_val_t(64)); }
  size_t size() const override { return bytes_; }
  TensorBuffer* root_buffer() override { return this; }
  void FillAllocationDescription(
      tensorflow::AllocationDescription* proto) const override {}

 private:
  static void* Allocate(size_t bytes) {
    return operator new(bytes == 0 ? 64 : bytes, std::align_val_t(64));
  }
  size_t bytes_;
};

class OwnBufferOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    const Tensor& in = ctx->input(0);
    auto* buf = new OwnBuffer(in.TotalBytes());
    std::memcpy(buf->data(), in.tensor_data().data(), in.TotalBytes());
    Tensor out(in.dtype(), in.shape(), buf);
    buf->Unref();
    ctx->set_output(0, out);
  }
};

class ScaleOp : public OpKernel {
 public:
  explicit ScaleOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("factor", &factor_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("scratch_bytes", &scratch_bytes_));
  }
  void Compute(OpKernelContext* ctx) override {
    const Tensor& in = ctx->input(0);
    if (scratch_bytes_ > 0) {
      // An optional scratch space, as cuDNN's autotuning asks for: the
      // kernel computes the same without it.
      tensorflow::AllocationAttributes optional;
      optional.retry_on_failure = false;
      Tensor scratch;
      (void)ctx->allocate_temp(tensorflow::DT_UINT8,
                               tensorflow::TensorShape({scratch_bytes_}),
                               &scratch, tensorflow::AllocatorAttributes(),
                               optional);
    }
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, in.shape(), &out));
    auto x = in.flat<float>();
    auto y = out->flat<float>();
    for (int64_t i = 0; i < x.size(); ++i) y(i) = x(i) * factor_;
  }

 private:
  float factor_;
  int64_t scratch_bytes_;
};

}  // namespace

REGISTER_OP("TflmsTestOwnBuffer")
    .Input("x: float")
    .Output("y: float")
    .SetShapeFn(tensorflow::shape_inference::UnchangedShape);
REGISTER_OP("TflmsTestScale")
    .Input("x: float")
    .Output("y: float")
    .Attr("factor: float")
    .Attr("scratch_bytes: int = 0")
    .SetShapeFn(tensorflow::shape_inference::UnchangedShape);
REGISTER_KERNEL_BUILDER(Name("TflmsTestOwnBuffer").Device(tensorflow::DEVICE_CPU),
                        OwnBufferOp);
REGISTER_KERNEL_BUILDER(Name("TflmsTestScale").Device(tensorflow::DEVICE_CPU),
                        ScaleOp);
