"""Build the optional C kernels (byte-shuffle, row-wise quantization, changed rows, a SIGTERM hook); the rest is in pyproject.toml.

``optional=True``: without a C compiler the install still succeeds and ckpt_core uses its numpy
code (same bytes; shuffle about 3x the CPU, greedy quantization about 5x: docs/performance.md,
docs/quantization.md).
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension("ckpt_core._cshuffle", sources=["core/_cshuffle.c"],
                             extra_compile_args=["-O3"], optional=True),
                   Extension("ckpt_core._cquant", sources=["core/_cquant.c"],  # rowwise quantization
                             extra_compile_args=["-O3", "-ffp-contract=off"], optional=True),
                   Extension("ckpt_core._crows", sources=["core/_crows.c"],  # incremental: changed rows
                             extra_compile_args=["-O3"], optional=True),
                   Extension("ckpt_core._csig", sources=["core/_csig.c"],  # SIGTERM off the main thread
                             optional=True)])
