"""models/training/: training the shipped models (not needed to serve them).

Owns: the two models' presets (architecture + recipe: configs.py), the corpus and the split by file (data.py), the
byte-level BPE tokenizer (tokenizer.py), the chained-depth MTP training forward (chained.py), the losses and
held-out evaluation (eval.py; also `python -m models.training.eval --checkpoint DIR`), and the training loop +
checkpoint writing (train.py).
"""
