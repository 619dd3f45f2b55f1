"""tflms.addon: LMS for the stock TensorFlow GPU wheel, checked without a GPU.

The slow tests run once per TensorFlow version in $TFLMS_ADDON_TF_VERSIONS (space-separated;
default: the newest supported, 2.21.0). For each, they install that version's stock
`tensorflow` GPU wheel into a virtual environment of its own ($TFLMS_CACHE_DIR/venvs/
gpu-<version>, created once: from a wheel cached in ~/.cache/tflms/wheels when there is one,
else from PyPI through pip's cache; a failed download fails the test, naming it), build the
add-on there against that wheel's headers and libtensorflow_framework.so.2, check that the
library resolves every symbol against that wheel alone (CUDA's included: the wheel's
framework library exports lazily loading stubs of the CUDA runtime and driver), load it,
and run a TensorFlow program on the CPU with the LMS names installed: its results must be
identical to the same program without the add-on. Cold, that takes a few minutes per
version (about 1 to 1.5 minutes of pip, 2 minutes of compiling on two cores); cached, well
under a minute. `make addon-check` runs them for the newest version (in CI, `make test`),
`make addon-check-all` for every supported one.

The other tests need only the checkout's tensorflow-cpu and g++: what the add-on says when
it cannot work (CPU wheel, wrong version, no compiler, missing header).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tflms.patch import NEWEST_VERSION, SUPPORTED_VERSIONS

pytestmark = pytest.mark.tf

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "tflms" / "addon" / "csrc"
VERSION = NEWEST_VERSION
CACHE = Path(os.environ.get("TFLMS_CACHE_DIR") or Path.home() / ".cache" / "tflms")
ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": str(ROOT), "TFLMS_QUIET_BUILD": "1"}


def _versions_to_check() -> list[str]:
    versions = (os.environ.get("TFLMS_ADDON_TF_VERSIONS") or VERSION).split()
    unknown = [v for v in versions if v not in SUPPORTED_VERSIONS]
    if unknown:
        raise ValueError(
            f"TFLMS_ADDON_TF_VERSIONS names {' '.join(unknown)}: the add-on supports "
            f"{', '.join(SUPPORTED_VERSIONS)} (tflms/patch/__init__.py SUPPORTED_VERSIONS)"
        )
    return versions


CHECKED_VERSIONS = _versions_to_check()


def _gpu_python(version: str) -> Path:
    """The interpreter of the environment with the GPU wheel of `version`, made on first use."""
    venv = CACHE / "venvs" / f"gpu-{version}"
    python = venv / "bin" / "python"
    ready = venv / ".tflms-ready"
    if ready.is_file() and python.is_file():
        return python
    if not python.is_file():
        base = getattr(sys, "_base_executable", sys.executable)
        subprocess.run([base, "-m", "venv", str(venv)], check=True)
    tag = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    cached = sorted((CACHE / "wheels").glob(f"tensorflow-{version}-{tag}-{tag}-*.whl"))
    dist = str(cached[-1]) if cached else f"tensorflow=={version}"
    proc = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", dist, "tqdm", "pybind11"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, (
        f"pip install {dist} into {venv} failed (the stock GPU wheel is about 600 MB from "
        f"PyPI: network or disk?); the add-on for TensorFlow {version} was NOT checked:\n"
        f"{proc.stderr[-3000:]}"
    )
    ready.write_text(dist + "\n")
    return python


def _run_gpu_wheel(version: str, code: str, timeout: int = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(_gpu_python(version)), "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **ENV},
        check=False,
    )


@pytest.fixture(scope="module", params=CHECKED_VERSIONS)
def version(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def addon_library(version: str) -> Path:
    proc = _run_gpu_wheel(
        version,
        "from tflms._addon_build import library_path\n"
        "path, version = library_path(quiet=True)\n"
        "print('LIB', version, path)",
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("LIB ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    _, built_for, path = lines[0].split(" ", 2)
    assert built_for == version
    return Path(path)


def _framework(library: Path) -> Path:
    runpath = subprocess.run(
        ["readelf", "-d", str(library)], capture_output=True, text=True, check=True
    ).stdout
    (tf_dir,) = re.findall(r"RUNPATH.*\[(.*)\]", runpath)
    return Path(tf_dir.split(":")[0]) / "libtensorflow_framework.so.2"


@pytest.mark.slow
def test_library_links_against_the_gpu_wheel_alone(addon_library: Path) -> None:
    dynamic = subprocess.run(
        ["readelf", "-d", str(addon_library)], capture_output=True, text=True, check=True
    ).stdout
    needed = set(re.findall(r"NEEDED.*\[(.*)\]", dynamic))
    # Only TensorFlow's framework library and the C++ runtime: no libcudart, no libcuda,
    # no second absl or protobuf.
    assert needed <= {
        "libtensorflow_framework.so.2",
        "libstdc++.so.6",
        "libgcc_s.so.1",
        "libc.so.6",
        "libm.so.6",
        "ld-linux-x86-64.so.2",
    }, needed
    ldd = subprocess.run(
        ["ldd", "-r", str(addon_library)], capture_output=True, text=True, check=False
    )
    assert "undefined symbol" not in ldd.stdout + ldd.stderr, ldd.stdout + ldd.stderr
    # The CUDA runtime and driver calls of the engine's CUDA backend resolve to the
    # wheel's own stubs, which load libcudart / libcuda on first use, as TensorFlow does.
    undefined = subprocess.run(
        ["nm", "-D", "--undefined-only", str(addon_library)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    cuda = {s for s in undefined if re.fullmatch(r"cu(da)?[A-Z]\w*", s)}
    assert {"cudaMemcpyAsync", "cudaStreamWaitEvent", "cuMemMap", "cuMemUnmap"} <= cuda
    defined = set(
        subprocess.run(
            ["nm", "-D", "--defined-only", str(_framework(addon_library))],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
    )
    assert cuda <= defined, sorted(cuda - defined)


PROGRAM = r"""
import hashlib, sys
if sys.argv[1] == "addon":
    import tflms.addon
