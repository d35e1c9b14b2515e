"""The Streamlit dashboard (installed as perfscope.dashboard); `perfscope dashboard STORE` starts it."""

#: `perfscope dashboard STORE` hands the store to the app in this variable (script arguments would
#: collide with pytest's when the app runs inside AppTest).
ENV_STORE = "PERFSCOPE_DASHBOARD_STORE"
#: the access token a browser must bring, as the first segment of every path (guard.py); unset: no
#: token (--no-token)
ENV_TOKEN = "PERFSCOPE_DASHBOARD_TOKEN"
#: the Host header values the server answers, comma-separated; unset or "*": any (a wildcard bind)
ENV_HOSTS = "PERFSCOPE_DASHBOARD_HOSTS"
#: the folder (or s3:// prefix) under which the sidebar may open another store
ENV_ROOT = "PERFSCOPE_DASHBOARD_ROOT"
