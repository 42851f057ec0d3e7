"""Fine-tuning a chat model with LoRA on conversations: exactness, masks per template family, optimizer memory.

    python benchmarks/chat_finetune.py [--steps 4] [--skip-processes]

Everything is built here, offline (tests/support/chat_models.py): tiny chat-model directories of nine template
families, a tiny random Qwen2 model, and conversations whose assistant replies run from one word to several
hundred characters.

1. **Exactness.** ``bigbatch train --model hf:DIR --lora-rank 8`` on the conversations, micro-batch 8 x K 1
   (the reference), 1 x K 8 and, unless ``--skip-processes``, 2 processes of 4 x K 1, packed and one per row:
   the largest relative L2 difference of any adapter tensor from the reference's.
2. **Templates** (the project's look-alikes; the real templates are benchmarks/chat_templates.py's). For each family: whether bigbatch masks every assistant reply and its end of turn exactly (the
   decoded trained runs against hand-written expectations) or refuses it (its line); and whether transformers'
   ``return_assistant_tokens_mask`` (what TRL's ``assistant_only_loss`` relies on) gives a mask, and whether that
   mask is bigbatch's token for token.
3. **Memory.** AdamW's state after one step for LoRA rank 16 against full fine-tuning of the same ``hf:`` model
   (Qwen2s of 4 layers, 256 and 1,024 wide): bytes and their ratio.

4. **TRL**, where ``trl`` can be imported (it is not among the project's pins: ``pip install --no-deps --target DIR
   trl==1.16.0`` and ``PYTHONPATH=DIR``): its SFTTrainer with ``assistant_only_loss`` on the marked template, its
   labels against bigbatch's mask, the first loss at K = 1, and each tool's K = 8 update (SGD, no clipping)
   against its own big-batch update.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "support"))
from chat_models import FAMILIES, GENERATION_MARKED, chat_model_dir, conversations  # noqa: E402

from bigbatch.data.chat import ChatEncoder, ChatSettings, conversation_from_record  # noqa: E402
from bigbatch.engine.optim import build_adamw  # noqa: E402
from bigbatch.errors import BigBatchError  # noqa: E402

ENDS = {
    "llama3": "<|eot_id|>",
    "qwen2.5": "<|im_end|>",
    "qwen3": "<|im_end|>",
    "mistral": "</s>",
    "gemma": "<end_of_turn>",
    "phi3": "<|end|>",
    "smollm": "<|im_end|>",
    "gpt-oss": ("<|end|>", "<|return|>"),  # the last reply closes with <|return|>, earlier ones with <|end|>
    "plain": "",
}
ROW = {
    "messages": [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "hello there"},
        {"role": "user", "content": "how are you"},
        {"role": "assistant", "content": "I am fine, thank you"},
    ]
}


def bigbatch(*args: str) -> None:
    subprocess.run([str(Path(sys.executable).parent / "bigbatch"), *args], check=True, capture_output=True, text=True)


def adapters(run: Path) -> dict[str, torch.Tensor]:
    from bigbatch.run.checkpoints.checkpoint import load_checkpoint, resolve_checkpoint

    state = load_checkpoint(resolve_checkpoint(run))["model"]
    return {name: value.float() for name, value in state.items() if "lora_" in name}


def exactness(root: Path, steps: int, processes: bool) -> None:
    model = chat_model_dir(root / "model", "qwen2.5", with_model=True)
    data = root / "chat.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in conversations() * 8))
    common = [
        *("train", "--model", f"hf:{model}", "--data", str(data), "--data-mode", "documents", "--seq-len", "64"),
        *("--total-batch-tokens", "512", "--max-steps", str(steps), "--eval-every", "0", "--sample-tokens", "0"),
        *("--noise-scale-every", "0", "--lr", "1e-2", "--warmup-steps", "0", "--lora-rank", "8"),
        *("--cache-dir", str(root / "cache")),
    ]
    print("exactness: LoRA rank 8, relative L2 of the adapters from micro-batch 8 x K 1 (goal <= 1e-5)")
    for pack in ("on", "off"):
        reference = root / f"ref-{pack}"
        bigbatch(*common, "--pack", pack, "--micro-batch", "8", "--out", str(reference))
        arms = {"1 x K 8": ["--micro-batch", "1"]}
        if processes:
            arms["2 processes x 4 x K 1"] = ["--micro-batch", "4", "--nproc", "2"]
        ref = adapters(reference)
        for label, extra in arms.items():
            out = root / f"{label.replace(' ', '')}-{pack}"
            bigbatch(*common, "--pack", pack, *extra, "--out", str(out))
            theirs = adapters(out)
            worst = max(((theirs[k] - v).norm() / v.norm().clamp_min(1e-30)).item() for k, v in ref.items())
            print(f"  pack {pack:3} | {label:22} | {len(ref)} adapter tensors | max relative L2 {worst:.2e}")


def transformers_mask(directory: Path, row: dict) -> list[int] | None:
    """transformers' assistant mask (TRL's assistant_only_loss), or None where it gives none."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    try:
        out = tokenizer.apply_chat_template(
            row["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
    except Exception:  # a template transformers cannot mask
        return None
    mask = list(out.get("assistant_masks") or [])
    return mask if any(mask) else None


def templates(root: Path) -> None:
    print("templates: bigbatch's mask (hand-marked: each reply and its end of turn) | transformers' assistant mask")
    correct = accepted = agree = 0
    for family in FAMILIES:
        directory = chat_model_dir(root / f"t-{family}", family)
        encoder = ChatEncoder((directory / "tokenizer.json").read_text(), directory, ChatSettings())
        try:
            encoded = encoder.encode(conversation_from_record(ROW, "row"))
            assert encoded is not None
            runs = [encoder.decode(encoded.ids[a:b].tolist()).strip() for a, b in encoded.spans]
            first, last = (ENDS[family], ENDS[family]) if isinstance(ENDS[family], str) else ENDS[family]
            opening = "<|channel|>final<|message|>" if family == "gpt-oss" else ""  # written after its header
            ok = runs == [f"{opening}hello there{first}", f"{opening}I am fine, thank you{last}"]
            ours = "exact" if ok else f"WRONG {runs}"
            correct += ok
        except BigBatchError as exc:
            encoded, ours = None, f"refused: {str(exc)[:90]}..."
        theirs = transformers_mask(directory, ROW)
        accepted += theirs is not None
        same = ""
        if theirs is not None and encoded is not None:
            ours_mask = encoded.mask.tolist()
            same = " (the same tokens)" if theirs[1:] == ours_mask[1:] else " (other tokens)"
            agree += theirs[1:] == ours_mask[1:]
        marked = "markers" if family in GENERATION_MARKED else "no markers"
        print(f"  {family:8} ({marked:10}) | bigbatch {ours} | transformers {'mask' if theirs else 'none'}{same}")
    print(
        f"  bigbatch masks {correct} of {len(FAMILIES)} exactly; transformers/TRL gives a mask for {accepted}, "
        f"the same tokens as bigbatch's in {agree}"
    )


def optimizer_bytes(model: torch.nn.Module) -> int:
    optimizer = build_adamw(model, lr=1e-3)
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    return sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t))


