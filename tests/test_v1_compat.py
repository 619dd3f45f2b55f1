"""tensorflow_large_model_support: TFLMS v1 call patterns on stock and patched TensorFlow.

Stock: the official tensorflow-cpu wheel, in this process. Every v1 call pattern
(LMS.run before a Session, a hook in MonitoredTrainingSession, a callback in
model.fit) must stop with LMSUnavailableError naming docs/building.md, except
n_tensors=0 (LMS off), which trains as before.

Patched: the wheel's Python package with the patch's Python half applied
(tflms/patch/pycopy.py), in a subprocess that runs this file's main(). The
scenario there is ordered, because LMS settings lock once the runtime starts.
"""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tensorflow_large_model_support.parameters import (
    BY_NAME,
    PARAMETERS,
    SET_ENABLED,
    SET_PREFETCH_ENABLED,
    SET_PREFETCH_LOOKAHEAD,
    prefetch_lookahead,
    translate,
)
from tests.test_prefetch_default import cpp_default

REPO = Path(__file__).resolve().parents[1]
NO_EFFECT = (
    "optimizer_scopes",
    "starting_scope",
    "starting_op_names",
    "excl_scopes",
    "incl_scopes",
    "excl_types",
    "incl_types",
    "fuse_swapins",
    "ctrld_strategy",
    "swap_branches",
    "branch_threshold",
    "cpu_device",
    "optimizer_scopes_override",
)


# ---------------------------------------------------------------- translation (no TensorFlow)
def test_v1_defaults_switch_lms_on_and_nothing_else() -> None:
    t = translate({p.name: p.default for p in PARAMETERS})
    assert t.settings == {SET_ENABLED: True}
    assert t.ignored == {}
    assert not t.debug and t.debug_level == 1


def test_n_tensors_zero_turns_lms_off_and_drops_the_lookahead() -> None:
    t = translate({"n_tensors": 0, "lb": 5})
    assert t.settings == {SET_ENABLED: False}
    assert not t.enabled


def test_positive_n_tensors_is_on_with_the_count_reported_ignored() -> None:
    t = translate({"n_tensors": 120})
    assert t.settings == {SET_ENABLED: True}
    assert "120" in t.ignored["n_tensors"]


@pytest.mark.parametrize(
    ("lb", "ub", "lookahead", "sources"),
    [(8, 10000, 8, ("lb",)), (8, 64, 8, ("lb", "ub")), (1, 16, 16, ("ub",)), (1, 10000, None, ())],
)
def test_lb_and_ub_switch_prefetch_on_with_their_lookahead(
    lb: int, ub: int, lookahead: int | None, sources: tuple[str, ...]
) -> None:
    t = translate({"lb": lb, "ub": ub})
    assert t.settings.get(SET_PREFETCH_LOOKAHEAD) == lookahead
    assert t.sources.get(SET_PREFETCH_LOOKAHEAD, ()) == sources
    if lookahead is None:
        # v1 defaults: prefetch keeps TensorFlow's own setting (off) and lookahead.
        assert list(t.settings) == [SET_ENABLED]
    else:
        assert t.settings[SET_PREFETCH_ENABLED] is True
        assert t.sources[SET_PREFETCH_ENABLED] == sources
        assert list(t.settings) == [SET_ENABLED, SET_PREFETCH_ENABLED, SET_PREFETCH_LOOKAHEAD]
    assert "lb" not in t.ignored and "ub" not in t.ignored


@pytest.mark.parametrize(("lb", "ub"), [(0, 0), (0, 10000), (0, 50)])
def test_lb_zero_asks_for_swap_ins_right_before_use_so_prefetch_off(lb: int, ub: int) -> None:
    t = translate({"lb": lb, "ub": ub})
    assert t.settings == {SET_ENABLED: True, SET_PREFETCH_ENABLED: False}
    assert "lb" in t.sources[SET_PREFETCH_ENABLED]


def test_lookahead_is_capped_at_what_the_config_field_holds() -> None:
    assert prefetch_lookahead(1, 10**12) == (2**31 - 1, ("ub",))
    assert prefetch_lookahead(1, 10000) == (0, ())


