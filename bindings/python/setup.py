"""Build the wheel with libtinyloop inside.

The metadata is in pyproject.toml. Building the package also builds the library: `cargo build
--release` in the TinyLoop checkout this folder belongs to (a no-op when target/release, or
CARGO_TARGET_DIR, is fresh), then libtinyloop.so is copied into the package, with the CUDA kernels
precompiled for sm_80 and sm_90a when scripts/ship-kernels ships them (TINYLOOP_SHIP_KERNELS=1,
or an NVIDIA driver on this machine). `pip install -v` shows the build's progress. The wheel is
tagged for this platform but any Python 3: the binding is plain ctypes.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1
    from wheel.bdist_wheel import bdist_wheel

ROOT = Path(__file__).resolve().parent.parent.parent
LIBRARY = "libtinyloop.so"


def run(command, **kwargs):
    try:
        subprocess.run(command, cwd=ROOT, check=True, **kwargs)
    except FileNotFoundError as e:
        sys.exit(f"tinyloop_py: cannot run {command[0]} ({e}); building the package needs Rust's cargo")
    except subprocess.CalledProcessError as e:
        sys.exit(f"tinyloop_py: {' '.join(map(str, command))} failed with status {e.returncode}")


class build_py_with_library(build_py):
    """The Python files, plus the library and kernels of a release build."""

    def run(self):
        super().run()
        if not (ROOT / "Cargo.toml").is_file() or not (ROOT / "include" / "tinyloop.h").is_file():
            sys.exit(
                f"tinyloop_py: {ROOT} is not a TinyLoop checkout; build the package from "
                "bindings/python of one (pip >= 21.3 builds a local folder in place)"
            )
        run(["cargo", "build", "--release", "--lib", "--bins"])
        release = ROOT / os.environ.get("CARGO_TARGET_DIR", "target") / "release"
        package = Path(self.build_lib).resolve() / "tinyloop_py"
        shutil.copy2(release / LIBRARY, package / LIBRARY)
        kernels = package / "tinyloop" / "kernels"
        shutil.rmtree(kernels, ignore_errors=True)
        env = dict(os.environ, TINYLOOP_BIN=str(release / "tinyloop"), PYTHON=sys.executable)
        run([str(ROOT / "scripts" / "ship-kernels"), str(kernels)], env=env)


class NativeDistribution(Distribution):
    """Native code inside: built into the platform folder and installed as platlib."""

    def has_ext_modules(self):
        return True


class bdist_wheel_for_platform(bdist_wheel):
    """py3-none-<platform>: no Python extension module, so any Python 3 version."""

    def get_tag(self):
        return "py3", "none", super().get_tag()[2]


setup(
    distclass=NativeDistribution,
    cmdclass={"build_py": build_py_with_library, "bdist_wheel": bdist_wheel_for_platform},
)
