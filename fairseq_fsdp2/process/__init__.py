"""A run in its process, from start to end: how it starts (setup.py: its launch settings, checks
and process group, under torchrun.py, SLURM (slurm.py) or ranks the plugin starts itself,
spawn.py), the run from start to end (lifecycle.py: fairseq's call_main, wrapped), the state it
holds on the process and undoes at its end (run_context.py), the heartbeats that name a lost rank
(heartbeat.py), the one line a SIGTERM prints (sigterm.py) and the warnings a run silences
(quiet.py). What bad input is and how an error ends a command: command_line/."""
