"""bigbatch's learning from rewards side by side with TRL's GRPOTrainer: each of TRL's loss types at K 8 against its
own one big batch, beside bigbatch's aggregation of the same formula, on CPU.

    make bench-trl          # installs TRL into .bench/ (never into .venv) and runs this (after trl_dpo.py)

or, with TRL importable some other way, ``PYTHONPATH=.bench/trl python benchmarks/trl_grpo.py``. TRL is this
benchmark's alone: nothing in bigbatch imports it. About 20 seconds on 2 CPU cores.

The model: trl_dpo.py's tiny Llama (2 layers, 64 wide) and word-level tokenizer, written to a temporary directory and
loaded by both (bigbatch: ``build_hf_model`` of the directory, what ``--model hf:DIR`` loads). The rollout is fixed:
2 prompts of 4 words (one length: TRL's left padding would move the positions), 4 completions each of 1, 15, 6, 3
and 9, 2, 12, 5 words (``max_completion_length`` 16), fixed rewards. TRL samples nothing: its ``rollout_func`` hook
(documented, marked experimental in TRL 1.x) replays each prompt's fixed completions in order, and the reward
function looks each completion's reward up; bigbatch trains on the same token ids, with TRL's advantages
(``(r - mean) / (std + 1e-4)`` over the group, std unbiased) given in its rollout. One optimizer step of plain SGD
(lr 0.1: the update is the gradient, scaled), fp32 (``bf16=False``: TRL's configs default to bf16 autocast, on CPU
too, which moves its log-probabilities by about 1e-3), no gradient clipping, no KL, dropout off, and the ratio 1
(TRL's ``old_per_token_logps`` is ``None`` when generation and the optimizer step line up; bigbatch's old policy is
its own forward before the step).

For each of TRL's loss types that has a bigbatch aggregation of the same formula (``grpo`` as
``seq-mean-token-mean``, ``bnpo`` and ``dapo`` as ``token-mean``, ``dr_grpo`` as ``seq-mean-token-sum-norm`` with
C = ``max_completion_length``, ``cispo`` as ``token-mean`` with ``--policy-loss cispo``, ``luspo`` as
``seq-mean-token-sum``; ``sapo`` and ``vespo`` have none), the relative L2 distance of the update:

* TRL at K 8 (``gradient_accumulation_steps`` 8, ``per_device_train_batch_size`` 1) from TRL at K 1 (8 and 1);
* bigbatch at K 8 (micro-batches of 1 row) from bigbatch at K 1 (8 rows); and at 3 x K 3 (3, 3 and 2 completions);
* bigbatch at K 1 from TRL at K 1: the two tools compute the same update.

TRL's ``grpo`` and ``dr_grpo`` divide each micro-batch by its own count of sequences and by K, which is exact
because TRL's micro-batches always hold equally many sequences. ``bnpo`` divides by each micro-batch's own tokens
(as its documentation says: at one completion a micro-batch it is ``grpo``, which the last line checks), and
``dapo`` and ``cispo`` by the generation batch's tokens, which is exact.
"""

from __future__ import annotations

import os
import random
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trl_dpo import WORDS, flat_params, rel, require_trl, write_model  # noqa: E402

LR, PROMPTS, GENERATIONS, MAX_COMPLETION = 0.1, 2, 4, 16
LENGTHS = ((1, 15, 6, 3), (9, 2, 12, 5))  # each prompt's completions' tokens
FIRST_WORD = 4  # the word-level tokenizer's ids: <pad> <s> </s> <unk>, then the words
LOSS_TYPES = {  # TRL's loss type: bigbatch's aggregation and policy loss of the same formula
    "grpo": ("seq-mean-token-mean", "ppo"),
    "bnpo": ("token-mean", "ppo"),
    "dr_grpo": ("seq-mean-token-sum-norm", "ppo"),
    "dapo": ("token-mean", "ppo"),
    "cispo": ("token-mean", "cispo"),
    "luspo": ("seq-mean-token-sum", "ppo"),
}


