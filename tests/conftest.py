"""Shared pytest fixtures."""

from __future__ import annotations

import os

# Never let a test talk to the outside world by accident, and keep BLAS single-threaded:
# this suite runs multi-process jobs on 2 cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("STREAMLIT_BROWSER_GATHER_USAGE_STATS", "false")
