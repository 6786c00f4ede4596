"""The page as a document: sections of paragraphs, bullet lists, tables and images,
rendered as one self-contained HTML page and as Markdown. Text from runs and values files
is text in both: escaped for HTML or Markdown, control characters as visible escapes
(``safe_text.printable``)."""

from __future__ import annotations

import base64
import html
import re
from dataclasses import dataclass
from pathlib import Path

from fedmech_flwr.foundation.safe_text import printable


@dataclass
class Table:
    header: list[str]
    rows: list[list[str]]


@dataclass
class Image:
    path: Path
    caption: str


@dataclass
class Section:
    title: str
    blocks: list[str | list[str] | Table | Image]
    """A string is a paragraph, a list of strings a bullet list."""


CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 1200px; padding: 0 1em; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 2em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: 0.8em 0; font-size: 13px; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f2f2f2; } tr:nth-child(even) td { background: #fafafa; }
figure { margin: 1em 0; } img { max-width: 100%; } figcaption { color: #555; font-size: 13px; }
"""


def html_text(text: str) -> str:
    """``text`` as literal HTML: its control characters as visible escapes, HTML's
    special characters as entities."""
    return html.escape(printable(text))


def to_html(title: str, sections: list[Section]) -> str:
    e = html_text
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">', f"<title>{e(title)}</title>",
           '<link rel="icon" href="data:,">', f"<style>{CSS}</style></head><body>", f"<h1>{e(title)}</h1>"]
    for section in sections:
        out.append(f"<h2>{e(section.title)}</h2>")
        for block in section.blocks:
            if isinstance(block, str):
                out.append(f"<p>{e(block)}</p>")
            elif isinstance(block, list):
                out.append("<ul>" + "".join(f"<li>{e(item)}</li>" for item in block) + "</ul>")
            elif isinstance(block, Table):
                head = "".join(f"<th>{e(h)}</th>" for h in block.header)
                body = "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>" for row in block.rows)
                out.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
            else:
                data = base64.b64encode(block.path.read_bytes()).decode()
                out.append(f'<figure><img src="data:image/png;base64,{data}" alt="{e(block.caption)}">'
                           f"<figcaption>{e(block.caption)}</figcaption></figure>")
    return "\n".join(out + ["</body></html>", ""])


MARKDOWN_SPECIAL = re.compile(r"([\\`*\[\]|])")
"""Characters that Markdown would read as code, emphasis, a link or a table cell (``&``,
``<`` and ``>`` become entities; an underscore inside a word is literal already)."""


def markdown_text(text: str) -> str:
    """``text`` as literal Markdown on one line: HTML's special characters as entities,
    Markdown's escaped and control characters as visible escapes, so text from runs and
    values files cannot become HTML, a link or a table cell of its own."""
    return MARKDOWN_SPECIAL.sub(r"\\\1", html.escape(printable(" ".join(text.split())), quote=False))


def to_markdown(title: str, sections: list[Section], out_dir: Path) -> str:
    e = markdown_text
    out = [f"# {e(title)}", ""]
    for section in sections:
        out += [f"## {e(section.title)}", ""]
        for block in section.blocks:
            if isinstance(block, str):
                out += [e(block), ""]
            elif isinstance(block, list):
                out += [f"- {e(item)}" for item in block] + [""]
            elif isinstance(block, Table):
                out += ["| " + " | ".join(map(e, block.header)) + " |", "|" + "---|" * len(block.header)]
                out += ["| " + " | ".join(map(e, row)) + " |" for row in block.rows] + [""]
            else:
                out += [f"![{e(block.caption)}]({block.path.relative_to(out_dir).as_posix()})", ""]
    return "\n".join(out)
