"""``chandas_meter``: does a Sanskrit verse scan in the requested meter (chandas)?

Text may be Devanagari or IAST. Each syllable is *guru* (heavy, ``G``) when its vowel
is long (ā ī ū ṝ ḹ e ai o au), when it carries anusvāra/visarga (ṃ ḥ), or when two or
more consonants follow before the next vowel (also across word boundaries);
otherwise it is *laghu* (light, ``L``). The last syllable of a pāda may be either.

Verses are split into pādas at line breaks and daṇḍas (``।`` ``॥`` ``|``); a line of
twice the pāda length is split in half (ślokas are usually written two pādas a line).
"""

from __future__ import annotations

import re
from typing import Any, Dict, List

from atroposlib.envs.reward_fns.registry import registry
from atroposlib.envs.reward_fns.reward_function import RewardFunction

# Fixed-pattern (vṛtta) meters, one pāda each; "X" = either weight.
FIXED_METERS: Dict[str, str] = {
    "indravajra": "GGLGGLLGLGX",
    "upendravajra": "LGLGGLLGLGX",
    "vamsastha": "LGLGGLLGLGLX",
    "vasantatilaka": "GGLGLLLGLLGLGX",
    "malini": "LLLLLLGGLGGLGX",
    "mandakranta": "GGGGLLLLLGGLGGLGX",
    "shardulavikridita": "GGGLLGLGLLLGGGLGGLX",
    # Triṣṭubh as usually written: upajāti, indravajrā and upendravajrā pādas mixed.
    "tristubh": "XGLGGLLGLGX",
}
ANUSHTUBH = "anushtubh"
METERS = sorted([ANUSHTUBH, *FIXED_METERS])

_VOWELS_LONG = {"ā", "ī", "ū", "ṝ", "ḹ", "e", "ai", "o", "au"}
_VOWELS_SHORT = {"a", "i", "u", "ṛ", "ḷ"}
_VOWEL_RE = re.compile(r"ai|au|[aāiīuūṛṝḷḹeo]")

_DEV_INDEPENDENT = {
    "अ": "a",
    "आ": "ā",
    "इ": "i",
    "ई": "ī",
    "उ": "u",
    "ऊ": "ū",
    "ऋ": "ṛ",
    "ॠ": "ṝ",
    "ऌ": "ḷ",
    "ॡ": "ḹ",
    "ए": "e",
    "ऐ": "ai",
    "ओ": "o",
    "औ": "au",
}
_DEV_MATRA = {
    "ा": "ā",
    "ि": "i",
    "ी": "ī",
    "ु": "u",
    "ू": "ū",
    "ृ": "ṛ",
    "ॄ": "ṝ",
    "ॢ": "ḷ",
    "ॣ": "ḹ",
    "े": "e",
    "ै": "ai",
    "ो": "o",
    "ौ": "au",
}
_DEV_CONSONANTS = "कखगघङचछजझञटठडढणतथदधनपफबभमयरलवशषसह"
_DEV_CONSONANT_LATIN = [
    "k",
    "kh",
    "g",
    "gh",
    "ṅ",
    "c",
    "ch",
    "j",
    "jh",
    "ñ",
    "ṭ",
    "ṭh",
    "ḍ",
    "ḍh",
    "ṇ",
    "t",
    "th",
    "d",
    "dh",
    "n",
    "p",
    "ph",
    "b",
    "bh",
    "m",
    "y",
    "r",
    "l",
    "v",
    "ś",
    "ṣ",
    "s",
    "h",
]
_DEV_CONS = dict(zip(_DEV_CONSONANTS, _DEV_CONSONANT_LATIN, strict=True))
_VIRAMA, _ANUSVARA, _VISARGA, _CANDRABINDU = "्", "ं", "ः", "ँ"


def devanagari_to_iast(text: str) -> str:
    """Transliterate Devanagari to IAST (enough for scansion; digits/others pass through)."""
    out: List[str] = []
    chars = list(text)
    for i, ch in enumerate(chars):
        nxt = chars[i + 1] if i + 1 < len(chars) else ""
        if ch in _DEV_CONS:
            out.append(_DEV_CONS[ch])
            if nxt not in _DEV_MATRA and nxt != _VIRAMA:
                out.append("a")
        elif ch in _DEV_MATRA:
            out.append(_DEV_MATRA[ch])
        elif ch in _DEV_INDEPENDENT:
            out.append(_DEV_INDEPENDENT[ch])
        elif ch in (_ANUSVARA, _CANDRABINDU):
            out.append("ṃ")
        elif ch == _VISARGA:
            out.append("ḥ")
        elif ch == _VIRAMA:
            continue
        else:
            out.append(ch)
    return "".join(out)


def _consonant_units(cluster: str) -> int:
    """Number of consonant phonemes in ``cluster`` (aspirates like 'kh' count once)."""
    letters = [c for c in cluster if c.isalpha()]
    count = 0
    i = 0
    while i < len(letters):
        if letters[i] == "h" and i > 0 and letters[i - 1] in "kgcjṭḍtdpb":
            i += 1
            continue
        count += 1
        i += 1
    return count


