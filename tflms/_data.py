"""Where the patch tools find their inputs: the patches, tf/ and the engine sources in core/.

From a checkout (an editable install, or PYTHONPATH pointing at one) these are the checkout's
own top-level `patches/`, `tf/` and `core/`. An install from a wheel or an sdist has no
checkout: setup.py's build_py copies the same directories, laid out the same way, into the
package as `tflms/data/` (patches/*.patch, tf/**, core/include/**, core/src/**). Everything
that reads them asks `source_root()`; what writes a patch (`tflms patch generate`) asks
`checkout_root()`, because it must write into the checkout, never into site-packages.
"""

from __future__ import annotations

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
# The copy carried by a wheel; setup.py's SHIPPED_DIR names the same place.
SHIPPED_DIR = PACKAGE_DIR / "data"
PATCH_NAME = "tensorflow_v{version}_large_model_support.patch"


def checkout_root() -> Path | None:
    """The tflms checkout this package runs from, or None for an installed copy."""
    root = PACKAGE_DIR.parent
    if (root / "setup.py").is_file() and (root / "tf").is_dir() and (root / "core").is_dir():
        return root
    return None


def source_root() -> Path:
    """The directory holding patches/, tf/ and core/: the checkout, else the shipped copy.

    An installed package whose copy is missing still gets SHIPPED_DIR, so that messages
    name the place the files were expected.
    """
    return checkout_root() or SHIPPED_DIR


def patch_file(version: str, root: Path | None = None) -> Path:
    """The LMS patch for TensorFlow `version` under `root` (default: source_root())."""
    return (root or source_root()) / "patches" / PATCH_NAME.format(version=version)
