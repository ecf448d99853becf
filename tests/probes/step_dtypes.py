"""fairseq-train (with the plugin) that reports, on every rank, what its optimizer steps
take and what its gradients were reduced in: test code (tests/test_narrow_grads.py,
tests/test_backend.py).

At the start of every optimizer step (the torch optimizer's ``step``, as fairseq's wrapper calls
it after the gradients are reduced, scaled and clipped), one line
``step dtypes: {json}``:
- ``rank``: this process's rank;
- ``grads``: how many of the optimizer's parameters hold a gradient of each kind, keyed
  ``"DTensor torch.bfloat16"`` (a sharded gradient, its dtype) or ``"Tensor ..."`` (a plain one);
- ``reduced``: the dtype of every reduce-scatter input since the last step, counted (an
  update skipped for an overflow adds its reductions to the next step's). On gloo every
  reduce-scatter of the plugin, FSDP2's and the tied embedding's early one, goes through
  ``gloo_collectives.AllReduceReduceScatter``, wrapped here; its input is what the ranks sum,
  in the dtype they sum in.
Recording changes no value: the run's losses stay those of an unprobed run.

And fairseq's trainer logs at INFO on every rank, for tests that check what each rank did
(fairseq sets the root logger of every rank but rank 0 to WARNING, so its ``NOTE: gradient
overflow detected ...`` lines would appear from rank 0 only; the logger's own level lets its
records through, the root's handlers print them). Rank 0's output is unchanged.
"""
import collections
import json
import logging
import os

from fairseq_cli.train import cli_main
from torch.distributed.tensor import DTensor

from fairseq_fsdp2.sharding import gloo_collectives
from fairseq_fsdp2.trainer import fsdp2_trainer

PREFIX = "step dtypes: "
reduced = collections.Counter()


def recording_reduce_scatter(call):
    def __call__(self, output_tensor, input_tensor, *args, **kwargs):
        reduced[str(input_tensor.dtype)] += 1
        return call(self, output_tensor, input_tensor, *args, **kwargs)
    return __call__


def grads_of(optimizer) -> dict:
    kinds = collections.Counter()
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                kind = "DTensor" if isinstance(p.grad, DTensor) else "Tensor"
                kinds[f"{kind} {p.grad.dtype}"] += 1
    return dict(kinds)


def recording_build(build):
    def _build_optimizer(self):
        build(self)
        torch_optimizer = self._optimizer.optimizer  # fairseq's wrapper(s) -> torch's optimizer
        step = torch_optimizer.step

        def recorded_step(*args, **kwargs):
            report = {"rank": int(os.environ.get("RANK", "0")),
                      "grads": grads_of(torch_optimizer), "reduced": dict(reduced)}
            print(PREFIX + json.dumps(report, sort_keys=True), flush=True)
            reduced.clear()
            return step(*args, **kwargs)
        torch_optimizer.step = recorded_step
    return _build_optimizer


if __name__ == "__main__":
    logging.getLogger("fairseq.trainer").setLevel(logging.INFO)
    reduce_scatter = gloo_collectives.AllReduceReduceScatter
    reduce_scatter.__call__ = recording_reduce_scatter(reduce_scatter.__call__)
    trainer = fsdp2_trainer.FSDP2Trainer
    trainer._build_optimizer = recording_build(trainer._build_optimizer)
    cli_main()
