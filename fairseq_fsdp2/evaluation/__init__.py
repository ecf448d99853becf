"""Evaluation and deployment of a fine-tuned NLLB model: every direction of a test set
translated with NLLB's generation settings and scored as NLLB scores (chrF++, spBLEU, BLEU), a
baseline compared (the forgetting check), and an export to CTranslate2.

- inputs.py: the directions, sources and references (prepared data, or raw text files)
- models.py: what a model argument names (a fairseq checkpoint of any kind, a Hugging Face
  directory, a CTranslate2 directory), checked before any generation
- hf_model.py: a Hugging Face NLLB directory built as fairseq's model
- generation.py: NLLB's generation settings and fairseq's own generator, per direction
- ranks.py: under torchrun, the ranks' shares of the directions
- runner.py: one evaluation, direction by direction
- scores.py: sacreBLEU's chrF++, spBLEU and BLEU with their signatures
- report.py: the table, the JSON file, the drops, the chart
- ctranslate2_export.py: a checkpoint -> a CTranslate2 model directory

The command: ``python -m fairseq_fsdp2.evaluate`` (evaluate.py), ``scripts/evaluate_nllb.sh``.
"""
