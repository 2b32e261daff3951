"""The compiled pieces, built by ``pip install`` where a C compiler is found;
without them pycoll runs the same steps in Python (pycoll/_step.c and
transports/_ring.c say what they do)."""

from setuptools import Extension, setup

COPIES = "transports/_copies.h"  # the copies every extension includes

# Python's own CFLAGS decide the optimization level otherwise: -O2 in many
# distributions' builds, where GCC 12 and later leave _step.c's reduction loops
# unvectorized.  On the Xeon GPU hosts (Ubuntu's Python, GCC 13) a 64 KiB
# float32 sum took 7.3 us at -O2 and 2.6 at -O3 (NumPy's 2.4), a 64 KiB
# allreduce at n = 2 29 us and 17 (benchmarks/results/gpu/2026-12-06/O3_console.txt).
OPT = ["-O3"]

setup(
    ext_modules=[
        Extension(name, [src], depends=[COPIES], optional=True, extra_compile_args=OPT)
        for name, src in (
            ("pycoll._step", "pycoll/_step.c"),
            ("pycoll._replay", "pycoll/_replay.c"),
            ("transports._ring", "transports/_ring.c"),
        )
    ]
)
