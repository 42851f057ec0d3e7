"""Chat masks on the templates models really ship: trained, refused or wrong, per family and conversation.

    python benchmarks/chat_templates.py [--family NAME ...]

The templates are byte copies (tests/support/real_chat/, provenance in its PROVENANCE.md), each in a tokenizer
directory built offline in the layout of the real model's files (tests/support/real_templates.py). For every
family and every conversation of ``CONVERSATIONS`` (single-turn, multi-turn, system, tools, reasoning, reasoning
inside the content, a greeting before the first question):

1. **Mask.** bigbatch's trained text, turn by turn, against the hand-marked spans of ``HAND_MARKED`` where there
   are some: ``exact`` or ``WRONG``; else ``trained`` (its runs are printed with ``--verbose``). A refusal is
   printed with its line, and counted apart where the template itself refuses the conversation (Gemma's system
   role, roles that must alternate).
2. **Ids.** The ids bigbatch trains on against ``AutoTokenizer``'s for the rendered text
   (``apply_chat_template(tokenize=True)``): equal, or the first difference.
3. **TRL.** Where TRL ships a training template with ``{% generation %}`` markers (a byte copy beside the
   originals), transformers' ``return_assistant_tokens_mask`` on it (what TRL's ``assistant_only_loss`` trains):
   the same trained text as bigbatch's, or the difference. TRL's templates are patched (Qwen3's keeps a think block
   in every reply, DeepSeek-R1's keeps the reasoning), so a difference is the patch's, named per family.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "support"))
from real_templates import (  # noqa: E402
    FAMILIES,
    HAND_MARKED,
    TEMPLATE_REFUSES,
    TRAINING_TEMPLATE,
    conversations,
    hand_mask,
    real_chat_dir,
)

from bigbatch.data.chat import ChatEncoder, ChatSettings, conversation_from_record  # noqa: E402
from bigbatch.data.tokenizers import file_tokenizer_name, get_tokenizer  # noqa: E402
from bigbatch.errors import BigBatchError  # noqa: E402

TRAINING_DIR = ROOT / "tests" / "support" / "real_chat" / "trl_training"


def char_runs(text: str, offsets: list[tuple[int, int]], mask: list[int]) -> list[str]:
    """The characters of each run of consecutive trained tokens (decoding a piece alone can drop a space)."""
    runs, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append(text[offsets[start][0] : offsets[i - 1][1]])
            start = None
    return runs


def trl_runs(tokenizer: Any, family: str, row: dict[str, Any]) -> list[str] | None:
    """The trained text under TRL's training template, or None where it has none or cannot render the row."""
    name = TRAINING_TEMPLATE.get(family)
    if not name:
        return None
    template = (TRAINING_DIR / name).read_text(encoding="utf-8")
    kwargs: dict[str, Any] = {"tools": row.get("tools"), "chat_template": template}
    try:
        out = tokenizer.apply_chat_template(
            row["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True, **kwargs
        )
        text = tokenizer.apply_chat_template(row["messages"], tokenize=False, **kwargs)
    except Exception:  # a row TRL's template refuses
        return None
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    if list(encoding["input_ids"]) != list(out["input_ids"]):
        return None
    return char_runs(text, list(encoding["offset_mapping"]), list(out["assistant_masks"]))


def trl_difference(ours: list[str], theirs: list[str]) -> str:
    """How TRL's trained text differs from bigbatch's, reply by reply: "same", or what TRL trains before and after
    bigbatch's text of each reply (the header, a new line after the end of turn, a think block its patched template
    writes), or "other" where a reply is not bigbatch's with something around it."""
    if theirs == ours:
        return "same"
    if len(theirs) != len(ours):
        return "other"
    added = set()
    for mine, its in zip(ours, theirs, strict=True):
        at = its.find(mine)
        if at < 0:
            return "other"
        before, after = its[:at], its[at + len(mine) :]
        if before:
            added.add(f"{before!r} before")
        if after:
            added.add(f"{after!r} after")
    return "TRL also trains " + ", ".join(sorted(added))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", nargs="*", default=list(FAMILIES))
    parser.add_argument("--verbose", action="store_true", help="print every trained run")
    args = parser.parse_args()
    import transformers

    counts = {"exact": 0, "trained": 0, "wrong": 0, "refused": 0, "template refuses": 0}
    ids_equal = ids_total = trl_same = trl_total = 0
    trl_kinds: dict[str, int] = {}
    differences: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.family:
            directory = real_chat_dir(Path(tmp) / family, family)
            tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
            run_tokenizer = get_tokenizer(file_tokenizer_name(directory / "tokenizer.json"))  # what a run encodes with
            encoder = ChatEncoder(run_tokenizer.to_str(), directory, ChatSettings())  # type: ignore[attr-defined]
            print(f"{family}: header {encoder.marks.headers[:1]} | closes with {encoder.marks.closers}")
            for name, row in conversations().items():
                where = f"  {family:20} {name:17}"
                refused_by_template = (family, name) in TEMPLATE_REFUSES
                try:
                    encoded = encoder.encode(conversation_from_record(row, name))
                except BigBatchError as exc:
                    kind = "template refuses" if refused_by_template else "refused"
                    counts[kind] += 1
                    print(f"{where} {kind}: {str(exc)[:150]}")
                    continue
                assert encoded is not None
                ids = encoded.ids.tolist()
                ours = encoded.trained_text()
                expected = HAND_MARKED.get((family, name))
                if expected is None:
                    verdict = "trained"
                elif encoded.mask.tolist() == hand_mask(encoded.text, encoded.offsets.tolist(), expected):
                    verdict = "exact"
                else:
                    verdict = "wrong"
                    differences.append(f"{family}/{name}: bigbatch {ours} | hand-marked {expected}")
                counts[verdict] += 1
                text = encoder.template.render(name, row["messages"], row.get("tools"))
                theirs = tokenizer(text, add_special_tokens=False)["input_ids"]
                ids_total += 1
                ids_equal += theirs == ids
                trl = trl_runs(tokenizer, family, row)
                trl_note = ""
                if trl is not None:
                    trl_total += 1
                    difference = trl_difference(ours, trl)
                    trl_same += difference == "same"
                    trl_kinds[difference] = trl_kinds.get(difference, 0) + 1
                    trl_note = f" | TRL: {difference}" + (f" {trl}" if difference == "other" else "")
                ids_note = "ids = AutoTokenizer's" if theirs == ids else "ids DIFFER from AutoTokenizer's"
                print(f"{where} {verdict.upper() if verdict == 'wrong' else verdict} | {ids_note}{trl_note}")
                if args.verbose or verdict == "wrong":
                    print(f"      {ours}")
    print(
        f"\n{sum(counts.values())} family x conversation cases: {counts['exact']} exact against hand-marked spans, "
        f"{counts['trained']} trained (no hand marks), {counts['wrong']} wrong, {counts['refused']} refused by "
        f"bigbatch, {counts['template refuses']} refused by the template itself"
    )
    print(f"ids equal AutoTokenizer's in {ids_equal} of {ids_total}")
    print(
        f"TRL's training templates, {trl_total} cases: " + "; ".join(f"{n} {k}" for k, n in sorted(trl_kinds.items()))
    )
    for line in differences:
        print(f"  WRONG {line}")


if __name__ == "__main__":
    main()
