"""The one compiled piece, built by ``pip install`` where a C compiler is found;
without it pycoll runs the same steps in Python (pycoll/_step.c says what it does)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("pycoll._step", ["pycoll/_step.c"], optional=True)])
