"""Build the optional C byte-shuffle kernels; everything else is configured in pyproject.toml.

``optional=True``: without a C compiler the install still succeeds and ckpt_core uses its numpy
shuffle (same bytes, about 3x the CPU; see docs/performance.md).
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension("ckpt_core._cshuffle", sources=["core/_cshuffle.c"],
                             extra_compile_args=["-O3"], optional=True)])
