"""runtime/bench/: `mtp-bench`, the side-by-side decoding benchmark (an app on top of the engine).

Owns: the workload and our / HF runners (runners.py), the llama.cpp runner (llama_cpp.py) and the GGUF
conversion wrapper it needs (gguf.py), what runs in a bench and in which order (setup.py), the CLI and the
measurement loop (main.py), the memory-bandwidth bound per step (bound.py), bench.json (report.py), the
README tables generated from it (table.py) and the plots (plots.py); `mtp-bench serve`, the serving benchmark
over real servers (serve_bench.py, serve_report.py); what weight quantization costs and buys, two engines side by
side (quant_quality.py). Nothing in the engine imports it.
"""
