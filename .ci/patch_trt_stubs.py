"""Make tensorrt-stubs usable by mypy: copy them to build/trt-stubs and fix what breaks parsing.

tensorrt-stubs 10.13.0.35.1 ships no py.typed (mypy would silently treat `tensorrt` as Any) and its
tensorrt.pyi has parameters named `in` (a keyword) and a non-default parameter after defaulted ones.
`make lint` runs mypy with MYPYPATH pointing at the patched copy, so TensorRT calls are really checked.
"""

import re
import shutil
import sys
import sysconfig
from pathlib import Path

site = Path(sysconfig.get_paths()["purelib"])
out = Path(sys.argv[1] if len(sys.argv) > 1 else "build/trt-stubs")
shutil.rmtree(out, ignore_errors=True)
for pkg in ("tensorrt", "tensorrt_bindings"):
    if not (site / pkg).is_dir():
        sys.exit(f"tensorrt-stubs not installed in {site}: run `make install`")
    shutil.copytree(site / pkg, out / pkg)
stub = out / "tensorrt_bindings" / "tensorrt.pyi"
text = stub.read_text()
text = re.sub(r"\bin: ", "in_: ", text)  # `in` is a keyword
text = text.replace("power: Weights = None, channel_axis: int)", "power: Weights = None, channel_axis: int = ...)")
stub.write_text(text)
print(f"patched TensorRT stubs in {out}")
