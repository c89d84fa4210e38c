"""Files a job names (a dataset's `path`): found in its tenant's folder of the data directory,
and nowhere else.

A job's params come from a tenant, and env_svc reads them with its own rights, which reach
the bus key in /proc/self/environ and every other tenant's data. So a job-supplied path is:
- relative, without `..`, and resolves (symlinks followed) inside the tenant's folder,
  `$MARLAAS_DATA_DIR/<tenant>/` (the environment's `data_dir`);
- a regular file (not /dev/zero, a FIFO or a directory), opened without following a link
  swapped in after the check, and checked again by the path the kernel opened;
- at most `MAX_FILE_BYTES`, each line at most `MAX_LINE_BYTES`, read no further;
- or a folder (a `save_to_disk` dataset) holding no link at all and at most `MAX_TREE_FILES`
  such files of `MAX_FILE_BYTES` in all (`confine_tree`).
Every refusal is a `DataFileError` whose text names the job's own path and the rule, never
the file's contents nor where the data directory lies.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

DATA_DIR_VAR = "MARLAAS_DATA_DIR"
"""The data directory (default: the working directory): each tenant's files are in its
folder, `<data dir>/<tenant>/`; the same files mounted at the same place for env_svc and the
CLI."""
MAX_FILE_BYTES = 64 * 1024 * 1024
MAX_LINE_BYTES = 64 * 1024
MAX_TREE_FILES = 256
"""Files in a dataset folder (`save_to_disk` writes a handful per split)."""


class DataFileError(ValueError):
    """A job-supplied file that may not or cannot be read; the text quotes no content."""


@dataclass(frozen=True)
class DataFile:
    """A checked file: where it really is, which file that is, and its version (caches)."""

    path: Path
    device: int
    inode: int
    mtime_ns: int
    size: int


def data_dir() -> Path:
    return Path(os.environ.get(DATA_DIR_VAR) or ".")


def tenant_data_dir(tenant: str) -> Path:
    """The tenant's folder of the data directory: its jobs' files are found here only."""
    return data_dir() / tenant


def confine(folder: Path, path: str) -> DataFile:
    """The file `path` names inside `folder`, checked as the module says; else DataFileError."""
    return _checked_file(_resolve(folder, path), path)


@dataclass(frozen=True)
class DataTree:
    """A checked folder (a `save_to_disk` dataset): its regular files by their path in it."""

    files: tuple[tuple[str, DataFile], ...]


def confine_tree(folder: Path, path: str) -> DataTree:
    """The folder `path` names inside `folder` and every file under it, each checked as
    `confine` checks one: no link anywhere inside it (a dataset folder written by `datasets`
    has none), regular files only, at most `MAX_TREE_FILES` of them and `MAX_FILE_BYTES` in
    all; else DataFileError."""
    real = _resolve(folder, path)
    if not real.is_dir():
        raise DataFileError(f"{path!r}: not a folder")
    files: list[tuple[str, DataFile]] = []
    total = 0
    for where, folders, names in os.walk(real, followlinks=False):
        here = Path(where)
        for name in sorted([*folders, *names]):
            inside = (here / name).relative_to(real).as_posix()
            if (here / name).is_symlink():
                raise DataFileError(f"{path!r}: {inside!r} is a link (none allowed in a folder)")
        for name in sorted(names):
            inside = (here / name).relative_to(real).as_posix()
            file = _checked_file(here / name, f"{path}/{inside}")
            total += file.size
            files.append((inside, file))
            if len(files) > MAX_TREE_FILES:
                raise DataFileError(f"{path!r}: more than {MAX_TREE_FILES} files")
            if total > MAX_FILE_BYTES:
                raise DataFileError(
                    f"{path!r}: more than {MAX_FILE_BYTES} bytes; a data folder may have "
                    f"{MAX_FILE_BYTES} at most"
                )
    if not files:
        raise DataFileError(f"{path!r}: an empty folder")
    return DataTree(tuple(files))


def _resolve(folder: Path, path: str) -> Path:
    """What `path` names inside `folder`, links followed; else DataFileError."""
    relative = PurePosixPath(path)
    if not path or relative.is_absolute() or path.startswith("~"):
        raise DataFileError(f"{path!r}: must be a path relative to your data folder")
    if ".." in relative.parts:
        raise DataFileError(f"{path!r}: must not contain '..'")
    try:
        root = folder.resolve(strict=True)
    except OSError:
        raise DataFileError(f"{path!r}: no such file (you have no data folder)") from None
    try:
        real = (root / relative).resolve(strict=True)
    except (OSError, RuntimeError):  # missing, a dangling or looping link
        raise DataFileError(f"{path!r}: no such file in your data folder") from None
    if not real.is_relative_to(root):
        raise DataFileError(f"{path!r}: leads out of your data folder (a link)")
    return real


def _checked_file(real: Path, path: str) -> DataFile:
    try:
        info = real.lstat()
    except OSError as exc:
        raise DataFileError(f"{path!r}: cannot read: {exc.strerror}") from None
    if not stat.S_ISREG(info.st_mode):
        raise DataFileError(f"{path!r}: not a regular file")
    if info.st_size > MAX_FILE_BYTES:
        raise DataFileError(
            f"{path!r}: {info.st_size} bytes; a data file may have {MAX_FILE_BYTES} at most"
        )
    return DataFile(real, info.st_dev, info.st_ino, info.st_mtime_ns, info.st_size)


def read_bytes(file: DataFile, path: str) -> bytes:
    """The file's bytes, read through a descriptor that is checked to be the very file
    `confine` checked (whatever was swapped in on the way is refused) and no further than
    `MAX_FILE_BYTES`."""
    try:
        fd = os.open(file.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise DataFileError(f"{path!r}: cannot read: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if (info.st_dev, info.st_ino) != (file.device, file.inode):
            raise DataFileError(f"{path!r}: changed while it was being read")
        data = handle.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise DataFileError(f"{path!r}: grew past {MAX_FILE_BYTES} bytes while being read")
    return data


def read_lines(file: DataFile, path: str) -> list[str]:
    """The file's lines (`read_bytes`), each at most `MAX_LINE_BYTES`."""
    lines = read_bytes(file, path).split(b"\n")
    for number, line in enumerate(lines, start=1):
        if len(line) > MAX_LINE_BYTES:
            raise DataFileError(
                f"{path}:{number}: {len(line)} bytes; a line may have {MAX_LINE_BYTES} at most"
            )
    try:
        return [line.decode("utf-8") for line in lines]
    except UnicodeDecodeError:
        raise DataFileError(f"{path!r}: not UTF-8 text") from None
