"""Model card text shared by the commands that write into a card: one level-2 section replaced in
place (the Evaluation section of `eval --card` and `--eval-data`, the Adaptation section of `adapt`)."""

from __future__ import annotations

import re


def replace_section(text: str, heading: str, section: str) -> str:
    """`text` (a markdown card) with the section under the level-2 `heading` replaced by `section`, or
    `section` appended when the card has none."""
    start = re.search(rf"^{re.escape(heading)}[ \t]*$", text, flags=re.M)
    if start is None:
        return (text.rstrip("\n") + "\n\n" if text.strip() else "") + section
    nxt = re.search(r"^## ", text[start.end():], flags=re.M)
    end = start.end() + nxt.start() if nxt else len(text)
    rest = text[end:]
    return text[:start.start()] + section + ("\n" + rest if rest else "")
