"""A guard on JSON bytes as they stream into a parser: refuses nesting deeper than any trace needs
and strings longer than any trace holds, before the parser spends memory on them.

Streaming parsers build each value whole, and ijson's key paths grow with the depth (memory
quadratic in it): a few hundred KB of `[[[[...` would take tens of GB. The guard follows the
bytes with numpy (string state across escapes, bracket depth) at a few ns per byte.
"""

from __future__ import annotations

import numpy as np

from ..errors import PerfscopeError

_QUOTE, _BACKSLASH = 34, 92
_EMPTY_POS = np.empty(0, dtype=np.int64)
_EMPTY_BYTE = np.empty(0, dtype=np.uint8)


class JsonGuard:
    """Feed it every chunk in order; it raises PerfscopeError naming `source` at the first excess."""

    def __init__(self, source: str, *, max_depth: int = 64, max_string_bytes: int = 16 << 20) -> None:
        self.source = source
        #: set it to have each `feed` leave in `shallow_pos`/`shallow_byte`/`shallow_depth` the offsets
        #: (from the first byte fed) of the brackets outside strings that leave the depth at 2 or less,
        #: each bracket's byte and the depth after it: where the top levels of the document open and
        #: close, and where each element of a top-level array ends (a reader cuts the stream there)
        self.track_shallow = False
        self.shallow_pos = _EMPTY_POS
        self.shallow_byte = _EMPTY_BYTE
        self.shallow_depth = _EMPTY_POS
        self.max_depth = max_depth
        self.max_string_bytes = max_string_bytes
        self.depth = 0
        self.in_string = False
        self.backslashes = 0  # backslashes ending the previous chunk (inside a string)
        self.string_bytes = 0  # length so far of the string the previous chunk ended in
        self.offset = 0

    def feed(self, chunk: bytes) -> None:
        n = len(chunk)
        if not n:
            return
        b = np.frombuffer(chunk, dtype=np.uint8)
        quotes = np.flatnonzero(b == _QUOTE)
        real = self._real_quotes(b, quotes)
        # brackets and quotes are a few percent of a trace's bytes: work on their positions only.
        # `[` and `{` are the bytes that are 0x7b once 0x20 is set, `]` and `}` 0x7d (two compares:
        # a lookup table indexed by every byte took ten times as long)
        folded = b | 0x20
        opens = folded == 0x7B
        brackets = np.flatnonzero(opens | (folded == 0x7D))
        if len(brackets):
            signs = np.where(opens[brackets], 1, -1)
            inside = (np.searchsorted(real, brackets) + int(self.in_string)) % 2 == 1
            depth = self.depth + np.cumsum(np.where(inside, 0, signs), dtype=np.int64)
            if int(depth.max()) > self.max_depth:
                at = self.offset + int(brackets[int(np.argmax(depth > self.max_depth))])
                raise PerfscopeError(
                    f"{self.source}: JSON nested deeper than {self.max_depth} levels near byte {at:,}; "
                    "not a trace this tool reads"
                )
            self.depth = int(depth[-1])
            if self.track_shallow:
                keep = ~inside & (depth <= 2)
                self.shallow_pos = brackets[keep].astype(np.int64) + self.offset
                self.shallow_byte = b[brackets[keep]]
                self.shallow_depth = depth[keep]
        elif self.track_shallow:
            self.shallow_pos, self.shallow_byte, self.shallow_depth = _EMPTY_POS, _EMPTY_BYTE, _EMPTY_POS
        ends_in_string = bool((int(self.in_string) + len(real)) % 2)
        if ends_in_string:
            start = int(real[-1]) + 1 if len(real) else 0
            self.string_bytes = (0 if len(real) else self.string_bytes) + n - start
            if self.string_bytes > self.max_string_bytes:
                raise PerfscopeError(
                    f"{self.source}: a JSON string longer than {self.max_string_bytes >> 20} MB near byte "
                    f"{self.offset + n:,}; not a trace this tool reads"
                )
        else:
            self.string_bytes = 0
        self.in_string = ends_in_string
        if b[-1] == _BACKSLASH:
            not_bs = np.flatnonzero(b != _BACKSLASH)
            tail_run = n - 1 - int(not_bs[-1]) if len(not_bs) else n
            self.backslashes = tail_run + (self.backslashes if tail_run == n else 0)
        else:
            self.backslashes = 0
        self.offset += n

    def _real_quotes(self, b: np.ndarray, quotes: np.ndarray) -> np.ndarray:
        """The quotes that open or close a string: not escaped by an odd run of backslashes before
        them (a run may start in the previous chunk)."""
        if not len(quotes):
            return quotes
        prev = quotes - 1
        escaped_maybe = np.zeros(len(quotes), dtype=bool)
        escaped_maybe[prev >= 0] = b[prev[prev >= 0]] == _BACKSLASH
        if quotes[0] == 0 and self.backslashes:
            escaped_maybe[0] = True
        if not escaped_maybe.any():
            return quotes
        idx = np.arange(len(b))
        last_not_bs = np.maximum.accumulate(np.where(b != _BACKSLASH, idx, -1))
        before = np.where(quotes > 0, last_not_bs[np.maximum(prev, 0)], -1)
        run = prev - before
        run = np.where(before < 0, run + self.backslashes, run)
        return quotes[(run % 2) == 0]
