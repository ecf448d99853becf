"""One update of fairseq-train, on rank 0, run through a probe's own code: test code."""
import os


def on_rank0_at_update(update: int, run) -> None:
    """fairseq's ``Trainer.train_step`` of update ``update`` on rank 0 becomes
    ``run(trainer, samples, step)``, where ``step()`` runs the real one and returns its result
    (``run`` returns that too). Other updates, and the other ranks, are untouched. FSDP2Trainer calls
    fairseq's train_step through super(), so it goes through this."""
    if os.environ.get("RANK", "0") != "0":
        return
    from fairseq.trainer import Trainer

    real_train_step = Trainer.train_step

    def train_step(self, samples, raise_oom=False):
        step = lambda: real_train_step(self, samples, raise_oom)  # noqa: E731
        if self.get_num_updates() + 1 != update:
            return step()
        return run(self, samples, step)

    Trainer.train_step = train_step
