"""A deterministic English-like corpus that the tests make themselves: the same bytes on every machine.

Tests need natural-ish text (byte statistics of English, words that a BPE trainer can merge hundreds of times, a
stream that never repeats periodically so that train and validation splits differ), and they must not read
anything outside the repository. This module writes a play-like text: speaker headings, lines of verse built from
a few hundred words by a small grammar, punctuation, numbers, now and then a stage direction.

It draws from its own 64-bit linear congruential generator, written out below, and never from Python's ``random``,
whose algorithms may change between versions: the output is integer arithmetic and fixed tables only, so a given
``(n_bytes, seed)`` gives the same bytes on every platform and Python version (tests/unit/test_text_corpus.py pins
a hash). The text is ASCII, so a byte count is a character count, and it is prefix-stable:
``text_corpus(m) == text_corpus(n)[:m]`` for ``m <= n``.
"""

from __future__ import annotations

from functools import lru_cache

__all__ = ["Lcg64", "text_corpus", "text_corpus_str"]

# Words in rough order of frequency within each list: draws favour the front of a list (see Lcg64.skewed), which
# gives the skewed word frequencies of real text.
NAMES = (
    "KING",
    "QUEEN",
    "ROMEO",
    "JULIET",
    "HAMLET",
    "OPHELIA",
    "MACBETH",
    "BANQUO",
    "PORTIA",
    "BRUTUS",
    "CASSIUS",
    "VIOLA",
    "OLIVIA",
    "PROSPERO",
    "MIRANDA",
    "ARIEL",
    "LEAR",
    "CORDELIA",
    "EDGAR",
    "GLOUCESTER",
    "HORATIO",
    "MERCUTIO",
    "TYBALT",
    "NURSE",
    "FRIAR",
    "DUKE",
    "CAPTAIN",
    "MESSENGER",
    "FIRST CITIZEN",
    "SECOND CITIZEN",
    "CLOWN",
    "SERVANT",
)
NOUNS = (
    "lord",
    "man",
    "love",
    "heart",
    "king",
    "life",
    "world",
    "night",
    "day",
    "death",
    "time",
    "hand",
    "eyes",
    "father",
    "son",
    "blood",
    "friend",
    "name",
    "honour",
    "soul",
    "heaven",
    "crown",
    "sword",
    "house",
    "grace",
    "mother",
    "lady",
    "queen",
    "brother",
    "sister",
    "word",
    "tongue",
    "head",
    "face",
    "fortune",
    "war",
    "peace",
    "earth",
    "sun",
    "moon",
    "star",
    "sea",
    "fire",
    "wind",
    "rain",
    "storm",
    "field",
    "city",
    "gate",
    "street",
    "tower",
    "court",
    "throne",
    "castle",
    "garden",
    "forest",
    "river",
    "letter",
    "ring",
    "gold",
    "silver",
    "horse",
    "dog",
    "bird",
    "rose",
    "tree",
    "stone",
    "book",
    "song",
    "dream",
    "sleep",
    "fear",
    "hope",
    "grief",
    "joy",
    "shame",
    "truth",
    "faith",
    "reason",
    "wit",
    "fool",
    "knave",
    "villain",
    "gentleman",
    "soldier",
    "master",
    "servant",
    "stranger",
    "enemy",
    "people",
    "country",
    "kingdom",
    "land",
    "shore",
    "voice",
    "breath",
    "tears",
    "smile",
    "kiss",
    "promise",
    "oath",
    "law",
    "justice",
    "mercy",
    "power",
    "duty",
    "spirit",
    "ghost",
    "body",
    "grave",
    "morning",
    "evening",
    "hour",
    "year",
    "summer",
    "winter",
    "spring",
    "wine",
    "bread",
    "feast",
    "music",
    "battle",
    "army",
    "counsel",
    "danger",
    "matter",
    "cause",
    "news",
    "story",
    "tale",
    "secret",
    "wife",
    "husband",
    "child",
    "daughter",
    "uncle",
    "cousin",
    "prince",
    "duke",
    "bishop",
    "beggar",
    "thief",
    "widow",
)
VERBS = (
    "love",
    "know",
    "see",
    "speak",
    "hear",
    "come",
    "go",
    "take",
    "give",
    "make",
    "think",
    "say",
    "tell",
    "bear",
    "leave",
    "stay",
    "find",
    "keep",
    "hold",
    "fear",
    "die",
    "live",
    "fight",
    "kill",
    "weep",
    "sleep",
    "wake",
    "call",
    "seek",
    "swear",
    "pray",
    "trust",
    "serve",
    "follow",
    "forgive",
    "remember",
    "forget",
    "believe",
    "break",
    "bring",
    "send",
    "stand",
    "fall",
    "rise",
    "run",
    "walk",
    "sing",
    "play",
    "win",
    "lose",
    "hide",
    "show",
    "watch",
    "wait",
    "answer",
    "ask",
    "marry",
    "mourn",
    "praise",
    "curse",
    "command",
    "obey",
    "deny",
    "defend",
    "betray",
    "pardon",
    "warn",
    "greet",
    "kiss",
    "meet",
    "part",
    "return",
    "wonder",
    "dream",
    "doubt",
    "hate",
    "honour",
)
PAST = (
    "loved",
    "knew",
    "saw",
    "spoke",
    "heard",
    "came",
    "went",
    "took",
    "gave",
    "made",
    "thought",
    "said",
    "told",
    "left",
    "found",
    "kept",
    "held",
    "feared",
    "died",
    "lived",
    "fought",
    "killed",
    "wept",
    "slept",
    "called",
    "sought",
    "swore",
    "prayed",
    "served",
    "followed",
    "forgave",
    "broke",
    "brought",
    "sent",
    "stood",
    "fell",
    "rose",
    "ran",
    "sang",
    "won",
    "lost",
    "hid",
    "showed",
    "watched",
    "waited",
    "answered",
    "married",
    "betrayed",
)
ADJECTIVES = (
    "good",
    "sweet",
    "fair",
    "noble",
    "great",
    "old",
    "young",
    "poor",
    "dear",
    "true",
    "gentle",
    "brave",
    "proud",
    "dark",
    "bright",
    "cold",
    "warm",
    "wise",
    "foolish",
    "honest",
    "false",
    "cruel",
    "kind",
    "strange",
    "wild",
    "quiet",
    "bloody",
    "royal",
    "holy",
    "wicked",
    "happy",
    "sad",
    "heavy",
    "light",
    "little",
    "long",
    "black",
    "white",
    "golden",
    "bitter",
    "gracious",
    "mighty",
    "humble",
    "worthy",
    "merry",
    "idle",
    "pale",
    "deep",
    "empty",
    "silent",
    "loyal",
    "secret",
    "ancient",
    "sudden",
    "weary",
    "fierce",
)
ADVERBS = (
    "now",
    "then",
    "here",
    "there",
    "well",
    "yet",
    "still",
    "never",
    "ever",
    "again",
    "soon",
    "too",
    "indeed",
    "truly",
    "gently",
    "quickly",
    "alone",
    "away",
    "tonight",
    "today",
    "tomorrow",
    "once",
    "always",
    "perhaps",
)
PRONOUNS = ("I", "you", "he", "she", "we", "they", "thou")
OBJECTS = ("me", "you", "him", "her", "us", "them", "thee", "it")
DETERMINERS = ("the", "my", "your", "his", "her", "our", "their", "this", "that", "thy", "a", "no", "every")
PREPOSITIONS = (
    "of",
    "to",
    "in",
    "with",
    "for",
    "from",
    "by",
    "on",
    "upon",
    "at",
    "against",
    "before",
    "after",
    "without",
    "within",
    "through",
    "under",
    "beyond",
    "into",
    "near",
)
MODALS = ("will", "shall", "must", "may", "would", "should", "could", "can", "dare", "cannot")
CONJUNCTIONS = ("and", "but", "for", "or", "yet", "so", "though", "if", "when", "while", "since", "because")
INTERJECTIONS = ("O", "Alas", "Ay", "Nay", "Fie", "Marry", "Hark", "Lo", "Peace", "Come", "Good", "Why", "What")
QUESTION_WORDS = ("why", "what", "where", "how", "who", "when")
NUMBERS = (
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "ten",
    "twelve",
    "twenty",
    "forty",
    "a hundred",
    "a thousand",
)
DIRECTIONS = ("Enter", "Exit", "Exeunt", "Aside", "Flourish", "Alarum", "Sennet", "Re-enter", "Dies", "Kneels")


