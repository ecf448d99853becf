"""Memory measured while training: every rank's peak per log interval (monitor.py), the per-rank
breakdown of one update (breakdown.py, tracker.py: --fsdp2-memory-breakdown), and charts of a
run's memory.jsonl (charts.py)."""
