"""models/training/: training the shipped models (not needed to serve them).

Owns: the corpus and the split by file (data.py), the byte-level BPE tokenizer (tokenizer.py), the losses and
held-out evaluation (eval.py), and the training loop + checkpoint writing (train.py).
"""