def memory() -> None:
    """AdamW's state for LoRA rank 16 against full fine-tuning, at two widths: the adapters' share falls with the
    width (a rank-r adapter on a d x d map holds 2rd of its d**2 weights)."""
    import transformers

    from bigbatch.models.lora import LoraSettings, add_lora

    class Wrapped(torch.nn.Module):  # what hf:DIR wraps: the blocks are found inside hf_model
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.hf_model = inner

        def blocks(self) -> torch.nn.ModuleList:
            return self.hf_model.model.layers

    print("memory: AdamW state after one step, LoRA rank 16 against full fine-tuning (goal <= 0.05)")
    for width, ffn in ((256, 688), (1024, 2816)):
        config = transformers.Qwen2Config(
            vocab_size=4096,
            hidden_size=width,
            intermediate_size=ffn,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=4,
            max_position_embeddings=256,
            tie_word_embeddings=False,
        )
        torch.manual_seed(0)
        model = transformers.Qwen2ForCausalLM(config)
        n = sum(p.numel() for p in model.parameters())
        full = optimizer_bytes(model)
        wrapped = Wrapped(transformers.Qwen2ForCausalLM(config))
        report = add_lora(wrapped, LoraSettings(rank=16))
        lora = optimizer_bytes(wrapped)
        print(
            f"  Qwen2 4 x {width} ({n:,} parameters) | full {full / 2**20:.1f} MiB | LoRA {lora / 2**20:.2f} MiB "
            f"({report.adapter_parameters:,} adapter parameters) | ratio {lora / full:.4f}"
        )


