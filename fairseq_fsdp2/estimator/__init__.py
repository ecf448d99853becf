"""The offline memory estimator: the model as data (model_profile.py; with LoRA's adapters,
lora.py), one step simulated on a ledger of bytes (ledger.py; FSDP2's step: fsdp2_step.py,
legacy_ddp's: ddp_step.py), the peak per class of ranks (peak.py), fairseq-train arguments turned
into all of that (from_args.py), the largest --max-tokens that fits a budget (fit.py), and the
docs' predicted tables (doc_tables.py)."""
