"""MkDocs hook: the site's front page is the README, its links made relative to docs/."""

from __future__ import annotations

from pathlib import Path
from typing import Any

README = Path(__file__).resolve().parents[2] / "README.md"


def on_page_markdown(markdown: str, *, page: Any, **kwargs: Any) -> str:
    if page.file.src_uri != "index.md":
        return markdown
    return README.read_text(encoding="utf-8").replace("](docs/", "](")
