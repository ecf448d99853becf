"""The benchmarks behind docs/benchmarks.md (not tests, and not part of the installed package:
scripts/benchmark*.py put this checkout first on sys.path, parse their arguments and call these):
the shared harness (harness.py: synthetic corpus, fairseq-train arguments, rank processes running
worker.py, the records they log, machine and versions, a marked section of the page), the
comparison of fairseq's legacy_ddp with FSDP2's plans (plans.py), the vocabulary loss's chunk-size
sweep (loss_sweep.py), the real NLLB-600M dimensions (nllb600m.py: the recipe's settings), Adam's
moments in 32, 16 and 8 bits there (adam_stats_600m.py, timed in the ranks by update_timers.py),
LoRA against full fine-tuning (lora_600m.py), asynchronous checkpoints (async_save_run.py, timed
by async_save_timers.py), the optimizer step on local shards (optimizer_step.py), the moments'
storage formats (moment_storage.py), the vocabulary loss timed alone (loss_alone.py) and the
fine-tuning quality of bf16 weights without an fp32 master (bf16_weights_quality.py, its ranks'
write-back chosen by weight_rounding.py)."""
