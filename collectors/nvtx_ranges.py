"""NVTX ranges in domain `perfscope` for every step and phase, with attributes cached per name."""

from __future__ import annotations

from typing import Any

DOMAIN = "perfscope"

# Nsight Systems colours: steps in grey, canonical phases in fixed colours, user spans in purple.
_COLOURS = {
    "step": "grey",
    "data": "yellow",
    "forward": "green",
    "backward": "blue",
    "sync": "red",
    "optimizer": "orange",
}


class NvtxRanges:
    """Phases are push/pop ranges on the training thread (they nest); steps are start/end ranges,
    which need not nest with the phases around a step boundary.

    The domain, its registered strings and the event attributes are created once per name. Without
    a tool attached (`nsys`, Nsight Compute) `nvtx.get_domain` returns a stand-in domain that records
    nothing; the ranges are then skipped altogether.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = False
        self._attrs: dict[str, Any] = {}
        self._domain: Any = None
        if not enabled:
            return
        try:
            import nvtx

            self._domain = nvtx.get_domain(DOMAIN)
            if type(self._domain).__name__ == "DummyDomain":
                return  # no tool attached (nsys, ncu): NVTX would record nothing, so skip the calls
            self._push = self._domain.push_range
            self._pop = self._domain.pop_range
            self._start = self._domain.start_range
            self._end = self._domain.end_range
            self.enabled = True
        except Exception:  # nvtx missing or broken: ranges are a nicety, never a reason to fail
            self._domain = None

    def _attributes(self, name: str) -> Any:
        attrs = self._attrs.get(name)
        if attrs is None:
            d = self._domain
            attrs = d.get_event_attributes(
                message=d.get_registered_string(name), color=_COLOURS.get(name, "purple")
            )
            self._attrs[name] = attrs
        return attrs

    def push(self, name: str) -> None:
        if self.enabled:
            self._push(self._attrs.get(name) or self._attributes(name))

    def pop(self) -> None:
        if self.enabled:
            self._pop()

    def step_begin(self, index: int) -> Any:
        if not self.enabled:
            return None
        return self._start(self._attrs.get("step") or self._attributes("step"))

    def step_end(self, range_id: Any) -> None:
        if self.enabled and range_id is not None:
            self._end(range_id)