class Rollout:
    """The fixed rollout: each prompt's words and ids, its completions' ids and rewards, in order."""

    def __init__(self, seed: int = 0) -> None:
        gen = random.Random(seed)
        self.prompts: list[str] = []
        self.prompt_ids: list[list[int]] = []
        self.completions: list[list[list[int]]] = []
        self.rewards: list[list[float]] = []
        for lengths in LENGTHS:
            ids = [FIRST_WORD + gen.randrange(len(WORDS)) for _ in range(4)]  # one length: no left padding
            self.prompt_ids.append(ids)
            self.prompts.append(" ".join(WORDS[i - FIRST_WORD] for i in ids))
            self.completions.append([[FIRST_WORD + gen.randrange(len(WORDS)) for _ in range(n)] for n in lengths])
            self.rewards.append([round(gen.random(), 3) for _ in range(GENERATIONS)])
        self.reward_of = {
            tuple(c): r
            for cs, rs in zip(self.completions, self.rewards, strict=True)
            for c, r in zip(cs, rs, strict=True)
        }
        assert len(self.reward_of) == PROMPTS * GENERATIONS, "completions must differ to look their rewards up"

    def replay(self, prompts: list[str], trainer: Any) -> dict[str, Any]:
        """TRL's ``rollout_func``: each prompt's next fixed completion, for every prompt of the generation batch (which
        holds each prompt ``num_generations`` times, as TRL's sampler repeats it, though the hook's documentation
        says it receives no duplicates)."""
        taken = dict.fromkeys(range(PROMPTS), 0)
        prompt_ids, completion_ids = [], []
        for prompt in prompts:
            g = self.prompts.index(prompt)
            prompt_ids.append(self.prompt_ids[g])
            completion_ids.append(self.completions[g][taken[g]])
            taken[g] += 1
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}

    def reward(
        self, prompts: list[Any], completions: list[Any], completion_ids: list[list[int]], **kw: Any
    ) -> list[float]:
        return [self.reward_of[tuple(ids)] for ids in completion_ids]

    def advantages(self) -> list[list[float]]:
        """TRL's: ``(r - mean) / (std + 1e-4)`` over each group, std unbiased (``scale_rewards="group"``)."""
        out = []
        for rewards in self.rewards:
            r = torch.tensor(rewards, dtype=torch.float64)
            out.append(((r - r.mean()) / (r.std() + 1e-4)).tolist())
        return out


