"""Shared pytest set-up: tests run on CPU with one thread per process, like CI."""

import os

os.environ.setdefault("SLIPSTREAM_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")
