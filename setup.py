"""Package metadata for Slipstream.

Compiled ops are built just in time by default; ``SLIPSTREAM_BUILD_OPS=1`` asks for an
ahead-of-time build once the ops land (see ``slipstream/ops``).
"""

from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent
version: dict[str, str] = {}
exec((ROOT / "slipstream" / "version.py").read_text(), version)

setup(
    name="slipstream",
    version=version["__version__"],
    description="A training engine for PyTorch: ZeRO data parallelism, offload, mixed precision, reliable checkpoints",
    long_description=(ROOT / "README.md").read_text(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["slipstream", "slipstream.*"]),
    package_data={"slipstream": ["py.typed"]},
    install_requires=[
        # Any build the user already has (CPU, CUDA, ROCm) from 2.4 on; we never pin an exact wheel.
        "torch>=2.4",
        "pydantic>=2.5,<3",
        "hjson>=3.1",
        "psutil>=5.9",
        "py-cpuinfo>=9.0",
        "ninja>=1.11",
        "packaging>=23",
    ],
    extras_require={
        "test": ["pytest>=7.4", "transformers>=4.40", "safetensors>=0.4"],
        "monitor": ["tensorboard>=2.14", "tqdm>=4.66"],
        "dev": ["pytest>=7.4", "transformers>=4.40", "safetensors>=0.4", "tensorboard>=2.14", "tqdm>=4.66"],
    },
    entry_points={"console_scripts": ["slipstream=slipstream.launcher.cli:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "License :: OSI Approved :: Apache Software License",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
