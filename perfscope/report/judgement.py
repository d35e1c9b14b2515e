"""What the report concludes and how sure it is: the findings and recommendations, and the data
quality and confounds."""

from __future__ import annotations

from .context import Context
from .model import FindingsBlock, Section, table_block, table_columns


def findings(ctx: Context) -> Section:
    s = Section("findings", "Findings and recommendations")
    if ctx.findings:
        s.blocks.append(
            [
                "Ranked by the share of the lost efficiency each explains, then by severity and "
                "confidence. Each names its evidence: the runs and the analyses behind its numbers."
            ]
        )
        s.blocks.append(FindingsBlock(ctx.findings))
    else:
        s.blocks.append(["No rule fired: nothing in this selection needs explaining."])
    return s


def quality(ctx: Context) -> Section | None:
    values = ctx.rows("quality")
    if not values:
        return None
    s = Section("quality", "Data quality", definitions=("data-quality",))
    s.blocks.append(["What may make the numbers above less certain:"])
    s.blocks.append(
        table_block(
            "quality",
            "Data quality and confounds",
            table_columns(
                ("severity", "severity"),
                ("kind", "kind"),
                ("run_id", "run"),
                ("message", "what"),
            ),
            values,
        )
    )
    return s
