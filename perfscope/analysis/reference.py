"""Achieved allreduce bus bandwidth against the cluster's nccl-tests reference (`reference_bw`, written
by `perfscope import nccl-tests`), per NCCL run: what the network rule and the bus-bandwidth chart
compare."""

from __future__ import annotations

import itertools
import math
from typing import Any

import pyarrow as pa

from ..store.reader import Store
from .registry import analysis
from .selection import Selection
from .sync import sync_table

REFERENCE_SCHEMA = pa.schema(
    [
        ("group_id", pa.string()),
        ("run_id", pa.string()),
        ("source", pa.string()),
        ("cluster", pa.string()),
        ("backend", pa.string()),
        ("world_size", pa.int64()),
        ("message_bytes", pa.float64()),
        ("busbw_gb_per_s", pa.float64()),
        ("ref_busbw_gb_per_s", pa.float64()),
        ("delivered_share", pa.float64()),
        ("ref_ranks", pa.int64()),
        ("ref_nodes", pa.int64()),
        ("ref_bytes_min", pa.int64()),
        ("ref_bytes_max", pa.int64()),
        ("ref_file", pa.string()),
    ]
)


def busbw_at(points: list[tuple[int, float]], nbytes: float) -> float:
    """Reference busbw at a message size: linear in log2(size) between the measured sizes, the end
    values beyond them (nccl-tests sweeps sizes by powers of two)."""
    pts = sorted(points)
    if nbytes <= pts[0][0]:
        return pts[0][1]
    if nbytes >= pts[-1][0]:
        return pts[-1][1]
    for (b0, v0), (b1, v1) in itertools.pairwise(pts):
        if b0 <= nbytes <= b1:
            f = (math.log2(nbytes) - math.log2(b0)) / (math.log2(b1) - math.log2(b0)) if b1 > b0 else 0.0
            return v0 + f * (v1 - v0)
    return pts[-1][1]  # unreachable: the sizes bracket nbytes


def _pick(refs: list[dict[str, Any]], cluster: str, world_size: int, nodes: int) -> list[dict[str, Any]]:
    """The reference rows for a run: its cluster's (or a reference for every cluster), the benchmark
    with the rank count nearest the run's (busbw is meant to be comparable across rank counts), the
    same node count first."""
    own = [r for r in refs if r["cluster"] == cluster] or [r for r in refs if not r["cluster"]]
    if not own:
        return []
    key = min(
        {(r["ranks"], r["nodes"]) for r in own},
        key=lambda rn: (abs(math.log2(rn[0] / world_size)), (rn[1] or 1) != nodes, -rn[0]),
    )
    return [r for r in own if (r["ranks"], r["nodes"]) == key]


@analysis("reference_busbw", "Allreduce bus bandwidth against the nccl-tests reference", "busbw")
def reference_busbw(store: Store, sel: Selection) -> pa.Table:
    """Per NCCL run with collectives: its median busbw, and the nccl-tests busbw of its cluster at
    the run's mean message size and nearest rank count (in-place results, else out-of-place)."""
    refs = store.query(
        """
        SELECT cluster, ranks, nodes, bytes,
               coalesce(ip_busbw_gb_per_s, oop_busbw_gb_per_s) AS busbw, source_file
        FROM reference_bw
        WHERE op = 'allreduce' AND bytes > 0 AND coalesce(ip_busbw_gb_per_s, oop_busbw_gb_per_s) IS NOT NULL
        """
    ).to_pylist()
    rows = []
    if refs:
        runs = store.query(
            f"""
            SELECT group_id, run_id, source, cluster, backend, world_size, nodes, busbw_gb_per_s,
                   bytes_per_step / nullif(comm_count, 0) AS message_bytes
            FROM {sync_table(store, sel)}
            WHERE world_size > 1 AND busbw_gb_per_s IS NOT NULL AND lower(backend) LIKE '%nccl%'
            ORDER BY group_id, world_size, run_id
            """
        ).to_pylist()
        for r in runs:
            picked = _pick(refs, str(r["cluster"] or ""), int(r["world_size"]), int(r["nodes"] or 1))
            if not picked or not r["message_bytes"]:
                continue
            ref = busbw_at([(int(p["bytes"]), float(p["busbw"])) for p in picked], float(r["message_bytes"]))
            rows.append(
                {
                    **{k: r[k] for k in ("group_id", "run_id", "source", "cluster", "backend", "world_size")},
                    "message_bytes": float(r["message_bytes"]),
                    "busbw_gb_per_s": r["busbw_gb_per_s"],
                    "ref_busbw_gb_per_s": ref,
                    "delivered_share": r["busbw_gb_per_s"] / ref if ref > 0 else None,
                    "ref_ranks": picked[0]["ranks"],
                    "ref_nodes": picked[0]["nodes"],
                    "ref_bytes_min": min(int(p["bytes"]) for p in picked),
                    "ref_bytes_max": max(int(p["bytes"]) for p in picked),
                    "ref_file": ",".join(sorted({str(p["source_file"]) for p in picked})),
                }
            )
    return pa.Table.from_pylist(rows, schema=REFERENCE_SCHEMA)
