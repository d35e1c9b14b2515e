"""What `perfscope dashboard` runs with `streamlit run`: the app (app.py) behind the access guard."""

from __future__ import annotations

from pathlib import Path

import streamlit as st
from starlette.middleware import Middleware

from perfscope.dashboard.guard import AccessGuard

app = st.App(str(Path(__file__).resolve().parent / "app.py"), middleware=[Middleware(AccessGuard)])
