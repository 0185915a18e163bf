"""Install hyper_parallel: ``pip install -e .[test]``."""

from setuptools import find_packages, setup

setup(
    name="hyper_parallel",
    version="0.1.0",
    description="Distributed checkpoint for MindSpore training jobs: sharded, deduplicated, async, reshardable",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=find_packages(include=["hyper_parallel", "hyper_parallel.*"]),
    install_requires=[
        # A range, so that a cluster's matched Ascend build is kept; tested with 2.10.0 (CPU).
        "mindspore>=2.6,<2.11",
        "numpy<2",
        "safetensors>=0.4",
        "xxhash>=3.0",
        "tqdm>=4.60",
    ],
    extras_require={
        "zstd": ["zstandard>=0.22"],
        "s3": ["s3fs", "fsspec"],
        "test": ["pytest>=7", "pytest-cov>=5", "coverage>=7.10", "zstandard>=0.22", "psutil>=5",
                 "pytest-timeout>=2.1", "s3fs", "fsspec", "moto[server]"],
    },
    entry_points={"console_scripts": ["hp-ckpt=hyper_parallel.cli.main:main"]},
)
