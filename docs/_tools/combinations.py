"""Write docs/guides/combinations.md from the table of what combines
(``asyncsave._combine``): ``python docs/_tools/combinations.py``.
``tests/test_combine.py`` fails when the page and the table differ."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

from asyncsave._combine import markdown  # noqa: E402

(ROOT / "docs" / "guides" / "combinations.md").write_text(markdown())
