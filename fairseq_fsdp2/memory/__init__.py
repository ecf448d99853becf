"""Memory: per-rank peak logging (monitor.py); the per-rank breakdown of one update is in
breakdown.py and tracker.py (--fsdp2-memory-breakdown)."""
from .monitor import MemoryMonitor, read_peak, reset_peak

__all__ = ["MemoryMonitor", "read_peak", "reset_peak"]
