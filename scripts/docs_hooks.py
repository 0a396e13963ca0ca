"""mkdocs hook (``hooks:`` in mkdocs.yml): adds the reference pages generated from the code
(``scripts/docs_reference.py``) to the site at build time; nothing generated is committed."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

_spec = importlib.util.spec_from_file_location(
    "docs_reference", Path(__file__).with_name("docs_reference.py")
)
assert _spec is not None and _spec.loader is not None
reference = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(reference)


def on_files(files: Files, config: Any) -> Files:
    """Add each generated page under its path in the docs."""
    for name, make in reference.PAGES.items():
        files.append(File.generated(config, name, content=make()))
    return files


_ROLE = re.compile(r":(?:func|class|mod|meth|attr|data|exc):(?=<code>)")


def on_page_content(html: str, page: Page, **_: Any) -> str:
    """Drop the Sphinx roles of the docstrings (``:func:`x` `` shows as the code ``x``)."""
    return _ROLE.sub("", html)
