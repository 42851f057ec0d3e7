"""bigbatch's DPO side by side with TRL's DPOTrainer: the same tiny model, pairs, beta and reference, on CPU.

    make bench-trl          # installs TRL into .bench/ (never into .venv) and runs this

or, with TRL importable some other way, ``python benchmarks/trl_dpo.py``. TRL is this benchmark's alone: nothing
in bigbatch imports it.

A tiny Llama (transformers, 2 layers, 64 wide) with a word-level tokenizer, both written to a temporary directory,
and 30 text pairs of random words whose answers differ in length. TRL tokenizes them (prompt, then prompt +
answer, with its end-of-sequence token); bigbatch trains on those very token ids, so the two see the same
sequences. Both take the reference policy from a frozen copy of the starting model, plain SGD (so an update is the
gradient itself, scaled) at learning rate 0.1, no clipping, beta 0.1, dropout off:

* K 1 (all 30 pairs in one micro-batch): the first step's loss and reward margin of each, and their difference
  (goal: within 1e-5).
* K 8 with uneven micro-batches (TRL: 7 of 4 pairs and one of 2, its fixed micro-batch; bigbatch: the same cut,
  and 1, 2, ..., 7 and 2 pairs): each tool's update against its own one-micro-batch update, relative L2.
* Throughput: 12 steps of 8 pairs at K 1 (the first step left out), trained tokens (every position of every answer
  sequence that is not padding) per second: TRL (padded), bigbatch unpacked and packed (rows of 128).
"""

from __future__ import annotations

import copy
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

WORDS = [f"w{i}" for i in range(120)]
BETA, LR, PAIRS = 0.1, 0.1, 30


def require_trl() -> Any:
    try:
        import trl
    except ImportError as exc:
        raise SystemExit("TRL is not importable: run `make bench-trl`, which installs it into .bench/ first") from exc
    return trl


def write_model(directory: Path) -> None:
    """A tiny Llama and its word-level tokenizer in ``directory``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    special = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {token: i for i, token in enumerate(special + WORDS)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.save_pretrained(directory)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(directory)
    with torch.no_grad():  # the reference: the model a little moved, as one some steps behind it is
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    model.save_pretrained(directory / "reference")
    fast.save_pretrained(directory / "reference")


def pairs(n: int, seed: int) -> list[dict[str, str]]:
    gen = random.Random(seed)

    def words(low: int, high: int) -> str:
        return " " + " ".join(gen.choice(WORDS) for _ in range(gen.randint(low, high)))

    return [{"prompt": words(2, 6).strip(), "chosen": words(1, 9), "rejected": words(1, 9)} for _ in range(n)]


class Recorder:
    """A TRL callback: the first logged metrics and the time of each step's end."""

    def __init__(self) -> None:
        self.logs: list[dict[str, float]] = []
        self.step_ends: list[float] = []

    def callback(self) -> Any:
        from transformers import TrainerCallback

        recorder = self

        class _Callback(TrainerCallback):
            def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
                if logs:
                    recorder.logs.append(dict(logs))

            def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                recorder.step_ends.append(time.perf_counter())

        return _Callback()


