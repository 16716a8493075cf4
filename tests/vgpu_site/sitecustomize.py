"""Virtual GPUs in every process a test starts with ``DIGEN_VIRTUAL_GPUS`` set (tests/vgpu.py)."""

import os
import sys

if os.environ.get("DIGEN_VIRTUAL_GPUS"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import vgpu

    vgpu.install()
