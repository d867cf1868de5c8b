from setuptools import find_packages, setup

setup(
    name="minipar",
    version="0.1.0",
    description="A from-scratch, readable distributed-training engine: autograd, GPT-2, hand-written collectives, DP/TP/PP/ZeRO.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    # The repository keeps the Triton kernels in ./kernels, but they install (and import) as
    # minipar.kernels: a top-level "kernels" would collide with an unrelated PyPI package.
    packages=find_packages(include=["minipar", "minipar.*"]) + ["minipar.kernels"],
    package_dir={"minipar.kernels": "kernels"},
    python_requires=">=3.9",
    # regex: GPT-2's pre-tokenizer pattern needs the Unicode classes \p{L} and \p{N}, which re lacks
    install_requires=["numpy>=1.24", "mpi4py>=4.0", "mpich", "regex>=2022.1", "ml_dtypes>=0.3"],
    extras_require={
        # triton: kernel tests run in its CPU interpreter; tokenizers: the reference for the GPT-2 BPE test;
        # matplotlib: the picture tests
        "test": ["pytest>=7", "pytest-timeout>=2.1", "triton>=3.2", "tokenizers>=0.15", "matplotlib>=3.5"],
        "gpu": ["cupy-cuda12x", "triton"],
        # hf: tests/test_transformers.py compares minipar's GPT-2 with transformers' (torch's CPU build is enough);
        # torchao's float8 training (emulate=True runs on the CPU) is tests/test_precision.py's FP8 oracle
        "hf": ["transformers>=4.40", "torch", "tokenizers>=0.15", "torchao>=0.10"],
        "plot": ["matplotlib>=3.5"],
        # docs: mkdocs build --strict of mkdocs.yml, and docs/check_site.py (which drives Debian's chromium)
        "docs": ["mkdocs-material>=9.5", "matplotlib>=3.5", "playwright>=1.40"],
    },
    entry_points={"console_scripts": ["minipar=minipar.__main__:main"]},
)
