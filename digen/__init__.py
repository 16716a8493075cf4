"""digen: disaggregated RL post-training for diffusion and flow-matching models."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
