"""The model alone vs the same model under the program's constraints: numbers and a sheet.

    python scripts/compare.py ALONE_RUN CONSTRAINED_RUN --value Vid --sheet sheet.png
    python scripts/compare.py runs/demo/text_alone runs/demo/text --value Txt

Both are run directories of `lmpm run` with the same inputs and seed, the constrained one with
`--trace cells` (which constraint decided which cell). Prints, per constraint, the cells it decided
and how far each run satisfies it, and how many cells differ between the runs (`--json`: one JSON
line). For a grid value, `--sheet` writes the side-by-side PNG (model alone above, constrained
below, frames across, then the differing cells coloured by the constraint that decided them); for a
byte value it prints both texts with a mark under each byte a constraint decided.
See src/lmpm/compare.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lmpm.compare import compare, legend_of, sheet, text_lines
from lmpm.errors import LmpmError
from lmpm.printable import printable, printable_lines, printable_tree


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("alone", type=Path, help="run directory of the model alone")
    ap.add_argument("constrained", type=Path, help="run directory under the constraints")
    ap.add_argument("--value", required=True, help="the value to compare (Vid, Txt, ...)")
    ap.add_argument("--sheet", type=Path, help="write the side-by-side PNG here (grid values)")
    ap.add_argument("--title", default="", help="the sheet's title")
    ap.add_argument("--labels", default="model alone,constrained", help="two run labels")
    ap.add_argument("--json", action="store_true", help="one JSON line instead of the table")
    ap.add_argument(
        "--trust-bind",
        action="store_true",
        help="import the --bind modules the constrained run names (a run directory from "
        "elsewhere could name any module; see docs/security.md)",
    )
    args = ap.parse_args(argv)
    a, _, b = args.labels.partition(",")
    try:
        cmp = compare(
            args.alone,
            args.constrained,
            args.value,
            (a, b or "constrained"),
            trust_bind=args.trust_bind,
        )
        if args.sheet is not None:
            sheet(cmp, args.sheet, title=args.title)
    except LmpmError as exc:
        print(f"error: {printable_lines(str(exc))}", file=sys.stderr)
        return 2
    nums = printable_tree(cmp.numbers())  # names from the runs' logs: no terminal escapes
    if args.sheet is not None:
        nums["sheet"] = str(args.sheet)
    if args.json:
        print(json.dumps(nums))
        return 0
    print(
        f"{args.value}: {nums['cells_differ']} of {nums['cells']} cells differ "
        f"({100 * nums['share_differ']:.1f}%) between {a} and {b}"
    )
    width = max([len(c["name"]) for c in nums["constraints"]] + [10])
    print(
        f"  {'constraint':<{width}}  prio  decided cells (differ)  satisfied: "
        + " / ".join(cmp.labels)
    )
    for c in nums["constraints"]:
        sat = " / ".join("—" if v is None else f"{100 * v:.1f}%" for v in c["satisfied"].values())
        decided = f"{c['decided_cells']} ({c['decided_and_differ']})"
        print(f"  {c['name']:<{width}}  {c['priority']:>4}  {decided:>22}  {sat}")
    if cmp.alone.ndim == 1:
        alone, constrained, marks = text_lines(cmp)
        print(f"  {a:>12}: {alone}")
        print(f"  {b:>12}: {constrained}")
        legend = ", ".join(f"{m} = decided by {printable(n)}" for n, m in legend_of(cmp).items())
        print(f"  {'':>12}  {marks}   ({legend})")
    if args.sheet is not None:
        print(f"  sheet: {args.sheet}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
