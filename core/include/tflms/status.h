// Copyright 2026 The tflms Authors. Licensed under the Apache License 2.0.
//
// A minimal, dependency-free status type for the LMS engine.
//
// The engine is compiled both inside TensorFlow (where absl::Status exists)
// and standalone (tests, the Python binding, the planner). It must not depend
// on absl, so it carries its own status; the TensorFlow adapter converts it
// with ToAbslStatus() in tf/. Codes mirror the absl canonical codes that the
// adapter maps to, so no information is lost in the conversion.
#ifndef TFLMS_CORE_STATUS_H_
#define TFLMS_CORE_STATUS_H_

#include <string>
#include <utility>

namespace tflms {

enum class Code : int {
  kOk = 0,
  kInvalidArgument = 3,
  kNotFound = 5,
  kResourceExhausted = 8,
  kFailedPrecondition = 9,
  kUnimplemented = 12,
  kInternal = 13,
  kUnavailable = 14,
};

class Status {
 public:
  Status() = default;
  Status(Code code, std::string message)
      : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }

  bool ok() const { return code_ == Code::kOk; }
  Code code() const { return code_; }
  const std::string& message() const { return message_; }
  std::string ToString() const;

 private:
  Code code_ = Code::kOk;
  std::string message_;
};

inline Status InvalidArgument(std::string m) {
  return Status(Code::kInvalidArgument, std::move(m));
}
inline Status ResourceExhausted(std::string m) {
  return Status(Code::kResourceExhausted, std::move(m));
}
inline Status FailedPrecondition(std::string m) {
  return Status(Code::kFailedPrecondition, std::move(m));
}
inline Status Unimplemented(std::string m) {
  return Status(Code::kUnimplemented, std::move(m));
}
inline Status Internal(std::string m) {
  return Status(Code::kInternal, std::move(m));
}
inline Status Unavailable(std::string m) {
  return Status(Code::kUnavailable, std::move(m));
}

}  // namespace tflms

#define TFLMS_RETURN_IF_ERROR(expr)         \
  do {                                      \
    ::tflms::Status _tflms_status = (expr); \
    if (!_tflms_status.ok()) return _tflms_status; \
  } while (0)

#endif  // TFLMS_CORE_STATUS_H_