class Lcg64:
    """Knuth's MMIX linear congruential generator (period 2**64), read through its top 31 bits."""

    MULTIPLIER = 6364136223846793005
    INCREMENT = 1442695040888963407
    MASK = (1 << 64) - 1

    def __init__(self, seed: int) -> None:
        self.state = (seed * 0x9E3779B97F4A7C15 + 1) & self.MASK  # spread small seeds apart
        self.next()

    def next(self) -> int:
        """The next 31-bit value (the low bits of an LCG are poor, so only the top ones are used)."""
        self.state = (self.state * self.MULTIPLIER + self.INCREMENT) & self.MASK
        return self.state >> 33

    def below(self, n: int) -> int:
        """An integer in ``[0, n)``, ``n <= 2**31``."""
        return (self.next() * n) >> 31

    def chance(self, percent: int) -> bool:
        return self.below(100) < percent

    def pick(self, words: tuple[str, ...]) -> str:
        return words[self.below(len(words))]

    def skewed(self, words: tuple[str, ...]) -> str:
        """A word favouring the front of the list (the smaller of two uniform indices: frequency falls linearly)."""
        return words[min(self.below(len(words)), self.below(len(words)))]


def _plural(noun: str) -> str:
    if noun.endswith("man"):
        return noun[:-3] + "men"
    if noun == "child":
        return "children"
    if noun.endswith("y") and noun[-2] not in "aeiou":
        return noun[:-1] + "ies"
    if noun.endswith("fe"):
        return noun[:-2] + "ves"
    return noun + ("es" if noun.endswith(("s", "sh", "ch", "x")) else "s")