def trl_run(
    directory: Path,
    rows: list[dict[str, str]],
    batch: int,
    k: int,
    steps: int,
    log: bool = True,
    moved_reference: bool = False,
) -> tuple[Any, Recorder]:
    """TRL's DPOTrainer for ``steps`` steps of ``k`` micro-batches of ``batch`` pairs; the trainer and recorder."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trl = require_trl()
    model = AutoModelForCausalLM.from_pretrained(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    recorder = Recorder()
    out = tempfile.mkdtemp()
    config = trl.DPOConfig(
        output_dir=out,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=k,
        learning_rate=LR,
        optim="sgd",
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=0.0,
        max_steps=steps,
        logging_steps=1 if log else 10_000,
        disable_tqdm=True,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        seed=0,
        beta=BETA,
        disable_dropout=True,
    )
    trainer = trl.DPOTrainer(
        model=model,
        ref_model=AutoModelForCausalLM.from_pretrained(directory / "reference") if moved_reference else None,
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=[recorder.callback()],
    )
    return trainer, recorder


def token_groups(trainer: Any) -> list[Any]:
    """TRL's tokenized pairs as bigbatch's groups (the same ids)."""
    from bigbatch.engine.batch import ROLE_CHOSEN, ROLE_REJECTED
    from bigbatch.verify.answer_batches import Group

    data = trainer.train_dataset
    return [
        Group(
            list(row["prompt_ids"]), [list(row["chosen_ids"]), list(row["rejected_ids"])], [ROLE_CHOSEN, ROLE_REJECTED]
        )
        for row in data
    ]


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])


def bigbatch_steps(
    directory: Path, parts: list[list[Any]], packed: bool, seq_len: int, steps: int = 1
) -> tuple[list[Any], torch.Tensor]:
    """``steps`` bigbatch DPO steps over the micro-batches ``parts`` (groups each), the reference a frozen copy of
    the starting model (TRL's default); the records and the update."""
    from bigbatch.engine.accumulate import AccumulationEngine
    from bigbatch.engine.optim import constant_schedule
    from bigbatch.engine.preference import PreferenceObjective, PreferenceSettings, ReferencePolicy
    from bigbatch.models.hf.model import build_hf_model, read_hf_config
    from bigbatch.verify.answer_batches import answer_micro_batch

    model = build_hf_model(read_hf_config(directory), weights=True, dropout=0.0)
    objective = PreferenceObjective(PreferenceSettings("dpo", beta=BETA), ReferencePolicy(copy.deepcopy(model)))
    engine = AccumulationEngine(
        model, torch.optim.SGD(model.parameters(), lr=LR), constant_schedule(LR), grad_clip=0.0, objective=objective
    )
    before = flat_params(model)
    rows = max(2, max(2 * len(p) for p in parts))
    batches = [answer_micro_batch(part, seq_len, packed, rows=rows) for part in parts]
    records = [engine.step(batches) for _ in range(steps)]
    return records, flat_params(model) - before


def reference_policy(directory: Path) -> Any:
    from bigbatch.engine.preference import ReferencePolicy
    from bigbatch.models.hf.model import build_hf_model, read_hf_config

    return ReferencePolicy(build_hf_model(read_hf_config(directory / "reference"), weights=True, dropout=0.0))


def reference_check(directory: Path, rows: list[dict[str, str]]) -> dict[str, float]:
    """Each tool's reference log-probabilities of every answer, from a reference model of its own, against a plain
    transformers forward of that model: the largest absolute difference."""
    from transformers import AutoModelForCausalLM

    from bigbatch.models.hf.model import build_hf_model, read_hf_config
    from bigbatch.verify.answer_batches import answer_micro_batch

    trainer, _ = trl_run(directory, rows, PAIRS, 1, 1, moved_reference=True)
    groups = token_groups(trainer)
    plain_model = AutoModelForCausalLM.from_pretrained(directory / "reference").eval()
    policy = build_hf_model(read_hf_config(directory), weights=True, dropout=0.0)
    reference = reference_policy(directory)
    worst = {"trl": 0.0, "bigbatch": 0.0}
    collate = trainer.data_collator
    for i, group in enumerate(groups):
        batch = collate([trainer.train_dataset[i]])
        labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
        with torch.no_grad():
            out = trainer.ref_model(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels, fused_lm_head=True
            )
            width = batch["completion_mask"].shape[1] - 1
            theirs = out.log_probs[:, -width:].sum(1)  # (2,): chosen, rejected, as the trainer sums them
            ours = -reference.losses(policy, answer_micro_batch([group], 64, False, rows=2))
        for j, answer in enumerate(group.answers):
            ids = torch.tensor([group.prompt + answer])
            with torch.no_grad():
                logp = torch.log_softmax(plain_model(ids).logits.float(), -1)[0]
            plain = float(sum(logp[t - 1, ids[0, t]] for t in range(len(group.prompt), ids.shape[1])))
            worst["trl"] = max(worst["trl"], abs(float(theirs[j]) - plain))
            worst["bigbatch"] = max(worst["bigbatch"], abs(float(ours[j]) - plain))
    return worst


def plain_update(directory: Path, groups: list[Any]) -> torch.Tensor:
    """The first SGD step's update from the DPO formula written out over a plain transformers model in float64, each
    answer scored by its own forward (the reference: the starting model, so each log ratio starts at 0)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory).double().eval()
    reference = copy.deepcopy(model)

    def logp(m: torch.nn.Module, prompt: list[int], answer: list[int]) -> torch.Tensor:
        ids = torch.tensor([prompt + answer])
        log_probs = torch.log_softmax(m(ids).logits, -1)[0]
        start = len(prompt)
        return log_probs[start - 1 : -1].gather(1, ids[0, start:, None]).sum()

    losses = []
    for g in groups:
        with torch.no_grad():
            rc, rr = logp(reference, g.prompt, g.answers[0]), logp(reference, g.prompt, g.answers[1])
        margin = BETA * ((logp(model, g.prompt, g.answers[0]) - rc) - (logp(model, g.prompt, g.answers[1]) - rr))
        losses.append(-torch.nn.functional.logsigmoid(margin))
    torch.stack(losses).mean().backward()
    return torch.cat([(-LR * p.grad).reshape(-1) for p in model.parameters()])


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def trl_update(
    directory: Path, rows: list[dict[str, str]], batch: int, k: int, steps: int = 1
) -> tuple[torch.Tensor, Recorder]:
    trainer, recorder = trl_run(directory, rows, batch, k, steps=steps)
    before = flat_params(trainer.model)
    trainer.train()
    return flat_params(trainer.model) - before, recorder


def cut(groups: list[Any], sizes: list[int]) -> list[list[Any]]:
    parts, at = [], 0
    for size in sizes:
        parts.append(groups[at : at + size])
        at += size
    return parts


def throughput(directory: Path, rows: list[dict[str, str]]) -> dict[str, float]:
    """Trained tokens per second over steps 2..12 of 8 pairs at K 1."""
    from bigbatch.engine.accumulate import AccumulationEngine
    from bigbatch.engine.optim import constant_schedule
    from bigbatch.engine.preference import PreferenceObjective, PreferenceSettings, ReferencePolicy
    from bigbatch.models.hf.model import build_hf_model, read_hf_config
    from bigbatch.verify.answer_batches import answer_micro_batch

    steps, per_step = 12, 8
    trainer, recorder = trl_run(directory, rows * 4, per_step, 1, steps, log=False)
    groups = token_groups(trainer)
    trainer.train()
    tokens = [
        sum(
            len(g.prompt) * 2 + len(g.answers[0]) + len(g.answers[1]) for g in groups[i * per_step : (i + 1) * per_step]
        )
        for i in range(steps)
    ]
    elapsed = recorder.step_ends[-1] - recorder.step_ends[0]
    # TRL's sampler shuffles: its steps hold other pairs than these, of the same distribution; counted alike
    result = {"trl": sum(tokens[1:]) / elapsed}
    for packed in (False, True):
        model = build_hf_model(read_hf_config(directory), weights=True, dropout=0.0)
        objective = PreferenceObjective(PreferenceSettings("dpo", beta=BETA), ReferencePolicy(copy.deepcopy(model)))
        engine = AccumulationEngine(
            model, torch.optim.SGD(model.parameters(), lr=LR), constant_schedule(LR), grad_clip=0.0, objective=objective
        )
        seq_len = 128 if packed else max(len(g.prompt) + max(map(len, g.answers)) for g in groups)
        batches = [
            [answer_micro_batch(groups[i * per_step : (i + 1) * per_step], seq_len, packed, rows=1 if packed else 16)]
            for i in range(steps)
        ]
        engine.step(batches[0])
        started = time.perf_counter()
        for step_batches in batches[1:]:
            engine.step(step_batches)
        result["bigbatch packed" if packed else "bigbatch unpacked"] = sum(tokens[1:]) / (time.perf_counter() - started)
    return result


def main() -> None:
    try:
        import trl  # noqa: F401
    except ImportError:  # make bench runs every script: this one only where TRL was installed apart
        print("skipped: TRL is not importable; `make bench-trl` installs it into .bench/ and runs this")
        return
    torch.set_num_threads(min(2, torch.get_num_threads()))
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "tiny-llama"
        write_model(directory)
        rows = pairs(PAIRS, seed=1)
        # K 1: every pair in one micro-batch, three steps
        trl_three, trl_log = trl_update(directory, rows, PAIRS, 1, steps=3)
        trainer, _ = trl_run(directory, rows, PAIRS, 1, 1)
        groups = token_groups(trainer)
        seq_len = max(len(g.prompt) + max(map(len, g.answers)) for g in groups)
        records, ours_three = bigbatch_steps(directory, [groups], False, seq_len, steps=3)
        print(f"TRL {require_trl().__version__} DPOTrainer and bigbatch DPO, {PAIRS} pairs, beta {BETA}, SGD lr {LR}")
        print("K 1, reference the starting model, steps 1..3 (loss, reward margin; |differences|):")
        worst = 0.0
        for step, (theirs, record) in enumerate(zip(trl_log.logs, records, strict=False), start=1):
            ours = record.measurements["objective"].values
            diffs = abs(theirs["loss"] - record.loss), abs(theirs["rewards/margins"] - ours["rewards/margin"])
            worst = max(worst, *diffs)
            print(
                f"  step {step}: TRL {theirs['loss']:.7f} {theirs['rewards/margins']:+.7f} | bigbatch "
                f"{record.loss:.7f} {ours['rewards/margin']:+.7f} | {diffs[0]:.1e} {diffs[1]:.1e}"
            )
        print(
            f"  largest difference {worst:.1e}; the 3 steps' updates, TRL against bigbatch: rel L2 "
            f"{rel(trl_three, ours_three):.2e}"
        )
        moved = reference_check(directory, rows)
        print(
            "a reference model of its own (the start moved by noise), its log-probabilities of the 60 answers "
            "against a plain transformers forward (largest |difference|, nats):"
        )
        print(f"  TRL's (DPOTrainer's ref_model) {moved['trl']:.1e} | bigbatch's (--reference) {moved['bigbatch']:.1e}")
        # K 8, uneven: TRL's fixed micro-batch of 4 leaves 2 pairs for the eighth
        trl_one, _ = trl_update(directory, rows, PAIRS, 1)
        _, ours_one = bigbatch_steps(directory, [groups], False, seq_len)
        trl_eight, _ = trl_update(directory, rows, 4, 8)
        _, same_cut = bigbatch_steps(directory, cut(groups, [4] * 7 + [2]), False, seq_len)
        _, ragged = bigbatch_steps(directory, cut(groups, [1, 2, 3, 4, 5, 6, 7, 2]), False, seq_len)
        _, packed = bigbatch_steps(directory, cut(groups, [1, 2, 3, 4, 5, 6, 7, 2]), True, 64)
        plain_one = plain_update(directory, groups)
        print(
            "K 1, the first step's update against plain transformers + autograd in float64 (rel L2): "
            f"TRL {rel(trl_one, plain_one):.2e} | bigbatch {rel(ours_one, plain_one):.2e}"
        )
        print("K 8, uneven micro-batches, each against its own one-micro-batch update (rel L2):")
        print(f"  TRL (7 x 4 pairs + 1 x 2)                   {rel(trl_eight, trl_one):.2e}")
        print(f"  bigbatch, the same cut                      {rel(same_cut, ours_one):.2e}")
        print(f"  bigbatch, 1, 2, ..., 7 and 2 pairs           {rel(ragged, ours_one):.2e}")
        print(f"  bigbatch, the same, packed rows of 64        {rel(packed, ours_one):.2e}")
        rates = throughput(directory, rows)
        print("throughput, 8 pairs a step at K 1, trained tokens per second (steps 2..12):")
        for name, rate in rates.items():
            print(f"  {name:<18} {rate:>10,.0f} tok/s  ({rate / rates['trl']:.2f}x TRL)")
        print(json.dumps({"k1_worst_diff": worst, **{k: round(v) for k, v in rates.items()}}))


if __name__ == "__main__":
    main()
