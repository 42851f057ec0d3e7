"""Where each assistant reply lies in the one rendering of a whole conversation.

Templates render history differently from the last turn (Qwen3 writes an empty think block only into the last
reply, Phi-3 appends its end-of-text token when no generation prompt is asked, DeepSeek's generation prompt opens a
think block its history never shows, Mistral writes the system prompt into the last user turn, gpt-oss ends the
last reply with ``<|return|>`` and earlier ones with ``<|end|>``), so rendering prefixes of a conversation and
asking them to match the whole is the wrong test. Here the whole conversation is rendered once as it is (``W``)
and once more with the text of every message replaced by a unique marker (``W'``, the *skeleton*: what the
template writes around the messages). The skeleton's pieces between markers appear in ``W`` in the same order,
and what lies between them is each message's text as the template wrote it (trimmed, split, quoted or dropped).

A reply's trained span is then decided from that rendering alone:

* it starts right after the assistant header, which is what the template's generation prompt writes (found as the
  last occurrence, in the skeleton before the reply, of that prompt or of its longest part that ends on a special
  token; DeepSeek-R1's prompt ``<｜Assistant｜><think>\\n`` appears in history as ``<｜Assistant｜>``). What the
  template writes after the header for the reply (a think block, a channel header) is trained; a template without
  a generation prompt (Mistral, ChatML fine-tunes that ignore ``add_generation_prompt``) starts at the reply's text;
* it ends with the end-of-turn tokens that close the reply: the tokens a reply is closed with whether or not
  another turn follows (``<|im_end|>``, ``<|eot_id|>``, ``</s>``, ``<end_of_turn>``, Phi-3's ``<|end|>``), found by
  rendering two probe conversations; where those differ (gpt-oss), the first special token after each.

A message whose text the template does not render at all (a tool call it drops) has no span, and one whose fields
it renders only in part (reasoning of earlier turns dropped) is trained as rendered; both are counted.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from bigbatch.errors import DataError

MARKER = re.compile("\ue000(\\d+)\ue001")
TEXT_FIELDS = ("content", "reasoning_content", "thinking", "reasoning")
"""The fields of a message whose text is replaced by markers (reasoning goes by any of the three names)."""
SHAPE_TAGS = re.compile(r"(\s*(?:</?(?:think|tool_response|tool_call)>|/no_think|/think)\s*)")
"""What templates look for inside a message's text (tags to split reasoning out of a reply or to tell a tool
result from a question; Nemotron's and Qwen3's ``/think`` and ``/no_think`` switches): kept in the marked text,
so the template takes the same branch for it as for the real text."""


def _marker(number: int) -> str:
    return f"\ue000{number}\ue001"


@dataclass(frozen=True)
class MarkedField:
    message: int  # index in the conversation
    name: str  # content, reasoning_content, ..., tool_call
    lead: str = ""  # what the marked text keeps before its first marker (``<think>\n``, white space): its own text


@dataclass
class Skeleton:
    """A conversation with its texts replaced by markers, and what each marker stands for."""

    messages: list[dict[str, Any]]
    fields: list[MarkedField] = field(default_factory=list)

    def mark(self, text: str, message: int, name: str) -> str:
        """``text`` with each run of words replaced by a marker; the tags of :data:`SHAPE_TAGS` and the white space
        around them are kept."""
        parts = SHAPE_TAGS.split(text)
        out: list[str] = []
        first = True
        for part in parts:
            if not part or SHAPE_TAGS.fullmatch(part) or not part.strip():
                out.append(part)
                continue
            lead = part[: len(part) - len(part.lstrip())]
            trail = part[len(part.rstrip()) :]
            self.fields.append(MarkedField(message, name, "".join(out) + lead if first else ""))
            first = False
            out.append(lead + _marker(len(self.fields) - 1) + trail)
        return "".join(out)


def skeleton_of(messages: Sequence[dict[str, Any]]) -> Skeleton:
    """Every message's texts (and each tool call's function name, so a reply that only calls tools is found too)
    replaced by markers; roles and everything else as they are."""
    skeleton = Skeleton([])
    for index, message in enumerate(messages):
        copy = dict(message)
        for name in TEXT_FIELDS:
            value = copy.get(name)
            if isinstance(value, str) and value.strip():
                copy[name] = skeleton.mark(value, index, name)
        calls = copy.get("tool_calls")
        if isinstance(calls, list):
            marked_calls = []
            for call in calls:
                if isinstance(call, dict):
                    call = _mark_call(call, skeleton, index)
                marked_calls.append(call)
            copy["tool_calls"] = marked_calls
        skeleton.messages.append(copy)
    return skeleton


def _mark_call(call: dict[str, Any], skeleton: Skeleton, message: int) -> dict[str, Any]:
    function = call.get("function")
    if isinstance(function, dict) and isinstance(function.get("name"), str):
        skeleton.fields.append(MarkedField(message, "tool_call"))
        return {**call, "function": {**function, "name": _marker(len(skeleton.fields) - 1)}}
    if isinstance(call.get("name"), str):
        skeleton.fields.append(MarkedField(message, "tool_call"))
        return {**call, "name": _marker(len(skeleton.fields) - 1)}
    return call


@dataclass(frozen=True)
class Placed:
    """Where a marked field's text lies in the real rendering: characters ``[start, end)``."""

    number: int  # the marker's, an index into Skeleton.fields
    field: MarkedField
    start: int
    end: int


