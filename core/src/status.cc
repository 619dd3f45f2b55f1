// Copyright 2026 The tflms Authors. Licensed under the Apache License 2.0.
#include "tflms/status.h"

namespace tflms {

std::string Status::ToString() const {
  if (ok()) return "OK";
  const char* name = "UNKNOWN";
  switch (code_) {
    case Code::kOk: name = "OK"; break;
    case Code::kInvalidArgument: name = "INVALID_ARGUMENT"; break;
    case Code::kNotFound: name = "NOT_FOUND"; break;
    case Code::kResourceExhausted: name = "RESOURCE_EXHAUSTED"; break;
    case Code::kFailedPrecondition: name = "FAILED_PRECONDITION"; break;
    case Code::kUnimplemented: name = "UNIMPLEMENTED"; break;
    case Code::kInternal: name = "INTERNAL"; break;
    case Code::kUnavailable: name = "UNAVAILABLE"; break;
  }
  return std::string(name) + ": " + message_;
}

}  // namespace tflms
