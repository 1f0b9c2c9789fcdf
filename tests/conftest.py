"""Shared pytest set-up: tests run on CPU with one thread per process, like CI."""

import os

os.environ.setdefault("SLIPSTREAM_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA device; scripts/gpu_check.sh runs these on a GPU machine")
