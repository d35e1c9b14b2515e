"""The Streamlit dashboard (installed as perfscope.dashboard); `perfscope dashboard STORE` starts it."""

#: `perfscope dashboard STORE` hands the store to the app in this variable (script arguments would
#: collide with pytest's when the app runs inside AppTest).
ENV_STORE = "PERFSCOPE_DASHBOARD_STORE"
