"""Data preparation for multilingual NLLB-style training (prepare.py, preprocess.py), the
generated corpus of numbers written out in words for the demo and tests (numbers.py), and random
large-vocabulary corpora for the memory validation and benchmarks (synthetic.py)."""
