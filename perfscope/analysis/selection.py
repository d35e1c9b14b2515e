"""What an analysis looks at: which runs (experiment, run ids, cluster, backend, source), warm-up."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

SOURCES = ("measured", "simulated")


def _tuple(values: str | Iterable[str] | None) -> tuple[str, ...]:
    if values is None:
        return ()
    if isinstance(values, str):
        return (values,)
    return tuple(values)


def sql_literal(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


@dataclass(frozen=True)
class Selection:
    """Which runs an analysis reads. Empty tuples mean "all"; filters combine with AND.

    `warmup_steps` overrides the steady-state rule (drop the first max(10, 5%) steps of a run);
    0 keeps every step. `targets` ((metric, value) pairs) are the user's time-to-metric targets.
    `steps` (first, last), both included, is the step window of the analyses that draw single steps.
    """

    experiments: tuple[str, ...] = ()
    run_ids: tuple[str, ...] = ()
    clusters: tuple[str, ...] = ()
    backends: tuple[str, ...] = ()
    source: str | None = None
    warmup_steps: int | None = None
    targets: tuple[tuple[str, float], ...] = ()
    steps: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        # Accept a single string or any iterable; store tuples so a Selection is hashable (a cache key).
        for name in ("experiments", "run_ids", "clusters", "backends"):
            object.__setattr__(self, name, _tuple(getattr(self, name)))
        if self.source is not None and self.source not in SOURCES:
            raise ValueError(f"source must be one of {SOURCES} or None, not {self.source!r}")
        if self.warmup_steps is not None and self.warmup_steps < 0:
            raise ValueError("warmup_steps must be >= 0")
        object.__setattr__(self, "targets", tuple((str(m), float(v)) for m, v in self.targets))
        if self.steps is not None:
            first, last = (int(v) for v in self.steps)
            if last < first:
                raise ValueError(f"steps {first}..{last}: the last step is before the first")
            object.__setattr__(self, "steps", (first, last))

    def runs_where(self, alias: str = "r") -> str:
        """A SQL condition over the `runs` view (aliased `alias`) that keeps the selected runs."""
        conds = ["true"]
        for column, values in (
            ("experiment", self.experiments),
            ("run_id", self.run_ids),
            ("cluster", self.clusters),
            ("backend", self.backends),
        ):
            if values:
                conds.append(f"{alias}.{column} IN ({', '.join(sql_literal(v) for v in values)})")
        if self.source is not None:
            conds.append(f"coalesce({alias}.source, 'measured') = {sql_literal(self.source)}")
        return " AND ".join(conds)

    def as_dict(self) -> dict[str, object]:
        return {
            "experiments": list(self.experiments),
            "run_ids": list(self.run_ids),
            "clusters": list(self.clusters),
            "backends": list(self.backends),
            "source": self.source,
            "warmup_steps": self.warmup_steps,
            "targets": {m: v for m, v in self.targets},
            "steps": list(self.steps) if self.steps is not None else None,
        }