def place_fields(whole: str, marked: str, skeleton: Skeleton) -> list[Placed] | None:
    """The real rendering ``whole`` cut along the skeleton ``marked``: each piece of skeleton found in order, the
    text between two pieces being a marked field's. None when the two do not correspond (a template whose
    structure depends on the words of a message)."""
    markers = list(MARKER.finditer(marked))
    pieces = [marked[: markers[0].start()] if markers else marked]
    for a, b in zip(markers, markers[1:], strict=False):
        pieces.append(marked[a.end() : b.start()])
    if markers:
        pieces.append(marked[markers[-1].end() :])
    if not whole.startswith(pieces[0]):
        return None
    if not markers:
        return [] if whole == pieces[0] else None
    placed: list[Placed] = []
    at = len(pieces[0])
    tail = pieces[-1]
    for k, match in enumerate(markers):
        number = int(match.group(1))
        if number >= len(skeleton.fields):
            return None  # the template wrote a marker it was not given (cannot happen with a sane template)
        after = pieces[k + 1]
        if k + 1 == len(markers):
            end = len(whole) - len(tail)
            if end < at or not whole.endswith(tail):
                return None
        elif after:
            end = whole.find(after, at)
            if end < 0:
                return None
        else:  # two fields written back to back: separable only within one message
            if skeleton.fields[number].message != skeleton.fields[int(markers[k + 1].group(1))].message:
                return None
            end = at
        placed.append(Placed(number, skeleton.fields[number], at, end))
        at = end + len(after)
    return placed


@dataclass(frozen=True)
class TurnSpan:
    """Characters ``[start, end)`` of the whole rendering trained for assistant message ``message``;
    ``stopped``: the span ends on an end-of-turn token; ``partial``: the template left out part of the message."""

    message: int
    start: int
    end: int
    stopped: bool
    partial: bool
    after_header: bool  # the span starts where the generation prompt ends (else at the reply's own text)


@dataclass(frozen=True)
class TemplateMarks:
    """What a template writes around a reply, learned once from probe conversations (see the module's note).

    ``headers``: the generation prompt and its shorter forms that end on a special token, longest first;
    ``closers``: the end-of-turn texts a reply ends with, earliest match wins; ``openers``, for a template without a
    generation prompt (Mistral): what it writes between a question and its reply, and its shorter forms ending on a
    special token (``[/INST]``), so that a reply that opens with tool calls starts after ``[/INST]``, not at the
    call's name."""

    headers: tuple[str, ...]
    closers: tuple[str, ...]
    openers: tuple[str, ...] = ()


