"""Do two runs train the same? Compares the rows of their metrics.jsonl and eval.jsonl, leaving out
what depends on the clock (times, throughput, memory, sync timings, where staleness accrued).

    python benchmarks/same_rows.py RUN_A RUN_B [--json]

Two runs of one recipe at one seed on one model give the same rows however fast the machine is
(admission and the sync rule are deterministic in the events, not the clock), so a change that
should not alter training — a refactor — is checked by running a recipe before and after it.
Exit status 0 when every compared value is equal, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

CLOCK = ("time/", "throughput/", "memory/", "sync/", "agent/env_s", "staleness/at_launch",
         "staleness/generating",
         "staleness/queued")
CLOCK_KEYS = ("wall_s",)


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def comparable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(CLOCK) and k not in CLOCK_KEYS}


def same(a, b) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def differences(a: list[dict], b: list[dict]) -> tuple[int, list[str]]:
    """(values compared, where they differ)."""
    out = [] if len(a) == len(b) else [f"{len(a)} rows against {len(b)}"]
    compared = 0
    for i, (x, y) in enumerate(zip(map(comparable, a), map(comparable, b), strict=False)):
        for key in sorted(set(x) | set(y)):
            compared += 1
            if not same(x.get(key), y.get(key)):
                out.append(f"row {i} {key}: {x.get(key)!r} against {y.get(key)!r}")
    return compared, out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", type=Path)
    parser.add_argument("b", type=Path)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    report = {}
    for name in ("metrics.jsonl", "eval.jsonl"):
        compared, diff = differences(rows(args.a / name), rows(args.b / name))
        report[name] = {"rows": len(rows(args.a / name)), "values_compared": compared, "differences": diff}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for name, r in report.items():
            print(f"{name}: {r['rows']} rows, {r['values_compared']} values, {len(r['differences'])} differ")
            for line in r["differences"][:20]:
                print(f"  {line}")
    return 0 if not any(r["differences"] for r in report.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
