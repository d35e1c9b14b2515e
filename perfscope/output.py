"""Writing what a user names: report and table files, query results, the folder a store is written into.

Only regular files are written, always whole (a temporary file in the same folder, then a rename), and
never through a device, FIFO, socket, folder or symbolic link; a missing parent folder is refused, not
created. Every refusal and every OS error is one PerfscopeError line that names the flag to change.
Query results are made printable here too (`printable_columns`): CSV, JSON and a terminal table only
take plain values, so anything else is turned into DuckDB's own text for it.
"""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

import pyarrow as pa

from .errors import PerfscopeError
from .store.schema import TABLES

#: the longest file name most file systems take, in bytes, when the system does not say
_NAME_MAX_BYTES = 255
#: a temporary file is named after its target, cut to this many characters so the name stays legal
_TEMP_STEM_CHARS = 64

_KINDS = {
    stat.S_IFREG: "a file",
    stat.S_IFDIR: "a folder",
    stat.S_IFLNK: "a symbolic link",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFSOCK: "a socket",
}


def _kind(mode: int) -> str:
    return _KINDS.get(stat.S_IFMT(mode), "not a file")


def _refuse(what: str, path: object, reason: str, flag: str) -> PerfscopeError:
    return PerfscopeError(f"cannot write {what} {path}: {reason}; choose another {flag}")


def _name_max_bytes(folder: Path) -> int:
    try:
        return int(os.pathconf(folder if folder.is_dir() else ".", "PC_NAME_MAX"))
    except (OSError, ValueError):
        return _NAME_MAX_BYTES


def _as_path(path: str | os.PathLike[str], what: str, flag: str) -> Path:
    """The path, with the mistakes no system call reports cleanly refused: NUL bytes, over-long names."""
    text = os.fspath(path)
    if "\x00" in text:
        raise PerfscopeError(f"cannot write {what}: the name given to {flag} contains a NUL byte")
    if not text:
        raise PerfscopeError(f"cannot write {what}: {flag} is empty; give a file name")
    p = Path(text)
    limit = _name_max_bytes(p.parent)
    for part in p.parts:
        size = len(os.fsencode(part))
        if size > limit:
            raise PerfscopeError(
                f"cannot write {what}: the name {part[:40]}... is {size} bytes long, longer than the "
                f"{limit} bytes a file name may have; choose another {flag}"
            )
    return p


def _lstat(p: Path, what: str, flag: str) -> os.stat_result | None:
    """The target's own status (a link is not followed), or None when there is nothing there yet."""
    try:
        return os.lstat(p)
    except (FileNotFoundError, NotADirectoryError):
        return None  # the parent check says what is wrong with the folder
    except OSError as exc:
        raise _refuse(what, p, exc.strerror or str(exc), flag) from None


def _check_parent(p: Path, what: str, flag: str) -> Path:
    parent = p.parent
    try:
        st = os.stat(parent)  # a parent reached through a link (/tmp -> /private/tmp) is fine
    except FileNotFoundError:
        raise _refuse(
            what, p, f"the folder {parent} does not exist (perfscope creates no folders for {flag})", flag
        ) from None
    except NotADirectoryError:
        raise _refuse(what, p, f"{parent} is not a folder", flag) from None
    except OSError as exc:
        raise _refuse(what, p, f"cannot reach the folder {parent} ({exc.strerror or exc})", flag) from None
    if not stat.S_ISDIR(st.st_mode):
        raise _refuse(what, p, f"{parent} is {_kind(st.st_mode)}, not a folder", flag)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise _refuse(what, p, f"the folder {parent} is not writable", flag)
    return parent


def check_output_file(path: str | os.PathLike[str], *, what: str = "output", flag: str = "-o") -> Path:
    """Refuse, before any slow work, a file target that cannot or must not be written: one that exists
    and is not a regular file (folder, device, FIFO, socket, symbolic link), or whose folder is missing,
    not a folder or not writable, or whose name is too long."""
    p = _as_path(path, what, flag)
    st = _lstat(p, what, flag)
    if p.name in ("", ".", "..") or (st is not None and stat.S_ISDIR(st.st_mode)):
        raise PerfscopeError(f"{what} {p} is a folder; give a file name such as {p / 'report.html'}")
    if st is not None and not stat.S_ISREG(st.st_mode):
        reason = f"it is {_kind(st.st_mode)}, and perfscope writes only regular files"
        raise _refuse(what, p, reason, flag)
    _check_parent(p, what, flag)
    return p


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextmanager
def open_output(
    path: str | os.PathLike[str], *, what: str = "output", flag: str = "-o"
) -> Iterator[BinaryIO]:
    """A binary file to write `path` through: a temporary file beside it, renamed over `path` when the
    block ends without an error (a reader never sees half a file) and removed when it fails. The target
    is checked again just before the rename, so a device or link put there meanwhile is not replaced."""
    p = check_output_file(path, what=what, flag=flag)
    tmp: str | None = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name[:_TEMP_STEM_CHARS]}.", suffix=".tmp", dir=p.parent)
        with os.fdopen(fd, "wb") as f:
            yield f
            os.fchmod(f.fileno(), 0o666 & ~_umask())  # mkstemp makes 0600; outputs are meant to be shared
        check_output_file(p, what=what, flag=flag)
        os.replace(tmp, p)
        tmp = None
    except OSError as exc:
        raise _refuse(what, p, exc.strerror or str(exc), flag) from None
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def write_output(
    path: str | os.PathLike[str], payload: bytes, *, what: str = "output", flag: str = "-o"
) -> Path:
    """Write `payload` to `path` whole and safely (see `open_output`)."""
    with open_output(path, what=what, flag=flag) as f:
        f.write(payload)
    return Path(path)


