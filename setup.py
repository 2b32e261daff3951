"""The compiled pieces, built by ``pip install`` where a C compiler is found;
without them pycoll runs the same steps in Python (pycoll/_step.c and
transports/_ring.c say what they do)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("pycoll._step", ["pycoll/_step.c"], optional=True),
        Extension("pycoll._replay", ["pycoll/_replay.c"], optional=True),
        Extension("transports._ring", ["transports/_ring.c"], optional=True),
    ]
)
