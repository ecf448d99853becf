"""Data preparation for multilingual NLLB-style training (prepare.py: its raw input checked,
inputs.py; SentencePiece models, spm_model.py; fairseq dictionaries, dictionary.py;
fairseq-preprocess run in this process, preprocess.py), a pretrained model's vocabulary grown with
new languages and pieces (grown_vocab.py; its record, growth_record.py), the generated corpus of
numbers written out in words for the demo and tests (numbers.py), and random large-vocabulary
corpora for the memory validation and benchmarks (synthetic.py)."""
