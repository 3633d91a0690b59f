"""Text for Streamlit's markdown elements (captions, notes) that is drawn as written.

Streamlit's markdown loads its emoji plugin (remark-emoji and a 260-KB emoji table, fetched, parsed
and run by every new visitor) for any text in which something looks like a shortcode: a colon, word
characters, a colon, as in a time ``08:30:10``. The caption under the page's title carries the time its
figures were read, so every visit paid for it. A colon right after a word character (one that could
close a shortcode) is written escaped (``\\:``, CommonMark's escape for punctuation): the page shows the
same text, and no shortcode is seen.
"""

from __future__ import annotations

import re

_CLOSES_CODE = re.compile(r"(?<=[\w+-]):")


def as_written(text: str) -> str:
    """``text`` with each colon that could close an emoji shortcode escaped (drawn the same)."""
    return _CLOSES_CODE.sub(r"\\:", text)


_MARKUP = re.compile(r"([\\`*_{}\[\]()#+\-.!|<>~$:&])")


def plain(text: str) -> str:
    """``text`` drawn as written by Streamlit's markdown (a caption, a heading): every ASCII character that
    markdown, its HTML, LaTeX (``$``) or emoji shortcodes (``:``) could read as markup is escaped with a
    backslash, CommonMark's escape for punctuation. A job, owner or queue name in a caption is shown as it
    is, never as emphasis, a link or a formula."""
    return _MARKUP.sub(r"\\\1", text)