def output_folder(
    path: str | os.PathLike[str], *, what: str = "folder", flag: str = "-o", create: bool = True
) -> Path:
    """A folder to write several files into: an existing folder, or a new one made in an existing
    folder (never its parents); `create=False` only checks that it could be made."""
    p = _as_path(path, what, flag)
    try:
        if p.is_dir():
            return p
    except OSError as exc:
        raise _refuse(what, p, exc.strerror or str(exc), flag) from None
    st = _lstat(p, what, flag)
    if st is not None:
        raise _refuse(what, p, f"it is {_kind(st.st_mode)}, not a folder", flag)
    _check_parent(p, what, flag)
    if not create:
        return p
    try:
        p.mkdir()
    except FileExistsError:
        if not p.is_dir():
            raise _refuse(what, p, "something that is not a folder appeared there", flag) from None
    except OSError as exc:
        raise _refuse(what, p, f"cannot create it ({exc.strerror or exc})", flag) from None
    return p


def is_store_folder(path: Path) -> bool:
    """Whether `path` holds at least one of the store's table folders."""
    return any((path / name).is_dir() for name in TABLES)


def store_target(path: str | os.PathLike[str], *, what: str = "store", create: bool = False) -> Path:
    """A folder to record runs into: an existing store, an empty folder, or a new folder in an existing
    one; anything else (a file, a device, a folder of other things, a missing parent) is refused. With
    `create`, a new folder is made."""
    from .store.objectstore import refuse_s3

    refuse_s3(path, f"writing a {what} (simulate, demo, import)")
    flag = "STORE"
    p = _as_path(path, what, flag)
    st = _lstat(p, what, flag)
    if st is None:
        return output_folder(p, what=what, flag=flag, create=create)
    if stat.S_ISLNK(st.st_mode):
        try:
            st = os.stat(p)
        except OSError as exc:
            raise _refuse(
                what, p, f"it is a symbolic link that leads nowhere ({exc.strerror})", flag
            ) from None
    if not stat.S_ISDIR(st.st_mode):
        raise PerfscopeError(
            f"{p} is {_kind(st.st_mode)}, not a store; give a new or empty folder, or an existing store"
        )
    try:
        if is_store_folder(p) or not any(p.iterdir()):
            if not os.access(p, os.W_OK | os.X_OK):
                raise _refuse(what, p, "the folder is not writable", flag)
            return p
    except OSError as exc:
        raise _refuse(what, p, exc.strerror or str(exc), flag) from None
    raise PerfscopeError(
        f"{p} is not empty and not a perfscope store; give a new or empty folder, "
        "or an existing store to add the runs to"
    )


# ---- query results as text ---------------------------------------------------------------------


def _plain(t: pa.DataType, *, nested: bool) -> bool:
    """Whether every output format takes values of this type as they are."""
    if pa.types.is_boolean(t) or pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_null(t):
        return True
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_decimal(t):
        return True
    if nested and (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)):
        return _plain(t.value_type, nested=True)
    if nested and pa.types.is_struct(t):
        return all(_plain(t.field(i).type, nested=True) for i in range(t.num_fields))
    return False


def printable_columns(table: pa.Table, *, nested: bool = False) -> pa.Table:
    """`table` with every column CSV, a terminal table or JSON cannot take as it is (timestamps out of
    Python's range, intervals, blobs, maps, enums; lists and structs unless `nested`) turned into the
    text DuckDB writes for it ('infinity', '3 days', '[1, 2]', "{'a': 1}")."""
    import duckdb

    con: duckdb.DuckDBPyConnection | None = None
    try:
        for i, field in enumerate(table.schema):
            if _plain(field.type, nested=nested):
                continue
            con = con or duckdb.connect()
            column = pa.table({"v": table.column(i)})  # one column: any name, duplicates included
            try:
                con.register("perfscope_column", column)
                text = con.sql("SELECT CAST(v AS VARCHAR) AS v FROM perfscope_column").to_arrow_table()
            except duckdb.Error as exc:
                raise PerfscopeError(
                    f"column {field.name!r} of type {field.type} cannot be written as text ({exc}); "
                    "CAST it to VARCHAR in the query"
                ) from None
            table = table.set_column(i, pa.field(field.name, pa.string()), text.column(0))
    finally:
        if con is not None:
            con.close()
    return table


