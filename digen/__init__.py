"""digen: disaggregated RL post-training for diffusion and flow-matching models.

The public surface is small on purpose::

    from digen import DigenRunner, load_config
    result = await DigenRunner(load_config(overrides=["model.name=sd3"])).run()

Names load lazily, so ``import digen.sched`` stays free of torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "ConfigError": "digen.errors",
    "DigenConfig": "digen.config",
    "DigenError": "digen.errors",
    "DigenRunner": "digen.run.runner",
    "RewardError": "digen.errors",
    "RunResult": "digen.run.runner",
    "load_config": "digen.config",
}

__all__ = [*sorted(_EXPORTS), "__version__"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'digen' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__