def test_a_build_without_the_prefetch_setters_warns_once_naming_lb(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A patched TensorFlow older than the prefetch settings: LMS still switches on."""
    from types import SimpleNamespace

    from tensorflow_large_model_support import runtime

    state = {"enabled": False}

    def set_lms_enabled(value: bool) -> None:
        state["enabled"] = value

    experimental = SimpleNamespace(
        set_lms_enabled=set_lms_enabled, get_lms_enabled=lambda: state["enabled"]
    )
    fake = SimpleNamespace(
        config=SimpleNamespace(experimental=experimental),
        compat=SimpleNamespace(v1=SimpleNamespace(get_default_session=lambda: None)),
    )
    monkeypatch.setattr(runtime, "tensorflow", lambda: fake)
    with pytest.warns(runtime.LMSParameterWarning) as caught:
        applied = runtime.apply(translate({"lb": 4}), "LMS.run()", "advice")
    assert applied == {SET_ENABLED: True} and state["enabled"] is True
    (message,) = [str(w.message) for w in caught]
    assert (
        "lb: this TensorFlow has no tf.config.experimental.set_lms_prefetch_enabled, so "
        "set_lms_prefetch_enabled(True) is not applied" in message
    )
    assert "set_lms_prefetch_lookahead(4) is not applied" in message


def test_lms_config_refuses_bad_prefetch_values_before_importing_tensorflow() -> None:
    from tensorflow_large_model_support import lms_config

    with pytest.raises(ValueError, match="prefetch_lookahead must be an int from 0"):
        lms_config(prefetch_lookahead=-1)
    with pytest.raises(ValueError, match="prefetch_lookahead must be an int from 0"):
        lms_config(prefetch_lookahead=True)
    with pytest.raises(TypeError, match="prefetch a bool or None"):
        lms_config(prefetch=1)  # type: ignore[arg-type]


def test_bad_values_are_refused_with_what_to_change() -> None:
    with pytest.raises(ValueError, match=r"lb \(20\) must not be greater than ub \(10\)"):
        translate({"lb": 20, "ub": 10})
    with pytest.raises(ValueError, match="lb must be a non-negative int"):
        translate({"lb": -1})
    with pytest.raises(ValueError, match="n_tensors must be an int"):
        translate({"n_tensors": "all"})
    with pytest.raises(ValueError, match="debug_level must be 1 or 2"):
        translate({"debug_level": 0})
    with pytest.raises(TypeError, match="unknown TFLMS v1 parameter.*swapout_threshold"):
        translate({"swapout_threshold": 10})


def test_every_parameter_without_meaning_is_named_with_a_reason() -> None:
    given: dict[str, object] = {
        "optimizer_scopes": {"adam_optimizer"},
        "starting_scope": "conv1",
        "starting_op_names": ["input_1"],
        "excl_scopes": {"loss"},
        "incl_scopes": ["conv"],
        "excl_types": {"Conv2D"},
        "incl_types": {"Relu"},
        "fuse_swapins": True,
        "ctrld_strategy": "direct_order",
        "swap_branches": True,
        "branch_threshold": 100,
        "cpu_device": "/cpu:1",
        "optimizer_scopes_override": {"training/Adam"},
        "debug": True,
        "debug_level": 2,
        "graph": object(),
    }
    t = translate(given)
    assert sorted(t.ignored) == sorted(NO_EFFECT)
    message = t.ignored_message("LMS")
    for name in NO_EFFECT:
        assert f"  {name}: " in message
    assert t.debug and t.debug_level == 2
    # Empty collections are the v1 default, whatever their type.
    assert translate({"excl_scopes": [], "incl_types": set()}).ignored == {}


def test_debug_statistics_report_changes_per_scope(caplog: pytest.LogCaptureFixture) -> None:
    from tensorflow_large_model_support.statistics import StatsReporter

    readings = iter(
        [
            {0: {"num_allocs": 10, "bytes_reclaimed": 0}, 1: {"num_allocs": 3}},
            {0: {"num_allocs": 15, "bytes_reclaimed": 4096}, 1: {"num_allocs": 3}},
            {0: {"num_allocs": 15, "bytes_reclaimed": 4096}, 1: {"num_allocs": 3}},
            {0: {"num_allocs": 21, "bytes_reclaimed": 4096}, 1: {"num_allocs": 4}},
            {0: {"num_allocs": 21, "bytes_reclaimed": 4096}, 1: {"num_allocs": 4}},
        ]
    )
    reporter = StatsReporter("LMSKerasCallback", source=lambda: next(readings))
    caplog.set_level("INFO", logger="tensorflow_large_model_support")
    reporter.start()
    assert reporter.report("batch 0", "step") == {
        0: {"num_allocs": 5, "bytes_reclaimed": 4096},
        1: {},
    }
    assert reporter.report("batch 1", "step") == {0: {}, 1: {}}
    assert reporter.report("epoch 0", "epoch") == {
        0: {"num_allocs": 11, "bytes_reclaimed": 4096},
        1: {"num_allocs": 1},
    }
    assert reporter.report("training", "run") == {
        0: {"num_allocs": 11, "bytes_reclaimed": 4096},
        1: {"num_allocs": 1},
    }
    assert (
        "LMSKerasCallback batch 0, GPU 0: bytes_reclaimed=+4096, num_allocs=+5" in caplog.messages
    )
    assert "LMSKerasCallback batch 1, GPU 1: no change" in caplog.messages


def test_debug_statistics_say_once_why_there_are_none(caplog: pytest.LogCaptureFixture) -> None:
    from tensorflow_large_model_support.statistics import StatsReporter, StatsUnavailable

    calls = []

    def no_gpu() -> dict[int, dict[str, int]]:
        calls.append(1)
        raise StatsUnavailable("no GPU is visible to TensorFlow")

    reporter = StatsReporter("LMSSessionRunHook", source=no_gpu)
    reporter.start()
    assert reporter.report("step 1", "step") == {}
    assert reporter.report("after 1 steps", "run") == {}
    assert len(calls) == 1
    assert caplog.messages == [
        "LMSSessionRunHook: LMS statistics are not available: no GPU is visible to TensorFlow"
    ]


def test_importing_the_module_does_not_import_tensorflow() -> None:
    # v1 scripts import it next to TensorFlow; tools that only read PARAMETERS should not pay
    # for TensorFlow, and the hook and callback classes load it on first use.
    code = (
        "import sys, tensorflow_large_model_support as m; "
        "assert 'tensorflow' not in sys.modules, 'imported'; "
        "print(sorted(set(m.__all__) - set(dir(m))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "['LMSKerasCallback', 'LMSSessionRunHook']"


# ---------------------------------------------------------------- stock tensorflow-cpu wheel
def _v1_graph() -> tuple[Any, Any, Any, Any]:
    """mnist_deep_lms.py's shape: a graph whose optimizer is under name_scope('adam_optimizer')."""
    import tensorflow as tf

    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 4])
        # Zeros and a small step: every step moves x @ w from 0 toward 1 without overshoot,
        # so the loss falls whatever order a run evaluates loss and update in.
        w = tf.compat.v1.get_variable("w", [4, 1], initializer=tf.compat.v1.zeros_initializer())
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - 1.0))
        with tf.name_scope("adam_optimizer"):
            train = tf.compat.v1.train.AdamOptimizer(0.05).minimize(
                loss, global_step=tf.compat.v1.train.get_or_create_global_step()
            )
    return graph, x, loss, train