def trl_comparison(root: Path) -> None:
    """TRL's SFTTrainer (``assistant_only_loss``) beside bigbatch on the marked template (the one TRL can mask): its
    labels against bigbatch's mask, the first loss at K = 1, and with SGD (so the update is the gradient, which
    AdamW's first step would hide) each tool's K = 8 update against its own one-big-batch update."""
    try:
        import trl  # noqa: F401
    except ImportError:
        print("trl: not installed; pip install --no-deps --target DIR trl==1.16.0 and PYTHONPATH=DIR to compare")
        return
    import copy

    import torch.nn.functional as F
    import transformers
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from bigbatch.engine.accumulate import AccumulationEngine
    from bigbatch.engine.batch import MicroBatch
    from bigbatch.engine.optim import constant_schedule

    directory = chat_model_dir(root / "trl-model", "smollm", with_model=True)
    encoder = ChatEncoder((directory / "tokenizer.json").read_text(), directory, ChatSettings())
    rows, ours = [], []
    for i, row in enumerate(conversations()):
        encoded = None if row.get("tools") else encoder.encode(conversation_from_record(row, f"row {i}"))
        if encoded is not None and len(encoded.ids) <= 128:  # the tiny model's context: neither tool truncates
            rows.append({"messages": row["messages"]})
            ours.append(encoded)
    rows, ours = rows[:8], ours[:8]
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory))
    base = transformers.AutoModelForCausalLM.from_pretrained(str(directory))
    lr = 0.5

    def trainer(model: torch.nn.Module, batch: int, accumulation: int) -> SFTTrainer:
        args = SFTConfig(
            output_dir=str(root / "trl-out"),
            assistant_only_loss=True,
            per_device_train_batch_size=batch,
            gradient_accumulation_steps=accumulation,
            max_steps=1,
            learning_rate=lr,
            lr_scheduler_type="constant",
            optim="sgd",
            max_grad_norm=0.0,
            weight_decay=0.0,
            report_to=[],
            max_length=128,
            save_strategy="no",
            use_cpu=True,
            logging_steps=1,
        )
        return SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer)

    def moved(model: torch.nn.Module) -> torch.Tensor:
        pairs = zip(model.parameters(), base.parameters(), strict=True)
        return torch.cat([(p.detach() - q.detach()).flatten() for p, q in pairs])

    def trl_update(batch: int, accumulation: int) -> tuple[torch.Tensor, float]:
        model = copy.deepcopy(base)
        run = trainer(model, batch, accumulation)
        run.train()
        return moved(model), float(run.state.log_history[0]["loss"])

    class Logits(torch.nn.Module):
        def __init__(self, model: torch.nn.Module) -> None:
            super().__init__()
            self.model = model

        def forward(self, idx: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
            return self.model(input_ids=idx).logits

    def micro_batch(group: list) -> MicroBatch:
        width = max(len(e.ids) for e in group) - 1
        inputs = torch.zeros(len(group), width, dtype=torch.long)
        targets = torch.full((len(group), width), -100)
        for i, e in enumerate(group):
            ids, mask = torch.tensor(e.ids), torch.tensor(e.mask).bool()
            target = ids[1:].clone()
            target[~mask[1:]] = -100
            inputs[i, : len(ids) - 1], targets[i, : len(ids) - 1] = ids[:-1], target
        return MicroBatch(inputs=inputs, targets=targets)

    def bigbatch_update(k: int) -> torch.Tensor:
        model = copy.deepcopy(base)
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        engine = AccumulationEngine(Logits(model), optimizer, constant_schedule(lr), grad_clip=0.0)
        per = len(ours) // k
        engine.step([micro_batch(ours[i * per : (i + 1) * per]) for i in range(k)])
        return moved(model)

    prepared = trainer(copy.deepcopy(base), 8, 1).train_dataset
    by_ids = {tuple(e.ids.tolist()): e for e in ours}
    same_ids = same_mask = 0
    for example in prepared:
        match = by_ids.get(tuple(example["input_ids"]))
        if match is not None:
            same_ids += 1
            same_mask += [int(x != -100) for x in example["labels"]][1:] == match.mask.tolist()[1:]
    with torch.no_grad():
        total, count = 0.0, 0
        for e in ours:
            logits = base(input_ids=torch.tensor(e.ids).unsqueeze(0)).logits[0, :-1]
            keep = torch.tensor(e.mask[1:]).bool()
            total += F.cross_entropy(logits[keep], torch.tensor(e.ids[1:])[keep], reduction="sum").item()
            count += int(keep.sum())
    big_trl, trl_loss = trl_update(8, 1)
    k8_trl, _ = trl_update(1, 8)
    big_ours, k8_ours = bigbatch_update(1), bigbatch_update(8)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm())

    print(f"TRL {trl.__version__} SFTTrainer (assistant_only_loss) on the smollm template, {len(rows)} conversations")
    print(f"  tokens identical in {same_ids} of {len(rows)}; trained-token mask identical in {same_mask}")
    print(
        f"  first loss at K 1: bigbatch {total / count:.7f} | TRL {trl_loss:.7f} | difference {abs(total / count - trl_loss):.1e}"
    )
    print(
        f"  SGD update at K 8 against the tool's own big batch: bigbatch {rel(k8_ours, big_ours):.2e} | TRL "
        f"{rel(k8_trl, big_trl):.2e}; the two big-batch updates differ by {rel(big_trl, big_ours):.2e}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--skip-processes", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        templates(root)
        trl_comparison(root)
        memory()
        exactness(root, args.steps, not args.skip_processes)


if __name__ == "__main__":
    main()
