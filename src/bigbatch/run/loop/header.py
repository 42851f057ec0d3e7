"""The lines a run prints before its first step: version and devices, data, model, plan, long documents, and
that the first step compiles."""

from __future__ import annotations

from bigbatch import __version__
from bigbatch.data.answer_encode import answer_audit_lines
from bigbatch.data.answer_groups import AnswerGroupLoader
from bigbatch.data.chat import audit_lines
from bigbatch.data.data_mode import conversations_note
from bigbatch.data.documents import DocumentLoader
from bigbatch.data.rollout_loader import FileRollouts, RolloutLoader
from bigbatch.engine.optim import describe_optimizer
from bigbatch.models.registry import family_of
from bigbatch.parallel.launch import worker_threads_note
from bigbatch.progress import plural
from bigbatch.run.build import RunParts
from bigbatch.run.build.engine_phase import loss_spike_threshold
from bigbatch.run.configuration.seq_len import INIT_FROM_AUTO_SEQ_LEN_CAP


def header_lines(parts: RunParts) -> list[str]:
    meta, cfg = parts.dataset.meta, parts.model.config
    plan = f"plan | {describe_plan(parts)}"
    if parts.seq_len_auto:  # no --seq-len: say where the number came from
        if parts.plan.seq_len < cfg.block_size:  # --init-from's context, capped (see config.auto_seq_len)
            plan += (
                f" | seq_len {parts.plan.seq_len} (the model's block size {cfg.block_size:,}, capped at "
                f"{INIT_FROM_AUTO_SEQ_LEN_CAP:,}; --seq-len sets it)"
            )
        else:
            plan += f" | seq_len {parts.plan.seq_len} (the model's block size)"
    lines = [
        f"bigbatch {__version__} | device {parts.device} | precision {parts.engine.precision} | parallel "
        f"{parts.parallel} | run {parts.run_dir}",
        f"data {parts.dataset.directory} | {meta.tokenizer} tokenizer | train "
        f"{plural(meta.tokens.get('train', 0), 'token')} | val {plural(meta.tokens.get('val', 0), 'token')}",
        f"model {parts.config.model.init_from or parts.config.model.preset} | {parts.model.describe_size()} | "
        f"{family_of(cfg).describe_shape(cfg)} | vocab {cfg.vocab_size} | block {cfg.block_size}",
        plan,
    ]
    threads = worker_threads_note()
    if threads:  # bigbatch's launcher chose OMP_NUM_THREADS for the workers (torchrun's banner is kept back)
        lines.insert(1, f"threads | {threads}")
    if parts.ramp is not None:
        lines.append(f"batch ramp | {parts.ramp.describe()}")
    unit = parts.plan.tokens_per_k
    if parts.seesaw is not None:
        lines.append(f"seesaw | {parts.seesaw.describe(unit)}")
    lines.append(f"optimizer | {describe_optimizer(parts.engine.optimizer)}")
    follower = parts.engine.follower
    if follower is not None and (
        parts.ramp is not None or parts.seesaw is not None or follower.reference_tokens != parts.planned_tokens_per_step
    ):
        base = follower.base
        rule = follower.rule.describe(muon=base.momentum is not None)
        muon = ""
        if base.muon_lr is not None:
            muon = f", Muon lr {base.muon_lr:.3g}, momentum {base.momentum:g}, weight decay {base.muon_weight_decay:g}"
        lines.append(
            f"batch change | {rule} | B0 = {follower.reference_tokens:,} tokens/step, where lr {base.lr:.3g}, betas "
            f"({base.beta1:g}, {base.beta2:g}) and weight decay {base.weight_decay:g}{muon} hold"
        )
    if parts.engine.router is not None:
        lines.append(f"router | {parts.engine.router.describe()}")
    lines.append(f"bad steps | {describe_guard(parts)}")
    chat = meta.extra.get("chat")
    if isinstance(chat, dict) and parts.data_mode_auto and parts.config.data.data_mode == "documents":
        # no --data-mode, and raw conversations prepared as documents for it: say why
        lines.append(f"chat | {conversations_note('--data-mode')}")
    if isinstance(chat, dict):  # conversations: the audit prepare made of them
        lines.extend(f"chat | {line.removeprefix('chat: ')}" for line in audit_lines(chat, str(chat.get("loss_on"))))
    answer_rows = meta.extra.get("answer_rows")
    if meta.answers and isinstance(answer_rows, dict):  # pairs, KTO rows: what prepare kept, cut and left out
        lines.extend(f"rows | {line}" for line in answer_audit_lines(answer_rows))
    if isinstance(parts.train_loader, DocumentLoader):
        lines.append(f"documents | {describe_positions(parts.train_loader)}")
        lines.append(f"long documents | {describe_long_documents(parts.train_loader)}")
    if not isinstance(parts.train_loader, RolloutLoader):  # prompts: their own seeded order (docs/rewards.md)
        lines.append(f"order | {describe_order(parts)}")
    if parts.val_loader is not None:
        every = parts.config.run.eval_every
        lines.append(f"validation | every {'step' if every == 1 else f'{every} steps'} | {parts.val_loader.describe()}")
    if parts.compiled:  # last, just before the first step: torch.compile compiles then, silent for up to minutes
        lines.append(
            "compiling | torch.compile compiles the model during the first step: minutes can pass before step 1's "
            "line (--compile off trains without it)"
        )
    return lines


