"""runtime/bench/: `mtp-bench`, the side-by-side decoding benchmark (an app on top of the engine).

Owns: the workload and the runners (runners.py: our engine, HF `generate`), the measurement loop and CLI
(main.py), the JSON/table report (report.py) and the plots (plots.py). Nothing in the engine imports it.
"""
