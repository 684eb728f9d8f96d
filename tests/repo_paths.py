"""Where the repository is, for tests in any folder under `tests/` (`tests/conftest.py` puts `tests/` on the path)."""

from pathlib import Path

#: The repository's root: the folder above `tests/`, the one holding `pyproject.toml`.
REPO_ROOT = Path(__file__).resolve().parent.parent
