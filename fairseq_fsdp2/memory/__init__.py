"""Memory: per-rank peak logging."""
from .monitor import MemoryMonitor, read_peak, reset_peak

__all__ = ["MemoryMonitor", "read_peak", "reset_peak"]