def scan(text: str) -> str:
    """The weight pattern (``"GLLG..."``) of a line of IAST or Devanagari text."""
    line = devanagari_to_iast(text).lower()
    line = re.sub(r"[^a-zāīūṛṝḷḹṅñṭḍṇśṣṃḥ ]", " ", line)
    vowels = list(_VOWEL_RE.finditer(line))
    pattern = []
    for index, match in enumerate(vowels):
        vowel = match.group(0)
        end = vowels[index + 1].start() if index + 1 < len(vowels) else len(line)
        following = line[match.end() : end]
        heavy = (
            vowel in _VOWELS_LONG
            or "ṃ" in following
            or "ḥ" in following
            or _consonant_units(following.replace("ṃ", "").replace("ḥ", "")) >= 2
        )
        pattern.append("G" if heavy else "L")
    return "".join(pattern)


def split_padas(verse: str, pada_length: int) -> List[str]:
    """Weight patterns of the pādas of ``verse``."""
    padas: List[str] = []
    for part in re.split(r"[\n।॥|]+", verse):
        weights = scan(part)
        if not weights:
            continue
        if len(weights) == 2 * pada_length:
            padas.extend([weights[:pada_length], weights[pada_length:]])
        else:
            padas.append(weights)
    return padas


def _anushtubh_ok(pada: str, index: int) -> float:
    if len(pada) != 8:
        return 0.0
    checks = [pada[4] == "L", pada[5] == "G", pada[6] == ("L" if index % 2 == 1 else "G")]
    return sum(checks) / len(checks)


def _fixed_ok(pada: str, pattern: str) -> float:
    if len(pada) != len(pattern):
        return 0.0
    return sum(p == "X" or p == w for p, w in zip(pattern, pada, strict=True)) / len(pattern)


def meter_score(verse: str, meter: str) -> float:
    """Mean per-pāda match (1.0 = every pāda scans) over 4 expected pādas."""
    key = meter.lower().replace("ā", "a").replace("ṣ", "sh").replace("ṭ", "t").replace("-", "")
    if key not in METERS:
        raise ValueError(f"unknown meter {meter!r}; known: {', '.join(METERS)}")
    pada_length = 8 if key == ANUSHTUBH else len(FIXED_METERS[key])
    padas = split_padas(verse, pada_length)
    if not padas:
        return 0.0
    if key == ANUSHTUBH:
        per = [_anushtubh_ok(p, i) for i, p in enumerate(padas)]
    else:
        per = [_fixed_ok(p, FIXED_METERS[key]) for p in padas]
    return sum(per) / max(4, len(padas))


@registry.register(name="chandas_meter")
class ChandasMeterReward(RewardFunction):
    """Fraction of the verse that scans in ``meter`` (per call ``meter=`` overrides).

    Only the text after ``</think>`` is scanned. 1.0 means all four pādas match.
    """

    def __init__(self, meter: str = "tristubh", weight: float = 1.0, **kwargs: Any) -> None:
        super().__init__(weight=weight, **kwargs)
        meter_score("", meter)  # validates the name
        self.meter = meter

    def _score_text(self, text: str) -> float:
        """The score of one completion's text in this reward's meter."""
        return meter_score(text.split("</think>")[-1], self.meter)

    def compute(
        self, completions: List[Any], meter: str | None = None, **kwargs: Any
    ) -> List[float]:
        if meter is not None and meter != self.meter:
            return [
                meter_score(self.get_content(c).split("</think>")[-1], meter) for c in completions
            ]
        return [self._score_text(self.get_content(c)) for c in completions]


_IAST_TO_SLP1 = [
    ("kh", "K"),
    ("gh", "G"),
    ("ch", "C"),
    ("jh", "J"),
    ("ṭh", "W"),
    ("ḍh", "Q"),
    ("th", "T"),
    ("dh", "D"),
    ("ph", "P"),
    ("bh", "B"),
    ("ai", "E"),
    ("au", "O"),
]
_SINGLE_CHAR_MAP = {
    "a": "a", "ā": "A", "i": "i", "ī": "I", "u": "u", "ū": "U", "ṛ": "f", "ṝ": "F",
    "ḷ": "x", "ḹ": "X", "e": "e", "o": "o", "ṃ": "M", "ṁ": "M", "ḥ": "H",
    "k": "k", "g": "g", "ṅ": "N", "c": "c", "j": "j", "ñ": "Y", "ṭ": "w", "ḍ": "q",
    "ṇ": "R", "t": "t", "d": "d", "n": "n", "p": "p", "b": "b", "m": "m", "y": "y",
    "r": "r", "l": "l", "v": "v", "ś": "S", "ṣ": "z", "s": "s", "h": "h",
}  # fmt: skip
_DIGRAPH_RE = re.compile("|".join(re.escape(d[0]) for d in _IAST_TO_SLP1), re.UNICODE)
_DIGRAPHS = dict(_IAST_TO_SLP1)


def iast_to_slp1(text: str) -> str:
    """IAST (lower case) to SLP1, one ASCII letter per Sanskrit sound (``bhārata`` →
    ``BArata``); characters outside the scheme (spaces, punctuation) pass through."""
    out: List[str] = []
    pos = 0
    for match in _DIGRAPH_RE.finditer(text):
        out.extend(_SINGLE_CHAR_MAP.get(ch, ch) for ch in text[pos : match.start()])
        out.append(_DIGRAPHS[match.group(0)])
        pos = match.end()
    out.extend(_SINGLE_CHAR_MAP.get(ch, ch) for ch in text[pos:])
    return "".join(out)


__all__ = [
    "ChandasMeterReward",
    "FIXED_METERS",
    "METERS",
    "devanagari_to_iast",
    "iast_to_slp1",
    "meter_score",
    "scan",
]
