"""Model card text shared by the commands that write a card: the metadata block of a converted
folder's card (`card_metadata`), the metadata of a source's card (`read_card_metadata`), and one
level-2 section replaced in place (the Evaluation section of `eval --card` and `--eval-data`, the
Adaptation section of `adapt`), and a conversion's card turned into the adapted model's
(`adapted_card`: what a family's template marks `<!-- before adapt -->...<!-- /before adapt -->`
holds only before `adapt`)."""

from __future__ import annotations

import re
from pathlib import Path


def read_card_metadata(path: str | Path) -> dict:
    """The YAML front matter of a model card (README.md) as a dict; {} when there is no card or none."""
    path = Path(path)
    if not path.is_file():
        return {}
    from huggingface_hub import metadata_load

    try:
        return metadata_load(path) or {}
    except Exception:  # a card whose front matter does not parse tells nothing
        return {}


def card_metadata(base_model: str | None, license: str, license_name: str | None = None,
                  license_link: str | None = None) -> str:
    """The front-matter lines a converted checkpoint's card starts with: `base_model` (a Hub id, left
    out when the source has none), the license, the library and `pipeline_tag: text-generation`."""
    lines = [f"base_model: {base_model}"] if base_model else []
    lines.append(f"license: {license}")
    lines += [f"{k}: {v}" for k, v in (("license_name", license_name), ("license_link", license_link)) if v]
    lines += ["library_name: transformers", "pipeline_tag: text-generation"]
    return "\n".join(lines)


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


#: what a card template says only of the model as converted, before `adapt` trains it
BEFORE_ADAPT = re.compile(r"<!-- before adapt -->(.*?)<!-- /before adapt -->", flags=re.S)
#: what `adapted_card` says instead, outside the title
ADAPTED_NOTE = ("**This model was adapted after the conversion** (the Adaptation section below says how: attention "
                "transfer from the dense model, then distillation or fine-tuning); the sections above and below it "
                "describe the conversion it started from.")


def adapted_card(text: str) -> str:
    """The card of a converted folder as the card of the model `adapt` made from it: the title says
    "adapted" (without its "(... before use)"), and what the template marks as true only before
    adaptation (the warning that the outputs are poor) gives way to `ADAPTED_NOTE`."""
    title = re.search(r"^# .*$", text, flags=re.M)
    if title is not None and not title.group(0).endswith(", adapted"):
        heading = re.sub(r"\s*\([^()]*before use\)\s*$", "", title.group(0)) + ", adapted"
        text = text[:title.start()] + heading + text[title.end():]
    return BEFORE_ADAPT.sub(lambda m: ADAPTED_NOTE if m.group(1).strip() else "", text).replace(
        ADAPTED_NOTE + "\n\n" + ADAPTED_NOTE, ADAPTED_NOTE)
