"""Preparing rows of answers: text pairs tokenized as prompt/completion documents are, KTO rows with their KL
documents made in their split, bad and over-long rows refused (nothing written) or dropped and counted, and the
prepared dataset read back by the loader of answers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from real_templates import real_chat_dir

from bigbatch.data.answer_groups import AnswerGroupLoader
from bigbatch.data.answers import (
    ROLE_CHOSEN,
    ROLE_DESIRABLE,
    ROLE_KL,
    ROLE_REJECTED,
    ROLE_UNDESIRABLE,
    check_answers_for_objective,
)
from bigbatch.data.cache import ensure_prepared
from bigbatch.data.chat import ChatSettings
from bigbatch.data.data_mode import resolve_data_mode
from bigbatch.data.dataset import open_dataset
from bigbatch.data.loader import loader_for
from bigbatch.data.prepare import default_answer_settings, prepare_dataset, prepared_notes
from bigbatch.data.tokenizers import get_tokenizer
from bigbatch.data.validation_windows import validation_windows
from bigbatch.errors import ConfigError, DataError

Document = tuple[list[int], list[int], int]
"""Tokens, trained mask, role."""


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def documents(directory: Path, split: str = "train") -> list[Document]:
    found = []
    for shard in open_dataset(directory).document_shards(split):
        assert shard.mask is not None
        for i in range(len(shard.offsets) - 1):
            a, b = int(shard.offsets[i]), int(shard.offsets[i + 1])
            role = -1 if shard.roles is None else int(shard.roles[i])  # -1: ordinary documents
            found.append((shard.tokens[a:b].tolist(), shard.mask[a:b].tolist(), role))
    return found


def text(ids: list[int]) -> str:
    return bytes(ids).decode()


def kto_rows(n: int) -> list[dict]:
    return [{"prompt": f"P{i}:", "completion": f" c{i}", "label": i % 3 != 0} for i in range(n)]


def test_text_pairs_are_tokenized_as_prompt_completion_documents_ending_on_the_end_of_text_token(
    tmp_path: Path,
) -> None:
    """With a tokenizer that has an end-of-text token (a Qwen tokenizer.json: <|im_end|>), each answer is its
    document's trained span, ending on that token, as a prompt/completion document's completion is."""
    name = f"file:{real_chat_dir(tmp_path / 'qwen', 'qwen2.5')}"
    rows = [{"prompt": "Q: sky?\nA:", "chosen": " blue", "rejected": " green"}]
    data = write_rows(tmp_path / "pairs.jsonl", rows)
    completion = write_rows(tmp_path / "pc.jsonl", [{"prompt": "Q: sky?\nA:", "completion": " blue"}])
    meta = prepare_dataset(str(data), tmp_path / "out", name, val_fraction=0.0, mode="auto")
    assert meta.answers == "pairs" and meta.mode == "documents" and meta.masked
    prepare_dataset(str(completion), tmp_path / "pc", name, val_fraction=0.0, mode="documents")
    tokenizer = get_tokenizer(name)
    assert tokenizer.eot_token is not None
    (chosen_ids, chosen_mask, chosen_role), (rejected_ids, rejected_mask, rejected_role) = documents(tmp_path / "out")
    assert (chosen_role, rejected_role) == (ROLE_CHOSEN, ROLE_REJECTED)
    assert chosen_ids == documents(tmp_path / "pc")[0][0]  # the very tokens of a prompt/completion document
    for ids, mask, answer in ((chosen_ids, chosen_mask, " blue"), (rejected_ids, rejected_mask, " green")):
        trained = [t for t, m in zip(ids, mask, strict=True) if m]
        assert trained[-1] == tokenizer.eot_token
        assert tokenizer.decode(trained[:-1]) == answer
        assert tokenizer.decode(ids[: mask.index(1)]) == "Q: sky?\nA:"


def test_kto_rows_get_their_kl_document_in_their_own_split(tmp_path: Path) -> None:
    """Row i's KL document is its prompt, then row i + 1's completion, the last row taking the first one's, within
    each split; a KTO row (``label`` beside ``completion``) is never read as prompt/completion again."""
    data = write_rows(tmp_path / "kto.jsonl", kto_rows(10))
    assert resolve_data_mode("auto", str(data), "byte") == "documents"
    meta = prepare_dataset(str(data), tmp_path / "out", "byte", val_fraction=0.3, mode="auto")
    assert meta.answers == "kto"
    with pytest.raises(DataError, match="KTO rows .* --objective kto"):
        check_answers_for_objective(open_dataset(tmp_path / "out").answers, "lm")
    audit = meta.extra["answer_rows"]
    assert isinstance(audit, dict) and (audit["desirable"], audit["undesirable"]) == (6, 4)
    rows = []
    for split in ("train", "val"):
        docs = documents(tmp_path / "out", split)
        own = docs[0::2]
        assert all(role in (ROLE_DESIRABLE, ROLE_UNDESIRABLE) for _, _, role in own)
        assert all(role == ROLE_KL for _, _, role in docs[1::2])
        numbers = [int(text(ids).split(":")[0][1:]) for ids, _, _ in own]
        rows += numbers
        for k, ((ids, _, role), (kl_ids, kl_mask, _)) in enumerate(zip(own, docs[1::2], strict=True)):
            i, following = numbers[k], numbers[(k + 1) % len(numbers)]
            assert text(ids) == f"P{i}: c{i}" and role == (ROLE_DESIRABLE if i % 3 else ROLE_UNDESIRABLE)
            assert text(kl_ids) == f"P{i}: c{following}"
            assert text([t for t, m in zip(kl_ids, kl_mask, strict=True) if m]) == f" c{following}"
    assert sorted(rows) == list(range(10)) and len(documents(tmp_path / "out", "val")) == 6


def test_kto_rows_are_refused_as_packed_text(tmp_path: Path) -> None:
    data = write_rows(tmp_path / "kto.jsonl", kto_rows(2))
    with pytest.raises(ConfigError, match=r"kto\.jsonl:1 is a row of kto .* add --mode documents"):
        prepare_dataset(str(data), tmp_path / "out", "byte", val_fraction=0.0, mode="packed")
    assert not (tmp_path / "out").exists()


BAD = [
    {"prompt": "a", "chosen": " b", "rejected": " c"},
    {"prompt": "a", "chosen": " b"},
    {"prompt": "a", "chosen": " same", "rejected": " same"},
    {"prompt": "a", "chosen": " ", "rejected": " c"},
    {"prompt": "a", "chosen": " d", "rejected": " e"},
]


def test_a_bad_row_is_refused_in_one_line_naming_it_and_nothing_is_written(tmp_path: Path) -> None:
    data = write_rows(tmp_path / "prefs.jsonl", BAD)
    with pytest.raises(DataError) as caught:
        prepare_dataset(str(data), tmp_path / "out", "byte", val_fraction=0.0, mode="auto")
    message = str(caught.value)
    assert message.startswith(f"{data}:2: missing field 'rejected'") and "--bad-rows drop" in message
    assert "\n" not in message
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["prefs.jsonl"]  # no staging directory left either


def test_bad_rows_dropped_are_counted_and_said(tmp_path: Path) -> None:
    data = write_rows(tmp_path / "prefs.jsonl", BAD)
    settings = default_answer_settings(ChatSettings(), bad_rows="drop")
    meta = prepare_dataset(str(data), tmp_path / "out", "byte", val_fraction=0.0, mode="auto", answers=settings)
    audit = meta.extra["answer_rows"]
    assert isinstance(audit, dict)
    assert (audit["rows"], audit["groups"]) == (5, 2)
    assert audit["bad"] == {"missing field": 1, "identical answers": 1, "empty": 1}
    assert str(audit["first_bad"]).startswith(f"{data}:2:")
    assert len(documents(tmp_path / "out")) == 4
    notes = prepared_notes(meta)
    assert notes[0].startswith("pairs: 2 pairs kept of 5 rows")
    assert notes[1].startswith("pairs: 3 bad rows left out (1 empty, 1 identical answers, 1 missing field; e.g.")


@pytest.mark.parametrize("policy", ["drop-oldest-turns", "drop", "refuse"])
def test_a_row_longer_than_a_row_of_seq_len_follows_the_long_row_policy(tmp_path: Path, policy: str) -> None:
    rows = [
        {"prompt": "short", "chosen": " a", "rejected": " b"},
        {"prompt": "a prompt far too long", "chosen": " a", "rejected": " b"},
    ]
    data = write_rows(tmp_path / "prefs.jsonl", rows)
    chat = ChatSettings(long_conversations=policy, max_tokens=12)
    if policy == "refuse":
        with pytest.raises(
            DataError, match=r"prefs\.jsonl:2: a document of the row is 23 tokens, longer than a row of 12"
        ):
            prepare_dataset(str(data), tmp_path / "out", "byte", val_fraction=0.0, mode="auto", chat=chat)
        assert not (tmp_path / "out").exists()
        return
    meta = prepare_dataset(str(data), tmp_path / "out", "byte", val_fraction=0.0, mode="auto", chat=chat)
    audit = meta.extra["answer_rows"]
    assert isinstance(audit, dict) and (audit["groups"], audit["too_long"]) == (1, 1)
    assert "1 row left out (e.g." in prepared_notes(meta)[1]


def test_the_prepared_answers_are_read_by_the_loader_of_answers_train_and_validation(tmp_path: Path) -> None:
    rows = [{"prompt": f"q{i}", "chosen": f" yes{i}", "rejected": f" no{i}"} for i in range(12)]
    data = write_rows(tmp_path / "prefs.jsonl", rows)
    prepare_dataset(str(data), tmp_path / "out", "byte", val_fraction=0.25, mode="auto")
    dataset = open_dataset(tmp_path / "out")
    assert dataset.answers == "pairs"
    train = loader_for(dataset, "train", 4, 16, pack=True)
    assert isinstance(train, AnswerGroupLoader) and train.n_groups == 9
    windows = validation_windows(dataset, "val", 2, 16, eval_batches=0, pack=False)
    assert windows.whole and windows.windows == 3  # one pair per micro-batch of 2 rows, 3 pairs held out
    held = []
    while True:
        batch = windows.next_micro_batch()
        assert batch.answers is not None and batch.answers.role.tolist() == [ROLE_CHOSEN, ROLE_REJECTED]
        held.append(batch.origin)
        if windows.epoch:
            break
    assert len(set(held)) == 3
    assert windows.describe() == "3 micro-batches of 2 x 16 holding whole pairs (the whole split)"


def test_the_cache_keys_rows_of_answers_by_their_settings(tmp_path: Path) -> None:
    data = write_rows(tmp_path / "prefs.jsonl", BAD[:1] + BAD[4:])
    refuse = ensure_prepared(str(data), "byte", 0.0, tmp_path / "cache", mode="auto")
    drop = ensure_prepared(
        str(data), "byte", 0.0, tmp_path / "cache", mode="auto", answers=default_answer_settings(ChatSettings(), "drop")
    )
    assert refuse != drop and refuse.name.startswith("prefs.jsonl-byte-documents-")
    assert ensure_prepared(str(data), "byte", 0.0, tmp_path / "cache", mode="auto") == refuse  # reused


def test_an_hf_json_source_of_pairs_is_read_as_the_jsonl_file_is(tmp_path: Path) -> None:
    pytest.importorskip("datasets")
    rows = [{"prompt": f"q{i}", "chosen": f" yes{i}", "rejected": f" no{i}"} for i in range(4)]
    data = write_rows(tmp_path / "prefs.jsonl", rows)
    assert resolve_data_mode("auto", f"hf:json:{data}", "byte") == "documents"
    prepare_dataset(str(data), tmp_path / "jsonl", "byte", val_fraction=0.0, mode="auto")
    prepare_dataset(f"hf:json:{data}", tmp_path / "hf", "byte", val_fraction=0.0, mode="auto")
    assert documents(tmp_path / "hf") == documents(tmp_path / "jsonl")


def test_rows_of_another_shape_in_the_same_source_are_refused(tmp_path: Path) -> None:
    rows: list[dict] = [BAD[0], {"prompt": "p", "completion": " c", "label": True}]
    data = write_rows(tmp_path / "mixed.jsonl", rows)
    with pytest.raises(DataError, match=r"mixed\.jsonl:2 holds kto as text, the rows before it pairs as text"):
        prepare_dataset(str(data), tmp_path / "out", "byte", val_fraction=0.0, mode="auto")
    text_first = write_rows(tmp_path / "text.jsonl", [{"text": "plain"}, BAD[0]])
    with pytest.raises(DataError, match=r"text\.jsonl:2 is a row of pairs among text rows"):
        prepare_dataset(str(text_first), tmp_path / "out", "byte", val_fraction=0.0, mode="documents")


def test_the_roles_travel_in_the_data_fingerprint(tmp_path: Path) -> None:
    data = write_rows(tmp_path / "prefs.jsonl", BAD[:1] + BAD[4:])
    meta = prepare_dataset(str(data), tmp_path / "out", "byte", val_fraction=0.0, mode="auto")
    roles = tmp_path / "out" / "train_000000.roles.npy"
    assert np.load(roles).tolist() == [ROLE_CHOSEN, ROLE_REJECTED] * 2
    from bigbatch.data.fingerprint import prepared_data_fingerprint

    assert meta.fingerprints["data"] == prepared_data_fingerprint(
        tmp_path / "out", meta.shards, "documents", True, True
    )
    assert meta.fingerprints["data"] != prepared_data_fingerprint(tmp_path / "out", meta.shards, "documents", True)


def test_the_prepare_command_drops_bad_rows_says_so_and_shows_the_answers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from bigbatch.cli.app import main

    data = write_rows(tmp_path / "prefs.jsonl", BAD)
    out = tmp_path / "out"
    assert main(["prepare", str(data), "--out", str(out), "--bad-rows", "drop", "--show", "1"]) == 0
    printed = capsys.readouterr().out
    assert f"{out}: pairs: 2 pairs kept of 5 rows" in printed
    assert f"{out}: pairs: 3 bad rows left out" in printed
    assert "[chosen] a\u27e6 b\u27e7\n[rejected] a\u27e6 c\u27e7" in printed
    assert main(["prepare", str(data), "--out", str(tmp_path / "refused")]) == 2
    assert f"{data}:2: missing field 'rejected'" in capsys.readouterr().err
    assert not (tmp_path / "refused").exists()


def test_worker_processes_tokenize_text_rows_into_the_same_groups(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows tokenized in a pool (a task per few rows) come back matched to their rows, bad rows dropped between."""
    import bigbatch.data.encode as encode

    monkeypatch.setattr(encode, "TASK_BYTES", 16)
    rows = [{"prompt": f"q{i}", "chosen": f" yes {i}", "rejected": f" no {i}"} for i in range(30)]
    rows[7] = {"prompt": "q7", "chosen": " same", "rejected": " same"}
    data = write_rows(tmp_path / "prefs.jsonl", rows)
    settings = default_answer_settings(ChatSettings(), bad_rows="drop")
    for workers in (1, 2):
        prepare_dataset(
            str(data), tmp_path / f"w{workers}", "byte", 0.0, mode="auto", workers=workers, answers=settings
        )
    one = documents(tmp_path / "w1")
    assert one == documents(tmp_path / "w2") and len(one) == 58
    assert [text(ids) for ids, _, _ in one[14:16]] == ["q8 yes 8", "q8 no 8"]
