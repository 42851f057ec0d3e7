"""``bigbatch export``: a run's newest valid checkpoint as a Hugging Face GPT-2, Llama or mixture-of-experts model."""

from __future__ import annotations

import argparse
from pathlib import Path

from bigbatch.cli.common import CHECKPOINT_MEANING

HELP = "write a run's newest valid checkpoint as a Hugging Face model (GPT-2, Llama, Mixtral, Qwen2-MoE or Qwen3-MoE)"
DESCRIPTION = (
    "Write the model of the newest valid checkpoint (config.json + model.safetensors) and its tokenizer, loadable "
    "with transformers' GPT2LMHeadModel.from_pretrained(OUT_DIR), or LlamaForCausalLM's for a Llama run, "
    "MixtralForCausalLM's for an MoE run (Qwen3MoeForCausalLM's with query/key norms, Qwen2MoeForCausalLM's with a "
    "shared expert). A LoRA run's adapters are merged in, or written alone with --adapter. The line it prints says how "
    "far the reloaded export's logits are from the trained model's on a held batch. Needs the hf extra (pip install "
    "-e '.[hf]': transformers, and peft for --adapter), checked before anything is written; OUT appears whole or not "
    "at all."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", type=Path, metavar="RUN_DIR", help=CHECKPOINT_MEANING)
    parser.add_argument(
        "--format",
        default="hf",
        choices=("hf",),
        help="hf: the Hugging Face layout of the run's model, GPT-2, Llama, Mixtral, Qwen2-MoE or Qwen3-MoE (default)",
    )
    parser.add_argument(
        "--adapter",
        action="store_true",
        help="a LoRA run of --model hf:DIR: write only its adapters (adapter_config.json + adapter_model.safetensors, "
        "as peft loads them over DIR) instead of the merged model",
    )
    parser.add_argument("out_dir", type=Path, metavar="OUT_DIR", help="new (or empty) output directory")


def run(args: argparse.Namespace) -> int:
    from bigbatch.artifacts.export import export_hf

    print(export_hf(args.run, args.out_dir, adapter=args.adapter))
    return 0