import tensorflow as tf
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
if sys.argv[1] == "addon":
    tf.config.experimental.set_lms_enabled(True)
    tf.config.experimental.set_lms_defrag_enabled(True)
    assert tf.config.experimental.get_lms_enabled()
    # Prefetch unset: the library's default constant (the fixed-address mode's), both as
    # Python reports it and as the allocator would resolve it; explicit False and True are
    # kept, None unsets again.
    import os
    os.environ.pop("TF_LMS_PREFETCH", None)
    lib = tflms.addon._require()
    default = bool(lib.tflms_addon_prefetch_default())
    assert default is EXPECTED_PREFETCH_DEFAULT, default
    assert tf.config.experimental.get_lms_prefetch_enabled() is default
    assert lib.tflms_addon_prefetch_resolved() == default
    for explicit in (False, True, None):
        tf.config.experimental.set_lms_prefetch_enabled(explicit)
        want = default if explicit is None else explicit
        assert tf.config.experimental.get_lms_prefetch_enabled() is want, explicit
        assert lib.tflms_addon_prefetch_resolved() == want, explicit
    for env, want in (("false", False), ("true", True)):
        os.environ["TF_LMS_PREFETCH"] = env  # overrides the unset setting either way
        assert lib.tflms_addon_prefetch_resolved() == want, env
    del os.environ["TF_LMS_PREFETCH"]
    assert tf.config.experimental.get_lms_prefetch_lookahead() == 0
    for bad, error in (("1", TypeError), (-1, ValueError), (2**31, ValueError), (True, TypeError)):
        try:
            tf.config.experimental.set_lms_prefetch_lookahead(bad)
            raise AssertionError(f"set_lms_prefetch_lookahead({bad!r}) was accepted")
        except error:
            pass
    try:
        tf.config.experimental.set_lms_prefetch_enabled(1)
        raise AssertionError("set_lms_prefetch_enabled(1) was accepted")
    except TypeError:
        pass
    tf.config.experimental.set_lms_prefetch_enabled(True)
    tf.config.experimental.set_lms_prefetch_lookahead(32)
    assert tf.config.experimental.get_lms_prefetch_enabled() is True
    assert tf.config.experimental.get_lms_prefetch_lookahead() == 32
    assert tflms.addon.installed() == {"device_factory": True, "gpu_process_state": True}
    for name in list(tflms.addon.STAT_FUNCTIONS) + ["get_lms_stats", "reclaim_inactive"]:
        assert callable(getattr(tf.experimental, name)), name
