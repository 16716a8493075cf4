"""MixGRPO-Flash: MixGRPO with a second-order solver, on fewer steps, after the window.

Published form (Tencent-Hunyuan/MixGRPO, ``finetune_flux_grpo_MixGRPO_Flash.sh``): MixGRPO
as published, except that the steps after the SDE window are sampled by the multistep
second-order DPM-Solver++ (``dpm_apply_strategy=post``, midpoint form) on a compressed
schedule: with ``L`` the window's last step of ``N``, ``int((N - L) * 0.4) - 1`` steps
uniform in the grid's time from step ``L + 1`` down to 0. The steps before and in the window
are MixGRPO's (Euler, then Flow-GRPO's ``sde``), and the solver's history holds every
step's clean prediction ``x - sigma v``, the window's included. The window moves every 20
train steps instead of 25. Its variant Flash* keeps the window at the start
(``algo.params.stride=0``) and compresses by 0.2 (``rollout.post_compress=0.2``).

The window's transitions, their log-probs and the loss are MixGRPO's: the solver only makes
the image after them cheaper, so this file is the recipe alone, as ``rollout.solver=dpm2-post``
and ``rollout.post_compress`` on ``--algo mixgrpo`` run the same thing. Evaluation samples
with Euler on the whole schedule, as MixGRPO's evaluation pipeline does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from digen.algos.mixgrpo import MixGRPO

if TYPE_CHECKING:
    from digen.config import DigenConfig
    from digen.registry.models import Backbone

__all__ = ["MixGRPOFlash"]


class MixGRPOFlash(MixGRPO):
    name = "mixgrpo-flash"
    title = (
        "MixGRPO-Flash (Li et al. 2025): MixGRPO with DPM-Solver++ on compressed steps "
        "after the window"
    )

    def check(self, cfg: DigenConfig) -> str | None:
        if cfg.rollout.solver != "dpm2-post":
            return (
                f"rollout.solver = {cfg.rollout.solver} is not allowed: MixGRPO-Flash samples "
                "the steps after its window with dpm2-post (use --algo mixgrpo for Euler)"
            )
        return super().check(cfg)

    def preset(self, backbone: Backbone, real_weights: bool) -> dict[str, dict[str, Any]]:
        out = super().preset(backbone, real_weights)
        out["rollout"] |= {"solver": "dpm2-post", "post_compress": 0.4}
        if real_weights:
            out["algo"]["params"]["shift_every"] = 20
        return out
