"""What runs inside a training job: phases, NVTX, communication hooks, NVML and host pollers."""
