"""Builds hfreduce's compiled core, ``fireflyer.hfreduce._core``; everything else is in pyproject.toml.

The extension is plain C against the CPython API, compiled by the system compiler: no
torch, numpy or pybind11 headers, so build isolation never pulls in a torch. It is
optional: where no C compiler works, the install still succeeds and hfreduce falls back
to its torch reference path (``fireflyer.hfreduce.engine.kernels`` warns once).

Every ``src/fireflyer/hfreduce/_core/*.c`` is part of the one module. The AVX2 and
AVX-512 kernels carry their own ``target`` attributes and are chosen at import by CPU
feature, so the module itself is built for the baseline ISA and runs anywhere.
"""

import glob
import os
import sys

from setuptools import Extension, setup

CORE = os.path.join("src", "fireflyer", "hfreduce", "_core")

# -ffp-contract=off: no fused multiply-add, so every sum rounds as torch's separate add does.
# Never -ffast-math: NaN, signed zeros and subnormals must behave as IEEE 754 says.
COMPILE_ARGS = [] if sys.platform == "win32" else [
    "-O3",
    "-ffp-contract=off",
    "-fno-strict-aliasing",
    "-fvisibility=hidden",
    "-std=gnu11",
    "-Wall",
]

core = Extension(
    "fireflyer.hfreduce._core",
    sources=sorted(glob.glob(os.path.join(CORE, "*.c"))),
    depends=sorted(glob.glob(os.path.join(CORE, "*.h"))),
    include_dirs=[CORE],
    extra_compile_args=COMPILE_ARGS,
    optional=True,
)

setup(ext_modules=[core])