def _tiny_model() -> Any:
    import keras

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    return model


def _assert_names_the_build(message: str) -> None:
    assert "docs/building.md" in message
    assert "tf.config.experimental.set_lms_enabled" in message
    assert "tflms build-wheel --tf-version 2.21.0" in message


@pytest.mark.tf
def test_signatures_keep_every_v1_parameter_and_default() -> None:
    from tensorflow_large_model_support import LMS, LMSKerasCallback, LMSSessionRunHook

    expected = {
        LMS: set(BY_NAME) - {"optimizer_scopes_override"},
        LMSSessionRunHook: set(BY_NAME) - {"optimizer_scopes_override"},
        LMSKerasCallback: set(BY_NAME),
    }
    for cls, names in expected.items():
        params = inspect.signature(cls).parameters
        assert set(params) == names, cls
        for name in names:
            assert params[name].default == BY_NAME[name].default, (cls, name)
    assert list(inspect.signature(LMS).parameters)[:2] == ["optimizer_scopes", "graph"]


@pytest.mark.tf
def test_stock_wheel_session_pattern_fails_clearly_and_lms_off_still_trains() -> None:
    import tensorflow as tf

    from tensorflow_large_model_support import LMS, LMSUnavailableError, lms_config

    assert not hasattr(tf.config.experimental, "set_lms_enabled")
    graph, x, loss, train = _v1_graph()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the error comes first, not a parameter warning
        with pytest.raises(LMSUnavailableError) as err, graph.as_default():
            LMS({"adam_optimizer"}).run(graph=tf.compat.v1.get_default_graph())
    _assert_names_the_build(str(err.value))
    assert str(err.value).startswith("LMS: ")

    with pytest.raises(LMSUnavailableError, match="gpu_options.experimental.lms_enabled") as err:
        lms_config(tf.compat.v1.ConfigProto())
    assert "docs/building.md" in str(err.value)

    # n_tensors=0 asked v1 for no swapping: stock TensorFlow does exactly that.
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning for a call with nothing ignored
        off = LMS(n_tensors=0)
    off.run(graph)
    assert off.applied == {}
    data = np.ones((8, 4), np.float32)
    with graph.as_default(), tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        losses = [sess.run([train, loss], {x: data})[1] for _ in range(3)]
    assert losses[2] < losses[0]


