"""Arrow tables compared across machines: exact except floats, which match within a relative tolerance.

A store generated on another CPU, or with another numpy, can differ in the last bit of a float
(0.5050323677714642 against ...643); that is the same data, and a test must say so.
"""

from __future__ import annotations

import math

import pyarrow as pa


def assert_tables_close(
    got: pa.Table, want: pa.Table, *, rel: float = 1e-9, what: str = "table", abs_tol: float = 0.0
) -> None:
    """Same schema, same rows; float columns equal within `rel` (or `abs_tol`, for values that are
    zero up to rounding); NULL and NaN must match exactly."""
    assert got.schema.remove_metadata() == want.schema.remove_metadata(), f"{what}: schemas differ"
    assert got.num_rows == want.num_rows, f"{what}: {got.num_rows} rows, expected {want.num_rows}"
    for name in want.column_names:
        typ = want.schema.field(name).type
        a, b = got.column(name).to_pylist(), want.column(name).to_pylist()
        if not pa.types.is_floating(typ):
            assert a == b, f"{what}.{name} differs"
            continue
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            if x is None or y is None or math.isnan(x) or math.isnan(y):
                assert (x is None) == (y is None) and (x is None or math.isnan(x) == math.isnan(y)), (
                    f"{what}.{name}[{i}]: {x} != {y}"
                )
                continue
            assert math.isclose(x, y, rel_tol=rel, abs_tol=abs_tol) or x == y, (
                f"{what}.{name}[{i}]: {x} != {y}"
            )
