# SPDX-License-Identifier: Apache-2.0
"""Build hooks for `pip install .` (the metadata is in pyproject.toml).

build_py runs `make` for build/libvpager.so and copies it into the package;
the wheel is tagged py3-none-<platform>: it holds a native library, but one
that does not depend on the Python version. VPAGER_NO_MAKE=1 skips `make`
(build/libvpager.so must exist then).
"""

import os
import shutil
import subprocess

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

ROOT = os.path.dirname(os.path.abspath(__file__))
LIB = os.path.join(ROOT, "build", "libvpager.so")


class BuildPyWithLibrary(build_py):
    def run(self):
        if not os.environ.get("VPAGER_NO_MAKE"):
            # A plain build: SAN builds live elsewhere and need preloading.
            subprocess.check_call(["make", "-C", ROOT, "SAN=", "BUILD=build",
                                   "build/libvpager.so"])
        if not os.path.isfile(LIB):
            raise SystemExit("vpager: %s is missing; run `make` first" % LIB)
        super().run()
        dest = os.path.join(self.build_lib, "vpager")
        os.makedirs(dest, exist_ok=True)
        shutil.copy2(LIB, os.path.join(dest, "libvpager.so"))

    def get_outputs(self, include_bytecode=1):
        return super().get_outputs(include_bytecode) + [
            os.path.join(self.build_lib, "vpager", "libvpager.so")]


cmdclass = {"build_py": BuildPyWithLibrary}

try:  # setuptools >= 70.1 has its own bdist_wheel; older ones use wheel's.
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:
    try:
        from wheel.bdist_wheel import bdist_wheel
    except ImportError:
        bdist_wheel = None

if bdist_wheel is not None:
    class BdistWheelAnyPython(bdist_wheel):
        def get_tag(self):
            _, _, plat = super().get_tag()
            return "py3", "none", plat

    cmdclass["bdist_wheel"] = BdistWheelAnyPython


class DistributionWithLibrary(Distribution):
    """Holds a native library: platform wheel, installed into platlib."""

    def has_ext_modules(self):
        return True


setup(cmdclass=cmdclass, distclass=DistributionWithLibrary,
      options={"build": {"build_base": os.path.join("build", "python")}})