#: what makes a CSV field need quotes (csv.QUOTE_MINIMAL, as DuckDB and psql write CSV)
_CSV_SPECIAL = (",", '"', "\n", "\r")
#: what a spreadsheet reads as the start of a formula (OWASP's CSV injection list)
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def spreadsheet_safe(text: str) -> str:
    """A text cell no spreadsheet evaluates: one starting with a formula character (an op named
    `=HYPERLINK(...)` or `=cmd|' /C calc'!A0`) gets a leading `'`, which Excel, LibreOffice and
    Google Sheets read as "this is text" (OWASP's rule). Numbers are never passed here: -3 stays -3."""
    return "'" + text if text.startswith(FORMULA_STARTS) else text


def _csv_field(value: str | None, *, text: bool = True) -> str:
    """One field: NULL empty, an empty string "" (so the two stay apart), quotes only where needed;
    a `text` field (not a number) made spreadsheet-safe first."""
    if value is None:
        return ""
    if text:
        value = spreadsheet_safe(value)
    if value == "" or any(c in value for c in _CSV_SPECIAL):
        return '"' + value.replace('"', '""') + '"'
    return value


def _is_number(t: pa.DataType) -> bool:
    types = pa.types
    return types.is_integer(t) or types.is_floating(t) or types.is_decimal(t) or types.is_boolean(t)


def csv_text(table: pa.Table, *, header: bool = True) -> str:
    """`table` as CSV the way DuckDB's COPY, psql and Python's csv module write it: a field is quoted
    only when it holds a comma, a quote or a line break (quotes doubled); a value reads as Arrow's CSV
    writer writes it (pyarrow's writer quotes every string, which shell pipelines do not expect).
    Every CSV perfscope writes is made here (report --tables, sql --format csv, the dashboard's
    download), so every text cell and column name is spreadsheet-safe (spreadsheet_safe); numbers
    are written as they are."""
    import pyarrow.compute as pc

    text = [not _is_number(f.type) for f in table.schema]
    table = printable_columns(table)
    columns = [pc.cast(c, pa.string()).to_pylist() for c in table.columns]
    lines = [",".join(_csv_field(n) for n in table.column_names)] if header else []
    lines += [
        ",".join(_csv_field(v, text=t) for v, t in zip(row, text, strict=True))
        for row in zip(*columns, strict=True)
    ]
    return "".join(line + "\n" for line in lines)


#: `csv_pieces` turns at most this many cells, and this many bytes of Arrow, into Python text at a time:
#: a Python string per value is ~50 bytes however small the value (1 M rows of 40 booleans, 4 MB of
#: Arrow, were 3.7 GB as one text)
CSV_PIECE_CELLS = 65_536
CSV_PIECE_BYTES = 2**20


def csv_pieces(data: pa.Table | pa.RecordBatch, *, header: bool = True) -> Iterator[tuple[int, str]]:
    """`data` as the text `csv_text` writes, in pieces of a few rows each: (rows, text) pairs, the
    header alone first when asked for. Each piece's fields are made by Arrow's kernels, as one string
    per line, so no more than a piece is held as text and no Python object is made per value."""
    table = printable_columns(data if isinstance(data, pa.Table) else pa.Table.from_batches([data]))
    if header:
        yield 0, csv_text(table.schema.empty_table())
    n = table.num_rows
    if n == 0:
        return
    by_cells = CSV_PIECE_CELLS // max(table.num_columns, 1)
    by_bytes = CSV_PIECE_BYTES * n // max(table.nbytes, 1)
    step = max(1, min(by_cells, by_bytes, n))
    for start in range(0, n, step):
        piece = table.slice(start, step)
        yield piece.num_rows, _csv_lines(piece)


def _csv_lines(table: pa.Table) -> str:
    """csv_text(table, header=False), field by field in Arrow: `_csv_field`'s rule on whole columns."""
    import pyarrow.compute as pc

    if table.num_columns == 0:
        return "\n" * table.num_rows
    fields = []
    for column in table.columns:
        text = pc.cast(column.combine_chunks(), pa.string())
        if not _is_number(column.type):  # spreadsheet_safe, on the whole column
            formula = pc.match_substring_regex(text, "^[=+\\-@\t\r]")
            text = pc.if_else(formula, pc.binary_join_element_wise("'", text, ""), text)
        special = pc.or_(pc.match_substring_regex(text, '[,"\r\n]'), pc.equal(pc.utf8_length(text), 0))
        quoted = pc.binary_join_element_wise('"', pc.replace_substring(text, '"', '""'), '"', "")
        fields.append(pc.fill_null(pc.if_else(special, quoted, text), ""))
    lines = pc.binary_join_element_wise(*fields, ",")
    return "".join(s + "\n" for s in lines.to_pylist())


__all__ = [
    "check_output_file",
    "csv_pieces",
    "csv_text",
    "is_store_folder",
    "open_output",
    "output_folder",
    "printable_columns",
    "spreadsheet_safe",
    "store_target",
    "write_output",
]
