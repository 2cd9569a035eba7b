"""The index of named notes: every `# NOTE [ Name ]` in hbp/ with its file and line, as a
markdown table (docs/architecture.md pastes it), then the notes cited somewhere but defined
nowhere.

    python experiments/notes_index.py [--root hbp]

A note is defined by a comment or docstring line that holds only `NOTE [ Name ]`, or
`NOTE [ Name ]:` and its reasoning; a name's first line of the first kind is its entry, else
its first of the second. A citation is
`NOTE [ Name ]` anywhere else (code, docstrings, README, docs), possibly broken over two
comment lines.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# A definition: a line holding only the note's name, or its name then ":" and the reasoning
# (in a comment or a docstring).
DEFINITION = re.compile(r"^\s*(?:#\s*)?(?:.*\. )?NOTE \[ (.+?) \](?::.*|\s*)$")
CITATION = re.compile(r"NOTE \[ (.+?) \]")
LINE_BREAK = re.compile(r"\s*\n\s*(?:#:?\s*)?")  # a citation continued on the next comment line


def definitions(root: Path) -> list[tuple[str, Path, int]]:
    """(name, file, line) of every note defined under `root`, in file order."""
    alone: dict[str, tuple[str, Path, int]] = {}  # the line holds only the name
    inline: dict[str, tuple[str, Path, int]] = {}  # the name, ":" and the reasoning
    for path in sorted(root.rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            match = DEFINITION.match(line)
            if match:
                kind = inline if ":" in line[match.end(1) :] else alone
                kind.setdefault(match.group(1), (match.group(1), path, number))
    return list({**inline, **alone}.values())


def citations(paths: list[Path]) -> dict[str, list[Path]]:
    """Note name -> the files citing it (definitions excluded)."""
    cited: dict[str, list[Path]] = {}
    for path in paths:
        lines = [line for line in path.read_text().splitlines() if not DEFINITION.match(line)]
        text = LINE_BREAK.sub(" ", "\n".join(lines))
        for name in CITATION.findall(text):
            cited.setdefault(name, []).append(path)
    return cited


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default="hbp", help="the package to index (default hbp)")
    args = parser.parse_args()
    root = ROOT / args.root
    notes = definitions(root)
    print("| note | file | line |\n|---|---|---|")
    for name, path, number in sorted(notes, key=lambda n: (str(n[1]), n[2])):
        print(f"| {name} | `{path.relative_to(ROOT)}` | {number} |")
    sources = sorted(root.rglob("*.py")) + sorted((ROOT / "tests").rglob("*.py"))
    sources += [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    defined = {name for name, _, _ in notes}
    missing = {
        name: paths
        for name, paths in citations([p for p in sources if p.exists()]).items()
        if name not in defined and name != "Name"
    }
    if missing:
        print("\nCited but not defined:")
        for name, paths in sorted(missing.items()):
            files = ", ".join(sorted({str(p.relative_to(ROOT)) for p in paths}))
            print(f"- NOTE [ {name} ]: {files}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
