"""The data phase of a build: the prepared dataset (rank 0 prepares, the others wait and find it), its
fingerprints and tokenizer, and, once the plan is known, this rank's training loader and validation windows."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bigbatch.data.answer_groups import AnswerGroupLoader
from bigbatch.data.answers import check_answers_for_objective
from bigbatch.data.cache import ensure_prepared
from bigbatch.data.chat import ChatSettings
from bigbatch.data.dataset import Dataset, open_dataset
from bigbatch.data.documents import DocumentLoader
from bigbatch.data.fingerprint import dataset_fingerprints, tokenizer_fingerprint
from bigbatch.data.loader import loader_for
from bigbatch.data.prepare import default_answer_settings
from bigbatch.data.rollout_loader import RolloutLoader
from bigbatch.data.shards import check_requested_tokenizer
from bigbatch.data.stream import TokenStreamLoader
from bigbatch.data.tokenizers import carries_tokenizer_json, get_tokenizer, model_dir_tokenizer
from bigbatch.data.validation_windows import ValidationWindows, validation_windows
from bigbatch.errors import ConfigError, DataError
from bigbatch.parallel.distributed import DistContext, Say
from bigbatch.progress import plural
from bigbatch.run.configuration.seq_len import model_directory, resolve_seq_len
from bigbatch.run.configuration.train_config import TrainConfig
from bigbatch.sizing.plan import BatchPlan

Loader = TokenStreamLoader | DocumentLoader | AnswerGroupLoader | RolloutLoader


@dataclass(frozen=True)
class RunData:
    """The run's dataset and what identifies it."""

    dataset: Dataset  # a prepared or foreign token dataset
    fingerprints: dict[str, str]  # of the dataset's tokenizer and tokens
    bpe_json: str | None  # a bpe:VOCAB tokenizer travels inside each checkpoint (it is small)


def open_run_data(config: TrainConfig, dist: DistContext, say: Say) -> RunData:
    """The prepared dataset on every rank (rank 0 prepares raw text into the cache first), checked against
    ``--tokenizer``; the cache directory was checked with the settings (:func:`.checks.check_config`)."""
    dataset = open_dataset(prepare_data_once(config, dist))
    check_requested_tokenizer(dataset.meta, config.data.tokenizer, dataset.directory)
    fingerprints = dataset_fingerprints(dataset)
    _say_tokenizer(config, dataset.meta.tokenizer, fingerprints["tokenizer"], say)
    bpe_json = None
    if carries_tokenizer_json(dataset.meta.tokenizer):  # bpe:VOCAB and a model's own file:PATH travel in checkpoints
        bpe_json = get_tokenizer(dataset.meta.tokenizer, dataset.directory).to_str()  # type: ignore[attr-defined]
    return RunData(dataset, fingerprints, bpe_json)


def prepare_data(config: TrainConfig) -> Path:
    """The run's prepared dataset: raw text prepared into the cache once, or a dataset directory as it is."""
    data = config.data
    chat = chat_settings(config)
    return ensure_prepared(
        data.data,
        data_tokenizer(config),
        data.val_fraction,
        data.cache_dir or None,
        mode=data.data_mode,
        chat=chat,
        answers=default_answer_settings(chat, bad_rows_policy(config)),
    )


def bad_rows_policy(config: TrainConfig) -> str:
    """What becomes of a bad row of answers (``--bad-rows``): ``refuse`` unless the run's data settings say
    otherwise (a setting read where the configuration has it; ``refuse`` where it has none)."""
    return config.data.bad_rows


def chat_settings(config: TrainConfig) -> ChatSettings:
    """How the run's conversations become rows: which tokens are trained, and a conversation kept within one
    row of ``seq_len + 1`` tokens by the run's ``long_conversations`` policy."""
    data = config.data
    seq_len = resolve_seq_len(config).batch.seq_len
    return ChatSettings(
        loss_on=data.loss_on,
        no_assistant=data.no_assistant,
        long_conversations=data.long_conversations,
        max_tokens=seq_len + 1,
    )


def prepare_data_once(config: TrainConfig, dist: DistContext) -> Path:
    """Rank 0 prepares raw text into the cache while the others wait, then every rank finds it there."""
    path = prepare_data(config) if dist.is_main else None
    dist.barrier()
    return path if path is not None else prepare_data(config)


def data_tokenizer(config: TrainConfig) -> str:
    """``--tokenizer``; ``auto`` with a model directory that holds a tokenizer.json is that file."""
    directory = model_directory(config)
    if config.data.tokenizer in ("", "auto") and directory:
        return model_dir_tokenizer(directory) or config.data.tokenizer
    return config.data.tokenizer


def _say_tokenizer(config: TrainConfig, used: str, used_fingerprint: str, say: Say) -> None:
    """One line on what ``--tokenizer auto`` chose for a model directory."""
    directory = model_directory(config)
    if not directory or config.data.tokenizer not in ("", "auto"):
        return
    own = model_dir_tokenizer(directory)
    if own is None:
        say(
            "--tokenizer auto: %s has no tokenizer.json; using the data's %s tokenizer, as for a preset",
            directory,
            used,
            level=logging.WARNING,
        )
    elif tokenizer_fingerprint(own) == used_fingerprint:
        say("--tokenizer auto: the model's own tokenizer, %s", own.removeprefix("file:"))
    else:
        say(
            "--tokenizer auto: %s holds %s tokens, not those of %s's tokenizer.json; training on them",
            config.data.data,
            used,
            directory,
            level=logging.WARNING,
        )


