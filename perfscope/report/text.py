"""Text from a store or a trace (names, ids, tags, messages that quote them) as Markdown that shows it
literally: the one place the dashboard and the Markdown report make such text safe.

Anyone who can write a segment into a shared store chooses these strings. Rendered as Markdown, an
experiment named `![i](http://host/x.png)` would make every viewer's browser fetch that URL, and
`:red[...]`, `$\\href{...}$` or `**bold**` would draw spoofed findings. CommonMark lets every ASCII
punctuation character be escaped with a backslash, and an escaped one starts nothing: no emphasis,
link, image, code span, HTML, entity, table cell, Streamlit colour directive or icon, or LaTeX.
"""

from __future__ import annotations

import re
from typing import Any

#: every ASCII punctuation character (CommonMark's escapable set)
_PUNCTUATION = re.compile(r"([!-/:-@\[-`{-~])")
#: what GitHub-flavoured Markdown files need escaped inside a line: emphasis, links, images, code,
#: escapes, strikethrough, math, autolinks and HTML (numbers such as 1.25 stay as they are)
_GFM_SPECIAL = re.compile(r"([\\`*_\[\]!~$<>&|])")


def one_line(text: Any) -> str:
    """The text on one line: a newline in a name must not start a heading, a list or a block."""
    return " ".join(str(text).splitlines())


def literal(text: Any) -> str:
    """`text` as Markdown that Streamlit (or any CommonMark renderer) shows exactly as it is, on one line."""
    return _PUNCTUATION.sub(r"\\\1", one_line(text))


def literal_gfm(text: Any) -> str:
    """`text` for a Markdown file: shown literally on GitHub and by CommonMark renderers, with fewer
    backslashes than `literal` (a file is read as text too)."""
    return _GFM_SPECIAL.sub(r"\\\1", one_line(text))
