"""Captions with times are drawn as written without Streamlit's emoji plugin (dashboard/caption_text.py)."""

import re

from prefect_launch.dashboard.caption_text import as_written

# Streamlit's test for "this markdown may hold an emoji shortcode" (StreamlitMarkdown's frontend code,
# Streamlit 1.67): a match loads remark-emoji and its emoji table
SHORTCODE = re.compile(r":(?!material/|streamlit:)[\w+-][\w_+-]*:")


def test_times_no_longer_look_like_shortcodes():
    caption = "2026-12-03 08:00 – 2026-12-03 09:00 UTC · read at 08:30:10 UTC in 0.21 s · :rocket: · 10:20:30.456"
    assert SHORTCODE.search(caption)  # as the page wrote it: the plugin loaded
    shown = as_written(caption)
    assert not SHORTCODE.search(shown)
    assert shown.replace("\\:", ":") == caption  # the same text once the markdown escapes are read


def test_colons_that_close_nothing_are_left_alone():
    for text in ("a : b", " :x", "(: )", ""):
        assert as_written(text) == text


def test_plain_text_is_drawn_as_written():
    """A name in a caption or heading (dashboard/widgets.heading) is never read as markdown, HTML, LaTeX or an
    emoji shortcode: every such character is escaped, and nothing else changes."""
    from prefect_launch.dashboard.caption_text import plain

    text = "job *a_b* [x](javascript:1) <b>$1$</b> 08:30:10 · #1 ~ok~ & `c`"
    shown = plain(text)
    assert re.sub(r"\\(.)", r"\1", shown) == text  # the same text once the escapes are read
    assert not re.search(r"(?<!\\)[*_\[\]()<>$:#~&`]", shown)  # every markup character escaped
    assert plain("grouping job · read at") == "grouping job · read at"