def build_loaders(
    config: TrainConfig, dataset: Dataset, plan: BatchPlan, dist: DistContext, pack: bool
) -> tuple[Loader, ValidationWindows | None]:
    """This rank's training loader (shuffled with ``--shuffle on``) and the fixed validation windows (``None``
    with ``--eval-every 0``). Data of answers (pairs, KTO rows) is read only under an ``--objective`` that reads
    them, and such an objective only reads them (:func:`~bigbatch.data.answers.check_answers_for_objective`)."""
    answers = dataset.meta.answers if dataset.meta.mode == "documents" else ""
    check_answers_for_objective(answers, config.objective.name)
    train_loader = build_loader(
        config, dataset, plan, dist, "train", "training", shuffle=config.data.shuffle == "on", pack=pack
    )
    check_micro_batch_fits(train_loader, plan.micro_batch, dist.world_size)
    if isinstance(train_loader, DocumentLoader):
        train_loader.pack_auto = config.data.pack == "auto"
    return train_loader, validation_loader(config, dataset, plan, dist, pack)


def build_loader(
    config: TrainConfig,
    dataset: Dataset,
    plan: BatchPlan,
    dist: DistContext,
    split: str,
    name: str,
    shuffle: bool = False,
    pack: bool | None = None,
) -> Loader:
    """This rank's reader of ``split`` (in a seeded order per epoch with ``shuffle``; documents packed into rows
    with ``pack``); a documents split without a single valid target is refused. ``pack`` None: not known yet (a
    check before the model is built): documents one per row, groups of answers as ``--pack`` asks (how they are
    dealt decides what fits a micro-batch)."""
    if pack is None:
        pack = bool(dataset.meta.mode == "documents" and dataset.meta.answers and config.data.pack != "off")
    loader = loader_for(
        dataset,
        split,
        plan.micro_batch,
        plan.seq_len,
        dist.rank,
        dist.world_size,
        name=name,
        long_documents=config.data.long_documents,
        shuffle=shuffle,
        seed=config.run.seed,
        pack=pack,
    )
    if isinstance(loader, DocumentLoader) and loader.long_document_count and dataset.meta.extra.get("chat"):
        raise DataError(
            f"{plural(loader.long_document_count, 'conversation')} of the {name} split of {dataset.directory} "
            f"{'is' if loader.long_document_count == 1 else 'are'} longer than seq_len+1={plan.seq_len + 1} tokens: "
            "cut into windows, a later reply would be trained without its question; prepare the conversations with "
            f"--seq-len {plan.seq_len} (--long-conversations decides what becomes of them), or train with a larger "
            "--seq-len"
        )
    if isinstance(loader, AnswerGroupLoader) and loader.valid_targets == 0:
        raise DataError(f"the {name} split of {dataset.directory} holds no answer token to train on; fix the data")
    if isinstance(loader, DocumentLoader) and loader.valid_targets == 0:
        raise DataError(
            f"the {name} split of {dataset.directory} holds no valid targets: each of its "
            f"{plural(loader.n_docs, 'document')} is a single token or wholly masked (e.g. a prompt with an empty "
            "completion), so there is nothing to train on or score; fix the data"
        )
    return loader


def validation_loader(
    config: TrainConfig, dataset: Dataset, plan: BatchPlan, dist: DistContext, pack: bool = False
) -> ValidationWindows | None:
    if config.run.eval_every == 0:
        return None
    if not dataset.meta.shards.get("val"):
        raise DataError("the dataset has no validation split; prepare it with --val-fraction > 0 or set --eval-every 0")
    try:
        windows = validation_windows(
            dataset,
            "val",
            plan.micro_batch,
            plan.seq_len,
            config.run.eval_batches,
            dist.rank,
            dist.world_size,
            long_documents=config.data.long_documents,
            pack=pack,
        )
        if isinstance(windows.source, DocumentLoader | AnswerGroupLoader) and windows.source.valid_targets == 0:
            raise DataError(
                f"the validation split of {dataset.directory} holds no valid targets (every document is a single "
                "token or wholly masked)"
            )
        return windows
    except DataError as exc:
        raise DataError(f"{exc}, raise --val-fraction, or set --eval-every 0") from exc


def check_micro_batch_fits(loader: Any, micro_batch: int, world_size: int) -> None:
    """Refuse a documents split smaller than one global micro-batch: every micro-batch would hold the whole
    split plus rows of padding, so every step would repeat it K times (answers: fewer micro-batches of groups
    than processes, some of which would never read one)."""
    if isinstance(loader, AnswerGroupLoader):
        if loader.n_units < world_size:
            raise ConfigError(
                f"the training split's {plural(loader.n_groups, loader.answers + ' group')} fill "
                f"{plural(loader.n_units, 'micro-batch', 'micro-batches')} of {micro_batch} rows, fewer than the "
                f"{world_size} processes; use --micro-batch {max(1, micro_batch // world_size)} or less, fewer "
                "processes, or more data"
            )
        return
    n_seq = getattr(loader, "n_sequences", None)  # only a documents loader has a fixed count of sequences (rows)
    if n_seq is not None and micro_batch * world_size > n_seq:
        per_process = f" x {world_size} processes" if world_size > 1 else ""
        unit, what = (
            ("row", "documents packed into rows")
            if loader.pack
            else ("sequence", "documents after the long-document policy")
        )
        raise ConfigError(
            f"--micro-batch {micro_batch}{per_process} needs {micro_batch * world_size} {unit}s per micro-batch, "
            f"but the training split holds only {n_seq} {unit}{'s' if n_seq != 1 else ''} ({what}); use "
            f"--micro-batch {max(1, n_seq // world_size)} or less, or more data"
        )
