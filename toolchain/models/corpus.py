"""The synthetic training corpus of the embedded models, generated from a seed.

Two kinds of line: an arithmetic problem with a checkable answer (``task_examples``) and an English sentence
from a small template grammar (``text_samples``). Every item belongs to exactly one split by a fixed hash of its
content, so the held-out split never overlaps train whatever the seeds.
"""

from __future__ import annotations

import hashlib
import random
from typing import Literal

Split = Literal["train", "heldout"]

# One item in HELDOUT_MODULUS goes to the held-out split.
HELDOUT_MODULUS = 20


def _split_of(key: str) -> Split:
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return "heldout" if int.from_bytes(digest, "little") % HELDOUT_MODULUS == 0 else "train"


def format_problem(a: int, b: int) -> tuple[str, str]:
    """Numbers are written least significant digit first, zero-padded: 123+456=579 is ("321+654=", "9750").

    With every digit at a fixed offset from the one it depends on (answer digit k sits 8 tokens after digit k
    of the first operand and 4 after the second's), a tiny model learns the task within minutes on a CPU.
    """
    return f"{a:03d}"[::-1] + "+" + f"{b:03d}"[::-1] + "=", f"{a + b:04d}"[::-1]


def _problem_split(a: int, b: int) -> Split:
    # Keyed on the unordered pair: b+a must not be in train when a+b is held out.
    return _split_of(f"{min(a, b)}+{max(a, b)}")


def _operand(rng: random.Random) -> int:
    # One, two and three digits equally often: the many short operands (answer digits that copy the other
    # operand's) give the model an easy first step towards full addition.
    digits = rng.randint(1, 3)
    return rng.randint(0, 10**digits - 1)


def task_examples(split: Split, n: int, seed: int = 0) -> list[tuple[str, str]]:
    """``n`` distinct (prompt, answer) pairs of ``split``, e.g. ("321+654=", "9750") for 123+456=579."""
    rng = random.Random(f"task/{split}/{seed}")
    seen: set[tuple[int, int]] = set()
    out: list[tuple[str, str]] = []
    while len(out) < n:
        a, b = _operand(rng), _operand(rng)
        if (a, b) in seen or _problem_split(a, b) != split:
            continue
        seen.add((a, b))
        out.append(format_problem(a, b))
    return out


_NAMES = ["Alice", "Bruno", "Chen", "Dana", "Emeka", "Fatima", "Greta", "Hiro", "Ines", "Jonas", "Kofi", "Lena",
          "Mateo", "Nadia", "Oscar", "Priya", "Quinn", "Rosa", "Sami", "Tara", "Umar", "Vera", "Wen", "Yusuf"]
_PEOPLE = ["the teacher", "the farmer", "the doctor", "the baker", "the pilot", "the child", "the old man",
           "the painter", "the sailor", "the student", "the nurse", "the driver"]
_OBJECTS = ["book", "lamp", "apple", "chair", "cup", "letter", "key", "basket", "bottle", "clock", "map",
            "blanket", "coin", "hat", "kettle", "ladder", "mirror", "pencil", "rope", "shell", "stone", "violin"]
_ADJECTIVES = ["red", "small", "heavy", "old", "bright", "broken", "green", "quiet", "wooden", "shiny",
               "warm", "tiny", "strange", "blue", "soft", "empty", "round", "golden"]
_PLACES = ["the kitchen", "the garden", "the market", "the station", "the library", "the harbor", "the forest",
           "the school", "the bridge", "the village", "the museum", "the river", "the hill", "the bakery"]
_PREPOSITIONS = ["in", "near", "behind", "outside", "beside", "across"]
_VERBS_OBJ = ["found", "carried", "painted", "sold", "cleaned", "dropped", "bought", "fixed", "hid", "lost",
              "borrowed", "wrapped"]
_VERBS_MOVE = ["walked to", "ran to", "drove to", "went back to", "looked around", "waited at", "sang at"]
_TIMES = ["in the morning", "at noon", "after lunch", "in the evening", "at night", "on Monday", "on Sunday",
          "yesterday", "last week", "every day"]
_WEATHER = ["sunny", "cold", "windy", "rainy", "quiet", "busy", "crowded", "calm"]
_COUNTS = ["two", "three", "four", "five", "six", "seven", "many", "a few", "several"]


# Each template takes (pick, who, what): pick draws a word from a list, who is a person, what an object phrase.
_TEMPLATES = [
    lambda p, who, what: f"{who} {p(_VERBS_OBJ)} the {what} {p(_PREPOSITIONS)} {p(_PLACES)}.",
    lambda p, who, what: f"{who} {p(_VERBS_MOVE)} {p(_PLACES)} {p(_TIMES)}.",
    lambda p, who, what: f"The {what} was {p(_PREPOSITIONS)} {p(_PLACES)}.",
    lambda p, who, what: f"{p(_PLACES)} was {p(_WEATHER)} {p(_TIMES)}.",
    lambda p, who, what: f"{who} gave {p(_NAMES)} {p(_COUNTS)} {p(_OBJECTS)}s.",
    lambda p, who, what: f"There were {p(_COUNTS)} {p(_ADJECTIVES)} {p(_OBJECTS)}s {p(_PREPOSITIONS)} {p(_PLACES)}.",
    lambda p, who, what: f"{who} asked where the {what} was, and {p(_NAMES)} said it was "
                         f"{p(_PREPOSITIONS)} {p(_PLACES)}.",
    lambda p, who, what: f"When {who} {p(_VERBS_MOVE)} {p(_PLACES)}, the {p(_OBJECTS)} was {p(_ADJECTIVES)}.",
]


def _sentence(rng: random.Random) -> str:
    pick = rng.choice
    who = pick(_NAMES) if rng.random() < 0.6 else pick(_PEOPLE)
    what = f"{pick(_ADJECTIVES)} {pick(_OBJECTS)}"
    s = pick(_TEMPLATES)(pick, who, what)
    return s[0].upper() + s[1:]


def text_samples(split: Split, n: int, seed: int = 0) -> list[str]:
    """``n`` short texts of one to three sentences from ``split``."""
    rng = random.Random(f"text/{split}/{seed}")
    out: list[str] = []
    while len(out) < n:
        text = " ".join(_sentence(rng) for _ in range(rng.randint(1, 3)))
        if _split_of(text) == split:
            out.append(text)
    return out


def calibration_texts(n: int = 32, seed: int = 0) -> list[str]:
    """Representative inputs for quantization calibration: train-split text and problems with their answers."""
    texts = text_samples("train", n - n // 2, seed=seed + 1_000)
    problems = ["".join(pair) for pair in task_examples("train", n // 2, seed=seed + 1_000)]
    return texts + problems
