#!/usr/bin/env bash
# Learning from rewards on a laptop CPU (docs/rewards.md): a ~0.8M-parameter GPT learns two-number addition from
# 4,000 supervised rows (about a minute), then improves on 64 prompts by rewards alone (the exact answer, and the
# answer's format): the mean reward of a step goes from about 0.30 to about 0.53 in 200 steps (under a minute).
# Usage: bash examples/rewards_demo.sh [DIR]   (default runs/rewards-demo; uses the project's bigbatch)
set -euo pipefail
DIR="${1:-runs/rewards-demo}"
BIGBATCH="${BIGBATCH:-bigbatch}"
PYTHON="${PYTHON:-python}"
mkdir -p "$DIR"
"$PYTHON" -c "import sys; from pathlib import Path; from bigbatch.rewards.demo_task import write_task; write_task(Path(sys.argv[1]), n_prompts=64)" "$DIR"
DATA=(--data "$DIR/sft.jsonl" --data-mode documents --tokenizer byte --seq-len 16)
# 1. supervised: prompt "23+58=", completion "81\n", 400 steps: it answers about a quarter of the sums
"$BIGBATCH" train "${DATA[@]}" --model nano --micro-batch 64 --total-batch-tokens 1024 --max-steps 400 \
    --lr 3e-3 --eval-every 200 --sample-tokens 0 --noise-scale-every 0 --out "$DIR/sft"
"$BIGBATCH" export "$DIR/sft" --format hf "$DIR/sft-hf"
# 2. rewards alone: 8 prompts x 8 sampled completions a step, group-relative advantages, token-mean
"$BIGBATCH" train "${DATA[@]}" --init-from "$DIR/sft-hf" --objective grpo --prompts "$DIR/prompts.jsonl" \
    --reward builtin:exact-answer,builtin:format=0.2 --stop '\n' --group-size 8 --prompts-per-step 8 \
    --max-completion-tokens 5 --micro-batch 64 --max-steps 200 --lr 2e-4 --warmup-steps 10 --sample-tokens 0 \
    --out "$DIR/grpo"
"$BIGBATCH" report "$DIR/grpo"
