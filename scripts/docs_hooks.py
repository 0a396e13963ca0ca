"""mkdocs hook (``hooks:`` in mkdocs.yml): the Sphinx roles of the docstrings shown as code.
The reference pages generated from the code are committed under docs/reference/
(``make docs-reference``; a test fails when they are behind the code)."""

from __future__ import annotations

import re
from typing import Any

from mkdocs.structure.pages import Page

_ROLE = re.compile(r":(?:func|class|mod|meth|attr|data|exc):(?=<code>)")


def on_page_content(html: str, page: Page, **_: Any) -> str:
    """Drop the Sphinx roles of the docstrings (``:func:`x` `` shows as the code ``x``)."""
    return _ROLE.sub("", html)