assert tf.config.list_physical_devices("GPU") == []
x = tf.random.stateless_normal([8, 16, 16, 3], seed=[1, 2])
w = tf.Variable(tf.random.stateless_normal([3, 3, 3, 8], seed=[3, 4]))
v = tf.Variable(tf.random.stateless_normal([8 * 16 * 16, 10], seed=[5, 6]))

@tf.function
def step(x):
    with tf.GradientTape() as tape:
        h = tf.nn.relu(tf.nn.conv2d(x, w, 1, "SAME"))
        y = tf.matmul(tf.reshape(h, [8, -1]), v)
        loss = tf.reduce_mean(tf.square(y))
    gw, gv = tape.gradient(loss, [w, v])
    w.assign_sub(0.01 * gw)
    v.assign_sub(0.01 * gv)
    return loss

losses = [step(x) for _ in range(3)]
eager = tf.reduce_sum(tf.sort(tf.reshape(x, [-1])) * 2.0)
digest = hashlib.sha256()
for t in [*losses, eager, w, v]:
    digest.update(t.numpy().tobytes())
if sys.argv[1] == "addon":
    try:
        tf.config.experimental.set_lms_enabled(False)
        raise AssertionError("late set_lms_enabled(False) was accepted")
    except RuntimeError as e:
        assert "before TensorFlow creates its devices" in str(e), e
    for setter, value in (
        (tf.config.experimental.set_lms_prefetch_enabled, False),
        (tf.config.experimental.set_lms_prefetch_lookahead, 8),
    ):
        try:
            setter(value)
            raise AssertionError(f"late {setter.__name__}({value}) was accepted")
        except RuntimeError as e:
            assert "before TensorFlow creates its devices" in str(e), e
    setter(32)  # the value in force: allowed
    try:
        tf.experimental.get_bytes_in_use(0)
        raise AssertionError("statistics without a GPU")
    except RuntimeError as e:
        assert "no GPU is visible" in str(e), e
print("DIGEST", digest.hexdigest())
"""


def _expected_prefetch_default() -> bool:
    """The add-on's default as the patch's header declares it (the add-on compiles it):
    kFixedAddressPrefetchEnabledDefault, the fixed-address mode's."""
    header = ROOT / "tf/common/files/tensorflow/core/common_runtime/lms/lms_options.h"
    (value,) = re.findall(
        r"kFixedAddressPrefetchEnabledDefault = (true|false);", header.read_text()
    )
    return value == "true"


