"""Process groups stored once (issue 33, item 4): a comm row names its group by `group_id`, and the
group's members are a `process_groups` row written once per writer, not spelled out on every call.

Spelled out, a group of 262,144 data-parallel ranks is 1.7 MB of text on every comm row: 200 rows of
an imported op table took 1.8 GB in memory and 228 MB on disk, and `analyze` ran out of memory. The
store writer (`StoreWriter`) turns the members that its producers give (`comm.group_ranks`: the
recorder's, the importers') into ids as it writes: producers stay as they were, and stores written
before hold group_ranks on their rows, which readers take as the group's key and members
(`GROUP_KEY_SQL`, `group_members_sql`).
"""

from __future__ import annotations

import hashlib
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from .schema import TABLES

_COMM = TABLES["comm"].column_names
_RANK_AT = _COMM.index("rank")
_RANKS_AT = _COMM.index("group_ranks")
_ID_AT = _COMM.index("group_id")

#: a comm row's process group (alias c): its id, or its members in a store written before ids
GROUP_KEY_SQL = "coalesce(c.group_id, c.group_ranks)"


def group_id(members: str) -> str:
    """The id of the group whose members' global ranks are `members` ('0,2'): the same in every
    process, so the rows of several writers of one run name one group."""
    return "g" + hashlib.blake2b(members.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()


def group_members_sql(runs: str | None = None) -> str:
    """SQL of (run_id, grp, group_ranks): every process group of the runs (`runs`: a SQL expression
    of run ids, all runs when None) by the key GROUP_KEY_SQL gives its calls: the process_groups rows,
    and the groups of older rows, whose key is their members."""
    where = f" AND run_id IN {runs}" if runs else ""
    return f"""
        SELECT run_id, group_id AS grp, min(group_ranks) AS group_ranks FROM process_groups
        WHERE group_id IS NOT NULL AND group_ranks IS NOT NULL{where} GROUP BY run_id, group_id
        UNION
        SELECT DISTINCT run_id, group_ranks AS grp, group_ranks FROM comm
        WHERE group_id IS NULL AND group_ranks IS NOT NULL{where}
    """


#: comm with every call's group members in group_ranks, old rows and new alike: a user's query reads
#: `FROM (COMM_MEMBERS_SQL) comm` where it wants them (docs/schema.md)
COMM_MEMBERS_SQL = """SELECT c.* REPLACE (coalesce(c.group_ranks, g.group_ranks) AS group_ranks)
    FROM comm c LEFT JOIN (SELECT run_id, group_id, min(group_ranks) AS group_ranks FROM process_groups
                           GROUP BY run_id, group_id) g USING (run_id, group_id)"""


class GroupIds:
    """One writer's groups: the id of each member list it has seen, and the groups it has not yet
    written to process_groups."""

    def __init__(self) -> None:
        self._ids: dict[str, str] = {}

    def _id(self, members: str, rank: Any, new: list[Any]) -> str:
        gid = self._ids.get(members)
        if gid is None:
            gid = self._ids[members] = group_id(members)
            new += (rank, gid, members.count(",") + 1 if members else 0, members)
        return gid

    def take_members(self, data: list[Any] | pa.Table) -> tuple[list[Any] | pa.Table, list[Any]]:
        """Comm rows (flat, row after row, or an Arrow table of the schema) with each row's members
        replaced by its group's id, and the process_groups rows (flat) of the groups new here."""
        new: list[Any] = []
        if isinstance(data, pa.Table):
            members = data.column("group_ranks")
            if members.null_count == len(members):
                return data, new
            encoded = pc.dictionary_encode(members.combine_chunks())
            ranks = data.column("rank")
            ids = pa.array(
                [
                    self._id(m, ranks[pc.index(encoded.indices, k).as_py()].as_py(), new)
                    for k, m in enumerate(encoded.dictionary.to_pylist())
                ],
                pa.string(),
            )
            given = pc.take(ids, encoded.indices)
            ids_col = pc.coalesce(data.column("group_id").combine_chunks(), given)
            data = data.set_column(_ID_AT, "group_id", ids_col)
            data = data.set_column(_RANKS_AT, "group_ranks", pa.nulls(len(data), pa.string()))
            return data, new
        width = len(_COMM)
        members_col = data[_RANKS_AT::width]
        if not any(type(m) is str for m in members_col):
            return data, new
        ids_col, ranks = data[_ID_AT::width], data[_RANK_AT::width]
        data[_ID_AT::width] = [
            self._id(m, r, new) if type(m) is str else g
            for m, g, r in zip(members_col, ids_col, ranks, strict=True)
        ]
        # a value that is no text stays, for the write to refuse as it did
        data[_RANKS_AT::width] = [None if type(m) is str else m for m in members_col]
        return data, new
