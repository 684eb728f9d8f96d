"""Code says what and why in the present tense: no date (YYYY-MM-DD) in a tracked Python file. Git keeps history;
a date in a comment, docstring or field description marks a story about a past run, not the code's reason.

Test fixtures (`tests/fixtures/`) may hold dated data and are not checked."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from repo_paths import REPO_ROOT

#: Folders never searched when git is not available (virtual environments, built docs and packages).
SKIPPED_DIRS = {".venv", "venv", "site", "build", "dist", ".git", "__pycache__", "node_modules"}
#: Folders (relative to the repository root) whose files may hold dates.
EXEMPT_PREFIXES = ("tests/fixtures/",)
#: A calendar date as 20YY-MM-DD, assembled so that this file's own source holds no date-shaped literal.
DATE = re.compile("20" + r"[0-9]{2}" + "-" + r"[0-9]{2}" + "-" + r"[0-9]{2}")




def python_files(root: Path) -> list[str]:
    """Tracked `.py` files (paths relative to `root`, `/`-separated); without git, every `.py` file in the tree."""
    if shutil.which("git") and (root / ".git").exists():
        listed = subprocess.run(["git", "ls-files", "-z", "--", "*.py"], cwd=root, capture_output=True, check=False)
        if listed.returncode == 0:
            return [name for name in listed.stdout.decode().split("\0") if name and (root / name).is_file()]
    return sorted(path.relative_to(root).as_posix() for path in root.rglob("*.py")
                  if not SKIPPED_DIRS.intersection(path.relative_to(root).parts[:-1]))


def dated_lines(root: Path, names: list[str]) -> list[str]:
    """`path:line: text` of every line holding a date, outside the exempt folders."""
    found = []
    for name in names:
        if name.startswith(EXEMPT_PREFIXES):
            continue
        text = (root / name).read_text(encoding="utf-8", errors="replace")
        for number, line in enumerate(text.splitlines(), start=1):
            if DATE.search(line):
                found.append(f"{name}:{number}: {line.strip()}")
    return found


def test_no_python_file_holds_a_date():
    root = REPO_ROOT
    names = python_files(root)
    assert any(name.startswith("placement/") for name in names)  # the listing sees the packages
    found = dated_lines(root, names)
    assert not found, ("dates in Python files (state what the code does and why; git keeps the history):\n"
                       + "\n".join(found))


def test_the_check_finds_a_date_and_names_its_file_and_line(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "dated.py").write_text("X = 1\n# tuned on " + "2026" + "-01-31\n")
    (tmp_path / "tests" / "fixtures").mkdir(parents=True)
    (tmp_path / "tests" / "fixtures" / "data.py").write_text("WHEN = '" + "2026" + "-01-31'\n")
    (tmp_path / ".venv").mkdir()
    (tmp_path / ".venv" / "lib.py").write_text("# " + "2026" + "-01-31\n")
    names = python_files(tmp_path)  # no .git here: the tree walk, which skips .venv
    assert sorted(names) == ["pkg/dated.py", "tests/fixtures/data.py"]
    assert dated_lines(tmp_path, names) == ["pkg/dated.py:2: # tuned on " + "2026" + "-01-31"]
