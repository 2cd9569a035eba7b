"""Named notes: every `NOTE [ Name ]` the code, the tests and the docs cite is defined somewhere,
and docs/architecture.md's index lists every note of hbp/ (`python
experiments/notes_index.py` makes it)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))

import notes_index  # noqa: E402


def cited_but_undefined(root: Path = ROOT) -> dict[str, list[str]]:
    defined = {name for name, _, _ in notes_index.definitions(root / "hbp")}
    defined |= {name for name, _, _ in notes_index.definitions(root / "experiments")}
    tests = [p for p in (root / "tests").rglob("*.py") if p.name != Path(__file__).name]
    sources = [*(root / "hbp").rglob("*.py"), *tests]
    sources += [root / "README.md", *(root / "docs").glob("*.md")]
    return {
        name: sorted(str(p.relative_to(root)) for p in paths)
        for name, paths in notes_index.citations([p for p in sources if p.exists()]).items()
        if name not in defined and name != "Name"
    }


def test_every_cited_note_is_defined():
    assert not cited_but_undefined(), cited_but_undefined()


def test_the_check_finds_a_note_cited_across_two_comment_lines(tmp_path):
    (tmp_path / "hbp").mkdir()
    (tmp_path / "hbp" / "a.py").write_text(
        "# NOTE [ Kept ]\n# the reasoning\nx = 1  # NOTE [ Kept ]\n# see NOTE [ Gone\n# away ]\n"
    )
    assert cited_but_undefined(tmp_path) == {"Gone away": ["hbp/a.py"]}


def test_the_architecture_index_lists_every_note():
    index = (ROOT / "docs" / "architecture.md").read_text().split("## Named notes", 1)[1]
    listed = set(re.findall(r"^\| (.+?) \| `", index, re.M))
    defined = {name for name, _, _ in notes_index.definitions(ROOT / "hbp")}
    assert defined <= listed, (
        f"not in docs/architecture.md's index: {sorted(defined - listed)}; paste the table "
        "`python experiments/notes_index.py` prints"
    )
