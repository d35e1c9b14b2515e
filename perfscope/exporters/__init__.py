"""Exporters: what perfscope measured, written for other tools (trace viewers, experiment trackers)."""