def trl_update(directory: Path, rollout: Rollout, loss_type: str, batch: int, k: int) -> torch.Tensor:
    """One step of TRL's GRPOTrainer over the replayed rollout: the update."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback

    trl = require_trl()
    config = trl.GRPOConfig(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=k,
        num_generations=GENERATIONS,
        max_completion_length=MAX_COMPLETION,
        loss_type=loss_type,
        importance_sampling_level="sequence" if loss_type == "luspo" else "token",
        epsilon_high=5.0 if loss_type == "cispo" else None,  # cispo's bound on the weight itself (ScaleRL's 5)
        beta=0.0,
        learning_rate=LR,
        optim="sgd",
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=0.0,
        max_steps=1,
        logging_steps=10_000,
        disable_tqdm=True,
        report_to="none",
        use_cpu=True,
        bf16=False,  # TRL's configs default to bf16 mixed precision (autocast), on CPU too
        save_strategy="no",
        seed=0,
        disable_dropout=True,
    )
    trainer = trl.GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(directory),
        reward_funcs=rollout.reward,
        args=config,
        train_dataset=Dataset.from_list([{"prompt": p} for p in rollout.prompts]),
        processing_class=AutoTokenizer.from_pretrained(directory),
        rollout_func=rollout.replay,
    )
    trainer.remove_callback(PrinterCallback)  # its one line of the run's metrics per trainer
    before = flat_params(trainer.model)
    trainer.train()
    return flat_params(trainer.model) - before


def bigbatch_update(
    directory: Path, rollout: Rollout, aggregation: str, policy_loss: str, micro_batch: int
) -> torch.Tensor:
    """One bigbatch SGD step over the same completions, micro-batches of ``micro_batch`` rows (one completion a
    row): the update."""
    from bigbatch.data.rollout_loader import FileRollouts, RolloutLoader
    from bigbatch.data.rollouts import Completion, Group
    from bigbatch.engine.accumulate import AccumulationEngine
    from bigbatch.engine.optim import constant_schedule
    from bigbatch.engine.policy_gradient import RewardLossSettings, RewardObjective
    from bigbatch.models.hf.model import build_hf_model, read_hf_config

    groups = [
        Group(str(g), [Completion(prompt, c, r, a) for c, r, a in zip(cs, rs, advantages, strict=True)])
        for g, (prompt, cs, rs, advantages) in enumerate(
            zip(rollout.prompt_ids, rollout.completions, rollout.rewards, rollout.advantages(), strict=True)
        )
    ]
    model = build_hf_model(read_hf_config(directory), weights=True, dropout=0.0)
    settings = RewardLossSettings(aggregation, policy_loss, norm_constant=float(MAX_COMPLETION))
    engine = AccumulationEngine(
        model,
        torch.optim.SGD(model.parameters(), lr=LR),
        constant_schedule(LR),
        grad_clip=0.0,
        objective=RewardObjective(settings),
    )
    seq_len = max(len(p) + len(c) for p, cs in zip(rollout.prompt_ids, rollout.completions, strict=True) for c in cs)
    loader = RolloutLoader(FileRollouts(groups), PROMPTS, micro_batch, seq_len, pad_token=0, pack=False)
    k = loader.micro_batches_next_step()
    before = flat_params(model)
    engine.step([loader.next_micro_batch() for _ in range(k)])
    return flat_params(model) - before


def main() -> None:
    try:
        import trl
    except ImportError:  # make bench runs every script: this one only where TRL was installed apart
        print("skipped: TRL is not importable; `make bench-trl` installs it into .bench/ and runs this")
        return
    from transformers.utils import logging as transformers_logging

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func's warning, once per trainer
    transformers_logging.disable_progress_bar()  # "Loading weights", once per model
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' renamed gradient checkpointing
    torch.set_num_threads(min(2, torch.get_num_threads()))
    started = time.perf_counter()
    rollout = Rollout()
    lengths = sorted(len(c) for cs in rollout.completions for c in cs)
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "tiny-llama"
        write_model(directory)
        print(
            f"TRL {trl.__version__} GRPOTrainer and bigbatch --objective grpo, {PROMPTS} prompts x {GENERATIONS} fixed "
            f"completions of {', '.join(map(str, lengths))} tokens, one SGD step (lr {LR}), fp32"
        )
        print("relative L2 of the update against the same tool's one big batch (8 x K 1), and across the tools")
        header = (
            f"{'TRL loss':<8} {'bigbatch aggregation':<30} {'TRL 1 x K 8':>11} {'bigbatch 1 x K 8':>16} "
            f"{'bigbatch 3 x K 3':>16} {'K 1: TRL vs bigbatch':>20}"
        )
        print(header)
        trl_updates: dict[tuple[str, int], torch.Tensor] = {}
        for loss_type, (aggregation, policy_loss) in LOSS_TYPES.items():
            trl_one = trl_update(directory, rollout, loss_type, batch=8, k=1)
            trl_eight = trl_update(directory, rollout, loss_type, batch=1, k=8)
            trl_updates[loss_type, 1], trl_updates[loss_type, 8] = trl_one, trl_eight
            ours_one = bigbatch_update(directory, rollout, aggregation, policy_loss, micro_batch=8)
            ours_eight = bigbatch_update(directory, rollout, aggregation, policy_loss, micro_batch=1)
            ours_three = bigbatch_update(directory, rollout, aggregation, policy_loss, micro_batch=3)
            mode = aggregation + (f" ({policy_loss})" if policy_loss != "ppo" else "")
            print(
                f"{loss_type:<8} {mode:<30} {rel(trl_eight, trl_one):>11.2e} {rel(ours_eight, ours_one):>16.2e} "
                f"{rel(ours_three, ours_one):>16.2e} {rel(ours_one, trl_one):>20.2e}",
                flush=True,
            )
        print(
            "TRL's bnpo at 1 x K 8 against its grpo at 8 x K 1 (each micro-batch's own token mean, one completion "
            f"each: a mean of sequences' token means): {rel(trl_updates['bnpo', 8], trl_updates['grpo', 1]):.2e}"
        )
    print(f"total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
