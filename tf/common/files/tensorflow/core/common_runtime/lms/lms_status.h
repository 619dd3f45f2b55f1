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

// Conversions between the LMS engine's status type and absl::Status.
//
// The engine (lms/core) carries its own status so that it builds without
// absl; its codes are absl's canonical codes, so nothing is lost here.
#ifndef TENSORFLOW_CORE_COMMON_RUNTIME_LMS_LMS_STATUS_H_
#define TENSORFLOW_CORE_COMMON_RUNTIME_LMS_LMS_STATUS_H_

#include <string>

#include "absl/status/status.h"
#include "tflms/status.h"

namespace tensorflow {
namespace lms {

inline absl::Status ToAbslStatus(const tflms::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(static_cast<int>(s.code())),
                      s.message());
}

// Codes the engine does not know become kInternal, with the original code
// named in the message.
inline tflms::Status FromAbslStatus(const absl::Status& s) {
  if (s.ok()) return tflms::Status::Ok();
  switch (s.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kResourceExhausted:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kInternal:
    case absl::StatusCode::kUnavailable:
      return tflms::Status(static_cast<tflms::Code>(static_cast<int>(s.code())),
                           std::string(s.message()));
    default:
      return tflms::Internal(s.ToString());
  }
}

}  // namespace lms
}  // namespace tensorflow

#endif  // TENSORFLOW_CORE_COMMON_RUNTIME_LMS_LMS_STATUS_H_
