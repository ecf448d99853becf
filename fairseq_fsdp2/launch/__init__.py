"""A run's lifecycle: its launch settings and process group (setup.py), how it starts and
ends (lifecycle.py), the state it holds on the process and undoes at its end (run_context.py),
one-line errors where the plugin owns the process (cli.py, parse_errors.py); the launchers
users run (torchrun.py, slurm.py, spawn.py, sigterm.py), bad input found before work
(preflight.py; precheck.py before torchrun starts), the warnings a run silences (quiet.py), and
the heartbeats that name a lost rank (heartbeat.py); NLLB's fine-tuning recipe as a torchrun
command (nllb_recipe.py, for scripts/finetune_nllb.sh)."""
