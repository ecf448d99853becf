"""The benchmarks behind docs/benchmarks.md (not tests; scripts/benchmark*.py parse their
arguments and call these): the shared harness (harness.py: synthetic corpus, fairseq-train
arguments, rank processes running worker.py, the records they log, machine and versions, a
marked section of the page), the comparison of fairseq's legacy_ddp with FSDP2's plans
(plans.py, its report: plans_report.py), the vocabulary loss's chunk-size sweep (loss_sweep.py),
the real NLLB-600M dimensions (nllb600m.py), the optimizer step on local shards
(optimizer_step.py) and the vocabulary loss timed alone (loss_alone.py)."""
