"""Data preparation for multilingual NLLB-style training (prepare.py) and a small generated
corpus of numbers written out in words, for the demo and tests (numbers.py)."""
