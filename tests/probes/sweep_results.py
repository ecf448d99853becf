"""A hydra callback (``+hydra.callbacks.results._target_=sweep_results.JobResults``) that writes
each job's status and return value, one JSON line per job, to ``out``: what a sweeper such as
Optuna or Ax reads of a job (tests/test_in_process.py)."""
import json

from hydra.experimental.callback import Callback


class JobResults(Callback):
    def __init__(self, out: str):
        self.out = out

    def on_job_end(self, config, job_return, **kwargs) -> None:
        try:
            value = job_return.return_value  # raises the job's error if it failed
        except Exception as e:  # noqa: BLE001 - recorded for the test
            value = f"{type(e).__name__}: {e}"
        with open(self.out, "a") as f:
            f.write(json.dumps({"num": config.hydra.job.num, "status": job_return.status.name,
                                "value": value,
                                "save_dir": config.checkpoint.save_dir,
                                "maximize": config.checkpoint.maximize_best_checkpoint_metric,
                                "lr": list(config.optimization.lr)}) + "\n")
