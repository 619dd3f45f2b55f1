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
"""Tests for the Large Model Support settings (tf.config.experimental)."""

from tensorflow.core.protobuf import config_pb2
from tensorflow.python.eager import context
from tensorflow.python.framework import config
from tensorflow.python.framework import constant_op
from tensorflow.python.framework import test_util
from tensorflow.python.platform import test


def reset_eager(fn):
  """Runs `fn` in a fresh, uninitialized eager context."""

  def wrapper(*args, **kwargs):
    try:
      context._reset_context()  # pylint: disable=protected-access
      return fn(*args, **kwargs)
    finally:
      context._reset_context()  # pylint: disable=protected-access

  return wrapper


class LmsConfigTest(test.TestCase):

  def testConfigProtoFields(self):
    cfg = config_pb2.ConfigProto()
    self.assertFalse(cfg.gpu_options.experimental.lms_enabled)
    self.assertFalse(cfg.gpu_options.experimental.lms_defrag_enabled)
    cfg.gpu_options.experimental.lms_enabled = True
    cfg.gpu_options.experimental.lms_defrag_enabled = True
    parsed = config_pb2.ConfigProto.FromString(cfg.SerializeToString())
    self.assertTrue(parsed.gpu_options.experimental.lms_enabled)
    self.assertTrue(parsed.gpu_options.experimental.lms_defrag_enabled)

  def testFieldNumbersAreStable(self):
    fields = config_pb2.GPUOptions.Experimental.DESCRIPTOR.fields_by_name
    self.assertEqual(fields["lms_enabled"].number, 20)
    self.assertEqual(fields["lms_defrag_enabled"].number, 21)
    self.assertEqual(fields["lms_limit_bytes"].number, 22)
    self.assertEqual(fields["lms_prefetch_enabled"].number, 23)
    self.assertEqual(fields["lms_prefetch_lookahead"].number, 24)

  def testPrefetchEnabledHasPresence(self):
    field = config_pb2.GPUOptions.Experimental.DESCRIPTOR.fields_by_name[
        "lms_prefetch_enabled"
    ]
    self.assertTrue(field.has_presence)
    cfg = config_pb2.ConfigProto()
    experimental = cfg.gpu_options.experimental
    self.assertFalse(experimental.HasField("lms_prefetch_enabled"))
    experimental.lms_prefetch_enabled = False
    self.assertTrue(experimental.HasField("lms_prefetch_enabled"))
    # An explicit False is on the wire (field 23, varint 0) and survives a
    # round trip; an unset field is not written at all.
    data = cfg.SerializeToString()
    self.assertIn(b"\xb8\x01\x00", data)
    parsed = config_pb2.ConfigProto.FromString(data)
    self.assertTrue(
        parsed.gpu_options.experimental.HasField("lms_prefetch_enabled")
    )
    self.assertFalse(parsed.gpu_options.experimental.lms_prefetch_enabled)
    self.assertEqual(config_pb2.ConfigProto().SerializeToString(), b"")

  @reset_eager
  def testPrefetchUnsetIsTheDefaultAndLeavesTheFieldUnset(self):
    default = context._LMS_PREFETCH_ENABLED_DEFAULT  # pylint: disable=protected-access
    self.assertIsInstance(default, bool)
    self.assertIs(config.get_lms_prefetch_enabled(), default)
    self.assertEqual(config.get_lms_prefetch_lookahead(), 0)
    gpu = context.context().config.gpu_options
    self.assertFalse(gpu.experimental.HasField("lms_prefetch_enabled"))
    self.assertEqual(gpu.experimental.lms_prefetch_lookahead, 0)

  @reset_eager
  def testPrefetchExplicitTrueAndFalseReachContextConfig(self):
    for enable in (True, False, True):
      config.set_lms_prefetch_enabled(enable)
      self.assertIs(config.get_lms_prefetch_enabled(), enable)
      gpu = context.context().config.gpu_options
      self.assertTrue(gpu.experimental.HasField("lms_prefetch_enabled"))
      self.assertIs(gpu.experimental.lms_prefetch_enabled, enable)
    config.set_lms_prefetch_lookahead(32)
    self.assertEqual(config.get_lms_prefetch_lookahead(), 32)
    gpu = context.context().config.gpu_options
    self.assertEqual(gpu.experimental.lms_prefetch_lookahead, 32)

  @reset_eager
  def testPrefetchNoneGoesBackToTheDefault(self):
    default = context._LMS_PREFETCH_ENABLED_DEFAULT  # pylint: disable=protected-access
    config.set_lms_prefetch_enabled(not default)
    config.set_lms_prefetch_enabled(None)
    self.assertIs(config.get_lms_prefetch_enabled(), default)
    gpu = context.context().config.gpu_options
    self.assertFalse(gpu.experimental.HasField("lms_prefetch_enabled"))

  @reset_eager
  def testPrefetchFromContextConfigProto(self):
    for value in (True, False):
      cfg = config_pb2.ConfigProto()
      cfg.gpu_options.experimental.lms_prefetch_enabled = value
      context.context()._config = cfg  # pylint: disable=protected-access
      self.assertIs(config.get_lms_prefetch_enabled(), value)
    # A ConfigProto that does not set the field leaves LMS's default.
    context.context()._config = config_pb2.ConfigProto()  # pylint: disable=protected-access
    self.assertIs(
        config.get_lms_prefetch_enabled(),
        context._LMS_PREFETCH_ENABLED_DEFAULT,  # pylint: disable=protected-access
    )

  @reset_eager
  def testPrefetchDisablingOverridesContextConfigProto(self):
    cfg = config_pb2.ConfigProto()
    cfg.gpu_options.experimental.lms_prefetch_enabled = True
    cfg.gpu_options.experimental.lms_prefetch_lookahead = 16
    context.context()._config = cfg  # pylint: disable=protected-access
    self.assertTrue(config.get_lms_prefetch_enabled())
    self.assertEqual(config.get_lms_prefetch_lookahead(), 16)
    config.set_lms_prefetch_enabled(False)
    config.set_lms_prefetch_lookahead(0)
    gpu = context.context().config.gpu_options
    self.assertTrue(gpu.experimental.HasField("lms_prefetch_enabled"))
    self.assertFalse(gpu.experimental.lms_prefetch_enabled)
    self.assertEqual(gpu.experimental.lms_prefetch_lookahead, 0)
    # None clears the field the ConfigProto set.
    config.set_lms_prefetch_enabled(None)
    gpu = context.context().config.gpu_options
    self.assertFalse(gpu.experimental.HasField("lms_prefetch_enabled"))

  @reset_eager
  def testPrefetchRejectsBadValues(self):
    with self.assertRaisesRegex(TypeError, "lms_prefetch_enabled must be a bool"):
      config.set_lms_prefetch_enabled(1)
    with self.assertRaisesRegex(TypeError, "must be an int"):
      config.set_lms_prefetch_lookahead(2.0)
    with self.assertRaisesRegex(TypeError, "must be an int"):
      config.set_lms_prefetch_lookahead(True)
    with self.assertRaisesRegex(ValueError, "positive number of tensor uses"):
      config.set_lms_prefetch_lookahead(-1)
    with self.assertRaisesRegex(ValueError, "positive number of tensor uses"):
      config.set_lms_prefetch_lookahead(1 << 31)
    self.assertIs(
        config.get_lms_prefetch_enabled(),
        context._LMS_PREFETCH_ENABLED_DEFAULT,  # pylint: disable=protected-access
    )
    self.assertFalse(
        context.context().config.gpu_options.experimental.HasField(
            "lms_prefetch_enabled"
        )
    )
    self.assertEqual(config.get_lms_prefetch_lookahead(), 0)

  @reset_eager
  def testPrefetchChangeAfterInitializationRaises(self):
    default = context._LMS_PREFETCH_ENABLED_DEFAULT  # pylint: disable=protected-access
    constant_op.constant(1.0)  # initializes the runtime
    config.set_lms_prefetch_enabled(default)  # the value in force
    config.set_lms_prefetch_enabled(None)  # the default: the value in force
    config.set_lms_prefetch_lookahead(0)  # the value in force
    with self.assertRaisesRegex(
        RuntimeError, "set_lms_prefetch_enabled.*at the start"
    ):
      config.set_lms_prefetch_enabled(not default)
    with self.assertRaisesRegex(
        RuntimeError, "set_lms_prefetch_lookahead.*at the start"
    ):
      config.set_lms_prefetch_lookahead(8)
    self.assertIs(config.get_lms_prefetch_enabled(), default)
    self.assertEqual(config.get_lms_prefetch_lookahead(), 0)

  @reset_eager
  def testLmsLimitDefaultsToWholeDeviceAndReachesContextConfig(self):
    self.assertEqual(config.get_lms_limit(), 0)
    gpu = context.context().config.gpu_options
    self.assertEqual(gpu.experimental.lms_limit_bytes, 0)
    config.set_lms_limit(8 << 30)
    self.assertEqual(config.get_lms_limit(), 8 << 30)
    gpu = context.context().config.gpu_options
    self.assertEqual(gpu.experimental.lms_limit_bytes, 8 << 30)

  @reset_eager
  def testLmsLimitRejectsBadValues(self):
    with self.assertRaisesRegex(ValueError, "must be 0"):
      config.set_lms_limit(-1)
    with self.assertRaisesRegex(ValueError, "at least 256 bytes"):
      config.set_lms_limit(100)
    with self.assertRaisesRegex(TypeError, "must be an int"):
      config.set_lms_limit(1.0)
    with self.assertRaisesRegex(TypeError, "must be an int"):
      config.set_lms_limit(True)
    self.assertEqual(config.get_lms_limit(), 0)

  @reset_eager
  def testLmsLimitReadFromContextConfigProto(self):
    cfg = config_pb2.ConfigProto()
    cfg.gpu_options.experimental.lms_limit_bytes = 1 << 30
    context.context()._config = cfg  # pylint: disable=protected-access
    self.assertEqual(config.get_lms_limit(), 1 << 30)

  @reset_eager
  def testLmsLimitMayChangeAfterInitialization(self):
    constant_op.constant(1.0)  # initializes the runtime
    config.set_lms_limit(1 << 30)
    self.assertEqual(config.get_lms_limit(), 1 << 30)

  @reset_eager
  def testDefaultsAreOff(self):
    self.assertFalse(config.get_lms_enabled())
    self.assertFalse(config.get_lms_defrag_enabled())
    gpu = context.context().config.gpu_options
    self.assertFalse(gpu.experimental.lms_enabled)
    self.assertFalse(gpu.experimental.lms_defrag_enabled)

  @reset_eager
  def testSettingsReachContextConfig(self):
    config.set_lms_enabled(True)
    config.set_lms_defrag_enabled(True)
    self.assertTrue(config.get_lms_enabled())
    self.assertTrue(config.get_lms_defrag_enabled())
    gpu = context.context().config.gpu_options
    self.assertTrue(gpu.experimental.lms_enabled)
    self.assertTrue(gpu.experimental.lms_defrag_enabled)

    config.set_lms_enabled(False)
    self.assertFalse(config.get_lms_enabled())
    gpu = context.context().config.gpu_options
    self.assertFalse(gpu.experimental.lms_enabled)

  @reset_eager
  def testDisablingOverridesContextConfigProto(self):
    cfg = config_pb2.ConfigProto()
    cfg.gpu_options.experimental.lms_enabled = True
    context.context()._config = cfg  # pylint: disable=protected-access
    self.assertTrue(config.get_lms_enabled())
    config.set_lms_enabled(False)
    self.assertFalse(config.get_lms_enabled())
    gpu = context.context().config.gpu_options
    self.assertFalse(gpu.experimental.lms_enabled)

  @reset_eager
  def testRejectsNonBool(self):
    with self.assertRaisesRegex(TypeError, "lms_enabled must be a bool"):
      config.set_lms_enabled("yes")
    with self.assertRaisesRegex(TypeError, "lms_defrag_enabled must be a bool"):
      config.set_lms_defrag_enabled(1)

  @reset_eager
  def testChangeAfterInitializationRaises(self):
    constant_op.constant(1.0)  # initializes the runtime
    # Setting the value in force is harmless.
    config.set_lms_enabled(False)
    with self.assertRaisesRegex(RuntimeError, "set_lms_enabled.*at the start"):
      config.set_lms_enabled(True)
    with self.assertRaisesRegex(RuntimeError, "cannot be changed after"):
      config.set_lms_defrag_enabled(True)
    self.assertFalse(config.get_lms_enabled())

  @test_util.run_deprecated_v1
  def testSessionConfigCarriesSetting(self):
    cfg = config_pb2.ConfigProto()
    cfg.gpu_options.experimental.lms_enabled = True
    with self.session(config=cfg) as sess:
      sess_config = sess._config  # pylint: disable=protected-access
      self.assertTrue(sess_config.gpu_options.experimental.lms_enabled)
      self.assertEqual(sess.run(constant_op.constant(3)), 3)


if __name__ == "__main__":
  test.main()
