"""A job's data as rows: a file or folder in its tenant's data folder (env_svc/datafiles.py),
in one of the formats people keep datasets in.

- `jsonl`: one JSON object per line, read here line by line (`read_lines`' caps);
- `parquet`, `arrow` (one file) and `disk` (a folder `Dataset.save_to_disk` or
  `DatasetDict.save_to_disk` wrote; `split` picks one of a `DatasetDict`'s): read by Hugging
  Face `datasets`, offline, in a child process (env_svc/taskdata/workers.py) capped at
  `LOAD_MEMORY_BYTES` and `LOAD_DEADLINE_S`: a columnar file decompresses to far more than
  its 64 MiB (a tenant's parquet file of one repeated string would fill env_svc's memory),
  and `datasets` opens files by name, so it is given a private copy of the bytes read through
  the checked descriptors, never the tenant's path.
`auto` tells the format by the suffix (`.parquet`, `.arrow`; any other is JSONL) or a folder.
Only the mapped columns are loaded. Rows are read once per version of the files (every job of
a dataset builds an environment; env_svc builds one per job).
"""

from __future__ import annotations

import functools
import os
import tempfile
from pathlib import Path, PurePosixPath
from typing import Any, Literal

import msgspec

from env_svc.datafiles import DataFile, DataTree, confine, confine_tree, read_bytes, read_lines
from env_svc.taskdata.columns import Columns, Row
from env_svc.taskdata.errors import DatasetError
from env_svc.taskdata.workers import Child, ChildFailedError, ChildTimeoutError

Format = Literal["auto", "jsonl", "parquet", "arrow", "disk"]
SUFFIXES: dict[str, Format] = {".jsonl": "jsonl", ".parquet": "parquet", ".arrow": "arrow"}
LOAD_MEMORY_BYTES = 2 << 30
"""The reading child's address space: `datasets` and pyarrow take ~0.6 GiB of it."""
LOAD_DEADLINE_S = 120.0
MAX_TABLE_BYTES = 256 << 20
"""The mapped columns of a split, as arrow holds them: what comes back to env_svc as rows."""
_json_object = msgspec.json.Decoder(dict[str, Any])


def read_rows(
    folder: Path, param: str, path: str, fmt: Format, split: str, columns: Columns
) -> tuple[Row, ...]:
    """The rows of what `param` names (`path`, inside `folder` only); a problem is a
    `DatasetError` of `param`."""
    try:
        kind = _format(folder, path, fmt)
        if split and kind != "disk":
            raise ValueError(f"{path!r}: a split is chosen only in a save_to_disk folder")
        if kind == "jsonl":
            return _jsonl_rows(confine(folder, path), path, columns)
        if kind == "disk":
            return _hf_rows(confine_tree(folder, path), path, kind, split, columns)
        return _hf_rows(confine(folder, path), path, kind, split, columns)
    except ValueError as exc:  # refused, unreadable, or a row that is not a task
        raise DatasetError(param, str(exc)) from None


def _format(folder: Path, path: str, fmt: Format) -> Format:
    """`fmt`, or for `auto`: `disk` for a folder, else by the suffix, JSONL by default."""
    if fmt != "auto":
        return fmt
    if (folder / path).is_dir():  # confine_tree then checks where it is
        return "disk"
    return SUFFIXES.get(PurePosixPath(path).suffix.lower(), "jsonl")


@functools.lru_cache(maxsize=8)
def _jsonl_rows(file: DataFile, path: str, columns: Columns) -> tuple[Row, ...]:
    """Rows named by their line in messages, as an editor shows the file."""
    rows: list[Row] = []
    for number, line in enumerate(read_lines(file, path), start=1):
        if not line.strip():
            continue
        try:
            rows.append(columns.row(_json_object.decode(line)))
        except msgspec.ValidationError:
            raise ValueError(f"{path}:{number}: not a JSON object") from None
        except msgspec.DecodeError as exc:
            raise ValueError(f"{path}:{number}: not JSON: {exc}") from None
        except ValueError as exc:
            raise ValueError(f"{path}:{number}: {exc}") from None
    if not rows:
        raise ValueError(f"{path}: no rows")
    return tuple(rows)


@functools.lru_cache(maxsize=8)
def _hf_rows(
    found: DataFile | DataTree, path: str, kind: Format, split: str, columns: Columns
) -> tuple[Row, ...]:
    files = found.files if isinstance(found, DataTree) else (("data", found),)
    contents = [(inside, read_bytes(file, f"{path}/{inside}")) for inside, file in files]
    try:
        records = _loader(LOAD_MEMORY_BYTES).call(
            _load,
            kind,
            contents,
            split,
            columns.required,
            columns.optional,
            MAX_TABLE_BYTES,
            deadline_s=LOAD_DEADLINE_S,
        )
    except ChildTimeoutError:
        raise ValueError(f"{path!r}: reading took more than {LOAD_DEADLINE_S:g} s") from None
    except ChildFailedError as exc:
        raise ValueError(f"{path!r}: not a readable {kind} dataset ({exc})") from None
    return columns.rows(records, path)


@functools.cache
def _loader(memory_bytes: int) -> Child:
    return Child("dataset-loader", memory_bytes)


def _load(
    kind: Format,
    contents: list[tuple[str, bytes]],
    split: str,
    required: tuple[str, ...],
    optional: tuple[str, ...],
    max_bytes: int,
) -> list[dict[str, Any]]:
    """In the child: the bytes written to a private folder, read by `datasets`, offline, and
    the named columns' records returned."""
    with tempfile.TemporaryDirectory(prefix="marlaas-dataset-") as private:
        root = Path(private) / "data"
        for inside, data in contents:
            target = root / inside if kind == "disk" else root
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        os.environ.update(
            HF_DATASETS_OFFLINE="1",
            HF_HUB_OFFLINE="1",
            HF_DATASETS_CACHE=str(Path(private) / "cache"),
            HF_HOME=str(Path(private) / "home"),
        )
        import datasets

        datasets.disable_progress_bars()
        datasets.logging.set_verbosity_error()
        if kind == "parquet":
            table = datasets.Dataset.from_parquet(
                str(root), cache_dir=str(Path(private) / "cache"), keep_in_memory=True
            )
        elif kind == "arrow":
            table = datasets.Dataset.from_file(str(root), in_memory=True)
        else:
            table = datasets.load_from_disk(str(root), keep_in_memory=True)
        if isinstance(table, datasets.DatasetDict):
            chosen = split or "train"
            if chosen not in table:
                raise ValueError(f"no split {chosen!r}; it has {', '.join(table)}")
            table = table[chosen]
        elif split:
            raise ValueError(f"split {split!r}: the folder holds one dataset, not splits")
        assert isinstance(table, datasets.Dataset)
        have = table.column_names
        if missing := [name for name in required if name not in have]:
            raise ValueError(f"no column {missing[0]!r}; it has {', '.join(have)}")
        table = table.select_columns([*required, *(name for name in optional if name in have)])
        if (size := table.data.nbytes) > max_bytes:
            raise ValueError(f"its columns hold {size} bytes; a dataset may have {max_bytes}")
        return list(table.to_list())
