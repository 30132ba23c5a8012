"""Write docs/builtins.md from the built-in registry (lmpm.builtins_doc.render).

python scripts/gen_builtins.py          # rewrite the page
python scripts/gen_builtins.py --check  # exit 1 if the committed page is stale
"""

from __future__ import annotations

import sys
from pathlib import Path

from lmpm.builtins_doc import render

PATH = Path(__file__).resolve().parents[1] / "docs" / "builtins.md"


def main() -> int:
    text = render()
    if "--check" in sys.argv[1:]:
        if not PATH.exists() or PATH.read_text(encoding="utf-8") != text:
            sys.stderr.write(f"{PATH} is stale; run python scripts/gen_builtins.py\n")
            return 1
        return 0
    PATH.write_text(text, encoding="utf-8")
    print(f"wrote {PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
