"""``bigbatch prepare``: tokenize text into token shards."""

from __future__ import annotations

import argparse
from pathlib import Path

from bigbatch.cli.common import add_config_flag
from bigbatch.progress import plural
from bigbatch.run.configuration.train_config import BatchSection, DataSection
from bigbatch.settings.choices import DATA_MODE, TOKENIZER_NAMES
from bigbatch.settings.ranges import AUTO, NON_NEGATIVE_INT, POSITIVE_INT, POSITIVE_INT_OR_AUTO

HELP = "tokenize text into token shards"
DESCRIPTION = None
SHARD_TOKENS = 100_000_000  # bigbatch.data.prepare.DEFAULT_SHARD_TOKENS, without importing numpy for --help


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "source",
        help="a text file, a directory, a glob, 'builtin', or a Hugging Face dataset (needs datasets): "
        "hf:NAME[:CONFIG][:SPLIT] (the Hub), hf:BUILDER:FILES (json, csv, parquet, text, arrow; e.g. "
        "hf:json:data/*.jsonl), hf:DIR (save_to_disk); #COLUMN at the end for a text column other than 'text'",
    )
    parser.add_argument("--out", required=True, type=Path, help="new dataset directory to create")
    add_config_flag(
        parser, DataSection, "tokenizer", default="byte", note=f"; prepare: one of {', '.join(TOKENIZER_NAMES)}"
    )
    add_config_flag(parser, DataSection, "val_fraction")
    parser.add_argument(
        "--shard-tokens",
        type=POSITIVE_INT.argtype(),
        default=SHARD_TOKENS,
        help=f"tokens per shard (default: {SHARD_TOKENS:,})",
    )
    parser.add_argument(
        "--workers",
        type=POSITIVE_INT_OR_AUTO.argtype(),
        default=AUTO,
        metavar="N|auto",
        help="tokenizer processes; auto: one per CPU core (at most 32) for a large corpus and a "
        "tokenizer other than byte, else 1 (default: auto)",
    )
    parser.add_argument(
        "--mode",
        default="auto",
        choices=DATA_MODE,
        help="packed: one token stream; documents: one padded sequence per document, .jsonl prompts masked "
        "(conversations and rows of answers need documents); auto: documents when the first row is a conversation "
        "('messages' or ShareGPT 'conversations'), a preference pair ('prompt', 'chosen', 'rejected') or a KTO row "
        "('prompt', 'completion', 'label'), else packed (default: auto)",
    )
    add_config_flag(parser, DataSection, "bad_rows", note="; refused: nothing written")
    add_config_flag(parser, DataSection, "loss_on")
    add_config_flag(parser, DataSection, "no_assistant")
    add_config_flag(parser, DataSection, "long_conversations")
    add_config_flag(
        parser,
        BatchSection,
        "seq_len",
        default=None,
        allow_auto=False,
        note="; prepare: chat data and rows of answers only, a conversation (a row of answers: any of its "
        "documents) longer than seq_len+1 tokens is shortened, left out or refused by --long-conversations (longer, "
        "it would be cut into windows, or refused, when training); unset: no limit",
    )
    parser.add_argument(
        "--show",
        type=NON_NEGATIVE_INT.argtype(),
        default=0,
        metavar="N",
        help="chat data: print the first N conversations as rendered by the template, trained tokens between "
        "\u27e6 and \u27e7 (rows of answers: each answer's document); 0 prints none (default: 0)",
    )


def run(args: argparse.Namespace) -> int:
    from bigbatch.data.chat import ChatSettings
    from bigbatch.data.prepare import default_answer_settings, prepare_dataset, prepared_notes, shown_conversations

    chat = ChatSettings(
        loss_on=args.loss_on,
        no_assistant=args.no_assistant,
        long_conversations=args.long_conversations,
        max_tokens=args.seq_len + 1 if args.seq_len else 0,  # unset: no limit
    )
    answers = default_answer_settings(chat, args.bad_rows)
    meta = prepare_dataset(
        args.source,
        args.out,
        tokenizer_name=args.tokenizer,
        val_fraction=args.val_fraction,
        shard_tokens=args.shard_tokens,
        mode=args.mode,
        workers=None if args.workers == AUTO else args.workers,
        chat=chat,
        answers=answers,
    )
    print(
        f"{args.out}: {plural(meta.documents, 'document')}, train {meta.tokens['train']:,} tokens, "
        f"val {meta.tokens['val']:,} tokens ({meta.tokenizer}, vocab {meta.vocab_size}, {meta.mode})"
    )
    if args.mode == "auto" and "chat" in meta.extra:  # say why the mode is documents though none was given
        from bigbatch.data.data_mode import conversations_note

        print(f"{args.out}: {conversations_note('--mode')}")
    if args.mode == "auto" and meta.answers:
        from bigbatch.data.data_mode import answers_note

        print(f"{args.out}: {answers_note(meta.answers, '--mode')}")
    for note in prepared_notes(meta):
        print(f"{args.out}: {note}")
    if args.show:
        for text in shown_conversations(args.source, args.tokenizer, chat, args.show, answers):
            print(text)
    return 0
