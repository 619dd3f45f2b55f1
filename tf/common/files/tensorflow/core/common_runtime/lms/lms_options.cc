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

#include "tensorflow/core/common_runtime/lms/lms_options.h"

#include <cstdint>
#include <cstdlib>
#include <string>

#include "absl/log/log.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "tflms/engine.h"
#include "xla/tsl/util/env_var.h"

namespace tensorflow {
namespace lms {

const google::protobuf::FieldDescriptor* LmsField(
    const GPUOptions::Experimental& experimental, const char* name,
    google::protobuf::FieldDescriptor::CppType type) {
  const google::protobuf::FieldDescriptor* field =
      experimental.GetDescriptor()->FindFieldByName(name);
  return field != nullptr && field->cpp_type() == type ? field : nullptr;
}

// The environment variable overrides the option either way (as
// TF_FORCE_GPU_ALLOW_GROWTH overrides allow_growth), so an experiment can
// switch prefetch without touching the program.
bool PrefetchWithEnvOverride(bool setting, absl::string_view name,
                             bool was_set, absl::string_view device) {
  const char* env = std::getenv("TF_LMS_PREFETCH");
  if (env == nullptr || *env == '\0') return setting;
  const char* source = was_set ? "set" : "unset, the default";
  bool from_env = setting;
  absl::Status s = tsl::ReadBoolFromEnvVar("TF_LMS_PREFETCH",
                                           /*default_val=*/setting, &from_env);
  if (!s.ok()) {
    LOG(ERROR) << "TF_LMS_PREFETCH=" << env << " is not a boolean (true, "
               << "false, 1 or 0): it is ignored, and " << device << " uses "
               << name << " (" << (setting ? "true" : "false") << ", "
               << source << ").";
    return setting;
  }
  if (from_env != setting) {
    LOG(INFO) << "TF_LMS_PREFETCH=" << env << " overrides " << name << " ("
              << (setting ? "true" : "false") << ", " << source << ") for "
              << device << ": prefetch " << (from_env ? "on" : "off") << ".";
  }
  return from_env;
}

bool PrefetchEnabled(const GPUOptions& options, bool unset_default,
                     absl::string_view device) {
  bool from_options = unset_default;
  bool set = false;
  const GPUOptions::Experimental& experimental = options.experimental();
  if (const auto* field =
          LmsField(experimental, "lms_prefetch_enabled",
                   google::protobuf::FieldDescriptor::CPPTYPE_BOOL)) {
    const auto* reflection = experimental.GetReflection();
    // A field without presence (a config.proto declaring it as a plain bool)
    // cannot say "unset": only true then differs from not saying anything.
    set = field->has_presence() ? reflection->HasField(experimental, field)
                                : reflection->GetBool(experimental, field);
    if (set) from_options = reflection->GetBool(experimental, field);
  }
  return PrefetchWithEnvOverride(
      from_options, "GPUOptions.experimental.lms_prefetch_enabled", set,
      device);
}

bool FixedAddressPrefetchEnabled(int setting, absl::string_view device) {
  return PrefetchWithEnvOverride(
      setting < 0 ? kFixedAddressPrefetchEnabledDefault : setting != 0,
      "tf.config.experimental.set_lms_prefetch_enabled", setting >= 0,
      device);
}

int RunAheadEpochs(absl::string_view device) {
  int64_t epochs = kRunAheadEpochsDefault;
  const char* env = std::getenv("TF_LMS_RUN_AHEAD_EPOCHS");
  const bool from_env = env != nullptr && *env != '\0';
  if (from_env) {
    absl::Status s = tsl::ReadInt64FromEnvVar("TF_LMS_RUN_AHEAD_EPOCHS",
                                              kRunAheadEpochsDefault, &epochs);
    if (!s.ok() || epochs < 0 || epochs > tflms::kMaxRunAheadEpochs) {
      LOG(ERROR) << "TF_LMS_RUN_AHEAD_EPOCHS=" << env << " is ignored for "
                 << device << ": it must be 0 (off) or a number of epochs "
                 << "from 1 to " << tflms::kMaxRunAheadEpochs << "; "
                 << kRunAheadEpochsDefault
                 << " (the default) is used.";
      epochs = kRunAheadEpochsDefault;
    }
  }
  if (epochs > 0) {
    LOG(INFO) << "With prefetch, " << device << " holds the host within "
              << epochs << " last-use epochs of the GPU while tensors are on "
              << "the host ("
              << (from_env ? absl::StrCat("TF_LMS_RUN_AHEAD_EPOCHS=", env)
                           : std::string("LMS's default; "
                                         "TF_LMS_RUN_AHEAD_EPOCHS=0 turns it off"))
              << ").";
  }
  return static_cast<int>(epochs);
}

int PrefetchLookahead(const GPUOptions& options, int engine_default,
                      absl::string_view device) {
  const GPUOptions::Experimental& experimental = options.experimental();
  const auto* field =
      LmsField(experimental, "lms_prefetch_lookahead",
               google::protobuf::FieldDescriptor::CPPTYPE_INT32);
  if (field == nullptr) return engine_default;
  const int32_t lookahead =
      experimental.GetReflection()->GetInt32(experimental, field);
  if (lookahead < 0) {
    LOG(ERROR) << "GPUOptions.experimental.lms_prefetch_lookahead = "
               << lookahead << " is ignored for " << device << ": it must be "
               << "0 (LMS's default, " << engine_default << ") or a positive "
               << "number of tensor uses.";
    return engine_default;
  }
  return lookahead == 0 ? engine_default : lookahead;
}

}  // namespace lms
}  // namespace tensorflow
