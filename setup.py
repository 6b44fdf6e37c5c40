"""miles: RL post-training of LLMs as one SPMD job (torchrun / mpirun / sbatch), no Ray."""

from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent


def _requirements() -> list[str]:
    lines = (HERE / "requirements.txt").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]


setup(
    name="miles",
    version="0.1.0",
    description="RL post-training (GRPO, GSPO, PPO, REINFORCE++, SFT, OPD) as one SPMD job, without Ray",
    long_description=(HERE / "README.md").read_text() if (HERE / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.11",
    packages=find_packages(include=["miles", "miles.*"]),
    package_data={"miles.config": ["megatron_flags.txt", "miles_flags.txt", "sglang_server_args.json", "sglang_router_args.json"]},
    install_requires=_requirements(),
    extras_require={
        # SGLang pins its own torch + CUDA kernels: install it on GPU nodes only.
        "sglang": ["sglang>=0.5.0"],
        "megatron": ["megatron-core==0.16.1", "psutil>=5.9"],  # psutil: megatron-core's checkpoint writer
        "ft": ["torchft>=0.2.0", "nvidia-resiliency-ext>=0.4.1"],
        "wandb": ["wandb>=0.20"],
        "mpi": ["mpi4py>=4.0"],
        "test": ["megatron-core>=0.16", "psutil>=5.9", "pytest>=8", "pytest-timeout>=2.3", "ruff>=0.6", "torchft>=0.2.0", "mpi4py>=4.0", "wandb>=0.20"],
    },
    entry_points={"console_scripts": ["miles-engine=miles.engine.__main__:main"]},
    classifiers=["License :: OSI Approved :: Apache Software License", "Programming Language :: Python :: 3.11"],
)
