"""tflms.addon: LMS for the stock TensorFlow GPU wheel, checked without a GPU.

The slow tests install the stock `tensorflow` 2.21.0 GPU wheel into a virtual environment
of its own ($TFLMS_CACHE_DIR/venvs/gpu-2.21.0, created once: from the wheel cached in
~/.cache/tflms/wheels when it is there, else from PyPI through pip's cache), build the
add-on there against that wheel's headers and libtensorflow_framework.so.2, check that the
library resolves every symbol against that wheel alone (CUDA's included: the wheel's
framework library exports lazily loading stubs of the CUDA runtime and driver), load it,
and run a TensorFlow program on the CPU with the LMS names installed: its results must be
identical to the same program without the add-on. Cold, that takes a few minutes (about
40 s of pip, 2 minutes of compiling on two cores); cached, well under a minute.
`make addon-check` runs them.

The other tests need only the checkout's tensorflow-cpu: what the add-on says when it
cannot work (CPU wheel, wrong version, no compiler, missing header).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.tf

ROOT = Path(__file__).resolve().parent.parent
VERSION = "2.21.0"
CACHE = Path(os.environ.get("TFLMS_CACHE_DIR") or Path.home() / ".cache" / "tflms")
GPU_VENV = CACHE / "venvs" / f"gpu-{VERSION}"
CACHED_WHEEL = CACHE / "wheels" / f"tensorflow-{VERSION}-cp311-cp311-manylinux_2_27_x86_64.whl"
ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": str(ROOT), "TFLMS_QUIET_BUILD": "1"}


def _gpu_python() -> Path:
    """The GPU-wheel environment's interpreter, created on first use."""
    python = GPU_VENV / "bin" / "python"
    ready = GPU_VENV / ".tflms-ready"
    if ready.is_file() and python.is_file():
        return python
    if not python.is_file():
        base = getattr(sys, "_base_executable", sys.executable)
        subprocess.run([base, "-m", "venv", str(GPU_VENV)], check=True)
    tag = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    wheel = CACHED_WHEEL if CACHED_WHEEL.is_file() and tag in CACHED_WHEEL.name else None
    dist = str(wheel) if wheel else f"tensorflow=={VERSION}"
    proc = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", dist, "tqdm", "pybind11"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, f"pip install {dist} failed:\n{proc.stderr[-3000:]}"
    ready.write_text(dist + "\n")
    return python


def _run_gpu_wheel(code: str, timeout: int = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(_gpu_python()), "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **ENV},
        check=False,
    )


@pytest.fixture(scope="module")
def addon_library() -> Path:
    proc = _run_gpu_wheel(
        "from tflms._addon_build import library_path\nprint('LIB', library_path(quiet=True)[0])"
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("LIB ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return Path(lines[0].split(" ", 1)[1])


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
    try:
        tf.experimental.get_bytes_in_use(0)
        raise AssertionError("statistics without a GPU")
    except RuntimeError as e:
        assert "no GPU is visible" in str(e), e
print("DIGEST", digest.hexdigest())
"""


def _digest(mode: str) -> str:
    proc = _run_gpu_wheel(f"import sys; sys.argv = ['p', {mode!r}]\n{PROGRAM}")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("DIGEST ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    return lines[0]


@pytest.mark.slow
def test_program_on_cpu_is_unchanged_with_the_addon(addon_library: Path) -> None:
    assert _digest("addon") == _digest("stock")


@pytest.mark.slow
def test_import_after_devices_exist_says_what_to_change(addon_library: Path) -> None:
    proc = _run_gpu_wheel(
        "import tensorflow as tf\n"
        "tf.constant(1.0) + 1.0\n"
        "try:\n"
        "    import tflms.addon\n"
        "except RuntimeError as e:\n"
        "    print('ERR', type(e).__name__, e)\n"
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
    from tflms._addon_build import BuildError, check_tensorflow_version

    with pytest.raises(BuildError, match=r"TensorFlow 2\.21\.0 only.*tensorflow==2\.21\.0"):
        check_tensorflow_version("2.20.0")


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
