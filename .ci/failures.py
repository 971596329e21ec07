"""Print, for each failed test in a pytest log, where it failed and the first lines of why.

What CI shows of a run is its tail: this puts each failure's crash site and its first ``E``
lines there, a few short lines per test, so a failure can be understood from the tail alone.
"""

from __future__ import annotations

import re
import sys

# (a long test id gets one underscore each side; "_ _ _" separates a traceback's frames)
HEADER = re.compile(r"^_+ ([A-Za-z].*?) _+$")
CRASH = re.compile(r"^(\S+\.py):(\d+): (\w+)$")


def main(path: str) -> None:
    name, errors, crash, captured = None, [], None, False
    sections: list[tuple[str, list[str], str | None]] = []
    with open(path, encoding="utf-8", errors="replace") as log:
        for raw in log:
            line = raw.rstrip("\n")
            if line.startswith("=") and "short test summary" in line:
                break
            if m := HEADER.match(line):
                if name is not None:
                    sections.append((name, errors, crash))
                name, errors, crash, captured = m.group(1), [], None, False
            elif line.startswith("---") and " Captured " in line:
                captured = True  # (a test's own output: its "E " lines are not pytest's)
            elif name is None or captured:
                continue
            elif line.startswith("E ") and len(errors) < 6:
                errors.append(line[:200])
            elif m := CRASH.match(line):
                crash = f"{m.group(1)}:{m.group(2)} {m.group(3)}"
    if name is not None:
        sections.append((name, errors, crash))
    for name, errors, crash in sections:
        if not (errors or crash):
            continue
        print(f"  {name}: {crash or '?'}")
        for error in errors:
            print(f"    {error}")


if __name__ == "__main__":
    main(sys.argv[1])
