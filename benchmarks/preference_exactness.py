"""Every preference objective through ``bigbatch train``: the same update however the step is cut, on CPU.

    python benchmarks/preference_exactness.py                 # every objective, LoRA and full, about 8 minutes
    python benchmarks/preference_exactness.py --objectives dpo,kto --no-processes

The model is a tiny Qwen2 (2 layers, 32 wide) over a tokenizer directory laid out as Qwen2.5-Instruct ships it,
with its real chat template, byte for byte (tests/support/real_chat), built here offline. The data: 48
conversational pairs (``prompt``/``chosen``/``rejected`` messages, a short system prompt in place of the
template's long default one) and 48 KTO rows, rendered by that template.
Each run trains 3 AdamW steps (fp32, lr 1e-2, no warm-up) of 8 rows of 64 tokens a step, and the runs that cut
the same steps differently are compared by the relative L2 distance of their final parameters (LoRA: the
adapters; full: every parameter; goal: at most 1e-5):

* one answer a row (``--pack off``): micro-batch 8 x K 1 (the reference), 2 x K 4, and 2 processes of 4 x K 1;
* packed rows (``--pack on``): 4 x K 2 (the reference) and 2 processes of 4 x K 1 (the loader deals the same
  packed micro-batches to the ranks as to one process's K);
* and ``bigbatch verify --objective NAME --nproc 2`` for each objective: each term across two ranks holding uneven
  pairs (rank 0 one, then micro-batches of none).

A pair (a KTO row) is two rows when unpacked, so 2 x K 4 holds one pair a micro-batch and 8 x K 1 all four.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "support"))
from real_templates import real_chat_dir  # noqa: E402

OBJECTIVES = ("dpo", "ipo", "simpo", "orpo", "kto")
WORDS = "the cat sat on a mat while dogs ran far away from home and birds sang in tall green trees".split()


def tiny_chat_model(directory: Path) -> Path:
    """Qwen2.5's tokenizer layout and real template, and a tiny random Qwen2 over that vocabulary."""
    import transformers
    from tokenizers import Tokenizer

    real_chat_dir(directory, "qwen2.5")
    tokenizer = Tokenizer.from_str((directory / "tokenizer.json").read_text(encoding="utf-8"))
    eos = tokenizer.token_to_id("<|im_end|>")
    config = transformers.AutoConfig.for_model(
        "qwen2",
        vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        eos_token_id=eos,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(str(directory))
    return directory


def sentence(gen: random.Random, low: int, high: int) -> str:
    return " ".join(gen.choice(WORDS) for _ in range(gen.randint(low, high)))


def write_data(root: Path) -> dict[str, Path]:
    gen = random.Random(0)
    pairs, kto = root / "pairs.jsonl", root / "kto.jsonl"
    with pairs.open("w") as f:
        for _ in range(48):
            row = {
                "prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": sentence(gen, 2, 6)}],
                "chosen": [{"role": "assistant", "content": sentence(gen, 1, 5)}],
                "rejected": [{"role": "assistant", "content": sentence(gen, 1, 5)}],
            }
            f.write(json.dumps(row) + "\n")
    with kto.open("w") as f:
        for i in range(48):
            row = {
                "prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": sentence(gen, 2, 6)}],
                "completion": [{"role": "assistant", "content": sentence(gen, 1, 5)}],
                "label": i % 3 != 1,
            }
            f.write(json.dumps(row) + "\n")
    return {"pairs": pairs, "kto": kto}


def bigbatch(*args: str) -> None:
    done = subprocess.run(
        [str(Path(sys.executable).parent / "bigbatch"), *args], capture_output=True, text=True, check=False
    )
    if done.returncode:
        raise SystemExit(f"bigbatch {' '.join(args)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")


def trained(run: Path, lora: bool) -> dict[str, torch.Tensor]:
    from bigbatch.run.checkpoints.checkpoint import load_checkpoint, resolve_checkpoint

    state = load_checkpoint(resolve_checkpoint(run))["model"]
    return {k: v.float() for k, v in state.items() if (("lora_" in k) if lora else v.is_floating_point())}


def worst(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest relative L2 distance over the tensors, and over all of them flattened, of ``a`` from ``b``."""
    flat_a = torch.cat([a[k].reshape(-1) for k in sorted(b)])
    flat_b = torch.cat([b[k].reshape(-1) for k in sorted(b)])
    return float((flat_a - flat_b).norm() / flat_b.norm())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objectives", default=",".join(OBJECTIVES))
    parser.add_argument("--no-processes", action="store_true", help="leave out the two-process runs")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = tiny_chat_model(root / "model")
        data = write_data(root)
        print("relative L2 of the final parameters after 3 AdamW steps against the reference cut (goal <= 1e-5)")
        print(f"{'objective':<9} {'weights':<7} {'rows':<8} {'run':<26} {'rel L2':>9}")
        for objective in args.objectives.split(","):
            source = data["kto" if objective == "kto" else "pairs"]
            for lora in (True, False):
                common = [
                    *("train", "--model", f"hf:{model}", "--data", str(source), "--objective", objective),
                    *("--seq-len", "64", "--total-batch-tokens", "512", "--max-steps", "3", "--eval-every", "0"),
                    *("--sample-tokens", "0", "--lr", "1e-2", "--warmup-steps", "0", "--shuffle", "off"),
                    *("--cache-dir", str(root / "cache")),
                    *(["--lora-rank", "8"] if lora else []),
                ]
                arms = {
                    "off": {
                        "8 x K 1": ["--micro-batch", "8"],
                        "2 x K 4": ["--micro-batch", "2"],
                        "2 processes x 4 x K 1": ["--micro-batch", "4", "--nproc", "2"],
                    },
                    "on": {
                        "4 x K 2": ["--micro-batch", "4"],
                        "2 processes x 4 x K 1": ["--micro-batch", "4", "--nproc", "2"],
                    },
                }
                for pack, runs in arms.items():
                    reference = None
                    for label, extra in runs.items():
                        if args.no_processes and "processes" in label:
                            continue
                        out = root / "runs" / f"{objective}-{lora}-{pack}-{label.replace(' ', '')}"
                        bigbatch(*common, "--pack", pack, *extra, "--out", str(out))
                        params = trained(out, lora)
                        if reference is None:
                            reference = params
                            shown = "reference"
                        else:
                            shown = f"{worst(params, reference):9.2e}"
                        weights = "LoRA" if lora else "full"
                        rows = "packed" if pack == "on" else "unpacked"
                        print(f"{objective:<9} {weights:<7} {rows:<8} {label:<26} {shown:>9}", flush=True)
        if not args.no_processes:
            verify_across_ranks(args.objectives.split(","))


def verify_across_ranks(objectives: list[str]) -> None:
    """``bigbatch verify --objective NAME --nproc 2``: each term after DDP's one sync, rank 0 holding one pair and
    then micro-batches of none, against one process holding every pair."""
    print("bigbatch verify --model pico --seq-len 32 --nproc 2: each term across two ranks, uneven (goal <= 1e-5)")
    for objective in objectives:
        done = subprocess.run(
            [
                str(Path(sys.executable).parent / "bigbatch"),
                *("verify", "--model", "pico", "--objective", objective, "--seq-len", "32", "--nproc", "2"),
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        lines = [line.strip() for line in done.stdout.splitlines() if "split ranks" in line or "verdict" in line]
        print(f"  {objective:<6} " + " | ".join(lines), flush=True)


if __name__ == "__main__":
    main()