def learn_marks(
    render: Callable[[list[dict[str, Any]], bool], str | None],
    split_tokens: Callable[[str], list[tuple[int, int, bool]]],
    stop_texts: Sequence[str] = (),
) -> TemplateMarks:
    """The template's assistant header and end-of-turn texts. ``render(messages, generation_prompt)`` renders (None
    when the template refuses); ``split_tokens(text)`` is the text's tokens as (start, end, is special);
    ``stop_texts``: the tokens generation stops at (``generation_config.json``), closers too where a reply is
    closed differently by context (gpt-oss's ``<|call|>`` after a tool call)."""
    user, reply, follow = _marker(0), _marker(1), _marker(2)
    asked = [{"role": "user", "content": user}]
    if render(asked, False) is None:  # a template that wants a system prompt first
        asked = [{"role": "system", "content": _marker(3)}, *asked]
    headers: tuple[str, ...] = ()
    plain, prompted = render(asked, False), render(asked, True)
    if plain is None:
        raise DataError(
            "the chat template refuses the simplest conversation (a question, with or without a system prompt), so "
            "where its replies start and end cannot be learned; fix the template, or --loss-on all to train every "
            "token"
        )
    if plain is not None and prompted is not None:
        # the first token that differs, not the first character: "<|end|>" and "<|assistant|>" share "<|"
        plain_tokens, prompted_tokens = split_tokens(plain), split_tokens(prompted)
        same = 0
        for (a0, a1, _), (b0, b1, _) in zip(plain_tokens, prompted_tokens, strict=False):
            if plain[a0:a1] != prompted[b0:b1]:
                break
            same += 1
        cut = prompted_tokens[same][0] if same < len(prompted_tokens) else len(prompted)
        prompt = prompted[min(cut, _common_prefix(plain, prompted)) :]
        headers = tuple(dict.fromkeys(h for h in [prompt, *reversed(_cuts(prompt, split_tokens))] if h))
    answered = [*asked, {"role": "assistant", "content": reply}]
    last, followed = render(answered, False), render([*answered, {"role": "user", "content": follow}], False)
    openers: tuple[str, ...] = ()
    if not headers and last is not None and user in last and reply in last:
        between = last[last.index(user) + len(user) : last.index(reply)]
        openers = tuple(dict.fromkeys(o for o in [between, *reversed(_cuts(between, split_tokens))] if o))
    gaps = [_after(text, reply) for text in (last, followed) if text is not None and reply in text]
    closers: tuple[str, ...] = ()
    if gaps:
        tokens = [split_tokens(gap) for gap in gaps]
        pieces = [[(gap[a:b], special) for a, b, special in toks] for gap, toks in zip(gaps, tokens, strict=True)]
        common = 0
        while all(len(p) > common for p in pieces) and all(p[common] == pieces[0][common] for p in pieces):
            common += 1
        closer = gaps[0][: tokens[0][common - 1][1]].rstrip() if common else ""
        if closer:  # what closes a reply whether or not a turn follows (a template without special tokens too)
            closers = (closer,)
        else:  # replies closed differently when last (gpt-oss): the first special token of each
            firsts = [next((text for text, special in p if special), "") for p in pieces]
            closers = tuple(dict.fromkeys(f for f in [*firsts, *stop_texts] if f))
    return TemplateMarks(headers, closers, openers)


def _cuts(text: str, split_tokens: Callable[[str], list[tuple[int, int, bool]]]) -> list[str]:
    """``text`` cut at each token boundary after its first special token, shortest first: the shorter forms of a
    header (Qwen3.6 and Nemotron write ``<|im_start|>assistant\n`` before earlier replies and add ``<think>\n`` to
    the generation prompt; DeepSeek's history has ``<｜Assistant｜>`` alone). A cut before any special token would be
    a plain word, found anywhere."""
    cuts, special_seen = [], False
    for _, end, special in split_tokens(text):
        special_seen = special_seen or special
        if special_seen:
            cuts.append(text[:end])
    return cuts


