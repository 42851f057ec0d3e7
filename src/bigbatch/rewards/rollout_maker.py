"""Rollouts sampled from the policy being trained: prompts read from a JSONL file, ``group_size`` completions
each (the KV-cached batched sampler of :mod:`bigbatch.models.sampling`), scored by the reward functions.

**Prompts.** One JSON object per line: ``prompt`` (text, encoded as it is) or ``messages`` (a conversation, rendered
by the tokenizer's chat template with its generation prompt), plus whatever the reward functions read (the row is
passed to them whole). Prompts are taken in a seeded order, a new permutation each epoch of the file.

**Several processes.** Each rollout's prompts are dealt to ranks (prompt ``j`` to rank ``j mod W``); each rank
samples and scores its own, then every rank receives every group (one ``all_gather_object``), so each holds the
whole rollout in one order and deals it into micro-batches alike. Under FSDP every rank runs as many forwards: a
rank whose completions have all stopped keeps stepping until every rank's have (one small all-reduce a token).

**Reproducible.** The ``d``-th prompt drawn in the run is sampled from a generator seeded with the run's seed and
``d``, whichever rank samples it: what a rollout holds depends on the seed and the policy alone (not on the number
of processes), and the loader's checkpoint needs only ``d`` to resume sampling bitwise.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from bigbatch.data.rollouts import Completion, Group, check_fits, jsonl_rows
from bigbatch.data.tokenizers import continuation_decoder
from bigbatch.errors import DataError
from bigbatch.models.sampling import sample_completions
from bigbatch.parallel.distributed import DistContext
from bigbatch.rewards.functions import RewardSet

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplerSettings:
    """How completions are sampled: ``group_size`` per prompt, at most ``max_tokens`` each, ending at a stop
    token."""

    group_size: int = 8
    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_tokens: tuple[int, ...] = ()


@dataclass(frozen=True)
class PromptRow:
    """A prompt as read (``row``, what the reward functions see) and as the model reads it (``ids``)."""

    row: dict[str, Any]
    ids: list[int]
    number: int  # its line in the file


def read_prompts(
    path: Path,
    encode: Callable[[str], list[int]],
    render: Callable[[list[Any], str], str] | None,
    encode_rendered: Callable[[str], list[int]] | None = None,
) -> list[PromptRow]:
    """The prompt rows of a JSONL file (see the module docstring); ``render(messages, where)`` renders a
    conversation with the generation prompt (``None``: no chat template, and a ``messages`` row is refused), and
    ``encode_rendered`` encodes what it renders: the template's control tokens (``<|im_start|>``) as the special
    tokens they are, where ``encode`` keeps a prompt text's own as text."""
    if not path.is_file():
        raise DataError(f"--prompts {path}: no such file; give a JSONL file with a 'prompt' or 'messages' per line")
    rows: list[PromptRow] = []
    for number, where, row in jsonl_rows(path, "prompt"):
        if not isinstance(row, dict):
            raise DataError(f"{where} is not a JSON object with a 'prompt' or 'messages'")
        if isinstance(row.get("prompt"), str):
            ids = encode(row["prompt"])
        elif isinstance(row.get("messages"), list):
            if render is None:
                raise DataError(
                    f"{where} is a conversation ('messages'), and this run's tokenizer has no chat template; "
                    "give a chat model's tokenizer (--tokenizer file:DIR) or a 'prompt' text"
                )
            ids = (encode_rendered or encode)(render(row["messages"], where))
        else:
            raise DataError(f"{where} has neither a 'prompt' text nor a 'messages' list")
        if not ids:
            raise DataError(f"{where} has an empty prompt")
        rows.append(PromptRow(row, ids, number))
    if not rows:
        raise DataError(f"--prompts {path} holds no prompt; give one JSON object per line")
    return rows


