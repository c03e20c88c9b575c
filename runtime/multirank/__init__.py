"""runtime/multirank/: what a rank of an mpirun job does besides running the engine.

Owns the MPI world and one-line failure exits (parallel.py), the tensor-parallel leader/follower split
(tp_group.py), the start-up settings fingerprint (fingerprint.py) and the collective watchdog (watchdog.py).
"""
