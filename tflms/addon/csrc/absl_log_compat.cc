// Copyright 2026 The tflms Authors. Licensed under the Apache License 2.0.
//
// TensorFlow 2.19 and 2.20 only: absl's LOG(...) << integer, float, bool or
// pointer, compiled by g++ against those wheels, would not link.
//
// The absl these wheels bundle (LTS 2023-08-02 in 2.19, 2025-01-27 in 2.20)
// declares LogMessage::operator<<(const T&) as a template with an enable_if
// template parameter and marks its instantiations for the built-in types
// `extern template`: callers must use the copies instantiated inside
// libtensorflow_framework.so.2. That library was compiled with clang 18,
// which mangles such a template's signature differently from g++ (it
// encodes the enable_if parameter, "...TnNSt9enable_if..."), so g++'s
// references find no symbol (`ldd -r`: undefined
// LogMessage::operator<< <unsigned long, 0>). The absl of 2.21 (2025-08-14)
// dropped the enable_if parameter; both compilers then agree.
//
// The fix: instantiate those functions here (explicit instantiation
// definitions, which an earlier `extern template` permits), so the add-on
// carries g++'s copies of them. Their bodies call only what the framework
// library exports by name both compilers agree on (LogMessage::OstreamView).
// The patch's own files need nothing: inside TensorFlow one compiler builds
// everything.
#include "tensorflow/core/public/version.h"
#include "tf_version.h"

#if !TFLMS_TF_AT_LEAST(2, 21)

#include "absl/base/config.h"
#include "absl/log/internal/log_message.h"

namespace absl {
ABSL_NAMESPACE_BEGIN
namespace log_internal {

// NOLINTBEGIN(runtime/int)
template LogMessage& LogMessage::operator<<(const char& v);
template LogMessage& LogMessage::operator<<(const signed char& v);
template LogMessage& LogMessage::operator<<(const unsigned char& v);
template LogMessage& LogMessage::operator<<(const short& v);
template LogMessage& LogMessage::operator<<(const unsigned short& v);
template LogMessage& LogMessage::operator<<(const int& v);
template LogMessage& LogMessage::operator<<(const unsigned int& v);
template LogMessage& LogMessage::operator<<(const long& v);
template LogMessage& LogMessage::operator<<(const unsigned long& v);
template LogMessage& LogMessage::operator<<(const long long& v);
template LogMessage& LogMessage::operator<<(const unsigned long long& v);
template LogMessage& LogMessage::operator<<(void* const& v);
template LogMessage& LogMessage::operator<<(const void* const& v);
template LogMessage& LogMessage::operator<<(const float& v);
template LogMessage& LogMessage::operator<<(const double& v);
template LogMessage& LogMessage::operator<<(const bool& v);
// NOLINTEND(runtime/int)

}  // namespace log_internal
ABSL_NAMESPACE_END
}  // namespace absl

#endif  // !TFLMS_TF_AT_LEAST(2, 21)