class SampledRollouts:
    """Groups of completions sampled from ``model`` (set once it is wrapped for training) and scored by
    ``rewards`` (see the module docstring)."""

    def __init__(
        self,
        prompts: list[PromptRow],
        rewards: RewardSet,
        settings: SamplerSettings,
        tokenizer: Any,
        seq_len: int,
        seed: int,
        dist: DistContext,
        device: torch.device,
        source: str,
    ) -> None:
        self.prompts = prompts
        self.rewards = rewards
        self.settings = settings
        self.tokenizer = tokenizer  # decodes a completion for the reward functions
        self.end_token: int | None = getattr(tokenizer, "eot_token", None)
        self.seed = seed
        self.dist = dist
        self.device = device
        self.source = source  # the prompts file, for messages naming a row
        self.model: nn.Module | None = None
        self.sharded = False  # FSDP2: every rank runs as many forwards (a finished rank keeps stepping)
        self.use_cache = True  # the key-value cache (benchmarks/grpo_cost.py compares it with recomputing)
        self.drawn = 0  # prompts drawn so far (epoch after epoch of the file, each in its own order)
        self.generator = torch.Generator(device=device)
        longest = max(len(p.ids) for p in prompts)
        if longest + settings.max_tokens > seq_len + 1:
            where = next(p for p in prompts if len(p.ids) == longest)
            raise DataError(
                f"line {where.number} of {source}: its prompt of {longest:,} tokens and --max-completion-tokens "
                f"{settings.max_tokens} need rows of {longest + settings.max_tokens} tokens, more than "
                f"seq_len+1={seq_len + 1}; raise --seq-len or lower --max-completion-tokens"
            )

    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.prompts))

    def _next_prompts(self, n: int) -> list[tuple[int, PromptRow]]:
        """The next ``n`` prompts, each with its draw number ``d``."""
        picked = []
        for d in range(self.drawn, self.drawn + n):
            epoch, position = divmod(d, len(self.prompts))
            picked.append((d, self.prompts[int(self._order(epoch)[position])]))
        self.drawn += n
        return picked

    def _seed(self, draw: int) -> int:
        return int(np.random.SeedSequence([self.seed, draw]).generate_state(1, np.uint64)[0] >> 1)

    def make(self, prompts: int) -> tuple[list[Group], float]:
        """``prompts`` groups, each rank sampling and scoring its share, then all of them on every rank."""
        if self.model is None:
            raise RuntimeError("the sampler has no model yet")
        started = time.perf_counter()
        chosen = self._next_prompts(prompts)
        mine = [(j, d, p) for j, (d, p) in enumerate(chosen) if j % self.dist.world_size == self.dist.rank]
        # every rank samples as many prompts (FSDP: the same forwards): a rank with one fewer samples the first
        # prompt again and drops what it made
        rounds = -(-len(chosen) // self.dist.world_size)
        made: list[tuple[int, dict[str, Any]]] = []
        for r in range(rounds):
            j, draw, prompt = mine[r] if r < len(mine) else (-1, chosen[0][0], chosen[0][1])
            self.generator.manual_seed(self._seed(draw))
            completions = sample_completions(
                self.model,  # type: ignore[arg-type]  # a DecoderLM, perhaps sharded by FSDP2 in place
                prompt.ids,
                self.settings.group_size,
                self.settings.max_tokens,
                temperature=self.settings.temperature,
                top_p=self.settings.top_p,
                top_k=self.settings.top_k,
                stop_tokens=self.settings.stop_tokens,
                generator=self.generator,
                use_cache=self.use_cache,
                keep_going=self._keep_going if self.sharded and self.dist.world_size > 1 else None,
            )
            if r >= len(mine):
                continue
            made.append((j, self._scored(prompt, completions)))
        everyone = self.dist.all_gather_object(made) if self.dist.world_size > 1 else [made]
        by_index = {j: group for part in everyone for j, group in part}
        groups = []
        for j in range(len(chosen)):
            g = by_index[j]
            groups.append(Group(g["key"], [Completion.from_dict(c) for c in g["completions"]]))
        return groups, time.perf_counter() - started

    def _scored(self, prompt: PromptRow, completions: list[list[int]]) -> dict[str, Any]:
        """One group as plain data (it crosses processes): each completion's tokens and reward."""
        out = []
        decode = continuation_decoder(self.tokenizer, prompt.ids)  # keeps a leading space SentencePiece would drop
        for i, tokens in enumerate(completions):
            where = f"line {prompt.number} of {self.source}, completion {i + 1}"
            # the end-of-text token is a marker, not text: a reward reads the completion without it (a --stop
            # text, e.g. a newline, is the completion's own and stays)
            text_tokens = tokens[:-1] if tokens and tokens[-1] == self.end_token else tokens
            reward, _ = self.rewards.score(prompt.row, decode(text_tokens), where)
            completion = Completion(list(prompt.ids), list(tokens), float(reward))
            check_fits(completion, 10**9, where)
            out.append(completion.as_dict())
        return {"key": f"line {prompt.number}", "completions": out}

    def _keep_going(self, running: bool) -> bool:
        flag = torch.tensor([1.0 if running else 0.0], device=self.device)
        return bool(self.dist.all_reduce_sum(flag).item() > 0)

    def state_dict(self) -> dict[str, Any]:
        return {"drawn": self.drawn}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.drawn = int(state["drawn"])
