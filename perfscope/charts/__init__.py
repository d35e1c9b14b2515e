"""One chart builder per chart (Altair), shared by the dashboard and the report."""
