"""megatron_sp: Megatron-style GPT pretraining (TP/SP, PP, DP, CP) that runs on CPU and GPU."""
from pathlib import Path

from setuptools import find_packages, setup

setup(
    name="megatron_sp",
    version="0.1.0",
    description="Megatron-style GPT pretraining with tensor, sequence, pipeline, data and context parallelism; "
                "every parallel mode runs and is tested on CPU (gloo).",
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_sp", "megatron_sp.*"]),
    install_requires=[
        # Install the torch build for your hardware first (README): an unpinned torch pulls a CUDA build.
        "torch>=2.4",
        "numpy",
        "sentencepiece",
        "protobuf",  # reads a SentencePiece model's normalizer: the line-by-line fast path of preprocessing
        "pyyaml",
        "safetensors",  # checkpoint shards
    ],
    extras_require={
        # megatron-core: the data-compatibility tests compare against its own functions (wheels for x86_64;
        # elsewhere those tests skip).
        "test": ["pytest>=7", "transformers>=4.40", "matplotlib", "megatron-core==0.16.1; platform_machine == 'x86_64'"],
        "logging": ["wandb", "tensorboard", "matplotlib"],  # matplotlib: tools/plot_metrics.py
        # flash-attn builds against the installed CUDA torch.
        "gpu": ["flash-attn>=2.5"],
        # tokenizer.type=hf: a Hugging Face tokenizer.json through the `tokenizers` package alone.
        "hf": ["tokenizers>=0.15"],
        # Byte-compatibility and blending tests against megatron-core (its dataset modules import on CPU).
        "compat": ["megatron-core==0.16.1"],
    },
    scripts=[],
)
