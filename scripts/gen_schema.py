"""Write schema/lmpm-ir.schema.json from lmpm.ir.serialize.json_schema() (run after changing the IR).

python scripts/gen_schema.py          # rewrite the file
python scripts/gen_schema.py --check  # exit 1 if the committed file is stale
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from lmpm.ir.serialize import json_schema

PATH = Path(__file__).resolve().parents[1] / "schema" / "lmpm-ir.schema.json"


def render() -> str:
    return json.dumps(json_schema(), indent=2, sort_keys=True) + "\n"


def main() -> int:
    text = render()
    if "--check" in sys.argv[1:]:
        if not PATH.exists() or PATH.read_text() != text:
            sys.stderr.write(f"{PATH} is stale; run python scripts/gen_schema.py\n")
            return 1
        return 0
    PATH.parent.mkdir(parents=True, exist_ok=True)
    PATH.write_text(text)
    sys.stderr.write(f"wrote {PATH}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
