"""Package metadata for Slipstream.

Compiled ops are built just in time on first use (and cached); ``SLIPSTREAM_BUILD_OPS=1 pip
install --no-build-isolation .`` compiles them at install time instead, against the torch already
installed (see docs/ops.md). The C++/CUDA sources ship inside the package as ``slipstream/ops/csrc``
so a JIT build works from any install.
"""

import os
import sys
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent
version: dict[str, str] = {}
exec((ROOT / "slipstream" / "version.py").read_text(), version)

ext_modules: list = []
cmdclass: dict = {}
if os.environ.get("SLIPSTREAM_BUILD_OPS", "") not in ("", "0"):
    sys.path.insert(0, str(ROOT))
    from slipstream.ops.build import aot_extensions  # needs torch: install with --no-build-isolation

    ext_modules, cmdclass = aot_extensions(str(ROOT))

setup(
    name="slipstream",
    version=version["__version__"],
    description="A training engine for PyTorch: ZeRO data parallelism, offload, mixed precision, reliable checkpoints",
    long_description=(ROOT / "README.md").read_text(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=[*find_packages(include=["slipstream", "slipstream.*"]), "slipstream.ops.csrc"],
    package_dir={"slipstream.ops.csrc": "csrc"},
    package_data={"slipstream": ["py.typed"], "slipstream.ops.csrc": ["**/*.h", "**/*.cpp", "**/*.cu", "**/*.cuh"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    install_requires=[
        # Any build the user already has (CPU, CUDA, ROCm) from 2.6 on (the oldest scripts/compat_check.sh
        # can test: transformers 5 needs 2.6); we never pin an exact wheel.
        "torch>=2.6",
        "pydantic>=2.5,<3",
        "hjson>=3.1",
        "psutil>=5.9",
        "py-cpuinfo>=9.0",
        "ninja>=1.11",
        "packaging>=23",
        "safetensors>=0.4",  # checkpoints: tensors are never unpickled
        "numpy>=1.22",  # checkpoints: single-threaded, GIL-free copies and writes of tensor bytes
    ],
    extras_require={
        "test": ["pytest>=7.4", "hypothesis>=6.100", "transformers>=5.17,<6", "safetensors>=0.4", "tensorboard>=2.14"],
        "monitor": ["tensorboard>=2.14", "tqdm>=4.66"],
        # Host libraries of slipstream.integrations, in the ranges the tests run against.
        "hf": ["transformers>=5.17,<6", "accelerate>=1.10,<2"],
        "lightning": ["lightning>=2.5,<3"],
        # TRL's trainers switch with slipstream_trainer(); the hosts' stock examples read their data with datasets.
        "trl": ["transformers>=5.17,<6", "accelerate>=1.10,<2", "trl>=1.16,<2"],
        "dev": [
            "pytest>=7.4",
            "hypothesis>=6.100",
            "transformers>=5.17,<6",
            "accelerate>=1.10,<2",
            "lightning>=2.5,<3",
            "safetensors>=0.4",
            "tensorboard>=2.14",
            "tqdm>=4.66",
            "trl>=1.16,<2",
            "datasets>=5.2,<6",
            # The formatter and linter (ruff.toml), exact: its output changes between releases.
            "ruff==0.17.6",
        ],
    },
    entry_points={"console_scripts": ["slipstream=slipstream.cli:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "License :: OSI Approved :: Apache Software License",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
