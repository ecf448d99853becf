"""A run's lifecycle: how it starts and ends (run.py), the launchers users run (torchrun.py,
slurm.py, spawn.py, sigterm.py), bad input found before work (preflight.py), and the heartbeats
that name a lost rank (heartbeat.py)."""
