"""`mtp::swa_paged_attention`: the paged attention op's sliding-window mode with attention sinks (MiMo-V2-Flash).

Its schema and CPU kernel are C++ (plugins/csrc/swa_paged_attention.cpp over attention.h's loops, shared with
`mtp::paged_attention`); this module checks that schema against the op spec (plugins/op_spec.py) and registers the
fake. No CUDA (Triton) kernel and no TensorRT plugin yet (docs/MODELS.md "MiMo-V2-Flash"). Semantics:
plugins/reference_swa.py.
"""

from __future__ import annotations

import plugins.cpp_ops  # noqa: F401  (defines the mtp:: schemas and registers the C++ CPU kernels)
from plugins.op_backends import define_torch
from plugins.op_spec import SPECS

define_torch(SPECS["swa_paged_attention"])
