"""models/: the PyTorch model definitions (single source of truth for the math), checkpoint
import/export (checkpoint.py, the only place that knows Hugging Face tensor names), tiny random
models for tests (testing.py), and the shipped trained tiny model (tiny/, trained by training.train.py)."""