def describe_plan(parts: RunParts) -> str:
    p, last_window = parts.plan, parts.policy.last_window
    if parts.policy.token_budget:
        return (
            f"token budget {parts.policy.token_budget:,} valid targets/step | micro_batch {p.micro_batch} x seq_len "
            f"{p.seq_len} x world {p.world_size} per micro-batch | K varies (the micro-batch that reaches the "
            f"budget is included whole) | last window: {last_window}"
        )
    if isinstance(parts.train_loader, RolloutLoader):
        rollouts = parts.train_loader
        rows = "packed rows, positions restarting at each completion" if rollouts.pack else "one completion a row"
        sampled = (
            "" if isinstance(rollouts.source, FileRollouts) else f" x {parts.config.rewards.group_size} completions"
        )
        return (
            f"{rollouts.prompts_per_step} prompts{sampled} per step | micro_batch {p.micro_batch} x seq_len "
            f"{p.seq_len} x world {p.world_size} per micro-batch ({rows}) | K follows each step's completions | "
            f"every term over the step's {parts.config.rewards.loss_aggregation} units"
        )
    if isinstance(parts.train_loader, AnswerGroupLoader):
        loader = parts.train_loader
        kind = "pairs (chosen and rejected)" if loader.answers == "pairs" else "KTO rows (completion and KL answer)"
        rows = "packed rows, positions restarting at each answer" if loader.pack else "one answer a row"
        return (
            f"{p.describe()} (positions; whole {kind} per micro-batch, {rows}; each term normalized by its own units "
            f"of the step) | last window: {last_window}"
        )
    if parts.documents:
        packed = isinstance(parts.train_loader, DocumentLoader) and parts.train_loader.pack
        rows = (
            "packed rows: whole documents, or windows of long ones, back to back, positions restarting at each"
            if packed
            else "one document, or one window of a long one, per sequence"
        )
        return (
            f"{p.describe()} (positions; {rows}; normalized by the valid targets of each step) | last window: "
            f"{last_window}"
        )
    return p.describe()


def describe_positions(loader: DocumentLoader) -> str:
    """Where one epoch's positions go, as read and the other way: e.g. ``packed into 1,210 rows of 512 (--pack
    on): 2.1% padding, 24.0% masked prompts, 73.9% valid targets (one per row: 56.3% padding)``."""
    padding, prompt = loader.position_shares()
    other_padding, _ = loader.position_shares(packed=not loader.pack)
    if loader.pack:
        how = f"packed into {plural(loader.n_sequences, 'row')} of {loader.seq_len} (--pack on)"
        other = f"one per row: {other_padding:.1%} padding"
    else:
        how = f"{plural(loader.n_sequences, 'sequence')}, one per row of {loader.seq_len} (--pack off)"
        other = f"--pack on: {other_padding:.1%} padding"
    return (
        f"{how}: {padding:.1%} padding, {prompt:.1%} masked prompts, {1 - padding - prompt:.1%} valid targets ({other})"
    )


def describe_long_documents(loader: DocumentLoader) -> str:
    """The long-document policy of a documents-mode training split and what it costs."""
    total = loader.valid_targets + loader.dropped_targets
    longer = (
        f"{loader.long_document_count:,} of {plural(loader.n_docs, 'document')} longer than "
        f"seq_len+1={loader.seq_len + 1}"
    )
    if loader.long_documents == "split":
        return (
            f"split into seq_len windows ({plural(loader.sequence_count, 'sequence')}; {longer}) | "
            f"0 of {plural(total, 'target token')} dropped"
        )
    share = loader.dropped_targets / total if total else 0.0
    return (
        f"truncate to seq_len+1 tokens ({longer}) | {loader.dropped_targets:,} of {plural(total, 'target token')} "
        "dropped "
        f"({share:.1%}); --long-documents split trains on every one"
    )


def describe_order(parts: RunParts) -> str:
    """How the training windows are read: shuffled per epoch (``--shuffle on``) or in the data's order."""
    if parts.config.data.shuffle == "on":
        unit = "sequences" if parts.documents else f"windows of {parts.plan.seq_len} tokens"
        if isinstance(parts.train_loader, AnswerGroupLoader):
            unit = "pairs" if parts.train_loader.answers == "pairs" else "KTO rows"
        return f"shuffled: a permutation of the {unit} per epoch, seed {parts.config.run.seed} (--shuffle on)"
    return "the data's order (--shuffle off)"


def describe_guard(parts: RunParts) -> str:
    """``skip-micro | spikes: loss 6, gradient norm 12 robust sd over 100 steps | replay every 10 steps``."""
    guard = parts.config.guard
    spikes = ", ".join(
        f"{name} {threshold:g}"
        for name, threshold in (("loss", loss_spike_threshold(parts.config)), ("gradient norm", guard.grad_spike))
        if threshold > 0
    )
    text = f"{guard.bad_step}" + (
        f" (at most {plural(guard.max_rewinds, 'rewind')})" if guard.bad_step == "rewind" else ""
    )
    text += f" | spikes: {spikes} robust sd over {guard.spike_window} steps" if spikes else " | spikes: off"
    return text + " | " + describe_replay(guard.replay_every, parts.dist.world_size)


def describe_replay(every: int, world_size: int) -> str:
    """What ``--replay-every`` checks in this run; on one process, also what it cannot see (a device repeats its
    own wrong value when it computes the same micro-batch again)."""
    if not every:
        return "replay off"
    said = f"replay every {'step' if every == 1 else f'{every} steps'}"
    if world_size == 1:
        return f"{said} (one process: catches a wrong value that changes between runs, not one the device repeats)"
    return f"{said} (each rank's drawn micro-batch re-run on the next rank: a faulty device stops the run)"
