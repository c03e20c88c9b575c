"""models/: the PyTorch model definitions (the single source of truth for the math) and the shipped models.

Owns: the decoder with its MTP modules over a paged KV pool (glm4_moe.py: attention, decoder layers, the three
graph entry points), its feed-forward blocks (feed_forward.py: MLP, router, MoE), `ModelConfig` with every field
checked (config.py), which slice of each tensor a tensor-parallel / expert-parallel rank keeps (sharding.py), checkpoint import/export (checkpoint.py, the only place that knows Hugging Face tensor
names; safetensors_header.py bounds-checks headers before any read), tiny random checkpoints for tests
(testing.py), the shipped trained models (deep/: 12 layers, the demo and bench model; tiny/: 3 layers, fast
tests) and how they were trained (training/).
"""
