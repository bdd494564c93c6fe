"""A griffe extension for the API reference: the package's docstrings use a few reStructuredText idioms.

The docstrings are Google style, rendered as Markdown by mkdocstrings, but they cross-reference with Sphinx roles
(``:func:`~lightning_accel.big_modeling.dispatch_model```) and introduce code blocks with a trailing ``::``. Rendered
as they are, the roles show up as literal ``:func:`` text. This extension rewrites each role into inline code (the last
component of the path when it starts with ``~``, as Sphinx shows it) and a trailing ``::`` into ``:``, while griffe
reads the sources; the sources themselves are unchanged.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:func|class|meth|attr|mod|data|exc|obj|const|type):`(?P<tilde>~?)(?P<target>[^`]+)`")
_LITERAL_BLOCK = re.compile(r"(?<=\S)::$", re.MULTILINE)


def _shown(match: re.Match[str]) -> str:
    target = match["target"]
    return f"`{target.rsplit('.', 1)[-1] if match['tilde'] else target}`"


def rewrite(text: str) -> str:
    """The docstring ``text`` with Sphinx roles as inline code and ``::`` block openers as ``:``."""
    return _LITERAL_BLOCK.sub(":", _ROLE.sub(_shown, text))


class RstRoles(griffe.Extension):
    """Rewrite the reStructuredText idioms of every docstring griffe reads (see the module docstring)."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        """Rewrite ``obj``'s docstring, if it has one."""
        if obj.docstring is not None:
            obj.docstring.value = rewrite(obj.docstring.value)
