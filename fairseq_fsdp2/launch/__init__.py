"""A run's lifecycle: how it starts and ends (run.py), the launchers users run (torchrun.py,
slurm.py, spawn.py, sigterm.py), bad input found before work (preflight.py), and the heartbeats
that name a lost rank (heartbeat.py); NLLB's fine-tuning recipe as a torchrun command
(nllb_recipe.py, for scripts/finetune_nllb.sh)."""
