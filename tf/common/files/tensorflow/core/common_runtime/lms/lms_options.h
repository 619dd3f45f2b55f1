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

// LMS's settings in GPUOptions.experimental, as every LMS device resolves
// them: what the program set, the default where it did not, and the
// environment variable that overrides both for an experiment.
//
// The fields are read through reflection, by name, so that this file also
// compiles against a released config.pb.h, which has no accessors for them
// (tflms verify, and the CPU harness tflms.tfcpu, which runs this file inside
// the stock tensorflow-cpu wheel: there every field reads as unset).
#ifndef TENSORFLOW_CORE_COMMON_RUNTIME_LMS_LMS_OPTIONS_H_
#define TENSORFLOW_CORE_COMMON_RUNTIME_LMS_LMS_OPTIONS_H_

#include "absl/strings/string_view.h"
#include "google/protobuf/descriptor.h"
#include "tensorflow/core/protobuf/config.pb.h"

namespace tensorflow {
namespace lms {

// Whether LMS prefetch runs when the program does not say:
// GPUOptions.experimental.lms_prefetch_enabled unset (the field has presence,
// so an explicit false stays false whatever this is). TF_LMS_PREFETCH, when
// set, overrides it. This is the one switch for the patch's default: its
// Python side mirrors it (_LMS_PREFETCH_ENABLED_DEFAULT in
// python/eager/context.py, which must run without this library), and a test
// of the tflms repository checks that the two agree.
inline constexpr bool kPrefetchEnabledDefault = true;

// The same for the engine's fixed-address mode, which tflms.addon runs on the
// stock wheel (set_lms_prefetch_enabled never called). There a tensor comes
// back by mapping pages on the host, and on the one GPU its prefetch ran on
// (an H200, link-bound workload) it stepped slower than paging on demand, so
// it stays off until measured otherwise.
inline constexpr bool kFixedAddressPrefetchEnabledDefault = false;

// GPUOptions.experimental's field `name`, or null when this config.proto has
// none of that name or it is not of `type`.
const google::protobuf::FieldDescriptor* LmsField(
    const GPUOptions::Experimental& experimental, const char* name,
    google::protobuf::FieldDescriptor::CppType type);

// Whether the engine prefetches on `device` (a name for the log, e.g. "GPU
// 0"). GPUOptions.experimental.lms_prefetch_enabled, when set, is what the
// program asked for; unset, `unset_default` applies (kPrefetchEnabledDefault
// for the patch's allocator). TF_LMS_PREFETCH, when set to a boolean,
// overrides either; any other value is logged and ignored.
bool PrefetchEnabled(const GPUOptions& options, bool unset_default,
                     absl::string_view device);

// Whether the engine prefetches on `device` in the fixed-address mode of
// tflms.addon, whose setting is not a GPUOptions field (the stock wheel's
// config.proto has none) but tf.config.experimental.set_lms_prefetch_enabled:
// `setting` -1 when the program never called it, so
// kFixedAddressPrefetchEnabledDefault applies, 0 or 1 as set. TF_LMS_PREFETCH
// overrides either, as in PrefetchEnabled.
bool FixedAddressPrefetchEnabled(int setting, absl::string_view device);

// `setting`, or TF_LMS_PREFETCH where that is set to a boolean (true, false, 1
// or 0, any case), with the override logged; any other value is logged and
// `setting` kept. `name` is the setting's name for the log (the GPUOptions
// field, or the add-on's set_lms_prefetch_enabled) and `was_set` whether the
// program set it. The one reading of TF_LMS_PREFETCH for every LMS allocator.
bool PrefetchWithEnvOverride(bool setting, absl::string_view name,
                             bool was_set, absl::string_view device);

// The engine's host throttle where TF_LMS_RUN_AHEAD_EPOCHS is unset
// (EngineOptions::run_ahead_epochs; 0: off). 8 made the planner's 30 prefetch
// points 2.4% faster by geometric mean and ran its 57 steadiness points
// without running out of memory, where 6 did not (docs/how-it-works.md, "The
// host held near the GPU"). The planner mirrors it
// (PATCH_RUN_AHEAD_EPOCHS in tflms/planner/replay.py) to replay what the
// patch does, and a test of the tflms repository checks that the two agree.
inline constexpr int kRunAheadEpochsDefault = 8;

// TF_LMS_RUN_AHEAD_EPOCHS: with prefetch, how many last-use
// epochs (32 tensor unpins each) the host may run ahead of the GPU while
// tensors are on the host (EngineOptions::run_ahead_epochs); 0 turns the
// throttle off. Unset or empty: kRunAheadEpochsDefault. A value that is not
// a number from 0 to tflms::kMaxRunAheadEpochs is logged and the default
// kept; a nonzero result is logged once for `device`.
int RunAheadEpochs(absl::string_view device);

// GPUOptions.experimental.lms_prefetch_lookahead: tensor uses (pins) looked
// ahead for tensors to bring back; 0 (or a negative value, logged) keeps
// `engine_default`.
int PrefetchLookahead(const GPUOptions& options, int engine_default,
                      absl::string_view device);

}  // namespace lms
}  // namespace tensorflow

#endif  // TENSORFLOW_CORE_COMMON_RUNTIME_LMS_LMS_OPTIONS_H_
