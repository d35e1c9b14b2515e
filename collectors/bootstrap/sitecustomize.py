"""The interpreter start-up hook of `perfscope run` (its folder is put first on PYTHONPATH, so every
Python process the command starts imports it at start-up, the way auto-instrumentation tools bootstrap).

It only watches for `import torch` (stdlib only: a process that never imports torch pays a few
microseconds) and then hands over to perfscope.collectors.auto. It then runs the sitecustomize it
shadows, if there is one further along sys.path."""

from __future__ import annotations

import os
import sys
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))


def _hand_over(torch: Any) -> None:
    try:
        from perfscope.collectors import auto

        auto.instrument(torch)
    except Exception as exc:  # never the job's problem
        print(
            f"warning: perfscope run: this process is not recorded ({type(exc).__name__}: {exc})",
            file=sys.stderr,
        )


class _TorchWatcher:
    """A meta-path finder that answers for nothing; when `torch` is about to be imported it wraps the
    loader's exec_module so that perfscope is told once torch's own import has finished."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "torch":
            return None
        sys.meta_path.remove(self)  # once: the finders after it find torch as usual
        import importlib.util

        spec = importlib.util.find_spec(name)
        loader = getattr(spec, "loader", None)
        exec_module = getattr(loader, "exec_module", None)
        if exec_module is None:
            return spec

        def exec_then_instrument(module: Any) -> None:
            exec_module(module)
            _hand_over(module)

        loader.exec_module = exec_then_instrument  # type: ignore[union-attr]
        return spec


def _chain() -> None:
    """Run the sitecustomize this one shadows (a distribution's, a virtualenv's), as site would."""
    import importlib.machinery
    import importlib.util

    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


if (
    os.environ.get("PERFSCOPE_AUTO")
    and os.environ.get("PERFSCOPE_DISABLE", "").strip() in ("", "0")
    and "torch" not in sys.modules
):
    sys.meta_path.insert(0, _TorchWatcher())
_chain()
