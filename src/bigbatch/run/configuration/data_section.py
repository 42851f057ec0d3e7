"""The ``[data]`` section: the training data, how it is read, packed, masked and split."""

from __future__ import annotations

from dataclasses import dataclass

from bigbatch.run.configuration.fields import config_field as _opt
from bigbatch.settings.choices import (
    BAD_ROWS,
    DATA_MODE,
    LONG_CONVERSATIONS,
    LONG_DOCUMENTS,
    LOSS_ON,
    NO_ASSISTANT,
    PACK,
    SHUFFLE,
)
from bigbatch.settings.ranges import PROBABILITY


@dataclass
class DataSection:
    data: str = _opt(
        "builtin",
        "a prepared dataset directory; raw text (file, directory, glob, or 'builtin'); or token shards from "
        "build-nanogpt (.npy) / llm.c (.bin): a directory or glob",
    )
    tokenizer: str = _opt(
        "auto",
        "tokenizer for raw text: byte (no download), gpt2 (tiktoken), bpe:VOCAB (byte-level BPE trained on the "
        "data, e.g. bpe:4096) or file:PATH (a Hugging Face tokenizer.json, or the directory holding one); auto: with "
        "--init-from, that directory's tokenizer.json when it has one, else byte for raw text; the dataset's own for "
        "prepared or token-shard data (another name than the dataset's is an error)",
    )
    val_fraction: float = _opt(
        0.1,
        "share of the token stream held out for validation when preparing raw text; 0 holds none out (then set "
        "--eval-every 0)",
        range=PROBABILITY,
    )
    cache_dir: str = _opt("", "where raw text is prepared (default: $BIGBATCH_CACHE or ~/.cache/bigbatch)")
    data_mode: str = _opt(
        "auto",
        "how raw text is prepared: packed (one token stream) or documents (one padded sequence per document; "
        ".jsonl prompt/completion records mask the prompt); auto: documents when the first row is a conversation "
        "('messages' or ShareGPT 'conversations'), else packed",
        choices=DATA_MODE,
    )
    loss_on: str = _opt(
        "assistant",
        "chat data (.jsonl rows of 'messages', rendered with the model's chat template): train on every assistant "
        "turn's tokens (assistant, end-of-turn token included), only the last turn's (last-assistant) or every "
        "token (all)",
        choices=LOSS_ON,
    )
    no_assistant: str = _opt(
        "refuse",
        "chat data: a conversation with no assistant token to train on is refused in one line (refuse) or left out "
        "and counted (drop)",
        choices=NO_ASSISTANT,
    )
    long_conversations: str = _opt(
        "drop-oldest-turns",
        "chat data, a conversation longer than seq_len+1 tokens (it would be cut into windows, a later reply trained "
        "without its question): drop-oldest-turns (leave out its oldest rounds until it fits; the system prompt and "
        "tools stay), drop (leave it out) or refuse (one line naming it); counted in prepare's audit",
        choices=LONG_CONVERSATIONS,
    )
    bad_rows: str = _opt(
        "refuse",
        "preference pairs and KTO rows: a malformed row (a missing field, identical chosen and rejected, an answer "
        "that renders empty, a conversation the template refuses) is refused in one line naming it, or with drop "
        "left out and counted in prepare's lines; an over-long row follows --long-conversations",
        choices=BAD_ROWS,
    )
    long_documents: str = _opt(
        "split",
        "documents mode, a document longer than seq_len: split (into seq_len windows, each padded only at its end; "
        "every token is trained on) or truncate (keep its first seq_len+1 tokens, drop the rest)",
        choices=LONG_DOCUMENTS,
    )
    pack: str = _opt(
        "auto",
        "documents mode: on (rows of seq_len filled with whole documents back to back, attention and positions "
        "within each; a long document's windows as --long-documents split makes them), off (one padded document "
        "per row); auto: on for a new run, and what the run started with on resume",
        choices=PACK,
    )
    shuffle: str = _opt(
        "on",
        "training order: on (a seeded permutation of the windows each epoch; packed data: the windows of a step "
        "depend only on the seed, seq_len and tokens per step, not on micro_batch or processes; documents: the "
        "epoch's sequences) or off (the order of the data)",
        choices=SHUFFLE,
        switch=True,
    )
