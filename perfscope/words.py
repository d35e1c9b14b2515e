"""Counts in words, shared by the CLI, the report and the dashboard: '1 run', '2 runs', '1,200 rows'."""

from __future__ import annotations

from collections.abc import Iterable

#: nouns whose plural is not the noun + "s"
_IRREGULAR = {"analysis": "analyses", "process": "processes", "is": "are", "was": "were"}


def plural(noun: str, n: int) -> str:
    """`noun` as it reads after the count `n` ('run', 'runs'); the last word of a phrase is the one
    that changes ('world size' -> 'world sizes')."""
    if n == 1:
        return noun
    head, _, last = noun.rpartition(" ")
    if last in _IRREGULAR:
        last = _IRREGULAR[last]
    elif last.endswith("y") and last[-2:-1] not in "aeiou":
        last = last[:-1] + "ies"
    elif last.endswith(("s", "x", "z", "ch", "sh")):
        last += "es"  # 'micro-batch' -> 'micro-batches', 'pass' -> 'passes'
    else:
        last += "s"
    return f"{head} {last}" if head else last


def counted(n: int, noun: str) -> str:
    """The count and its noun: counted(1, 'run') == '1 run', counted(1200, 'row') == '1,200 rows'."""
    return f"{n:,} {plural(noun, n)}"


def ordinal(n: int) -> str:
    """1st, 2nd, 3rd, 4th ... 11th, 12th, 13th ... 21st, 22nd, 23rd, 101st."""
    suffix = "th" if n % 100 in (11, 12, 13) else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


#: what a label never prints for a value nobody recorded
_PLACEHOLDERS = ("", "-", "–", "None", "none", "null", "nan")


def known(value: object) -> bool:
    """Whether a label may print `value`: not None, not empty, not a placeholder such as '-'."""
    return value is not None and str(value).strip() not in _PLACEHOLDERS


def joined(parts: Iterable[object], sep: str = " · ") -> str:
    """The known parts, joined: an unknown one is left out, never printed as None, '-' or an empty
    field between separators ('2 ranks on 1 node · gloo', not '2 ranks on 1 node ·  · gloo')."""
    return sep.join(str(p) for p in parts if known(p))
