from setuptools import find_packages, setup

setup(
    name="minipar",
    version="0.1.0",
    description="A from-scratch, readable distributed-training engine: autograd, GPT-2, hand-written collectives, DP/TP/PP/ZeRO.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["minipar", "minipar.*", "kernels", "kernels.*"]),
    python_requires=">=3.9",
    install_requires=["numpy>=1.24", "mpi4py>=4.0", "mpich"],
    extras_require={
        "test": ["pytest>=7", "pytest-timeout>=2.1", "triton>=3.2"],  # triton: kernel tests run in its CPU interpreter
        "gpu": ["cupy-cuda12x", "triton"],
    },
    entry_points={"console_scripts": ["minipar=minipar.__main__:main"]},
)