def _digest(version: str, mode: str) -> str:
    setup = f"import sys; sys.argv = ['p', {mode!r}]\n"
    setup += f"EXPECTED_PREFETCH_DEFAULT = {_expected_prefetch_default()}\n"
    proc = _run_gpu_wheel(version, setup + PROGRAM)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("DIGEST ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    return lines[0]


@pytest.mark.slow
def test_program_on_cpu_is_unchanged_with_the_addon(addon_library: Path, version: str) -> None:
    assert _digest(version, "addon") == _digest(version, "stock")


@pytest.mark.slow
def test_import_after_devices_exist_says_what_to_change(addon_library: Path, version: str) -> None:
    proc = _run_gpu_wheel(
        version,
        "import tensorflow as tf\n"
        "tf.constant(1.0) + 1.0\n"
        "try:\n"
        "    import tflms.addon\n"
        "except RuntimeError as e:\n"
        "    print('ERR', type(e).__name__, e)\n",
    )
    assert "ERR AddonError" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    assert "before the first TensorFlow op" in proc.stdout


def test_cpu_wheel_is_refused_naming_the_gpu_wheel() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "try:\n    import tflms.addon\nexcept RuntimeError as e:\n    print('ERR', e)\n",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **ENV},
        check=False,
    )
    assert f"tensorflow=={VERSION}" in proc.stdout and "tflms.tfcpu" in proc.stdout, (
        proc.stdout + proc.stderr[-3000:]
    )


def test_unsupported_version_names_the_supported_ones() -> None:
    from tflms._addon_build import SUPPORTED_TF_VERSIONS, BuildError, check_tensorflow_version

    # One add-on per tag the patch supports.
    assert SUPPORTED_TF_VERSIONS == SUPPORTED_VERSIONS
    for supported in SUPPORTED_VERSIONS:
        check_tensorflow_version(supported)
    with pytest.raises(
        BuildError, match=r"TensorFlow 2\.19\.1, 2\.20\.0, 2\.21\.0 only.*tensorflow==2\.21\.0"
    ):
        check_tensorflow_version("2.18.0")


def _version_gate(major: int, minor: int, patch: int) -> subprocess.CompletedProcess[str]:
    from tflms import _wheel_build

    return subprocess.run(
        [
            _wheel_build.compiler(),
            "-fsyntax-only",
            "-x",
            "c++",
            *_wheel_build.version_macros(f"{major}.{minor}.{patch}"),
            str(CSRC / "tf_version.h"),
        ],
        capture_output=True,
        text=True,
        check=False,
    )


def test_compile_time_gate_accepts_exactly_the_supported_versions() -> None:
    # The C++ side refuses another TensorFlow by itself (a library built by hand, or a
    # version added to Python's list only), naming the supported ones.
    for supported in SUPPORTED_VERSIONS:
        proc = _version_gate(*map(int, supported.split(".")))
        assert proc.returncode == 0, proc.stderr
    names = ", ".join(SUPPORTED_VERSIONS)
    for other in [(2, 18, 0), (2, 20, 1), (2, 22, 0)]:
        proc = _version_gate(*other)
        assert proc.returncode != 0
        assert f"supports TensorFlow {names} only" in proc.stderr, proc.stderr
        assert "SUPPORTED_VERSIONS" in proc.stderr


def test_missing_compiler_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    from tflms import _wheel_build

    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", "")
    with pytest.raises(_wheel_build.BuildError, match="install g\\+\\+.*or set CXX"):
        _wheel_build.compiler()


def test_missing_header_is_named(tmp_path: Path) -> None:
    from tflms import _wheel_build

    src = tmp_path / "probe.cc"
    src.write_text('#include "tensorflow/core/no_such_header_tflms.h"\n')
    cxx = _wheel_build.compiler()
    with pytest.raises(_wheel_build.BuildError, match="no_such_header_tflms.h was not found"):
        _wheel_build._run([cxx, "-c", str(src), "-o", str(tmp_path / "probe.o")], "probe.cc")


def test_both_front_ends_compile_the_same_patch_sources() -> None:
    from tflms._addon_build import SPEC as ADDON
    from tflms.tfcpu._build import SPEC as TFCPU

    # One pin rule, one allocator, one movable buffer: the patch's files, not copies.
    assert ADDON.patch_sources == TFCPU.patch_sources
    assert TFCPU.csrc / "tensor_hooks.cc" in ADDON.extra_sources
    assert not list(ADDON.csrc.glob("kernel_pins*")) and not list(ADDON.csrc.glob("lms_alloc*"))