def _noun_phrase(rng: Lcg64) -> str:
    if rng.chance(8):
        return f"{rng.pick(NUMBERS)} {_plural(rng.skewed(NOUNS))}"
    if rng.chance(6):  # a numeral: digits are part of real text too
        return f"{rng.below(1_000) + 2} {_plural(rng.skewed(NOUNS))}"
    words = [rng.skewed(DETERMINERS)]
    if rng.chance(40):
        words.append(rng.skewed(ADJECTIVES))
    words.append(rng.skewed(NOUNS))
    if rng.chance(15):
        words += [rng.skewed(PREPOSITIONS), rng.skewed(DETERMINERS), rng.skewed(NOUNS)]
    phrase = " ".join(words)
    return "an" + phrase[1:] if phrase.startswith("a ") and phrase[2] in "aeiou" else phrase


def _clause(rng: Lcg64) -> str:
    subject = rng.skewed(PRONOUNS) if rng.chance(55) else _noun_phrase(rng)
    obj = rng.skewed(OBJECTS) if rng.chance(35) else _noun_phrase(rng)
    form = rng.below(6)
    if form == 0:
        clause = f"{subject} {rng.skewed(MODALS)} {rng.skewed(VERBS)} {obj}"
    elif form == 1:
        clause = f"{subject} {rng.skewed(PAST)} {obj}"
    elif form == 2:
        clause = f"{subject} {rng.skewed(MODALS)} not {rng.skewed(VERBS)} {obj}"
    elif form == 3:
        clause = f"{subject} {rng.skewed(PAST)} {rng.skewed(PREPOSITIONS)} {_noun_phrase(rng)}"
    elif form == 4:
        clause = f"{subject} {rng.pick(('is', 'was', 'seems', 'shall be'))} {rng.skewed(ADJECTIVES)}"
    else:
        clause = f"{rng.skewed(VERBS)} {obj}"  # an imperative
    if rng.chance(20):
        clause += f" {rng.skewed(ADVERBS)}"
    return clause


def _sentence(rng: Lcg64) -> str:
    kind = rng.below(10)
    if kind < 2:  # a question
        subject = rng.skewed(PRONOUNS) if rng.chance(55) else _noun_phrase(rng)
        auxiliary = rng.pick(("do", "did", "shall", "will", "must"))
        obj = rng.skewed(OBJECTS) if rng.chance(50) else _noun_phrase(rng)
        text = f"{rng.pick(QUESTION_WORDS)} {auxiliary} {subject} {rng.skewed(VERBS)} {obj}?"
    elif kind < 3:  # an exclamation
        text = f"{rng.skewed(INTERJECTIONS)}, {_noun_phrase(rng)}!"
    else:
        text = _clause(rng)
        while rng.chance(30):
            punctuation = rng.pick((",", ",", ";", ":", " --"))
            text += f"{punctuation} {rng.skewed(CONJUNCTIONS)} {_clause(rng)}"
        text += rng.pick((".", ".", ".", ".", "!", ";"))
    return text[0].upper() + text[1:]


def _speech(rng: Lcg64) -> str:
    """A speaker heading and one to six lines of verse, wrapped near a line length drawn per speech."""
    width = 36 + rng.below(30)
    lines: list[str] = []
    line = ""
    for _ in range(1 + rng.below(5)):
        for word in _sentence(rng).split(" "):
            if line and len(line) + 1 + len(word) > width:
                lines.append(line)
                line = word
            else:
                line = f"{line} {word}" if line else word
    lines.append(line)
    return f"{rng.skewed(NAMES)}:\n" + "\n".join(lines) + "\n\n"


def _direction(rng: Lcg64) -> str:
    who = " and ".join(rng.pick(NAMES).title() for _ in range(1 + rng.below(2)))
    return f"[{rng.pick(DIRECTIONS)} {who}.]\n\n"


@lru_cache(maxsize=16)
def text_corpus(n_bytes: int, seed: int = 0) -> bytes:
    """The first ``n_bytes`` bytes of the corpus of ``seed`` (ASCII; the same on every machine)."""
    rng = Lcg64(seed)
    parts: list[str] = []
    size = 0
    while size < n_bytes:
        if size and rng.chance(3):
            part = f"ACT {1 + rng.below(5)}. SCENE {1 + rng.below(7)}.\n\n"
        else:
            part = _direction(rng) if rng.chance(7) else _speech(rng)
        parts.append(part)
        size += len(part)
    return "".join(parts).encode("ascii")[:n_bytes]


def text_corpus_str(n_chars: int, seed: int = 0) -> str:
    """:func:`text_corpus` as text (ASCII, so characters are bytes)."""
    return text_corpus(n_chars, seed).decode("ascii")
