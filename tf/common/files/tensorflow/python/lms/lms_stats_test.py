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
"""Tests for the Large Model Support statistics (tf.experimental)."""

import inspect

from tensorflow.python.eager import context
from tensorflow.python.framework import config
from tensorflow.python.framework import constant_op
from tensorflow.python.framework import test_util
from tensorflow.python.platform import test

GPU_STATS = (
    "num_allocs", "bytes_in_use", "peak_bytes_in_use", "largest_alloc_size",
    "bytes_limit", "bytes_reserved", "peak_bytes_reserved",
    "bytes_reservable_limit", "bytes_inactive", "bytes_active",
    "peak_bytes_active", "bytes_reclaimed", "current_bytes_reclaimed",
    "peak_bytes_reclaimed", "num_single_reclaims", "num_full_reclaims",
    "num_defragmentations", "bytes_defragged",
    "num_allocs_from_free", "num_allocs_from_new_region",
    "num_allocs_from_single_reclaim", "num_allocs_from_fragment_reclaim",
    "num_allocs_from_full_reclaim", "num_allocs_from_defrag",
)
ALLOC_SOURCES = tuple(
    n for n in GPU_STATS if n.startswith("num_allocs_from_")
)
HOST_STATS = ("gpu_host_bytes_in_use", "gpu_host_peak_bytes_in_use")


class LmsStatsTest(test.TestCase):

  def testSignatures(self):
    for name in GPU_STATS + ("lms_stats",):
      fn = getattr(config, "get_" + name)
      self.assertEqual(str(inspect.signature(fn)), "(gpu_id=0)", name)
    self.assertEqual(
        str(inspect.signature(config.reclaim_inactive)), "(gpu_id=0)"
    )
    self.assertEqual(str(inspect.signature(config.set_lms_limit)), "(nbytes)")
    for name in HOST_STATS:
      fn = getattr(config, "get_" + name)
      self.assertEqual(str(inspect.signature(fn)), "(numa_node=0)", name)

  def testRejectsBadIds(self):
    with self.assertRaisesRegex(ValueError, "gpu_id must be a non-negative"):
      config.get_bytes_in_use(-1)
    with self.assertRaisesRegex(ValueError, "gpu_id must be a non-negative"):
      config.get_bytes_in_use(True)
    with self.assertRaisesRegex(ValueError, "numa_node must be a non-negative"):
      config.get_gpu_host_bytes_in_use("0")

  def testNoGpuGivesClearError(self):
    if context.context().list_physical_devices("GPU"):
      self.skipTest("a GPU is present")
    for name in GPU_STATS + HOST_STATS + ("lms_stats",):
      with self.assertRaisesRegex(RuntimeError, "no GPU is visible"):
        getattr(config, "get_" + name)()
    with self.assertRaisesRegex(RuntimeError, "reclaim_inactive: no GPU"):
      config.reclaim_inactive()

  @test_util.run_gpu_only
  def testCountersWithLms(self):
    # The first test to touch the GPU: its allocator is created below, with
    # LMS on.
    context._reset_context()  # pylint: disable=protected-access
    config.set_lms_enabled(True)
    x = constant_op.constant([1.0] * 1024)  # 4 KiB on GPU:0
    stats = config.get_lms_stats(0)
    for name in GPU_STATS:
      self.assertIn(name, stats)
      self.assertEqual(getattr(config, "get_" + name)(0), stats[name])
    self.assertGreaterEqual(stats["bytes_in_use"], 4096)
    self.assertEqual(
        stats["bytes_in_use"], stats["bytes_active"] + stats["bytes_inactive"]
    )
    self.assertGreaterEqual(stats["peak_bytes_in_use"], stats["bytes_in_use"])
    self.assertGreaterEqual(config.get_gpu_host_bytes_in_use(0), 0)
    self.assertLessEqual(
        sum(stats[n] for n in ALLOC_SOURCES), stats["num_allocs"]
    )
    self.assertGreater(stats["num_allocs_from_free"], 0)

    # x is inactive between operations: reclaim_inactive moves it to the host,
    # and the next use brings it back with its values.
    before = config.get_lms_stats(0)
    moved = config.reclaim_inactive(0)
    after = config.get_lms_stats(0)
    self.assertGreaterEqual(moved, 4096)
    self.assertEqual(after["bytes_inactive"], 0)
    self.assertEqual(
        after["bytes_reclaimed"] - before["bytes_reclaimed"], moved
    )
    self.assertAllEqual(x + 1.0, [2.0] * 1024)

    # The limit applies at run time; a value above the device means all of it.
    config.set_lms_limit(1 << 20)
    self.assertEqual(config.get_lms_limit(), 1 << 20)
    config.set_lms_limit(stats["bytes_limit"] * 2)
    config.set_lms_limit(0)
    del x


if __name__ == "__main__":
  test.main()
