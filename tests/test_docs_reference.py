"""The committed reference pages (docs/reference/config.md, metrics.md, cli.md) are what the
code generates now: readable on GitHub, never behind the code."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location(
    "docs_reference", ROOT / "scripts" / "docs_reference.py"
)
assert _spec is not None and _spec.loader is not None
reference = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(reference)


@pytest.mark.parametrize("name", sorted(reference.PAGES))
def test_the_committed_reference_page_is_what_the_code_generates(name: str) -> None:
    path = ROOT / "docs" / name
    assert path.is_file(), f"docs/{name} is missing: run `make docs-reference` and commit it"
    assert path.read_text() == reference.page_text(name), (
        f"docs/{name} is behind the code: run `make docs-reference` and commit the page"
    )


def test_links_to_the_reference_pages_resolve_on_github() -> None:
    """Every relative link to a reference page from README.md and docs/ names a file that is
    committed (they used to exist only in the built site)."""
    import re

    link = re.compile(r"\]\(([^)#\s]*reference/(?:config|metrics|cli)\.md)(?:#[^)]*)?\)")
    docs = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]
    found = 0
    for doc in docs:
        for target in link.findall(doc.read_text()):
            found += 1
            assert (doc.parent / target).resolve().is_file(), f"{doc.name}: {target}"
    assert found >= 3
