"""models/: the PyTorch model definitions (the single source of truth for the math) and the shipped models.

Owns: the decoder with its MTP modules over a paged KV pool (glm4_moe.py: attention, decoder layers, the three
graph entry points), multi-head latent attention for DeepSeek-V3 / GLM-4.7-Flash (mla.py: absorbed paged path, the
latent-pool geometry), its feed-forward blocks (feed_forward.py: MLP, router, MoE), `ModelConfig` with every field
checked (config.py), which slice of each tensor a tensor-parallel / expert-parallel rank keeps (sharding.py),
checkpoint import/export (checkpoint.py, the only place that knows Hugging Face tensor
names; checkpoint_files.py indexes shards from their headers and reads tensor slices on demand, so a rank
reads only what it keeps; fp8.py dequantizes FP8 releases; safetensors_header.py bounds-checks headers), tiny random checkpoints for tests
(testing.py; the MLA ones written by transformers itself), the shipped trained models (deep/: 12 layers, the demo and bench model; tiny/: 3 layers, fast
tests) and how they were trained (training/).
"""