@pytest.mark.tf
def test_stock_wheel_hook_in_monitored_training_session_fails_clearly() -> None:
    import tensorflow as tf

    from tensorflow_large_model_support import LMSSessionRunHook, LMSUnavailableError

    assert isinstance(LMSSessionRunHook(n_tensors=0), tf.compat.v1.train.SessionRunHook)
    graph, x, _, train = _v1_graph()
    with graph.as_default(), pytest.raises(LMSUnavailableError) as err:
        hooks = [LMSSessionRunHook({"adam_optimizer"})]
        with tf.compat.v1.train.MonitoredTrainingSession(hooks=hooks) as sess:
            sess.run(train, {x: np.ones((2, 4), np.float32)})
    _assert_names_the_build(str(err.value))
    assert str(err.value).startswith("LMSSessionRunHook: ")


@pytest.mark.tf
def test_stock_wheel_keras_callback_on_fit_fails_clearly_and_lms_off_still_fits() -> None:
    from tensorflow_large_model_support import LMSKerasCallback, LMSUnavailableError

    model = _tiny_model()
    data, target = np.ones((16, 4), np.float32), np.zeros((16, 1), np.float32)
    with pytest.raises(LMSUnavailableError) as err:
        model.fit(data, target, epochs=1, verbose=0, callbacks=[LMSKerasCallback()])
    _assert_names_the_build(str(err.value))
    history = model.fit(
        data, target, epochs=2, verbose=0, callbacks=[LMSKerasCallback(n_tensors=0)]
    )
    assert len(history.history["loss"]) == 2


# ---------------------------------------------------------------- patched copy of the wheel
def _patched_site(tmp: Path) -> Path:
    try:
        from tflms.patch.generate import collect
        from tflms.patch.pycopy import build_patched_package
        from tflms.patch.wheel import find_wheel
    except ImportError as e:  # the patch tools are another part of tflms
        pytest.skip(f"tflms.patch.pycopy is not available to build a patched copy: {e}")
    return build_patched_package(find_wheel("2.21.0"), tmp, collect("2.21.0").files).site


