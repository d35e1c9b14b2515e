"""What runs inside a training job: phases, NVTX, communication hooks, NVML and host pollers."""

from .profiler import Phase, Profiler, profile

__all__ = ["Phase", "Profiler", "profile"]
