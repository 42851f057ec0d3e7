"""Random settings for the differential fuzzer (``tests/integration/test_fuzz.py``, ``make fuzz``).

One integer seed gives one :class:`Setting`: the model family (GPT-2's ``pico``, ``llama-pico``, or the same Llama
shape as a transformers ``LlamaForCausalLM`` trained through ``--model hf:DIR``), the batch arithmetic (data mode,
micro-batch, K or a token budget, world size, DDP or FSDP2, last-window policy, long-document policy,
window order: ``--shuffle on``, bigbatch's default, or ``off``),
the optimizer (clipping that bites or not, schedule, AdamW hyper-parameters) and
the training data itself (a packed text or a ``.jsonl`` of ragged documents with
masked prompts), all drawn so that the configuration is valid for bigbatch.
The same seed always gives the same setting and data, so a counterexample is
reproduced by its seed alone.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

MODES = ("packed", "documents")
PARALLELS = ("none", "ddp", "fsdp")
LAST_WINDOWS = ("partial", "drop")
CLIPS = ("off", "loose", "tight")
LONG_DOCUMENTS = ("split", "truncate")  # documents mode: a document longer than T + 1 tokens (inert when packed)
FAMILIES = ("gpt", "llama", "hf", "moe")
PRESETS = {"gpt": "pico", "llama": "llama-pico", "hf": "hf:LlamaForCausalLM", "moe": "moe-pico"}  # 2 layers, 32 wide
ROUTER_BALANCES = ("exact", "running", "micro")  # moe: exact must match; running and micro are planted differences
ROUTER_AUX_COEFS = (0.1, 0.5, 1.0)  # large enough that a balancing loss accumulated otherwise shows above 1e-5
HF_DIR = "hf-llama"  # beside the data: the hf family's config.json (no weights: --seed initialises it)
HF_CONFIG = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 256,
    "hidden_size": 32,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
}
"""llama-pico's shape in transformers' terms (the reference reads it as its own Llama: fuzz_reference.hf_as_llama)."""
MAX_SEQ_LEN = 32
# Printable ASCII without the NUL byte: one byte = one token with the byte tokenizer, and token 0 (the
# document loader's padding) never occurs inside a document, so a padded row's length is visible.
ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,;:!?'-()\n"


@dataclass(frozen=True)
class Setting:
    seed: int
    mode: str  # packed | documents
    world: int  # 1 or 2 processes (gloo)
    parallel: str  # none (world 1) | ddp | fsdp
    micro_batch: int  # B
    seq_len: int  # T
    k: int  # fixed K per rank; 0 when steps are sized by token_budget
    token_budget: int  # valid targets per step; 0 = fixed K
    last_window: str  # partial | drop
    clip: str  # off (grad_clip 0) | loose (enabled, never reached) | tight (bites on every step)
    grad_clip: float
    max_steps: int
    lr: float
    min_lr_ratio: float
    warmup_steps: int
    decay_steps: int  # 0: auto (= max_steps)
    weight_decay: float
    beta1: float
    beta2: float
    eps: float
    init_seed: int  # --seed: the model's initialisation
    sync_every_micro_step: bool  # two ranks: reduce after every micro-step instead of once per step
    activation_checkpointing: bool  # recompute each block in backward (the gradient must not change)
    long_documents: str  # split (T-target windows) | truncate (first T + 1 tokens): --long-documents
    shuffle: bool  # --shuffle on (a seeded order per epoch, packed windows moved each later epoch) or off
    family: str  # gpt (pico: learned positions, LayerNorm, GELU, biases) | llama (llama-pico: RoPE, 1 k/v head, SwiGLU)
    # | hf (llama-pico's shape as transformers' LlamaForCausalLM, through --model hf:DIR)
    pack: bool  # documents mode: --pack on (documents back to back in rows, attention within each) or off
    router_balance: str  # moe: --router-balance (exact | running | micro); "" for a dense family
    router_aux_coef: float  # moe: --router-aux-coef; 0 for a dense family
    corpus: str  # packed mode: the whole training text
    documents: tuple[tuple[str | None, str], ...]  # documents mode: (prompt or None for a {"text"} line, text)

    def describe(self) -> str:
        sizing = f"K {self.k}" if self.k else f"budget {self.token_budget}"
        data = f"{len(self.corpus)} bytes" if self.mode == "packed" else f"{len(self.documents)} docs"
        if self.mode == "documents":
            longest = max(len((p or "").encode()) + len(t.encode()) for p, t in self.documents)
            data += (
                f", longest {longest} tokens, long documents {self.long_documents}, pack {'on' if self.pack else 'off'}"
            )
        return (
            f"seed {self.seed}: {PRESETS[self.family]} | {self.mode} ({data}) | world {self.world} {self.parallel} | B {self.micro_batch} "
            f"x T {self.seq_len} | {sizing} | last {self.last_window} | clip {self.clip} ({self.grad_clip:g}) | "
            f"{self.max_steps} steps lr {self.lr:.2g} warmup {self.warmup_steps} decay {self.decay_steps} "
            f"min {self.min_lr_ratio:g} wd {self.weight_decay:g} betas ({self.beta1:g}, {self.beta2:g}) "
            f"eps {self.eps:g}"
            + (" | sync every micro-step" if self.sync_every_micro_step else "")
            + (" | activation checkpointing" if self.activation_checkpointing else "")
            + f" | shuffle {'on' if self.shuffle else 'off'}"
            + (f" | router {self.router_balance} x {self.router_aux_coef:g}" if self.router_balance else "")
        )

    @property
    def expect_difference(self) -> bool | None:
        """Whether bigbatch must differ from the reference: a balancing loss accumulated otherwise than exactly
        (``running``: exact with one micro-batch per rank; ``micro``: with one micro-batch in all) is a planted
        difference the fuzzer must catch. False: it must match; None (a token budget, whose K varies): either."""
        if self.router_balance == "running":
            return None if not self.k else self.k > 1
        if self.router_balance == "micro":
            return True if self.world > 1 else (None if not self.k else self.k > 1)
        return False

    def data_path(self, directory: Path) -> Path:
        return directory / ("corpus.txt" if self.mode == "packed" else "docs.jsonl")

    def write_data(self, directory: Path) -> Path:
        """Write the training data into ``directory``: the text, or one JSON line per document (and for the hf
        family its model's config.json)."""
        if self.family == "hf":
            (directory / HF_DIR).mkdir(exist_ok=True)
            (directory / HF_DIR / "config.json").write_text(json.dumps(HF_CONFIG))
        path = self.data_path(directory)
        if self.mode == "packed":
            path.write_text(self.corpus)
        else:
            lines = [
                json.dumps({"text": text} if prompt is None else {"prompt": prompt, "completion": text})
                for prompt, text in self.documents
            ]
            path.write_text("\n".join(lines) + "\n")
        return path

    def train_flags(self, data: Path, cache: Path, out: Path) -> list[str]:
        """The ``bigbatch train`` flags of this setting."""
        if self.k:
            sizing = ["--total-batch-tokens", str(self.micro_batch * self.seq_len * self.k * self.world)]
        else:
            sizing = ["--token-budget", str(self.token_budget)]
        model = f"hf:{data.parent / HF_DIR}" if self.family == "hf" else PRESETS[self.family]
        return [
            "--model",
            model,
            "--dropout",
            "0",
            "--data",
            str(data),
            "--data-mode",
            self.mode,
            "--tokenizer",
            "byte",
            "--val-fraction",
            "0",
            "--cache-dir",
            str(cache),
            "--micro-batch",
            str(self.micro_batch),
            "--seq-len",
            str(self.seq_len),
            *sizing,
            "--last-window",
            self.last_window,
            "--long-documents",
            self.long_documents,
            "--shuffle",
            "on" if self.shuffle else "off",  # the reference replays either order (fuzz_reference)
            "--pack",
            "on" if self.pack else "off",  # documents: the reference packs the same rows, trains unpacked
            "--grad-clip",
            repr(self.grad_clip),
            "--max-steps",
            str(self.max_steps),
            "--lr",
            repr(self.lr),
            "--min-lr-ratio",
            repr(self.min_lr_ratio),
            "--warmup-steps",
            str(self.warmup_steps),
            "--decay-steps",
            str(self.decay_steps or "auto"),
            "--weight-decay",
            repr(self.weight_decay),
            "--beta1",
            repr(self.beta1),
            "--beta2",
            repr(self.beta2),
            "--eps",
            repr(self.eps),
            "--seed",
            str(self.init_seed),
            "--parallel",
            self.parallel,
            "--device",
            "cpu",
            "--precision",
            "fp32",
            "--no-compile",
            "--eval-every",
            "0",
            "--sample-tokens",
            "0",
            "--collective-timeout",
            "120",
            "--out",
            str(out),
            "--sync-every-micro-step" if self.sync_every_micro_step else "--no-sync-every-micro-step",
            "--activation-checkpointing" if self.activation_checkpointing else "--no-activation-checkpointing",
            *(
                ["--router-balance", self.router_balance, "--router-aux-coef", repr(self.router_aux_coef)]
                if self.router_balance
                else []
            ),
        ]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Setting:
        values = {f.name: data[f.name] for f in fields(cls)}
        values["documents"] = tuple((p, t) for p, t in values["documents"])
        return cls(**values)


def document_valid_targets(prompt: str | None, text: str, seq_len: int) -> int:
    """Valid targets of one document as one row: tokens cut to T + 1, targets inside the prompt masked (the
    ``truncate`` policy; ``split`` trains on more, never fewer, so a budget drawn from this fits either way)."""
    p = len((prompt or "").encode())
    n = p + len(text.encode())
    return max(0, min(n, seq_len + 1) - max(p, 1))


def document_positions(prompt: str | None, text: str, seq_len: int, long_documents: str) -> int:
    """Positions (targets, masked or not) one document fills: all its tokens but the first (``split``), or at
    most ``seq_len`` of them (``truncate``)."""
    n = len((prompt or "").encode()) + len(text.encode())
    return max(0, n - 1) if long_documents == "split" else max(0, min(n - 1, seq_len))


def _text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(n))