def _after(text: str, marker: str) -> str:
    rest = text[text.index(marker) + len(marker) :]
    cut = MARKER.search(rest)
    return rest[: cut.start()] if cut else rest


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _own_run(placed: list[Placed], first: int, turn: int) -> tuple[int, int, int]:
    """The reply's run of fields from ``first``: its last field, and the first field of another message after it.
    A marker met again is the same text written twice (a call's name in Muse's ``to=NAME`` and ``invoke
    name=NAME``, gpt-oss's in the tool's turn that answers it): it neither extends the reply nor ends it."""
    seen, last, at = {placed[first].number}, first, first + 1
    while at < len(placed):
        if placed[at].number in seen:
            at += 1
            continue
        if placed[at].field.message != turn:
            break
        seen.add(placed[at].number)
        last = at
        at += 1
    return first, last, at


def _reply_start(gap: str, gap_start: int, body_start: int, lead: str, marks: TemplateMarks) -> tuple[int, bool]:
    """Where a reply's trained characters start, and whether that is the end of the assistant header: after the
    last header in the gap before its text (the longest form found); for a template without a generation prompt,
    after what it writes between a question and a reply, or at the reply's own leading tag and white space."""
    for header in marks.headers:
        at = gap.rfind(header)
        if at >= 0:
            return gap_start + at + len(header), True
    for opener in marks.openers:
        at = gap.rfind(opener)
        if at >= 0:
            return gap_start + at + len(opener), False
    if lead and gap.endswith(lead):  # the reply's own leading tag and white space (<think>\n, "  ")
        return body_start - len(lead), False
    return body_start, False


def reply_spans(
    name: str,
    messages: Sequence[dict[str, Any]],
    whole: str,
    marked: str,
    skeleton: Skeleton,
    marks: TemplateMarks,
    turns: Sequence[int],
    specials: Sequence[str] = (),
) -> tuple[list[TurnSpan], list[int]]:
    """The trained span of each assistant message in ``turns``, and the turns the template does not render at all
    (no span). ``specials``: the tokenizer's special-token texts. One line naming the conversation when the two
    renderings do not correspond."""
    placed = place_fields(whole, marked, skeleton)
    if placed is None:
        raise DataError(
            f"{name}: the chat template renders this conversation in a shape that depends on its words (its "
            "rendering with the texts replaced does not line up with the real one), so the assistant's tokens "
            "cannot be located; --loss-on all trains every token without locating them"
        )
    spans, unrendered = [], []
    for turn in turns:
        own = [i for i, p in enumerate(placed) if p.field.message == turn]
        if not own:
            unrendered.append(turn)
            continue
        first, last, following = _own_run(placed, own[0], turn)
        gap_start = placed[first - 1].end if first else 0
        body_start, body_end = placed[first].start, placed[last].end
        gap = whole[gap_start:body_start]
        start, after_header = _reply_start(gap, gap_start, body_start, placed[first].field.lead, marks)
        after = whole[body_end : placed[following].start if following < len(placed) else len(whole)]
        found = [(after.find(c), c) for c in marks.closers if after.find(c) >= 0]
        end, stopped = body_end, False
        if found:
            at, closer = min(found)
            end, stopped = body_end + at + len(closer), True
        else:  # closed by a token the probes did not show (gpt-oss's <|call|>): the last special token before the
            # next header
            heads = [after.find(h) for h in marks.headers if after.find(h) >= 0]
            region = after[: min(heads)] if heads else after
            ends = [region.rfind(t) + len(t) for t in specials if t and region.rfind(t) >= 0]
            if ends:
                end, stopped = body_end + max(ends), True
        expected = {i for i, f in enumerate(skeleton.fields) if f.message == turn}
        partial = bool(expected - {placed[i].number for i in range(first, last + 1)})
        spans.append(TurnSpan(turn, start, end, stopped, partial, after_header))
    return spans, unrendered
