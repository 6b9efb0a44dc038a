"""Tables as a user keeps them (CSV / TSV, JSON records): a header row (or none), number columns, a column
of class names or numbers as the target, and at most one column of free text.

A table is read whole (it is for data sets that fit on the device) and checked before anything trains:
a missing or non-finite number, a column of words where numbers are needed, or a target that does not fit
the task is a :class:`~edgetrain.errors.ConfigError` naming the column and the line, never a NaN loss or a
traceback. Class names in the target column become class indices in sorted order (as an image folder's
subfolders do); the names are kept so predictions can be read back.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from ..errors import ConfigError

__all__ = ["Cells", "Table", "read_cells", "read_table", "input_columns", "split_columns", "MISSING"]

#: Cells read as "no value" (compared lower-cased, stripped).
MISSING = frozenset({"", "na", "n/a", "nan", "null", "none", "?", "-"})


@dataclass(frozen=True)
class Table:
    """A CSV file's columns, split into features and the target.

    Attributes:
        features: float32 ``[rows, feature columns]`` (zero columns when the table has only text).
        feature_names: the feature columns' names (the header's, else ``column 1``, ``column 2``, ...).
        text: the text column's cells, or None when there is none.
        text_name: the text column's name.
        target: the target column as float64 numbers, or as strings where it holds names.
        target_name: the target column's name.
    """

    features: np.ndarray
    feature_names: tuple[str, ...]
    text: list[str] | None
    text_name: str | None
    target: np.ndarray
    target_name: str


def _is_number(cell: str) -> bool:
    try:
        float(cell)
    except ValueError:
        return False
    return True


def _dialect(path: Path, sample: str) -> type[csv.Dialect] | csv.Dialect:
    try:
        return csv.Sniffer().sniff(sample, delimiters=",;\t|")
    except csv.Error:
        return csv.excel  # one column, or nothing the sniffer can tell: commas


def _rows(path: Path) -> tuple[list[list[str]], list[int]]:
    """The non-blank rows of a CSV file, and the file line each ends on."""
    rows, lines = [], []
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            sample = f.read(64 * 1024)
            f.seek(0)
            reader = csv.reader(f, _dialect(path, sample))
            for row in reader:
                if any(c.strip() for c in row):  # blank lines (and a trailing one) are not rows
                    rows.append([c.strip() for c in row])
                    lines.append(reader.line_num)
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); save the table as UTF-8 "
                          "CSV") from None
    return rows, lines


def _has_header(rows: list[list[str]]) -> bool:
    first, rest = rows[0], rows[1:]
    if any(_is_number(c) for c in first):
        return False
    if not rest:
        return True  # one row of words names columns; there is no data under them
    # a column of numbers under a word: the word names it
    for j, name in enumerate(first):
        cells = [r[j] for r in rest[:200] if j < len(r) and r[j].lower() not in MISSING]
        if name and cells and all(_is_number(c) for c in cells):
            return True
    return csv.Sniffer().has_header("\n".join(",".join(r) for r in rows[:50]))


def _column_index(target: int | str, names: Sequence[str], path: Path) -> int:
    if isinstance(target, str) and not target.lstrip("-").isdigit():
        if target not in names:
            raise ConfigError(f"{path}: no column named {target!r}; the columns are {', '.join(names)}")
        return list(names).index(target)
    j = int(target)
    if not -len(names) <= j < len(names):
        raise ConfigError(f"{path}: target_column {j} is out of range for {len(names)} columns")
    return j % len(names)


def _examples(cells: Sequence[str]) -> str:
    seen: list[str] = []
    for c in cells:
        if c not in seen:
            seen.append(c)
        if len(seen) == 3:
            break
    return ", ".join(repr(c if len(c) <= 30 else c[:27] + "...") for c in seen)


@dataclass(frozen=True)
class Cells:
    """A table file's cells before any column is given a role.

    Attributes:
        names: the column names (a header's, a JSON record's keys, else ``column 1``, ...).
        body: the rows, each a list of stripped cell strings (a missing value is ``""``).
        lines: the file line of each row (for messages).
        header: whether the names came from the file (a header row or JSON keys).
        records: whether the file holds JSON records (whose target defaults to ``label``).
    """

    names: tuple[str, ...]
    body: list[list[str]]
    lines: list[int]
    header: bool
    records: bool = False


def read_cells(path: Path) -> Cells:
    """The cells of a CSV / TSV file (UTF-8; commas, semicolons, tabs or bars; a header row detected) or of
    JSON records (one object per line, or an array of objects: the keys are the columns, ``null`` missing).

    Raises:
        ConfigError: an empty table, rows of different lengths, JSON that is not records, a value that is a
            list or an object.
    """
    if path.suffix.lower() in (".jsonl", ".json"):
        return _json_cells(path)
    rows, lines = _rows(path)
    if not rows:
        raise ConfigError(f"{path}: the table is empty")
    header = _has_header(rows)
    width = len(rows[0])
    names = tuple(c or f"column {j + 1}" for j, c in enumerate(rows[0])) if header else \
        tuple(f"column {j + 1}" for j in range(width))
    body, lines = (rows[1:], lines[1:]) if header else (rows, lines)
    if not body:
        raise ConfigError(f"{path}: the table has a header but no rows")
    for r, line in zip(body, lines):
        if len(r) != width:
            raise ConfigError(f"{path}: line {line} has {len(r)} cells, the first has {width}; quote cells that "
                              "contain the delimiter")
    return Cells(names, body, lines, header)


def _cell(v: object) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return str(int(v))
    if isinstance(v, (int, float, str)):
        return str(v).strip()
    raise TypeError(type(v).__name__)


def _json_cells(path: Path) -> Cells:
    import json

    text = path.read_text(encoding="utf-8-sig")
    try:
        if text.lstrip().startswith("["):  # an array: a record's "line" is its place in it
            records = json.loads(text)
            lines = list(range(1, len(records) + 1)) if isinstance(records, list) else []
        else:
            numbered = [(i + 1, ln) for i, ln in enumerate(text.splitlines()) if ln.strip()]
            records, lines = [json.loads(ln) for _, ln in numbered], [i for i, _ in numbered]
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not JSON Lines nor a JSON array ({e})") from None
    if not records or not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise ConfigError(f"{path}: expected one JSON object per line (or an array of objects), each a row")
    names = tuple(records[0])
    body = []
    for r, line in zip(records, lines):
        if tuple(r) != names and set(r) != set(names):
            raise ConfigError(f"{path}: line {line} has the keys {', '.join(r)}; the first has {', '.join(names)}")
        try:
            body.append([_cell(r[k]) for k in names])
        except TypeError as e:
            raise ConfigError(f"{path}: line {line} holds a {e} where a number or a text is expected") from None
    return Cells(names, body, lines, True, records=True)


def read_table(path: Path, target_column: int | str = -1, *, allow_text: bool = False) -> Table:
    """Read a table file (see :func:`read_cells`) and split it into features, an optional text column and the
    target.

    Args:
        path: the file.
        target_column: the target's column, by index (negative from the end) or by name; -1 in JSON records
            means ``label`` where there is one, else the last key.
        allow_text: a column of free text is allowed (the model reads text); otherwise a column of words is
            an error that says how to encode it.

    Raises:
        ConfigError: what :func:`read_cells` refuses, a missing or non-finite number, a column of words where
            numbers are needed (or more than one text column), an unknown target column.
    """
    cells = read_cells(path)
    if cells.records and target_column == -1 and "label" in cells.names:
        target_column = "label"
    return split_columns(path, cells, target_column, allow_text)


def input_columns(path: Path, wanted: Sequence[str], *, text: bool = False) -> Table:
    """The columns ``wanted`` of a table file, by name, as a model's inputs (no target; other columns, such
    as a target the file still has, are left out); checked as :func:`read_table` checks features.

    Raises:
        ConfigError: a wanted column is missing (or the file has no header to name them), and what
            :func:`read_table` refuses of those columns.
    """
    c = read_cells(path)
    missing = [w for w in wanted if w not in c.names]
    if missing:
        raise ConfigError(f"{path} lacks the column(s) the model was trained on: {', '.join(missing)} (its columns "
                          f"are {', '.join(c.names)}{'' if c.header else '; give it a header row'})")
    idx = [c.names.index(w) for w in wanted]
    body = [[r[j] for j in idx] + ["0"] for r in c.body]  # a placeholder target: split_columns wants one
    table = split_columns(path, Cells((*wanted, "(no target)"), body, c.lines, c.header), -1, text)
    if text and table.text is None:  # a text column that happens to hold numbers is still text
        return Table(table.features[:, :0], (), [r[0] for r in body], wanted[0], table.target, table.target_name)
    return table


def _floats(path: Path, name: str, cells: Sequence[str], lines: Sequence[int]) -> list[float]:
    """A column of numbers, refused (naming the first bad line) where one is missing or not finite."""
    values = [float(c) if c.lower() not in MISSING else math.nan for c in cells]
    bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
    if bad:
        raise ConfigError(f"{path}: column {name!r} has {len(bad)} missing or non-finite value(s) (the first, "
                          f"{cells[bad[0]]!r}, on line {lines[bad[0]]}): fill them in or drop those rows")
    return values


def split_columns(path: Path, cells: Cells, target_column: int | str, allow_text: bool) -> Table:
    """Split a table's cells into features, an optional text column and the target (see :func:`read_table`)."""
    names, lines = cells.names, cells.lines
    width = len(names)
    if width < 2:
        raise ConfigError(f"{path}: a table needs feature columns and a target column; this one has {width}")
    tcol = _column_index(target_column, names, path)
    columns = list(zip(*cells.body))
    numeric = [all(_is_number(c) or c.lower() in MISSING for c in col) and
               any(c.lower() not in MISSING for c in col) for col in columns]
    words = [j for j in range(width) if j != tcol and not numeric[j]]
    text_col = None
    if words:
        if not allow_text or len(words) > 1 or any(numeric[j] for j in range(width) if j != tcol):
            desc = "; ".join(f"column {names[j]!r} holds words ({_examples(columns[j])})" for j in words)
            hint = ("a model reads one text column alone: drop the other feature columns" if allow_text else
                    "encode it as numbers (one 0/1 column per category) or drop it; a column of free text trains "
                    "with a Hugging Face text model (model: hf:NAME)")
            raise ConfigError(f"{path}: {desc}: {hint}")
        text_col = words[0]
    feats = [j for j in range(width) if j not in (tcol, text_col)]
    values = {j: _floats(path, names[j], columns[j], lines) for j in feats}
    if numeric[tcol]:
        target = np.asarray(_floats(path, names[tcol], columns[tcol], lines), dtype=np.float64)
    else:
        missing = [i for i, c in enumerate(columns[tcol]) if c.lower() in MISSING]
        if missing:
            raise ConfigError(f"{path}: the target column {names[tcol]!r} is missing on {len(missing)} line(s) "
                              f"(the first on line {lines[missing[0]]}): drop those rows")
        target = np.asarray(columns[tcol], dtype=object).astype(str)
    if text_col is not None:
        empty = [i for i, c in enumerate(columns[text_col]) if not c]
        if empty:
            raise ConfigError(f"{path}: column {names[text_col]!r} is empty on {len(empty)} line(s) (the first "
                              f"on line {lines[empty[0]]}): drop those rows")
    x = np.asarray([values[j] for j in feats], dtype=np.float32).reshape(len(feats), len(cells.body)).T
    return Table(np.ascontiguousarray(x), tuple(names[j] for j in feats),
                 list(columns[text_col]) if text_col is not None else None,
                 names[text_col] if text_col is not None else None, target, names[tcol])
