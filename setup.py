# Thin shim for tools that still call setup.py; metadata lives in pyproject.toml.
from setuptools import setup

setup()
