"""``gradsync train --help`` is grouped as docs/train.md's "Flags" table groups the flags
(issue 37: one list of every flag), with every flag in a group, the new ones included."""

import argparse
import re
from pathlib import Path

from gradsync.train.config.flags import add_arguments

DOC = Path(__file__).resolve().parents[2] / "docs" / "train.md"


def _doc_groups() -> dict[str, list[str]]:
    text = DOC.read_text()
    table = text[text.index("## Flags"):text.index("## The global batch")]
    out = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") \
            else []
        if len(cells) >= 2 and cells[0] not in ("group", "---"):
            row = " | ".join(cells[1:])  # a flag's choices are written a\|b
            out[cells[0]] = [m.group(1) for item in _items(row)
                             if (m := re.match(r"`(--[a-z][a-z-]*)", item))]
    return out


def _items(row: str) -> list[str]:
    """The row's comma-separated items outside parentheses: each starts with its flag (a
    flag named inside an item's parentheses is a remark, not the item)."""
    items, depth, cur = [], 0, ""
    for ch in row:
        depth += (ch == "(") - (ch == ")")
        if ch == "," and depth == 0:
            items.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return items + [cur.strip()]


def _help_groups(text: str) -> dict[str, list[str]]:
    out, title = {}, None
    for line in text.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            title = line[:-1]
            out[title] = []
        elif title and line.startswith("  -"):
            out[title].append(line.split()[0].rstrip(","))
    return out


def _help() -> str:
    p = argparse.ArgumentParser(prog="gradsync train", formatter_class=lambda prog:
                                argparse.HelpFormatter(prog, width=200))
    add_arguments(p)
    return p.format_help()


def test_help_has_docs_groups_in_docs_order_with_every_flag():
    docs, helped = _doc_groups(), _help_groups(_help())
    assert len(docs) >= 10
    groups = [t for t in helped if t not in ("options", "usage")]
    assert groups == list(docs)  # the same groups, in the same order
    for title, flags in docs.items():
        assert sorted(set(flags)) == sorted(helped[title]), title  # each flag where docs say
    assert helped.get("options", []) == ["-h"]  # nothing left ungrouped
