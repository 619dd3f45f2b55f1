# Copyright 2026 The TensorFlow Authors. All Rights Reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
# ==============================================================================

def get_gpu_host_stats(numa_node: int) -> dict[str, int]: ...
def get_lms_stats(tf_gpu_id: int) -> dict[str, int]: ...
def reclaim_inactive(tf_gpu_id: int) -> int: ...
def set_lms_limit(tf_gpu_id: int, bytes: int) -> None: ...
