"""The compiled pieces, built by ``pip install`` where a C compiler is found;
without them pycoll runs the same steps in Python (pycoll/_step.c and
transports/_ring.c say what they do)."""

from setuptools import Extension, setup

COPIES = "transports/_copies.h"  # the copies every extension includes

setup(
    ext_modules=[
        Extension("pycoll._step", ["pycoll/_step.c"], depends=[COPIES], optional=True),
        Extension("pycoll._replay", ["pycoll/_replay.c"], depends=[COPIES], optional=True),
        Extension("transports._ring", ["transports/_ring.c"], depends=[COPIES], optional=True),
    ]
)