@pytest.fixture(scope="module")
def patched_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Runs both scenarios at once, each in its own process on the patched copy."""
    from tflms.patch.pycopy import subprocess_env

    site = _patched_site(tmp_path_factory.mktemp("patched"))
    env = subprocess_env(site)
    env["PYTHONPATH"] = f"{env['PYTHONPATH']}:{REPO}"
    procs = {
        name: subprocess.Popen(
            [sys.executable, __file__, "--patched-scenario", name],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name in SCENARIOS
    }
    results: dict[str, dict[str, Any]] = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
        assert proc.returncode == 0 and lines, f"{name}: {stderr[-4000:]}"
        results[name] = json.loads(lines[-1])
        assert "site/tensorflow" in results[name]["tensorflow_file"]
    return results


@pytest.mark.tf
def test_patched_session_pattern_switches_lms_and_warns_once(
    patched_results: dict[str, dict[str, Any]],
) -> None:
    r = patched_results["sessions"]
    # LMS.run(graph) before the Session: on, with prefetch on and lb=4 as its
    # lookahead; one warning, for what v1 needed and now is meaningless.
    s = r["session"]
    assert s["before"] is False and s["after"] is True
    assert s["applied"] == {
        SET_ENABLED: True,
        SET_PREFETCH_ENABLED: True,
        SET_PREFETCH_LOOKAHEAD: 4,
    }
    assert s["prefetch"] == {"enabled": True, "lookahead": 4, "context_config": [True, 4]}
    (ignored,) = s["warnings"]
    assert "optimizer_scopes:" in ignored and "swap_branches:" in ignored
    assert "lb:" not in ignored and "debug:" not in ignored
    assert s["warning_file"].endswith("test_v1_compat.py")
    assert s["losses"][2] < s["losses"][0]
    assert any(
        "applied tf.config.experimental.set_lms_enabled(True), set_lms_prefetch_enabled(True), "
        "set_lms_prefetch_lookahead(4)" in m
        for m in s["log"]
    )
    assert s["config"] == {
        "lms_enabled": True,
        "defrag": True,
        "prefetch": [True, 16],
        "caller_config_untouched": True,
    }

    assert r["n_tensors_0"] == {"enabled": False, "applied": {SET_ENABLED: False}}
    # lb=0 sets prefetch off explicitly (the field is set, to False), so it stays off
    # whatever TensorFlow's default for an unset field is.
    assert r["lb_0"] == {
        "applied": {SET_ENABLED: True, SET_PREFETCH_ENABLED: False},
        "getter": False,
        "context_config": {"has_field": True, "value": False},
    }
    # lms_config: prefetch None leaves the field unset (TensorFlow's default), False and
    # True set it.
    assert r["lms_config_prefetch"] == {
        "None": [False, False],
        "False": [True, False],
        "True": [True, True],
    }
    assert r["prefetch_default"] is cpp_default()
    assert "already open" in r["open_session"] and "lms_config(config)" in r["open_session"]


@pytest.mark.tf
def test_patched_hook_switches_lms_at_begin_and_logs_statistics(
    patched_results: dict[str, dict[str, Any]],
) -> None:
    h = patched_results["sessions"]["hook"]
    assert h["enabled_in_session"] is True and h["steps"] == 3
    # debug=True reads the statistics; on this CPU-only machine it says why there are none.
    assert h["log"] == [
        "LMSSessionRunHook: LMS statistics are not available: no GPU is visible to TensorFlow"
    ]


@pytest.mark.tf
def test_patched_keras_callback_switches_lms_before_the_model_and_refuses_late_changes(
    patched_results: dict[str, dict[str, Any]],
) -> None:
    k = patched_results["keras"]["keras"]
    assert k["before"] is False
    assert k["enabled_before_model"] is True and k["epochs"] == 2
    assert "LMSKerasCallback: Large Model Support cannot be switched off now" in k["too_late"]
    assert "before building the model" in k["too_late"]
    assert "cannot be changed after" in k["too_late"]  # TensorFlow's own reason, kept
    assert "LMS.run(): Large Model Support cannot be switched off now" in k["run_too_late"]
    assert k["same_value_after_init"] is True
    # lb after the runtime started: TensorFlow refuses the prefetch change, and the
    # message names the setting and the v1 parameter it came from. The first setting that
    # differs from the one in force is refused: the switch while prefetch's default is off,
    # else the lookahead.
    refused = "set_lms_prefetch_lookahead(8)" if cpp_default() else "set_lms_prefetch_enabled(True)"
    assert (
        f"LMS.run(): tf.config.experimental.{refused} (from lb) cannot be applied now"
        in k["prefetch_too_late"]
    )
    assert f"{refused} at the start" in k["prefetch_too_late"]


def _sessions_scenario() -> dict[str, Any]:
    """v1 session patterns, in a subprocess on the patched copy; returns what it saw."""
    import logging

    import tensorflow as tf

    from tensorflow_large_model_support import (
        LMS,
        LMSSessionRunHook,
        LMSTooLateError,
        lms_config,
    )

    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logging.getLogger("tensorflow_large_model_support").addHandler(Collect())
    out: dict[str, Any] = {"tensorflow_file": tf.__file__}
    experimental: Any = tf.config.experimental
    data = np.ones((8, 4), np.float32)

    # 1. mnist_deep_lms.py: LMS({'adam_optimizer'}).run(graph) before the Session.
    graph, x, loss, train = _v1_graph()
    before = experimental.get_lms_enabled()
    from tensorflow.python.eager import context

    default = context._LMS_PREFETCH_ENABLED_DEFAULT  # noqa: SLF001
    out["prefetch_default"] = default
    assert experimental.get_lms_prefetch_enabled() is default
    with warnings.catch_warnings(record=True) as caught, graph.as_default():
        warnings.simplefilter("always")
        lms = LMS({"adam_optimizer"}, lb=4, swap_branches=True, debug=True)
        lms.run(graph=tf.compat.v1.get_default_graph())
    with graph.as_default(), tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        losses = [float(sess.run([train, loss], {x: data})[1]) for _ in range(3)]
    mine = tf.compat.v1.ConfigProto(log_device_placement=True)
    cfg = lms_config(mine, defrag=True, prefetch=True, prefetch_lookahead=16)
    gpu_options = context.context().config.gpu_options.experimental
    with graph.as_default(), tf.compat.v1.Session(config=cfg) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
    out["session"] = {
        "before": before,
        "after": experimental.get_lms_enabled(),
        "applied": lms.applied,
        "prefetch": {
            "enabled": experimental.get_lms_prefetch_enabled(),
            "lookahead": experimental.get_lms_prefetch_lookahead(),
            "context_config": [
                gpu_options.lms_prefetch_enabled,
                gpu_options.lms_prefetch_lookahead,
            ],
        },
        "warnings": [str(w.message) for w in caught],
        "warning_file": caught[0].filename,
        "losses": losses,
        "log": list(records),
        "config": {
            "lms_enabled": cfg.gpu_options.experimental.lms_enabled,
            "defrag": cfg.gpu_options.experimental.lms_defrag_enabled,
            "prefetch": [
                cfg.gpu_options.experimental.lms_prefetch_enabled,
                cfg.gpu_options.experimental.lms_prefetch_lookahead,
            ],
            "caller_config_untouched": not mine.gpu_options.experimental.lms_enabled
            and cfg.log_device_placement,
        },
    }

    # 2. n_tensors=0 switches LMS off (the runtime has not started: allowed).
    off = LMS({"adam_optimizer"}, n_tensors=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        off.run(graph)
    out["n_tensors_0"] = {"enabled": experimental.get_lms_enabled(), "applied": off.applied}

    # 2b. lb=0: swap-ins right before use, so prefetch explicitly off (prefetch is on from 1).
    on_demand = LMS({"adam_optimizer"}, lb=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        on_demand.run(graph)
    experimental_config = context.context().config.gpu_options.experimental
    out["lb_0"] = {
        "applied": on_demand.applied,
        "getter": experimental.get_lms_prefetch_enabled(),
        "context_config": {
            "has_field": experimental_config.HasField("lms_prefetch_enabled"),
            "value": experimental_config.lms_prefetch_enabled,
        },
    }
    experimental.set_lms_enabled(False)  # as n_tensors=0 left it, for step 3
    made = {str(p): lms_config(prefetch=p).gpu_options.experimental for p in (None, False, True)}
    out["lms_config_prefetch"] = {
        k: [e.HasField("lms_prefetch_enabled"), e.lms_prefetch_enabled] for k, e in made.items()
    }

    # 3. A session already open: switching now would not reach its devices.
    with graph.as_default(), tf.compat.v1.Session():
        try:
            LMS().run(graph)
            out["open_session"] = "no error"
        except LMSTooLateError as e:
            out["open_session"] = str(e)

    # 4. cnn_mnist_lms.py's hook, in MonitoredTrainingSession (what Estimator ran).
    records.clear()
    graph, x, _, train = _v1_graph()
    with graph.as_default():
        hook = LMSSessionRunHook({"adam_optimizer"}, debug=True, debug_level=2)
        stop = tf.compat.v1.train.StopAtStepHook(last_step=3)
        with tf.compat.v1.train.MonitoredTrainingSession(hooks=[hook, stop]) as sess:
            enabled_in_session = experimental.get_lms_enabled()
            while not sess.should_stop():
                sess.run(train, {x: data})
    out["hook"] = {
        "enabled_in_session": enabled_in_session,
        "steps": hook.steps,
        "log": list(records),
    }
    return out


def _keras_scenario() -> dict[str, Any]:
    """The v1 Keras pattern, in its own subprocess: the runtime must not have started."""
    import tensorflow as tf

    from tensorflow_large_model_support import LMS, LMSKerasCallback, LMSTooLateError

    experimental: Any = tf.config.experimental
    data = np.ones((8, 4), np.float32)
    out: dict[str, Any] = {"tensorflow_file": tf.__file__}
    # Keras_ResNet50.py's callback: created before the model (LMS is off until then), then fit.
    before = experimental.get_lms_enabled()
    callback = LMSKerasCallback(debug=True)
    enabled_before_model = experimental.get_lms_enabled()
    model = _tiny_model()
    history = model.fit(
        data, np.zeros((8, 1), np.float32), epochs=2, verbose=0, callbacks=[callback]
    )
    keras: dict[str, Any] = {
        "before": before,
        "enabled_before_model": enabled_before_model,
        "epochs": len(history.history["loss"]),
    }
    try:
        LMSKerasCallback(n_tensors=0)
        keras["too_late"] = "no error"
    except LMSTooLateError as e:
        keras["too_late"] = str(e)
    try:
        LMS(n_tensors=0).run()
        keras["run_too_late"] = "no error"
    except LMSTooLateError as e:
        keras["run_too_late"] = str(e)
    keras["same_value_after_init"] = LMSKerasCallback().applied == {SET_ENABLED: True}
    try:
        LMS(lb=8).run()
        keras["prefetch_too_late"] = "no error"
    except LMSTooLateError as e:
        keras["prefetch_too_late"] = str(e)
    out["keras"] = keras
    return out


SCENARIOS = {"sessions": _sessions_scenario, "keras": _keras_scenario}

if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--patched-scenario":
    print(json.dumps(SCENARIOS[sys.argv[2]]()))


def test_keras_callback_compiles_without_xla_when_lms_is_on() -> None:
    # On stock TensorFlow the callback cannot switch LMS on; its translation is
    # set directly here to check what set_model does with a model compiled
    # with XLA.
    import keras  # noqa: PLC0415

    from tensorflow_large_model_support.keras_callback import LMSKerasCallback  # noqa: PLC0415
    from tensorflow_large_model_support.parameters import SET_ENABLED, Translation  # noqa: PLC0415

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(loss="mse", jit_compile=True)
    assert model.jit_compile
    callback = LMSKerasCallback(n_tensors=0)  # LMS off: set_model leaves XLA alone
    callback.set_model(model)
    assert model.jit_compile
    callback.translation = Translation(settings={SET_ENABLED: True})
    callback.set_model(model)
    assert not model.jit_compile