def _documents(rng: random.Random, seq_len: int) -> list[tuple[str | None, str]]:
    docs: list[tuple[str | None, str]] = []
    for _ in range(rng.randint(1, 30)):
        if rng.random() < 0.2:
            docs.append((None, _text(rng, rng.randint(1, seq_len + 8))))
            continue
        prompt = rng.choice([0, rng.randint(1, max(1, seq_len // 2)), rng.randint(0, seq_len + 6)])
        completion = rng.choice([0, rng.randint(1, 4), rng.randint(1, seq_len + 8)])
        docs.append((_text(rng, prompt), _text(rng, completion)))  # both empty: prepare skips the line
    return docs


def non_empty(documents: tuple[tuple[str | None, str], ...]) -> list[tuple[str | None, str]]:
    """The documents that prepare keeps (a line with no text at all is not a document)."""
    return [(p, t) for p, t in documents if (p or "") + t]


def draw(seed: int) -> Setting:
    """The setting of ``seed``: every choice random, every combination valid."""
    rng = random.Random(seed)
    world = rng.choice([1, 2])
    parallel = "none" if world == 1 else rng.choice(["ddp", "fsdp"])
    mode = rng.choice(MODES)
    B = rng.randint(1, 4)
    T = rng.randint(2, MAX_SEQ_LEN)
    budget_mode = rng.random() < 0.5
    k = 0 if budget_mode else rng.randint(1, 4)
    last_window = rng.choice(LAST_WINDOWS)
    global_window = B * T * world  # tokens of one global micro-batch (packed)
    corpus = ""
    documents: tuple[tuple[str | None, str], ...] = ()
    token_budget = 0
    if mode == "packed":
        windows = rng.randint(1, 6)  # whole global windows in one pass: the stream wraps within a few steps
        corpus = _text(rng, windows * global_window + 1 + rng.randint(0, global_window - 1))
        if budget_mode:
            high = 3 * global_window
            if last_window == "drop":  # every step must fit in one pass over the data (shuffled too: from the
                # micro-batch after the one that straddles a pass's start to the one that ends it, `windows` or more)
                high = min(high, windows * global_window)
            token_budget = rng.randint(1, high)
    else:
        docs = _documents(rng, T)
        # At least one global micro-batch of documents (bigbatch refuses fewer sequences; a document is one
        # sequence or more, whichever the long-document policy); one whole step under K and drop.
        while len(non_empty(tuple(docs))) < B * world * (k if k and last_window == "drop" else 1):
            docs.extend(_documents(rng, T))
        if sum(document_valid_targets(p, t, T) for p, t in docs) == 0:
            docs.append((_text(rng, 2), _text(rng, rng.randint(1, T))))
        documents = tuple(docs)
        if budget_mode:
            kept = non_empty(documents)
            total = sum(document_valid_targets(p, t, T) for p, t in kept)
            per_window = total / math.ceil(len(kept) / (B * world))
            high = max(1, int(3 * per_window))
            if last_window == "drop":
                high = min(high, total)
            token_budget = rng.randint(1, high)
    clip = rng.choice(CLIPS)
    grad_clip = {"off": 0.0, "loose": 1e4, "tight": round(rng.uniform(0.003, 0.05), 4)}[clip]
    max_steps = rng.randint(1, 4)
    warmup = rng.randint(0, max_steps)
    decay = rng.choice([0, rng.randint(max(warmup, 1), max_steps + 2)])
    lr, min_lr_ratio = round(10 ** rng.uniform(-4.0, -2.5), 7), rng.choice([0.0, 0.1, 0.5, 1.0])
    weight_decay, beta1 = rng.choice([0.0, 0.1, 0.5]), rng.choice([0.9, 0.8])
    beta2, eps, init_seed = rng.choice([0.95, 0.999]), rng.choice([1e-8, 1e-6]), rng.randrange(2**31)
    # drawn last, so that adding them left every earlier choice of a seed as it was
    sync_every_micro_step = world == 2 and rng.random() < 0.25
    activation_checkpointing = rng.random() < 0.2
    long_documents, shuffle, family = rng.choice(LONG_DOCUMENTS), rng.random() < 0.5, _family(rng)
    pack = mode == "documents" and rng.random() < 0.5
    router_balance, router_aux_coef = "", 0.0
    moe = random.Random(f"moe-{seed}")  # its own stream: every earlier choice of a seed stays as it was
    if family == "llama" and moe.random() < 0.5:  # half the llama-pico settings become moe-pico's
        family = "moe"
        router_balance = moe.choices(ROUTER_BALANCES, weights=(6, 2, 2))[0]
        router_aux_coef = moe.choice(ROUTER_AUX_COEFS)
    if pack:  # enough rows: any packing of the documents' positions needs at least ceil(positions / T) rows
        more = random.Random(seed + 1)  # its own stream: the other choices of a seed stay as they were
        needed = B * world * (k if k and last_window == "drop" else 1)
        while math.ceil(sum(document_positions(p, t, T, long_documents) for p, t in documents) / T) < needed:
            documents += tuple(_documents(more, T))
    return Setting(
        seed=seed,
        mode=mode,
        world=world,
        parallel=parallel,
        micro_batch=B,
        seq_len=T,
        k=k,
        token_budget=token_budget,
        last_window=last_window,
        clip=clip,
        grad_clip=grad_clip,
        max_steps=max_steps,
        lr=lr,
        min_lr_ratio=min_lr_ratio,
        warmup_steps=warmup,
        decay_steps=decay,
        weight_decay=weight_decay,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        init_seed=init_seed,
        corpus=corpus,
        documents=documents,
        sync_every_micro_step=sync_every_micro_step,
        activation_checkpointing=activation_checkpointing,
        long_documents=long_documents,
        shuffle=shuffle,
        family=family,
        pack=pack,
        router_balance=router_balance,
        router_aux_coef=router_aux_coef,
    )


def _family(rng: random.Random) -> str:
    """gpt or llama, each half the time; a llama is trained as the hf family half the time (drawn after: the hf
    family came later, and every earlier choice of a seed stayed as it was)."""
    family = rng.choice(FAMILIES[:2])
    return "hf" if family == "llama" and rng.random() < 0.5 else family
