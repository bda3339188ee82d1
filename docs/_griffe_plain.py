"""A griffe extension for mkdocs (mkdocs.yml's mkdocstrings options): memfit's docstrings read as plain text.

They are written as design notes, not in Google or NumPy style: prose paragraphs, and argument lists laid out
in columns (``name   description``, continuation lines indented under the description). Markdown would run
the columns together, so a paragraph with an indented line or a two-space gap after its first word is kept as
a preformatted block; prose paragraphs stay Markdown, with reST's ``code`` and :class:`name` made Markdown's.
The docstrings themselves are not changed.
"""

from __future__ import annotations

import re

import griffe

_COLUMNS = re.compile(r"^\S+ {2,}\S")
_ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc):`~?([^`]+)`")


def _prose(paragraph: str) -> str:
    paragraph = _ROLE.sub(r"`\1`", paragraph)
    return re.sub(r"``(.+?)``", r"`\1`", paragraph)


def _preformatted(paragraph: str) -> str:
    text = _ROLE.sub(r"\1", paragraph).replace("``", "")
    return "```text\n" + text + "\n```"


def plain(text: str) -> str:
    out = []
    for paragraph in re.split(r"\n\s*\n", text.strip("\n")):
        lines = paragraph.splitlines()
        columns = any(line.startswith((" ", "\t")) for line in lines) or any(_COLUMNS.match(line) for line in lines)
        out.append(_preformatted(paragraph) if columns else _prose(paragraph))
    return "\n\n".join(out)


class PlainDocstrings(griffe.Extension):
    def on_object(self, *, obj, **kwargs) -> None:
        if obj.docstring is not None and not getattr(obj.docstring, "_memfit_plain", False):
            obj.docstring.value = plain(obj.docstring.value)
            obj.docstring._memfit_plain = True
