"""Experiment trackers: a run's config, scalars, sample grids and timeline, sent to TensorBoard
and / or Weights & Biases beside ``metrics.jsonl`` (which every run writes, whatever the config).

``logger: [tensorboard, wandb]`` in the config picks them. Each is an optional extra, imported
only when a run asks for it; :func:`require` names a missing one in one sentence before the run
starts. Only the lead process (rank 0) logs. Where the records go:

- ``tensorboard``: event files in ``<out>/tensorboard/``, for ``tensorboard --logdir
  <out>/tensorboard``. A resumed run drops what the previous one logged past its checkpoint.
- ``wandb``: the run directory wandb makes in ``<out>/wandb/``. The mode is ``WANDB_MODE`` when
  set; otherwise online when an API key is configured and offline when none is (a machine
  without network still records the run; ``wandb sync <out>/wandb/offline-run-*`` uploads it).
  Each ``digen run`` (a resumed one too) is a W&B run of its own.

Scalars are logged under their ``metrics.jsonl`` names (``reward_mean``, ``time/train_s``, ...) at
the row's ``step``; sample grids under ``sample_grid`` at their step; the timeline under
``timeline`` at the last step.
"""

from __future__ import annotations

import importlib.util
import netrc
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from digen.errors import DigenError
from digen.registry.trackers import TRACKERS

if TYPE_CHECKING:
    from PIL import Image

__all__ = ["TRACKERS", "Trackers", "require", "wandb_mode"]


def require(names: Sequence[str]) -> None:
    """Raise :class:`DigenError` (one sentence) if a tracker in ``names`` is not installed."""
    for name in names:
        if importlib.util.find_spec(name) is None:
            raise DigenError(
                f"logger has {name}, but the {name} package is not installed; "
                f"install it with pip install 'digen[{name}]'."
            )


def wandb_mode(environ: Mapping[str, str]) -> str:
    """The W&B mode of a run: ``WANDB_MODE`` when set, else online when an API key is
    configured (``WANDB_API_KEY`` or a netrc entry for the W&B host, what ``wandb login``
    writes) and offline when none is."""
    if environ.get("WANDB_MODE"):
        return environ["WANDB_MODE"]
    return "online" if _wandb_key_configured(environ) else "offline"


def _wandb_key_configured(environ: Mapping[str, str]) -> bool:
    if environ.get("WANDB_API_KEY") or environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlparse(environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname
    path = environ.get("NETRC") or os.path.join(os.path.expanduser("~"), ".netrc")
    try:
        return netrc.netrc(path).authenticators(host or "") is not None
    except (OSError, netrc.NetrcParseError):
        return False


class Trackers:
    """One object fanning a run's records out to the trackers ``names`` (none: every call
    does nothing, so callers need no checks)."""

    def __init__(
        self, names: Sequence[str], out_dir: str | os.PathLike, *, first_step: int = 0
    ) -> None:
        """first_step: the step this run starts at (a resumed run's checkpoint step)."""
        require(names)
        self._backends: list[Any] = []
        try:
            for name in names:
                self._backends.append(_BACKENDS[name](Path(out_dir), first_step))
        except BaseException:
            self.close()
            raise

    def log_config(self, cfg: Mapping[str, Any]) -> None:
        """The resolved config (``config_to_dict``)."""
        for backend in self._backends:
            backend.config(cfg)

    def log_step(self, step: int, metrics: Mapping[str, Any]) -> None:
        """One ``metrics.jsonl`` row: its numbers (``step`` aside) at ``step``."""
        values = {
            k: float(v) for k, v in metrics.items() if k != "step" and isinstance(v, int | float)
        }
        for backend in self._backends:
            backend.scalars(step, values)

    def log_image(
        self,
        name: str,
        image: Image.Image | str | os.PathLike,
        step: int,
        captions: Sequence[str] = (),
    ) -> None:
        """A picture (a sample grid, the timeline), given as an image or a file, at ``step``;
        ``captions`` (the samples' prompts) become its caption where the tracker shows one."""
        if not self._backends:
            return
        from PIL import Image

        if isinstance(image, Image.Image):
            picture = image.convert("RGB")
        else:
            with Image.open(image) as im:
                picture = im.convert("RGB")
        caption = " | ".join(dict.fromkeys(captions))  # a group's prompt once
        for backend in self._backends:
            backend.image(name, picture, step, caption)

    def close(self) -> None:
        """Flush and close every tracker (safe to call again)."""
        backends, self._backends = self._backends, []
        for backend in backends:
            backend.close()


class _TensorBoard:
    def __init__(self, out_dir: Path, first_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(out_dir / "tensorboard"), purge_step=first_step or None)

    def config(self, cfg: Mapping[str, Any]) -> None:
        import yaml

        text = yaml.safe_dump(dict(cfg), sort_keys=False)
        # indented: a code block in TensorBoard's markdown text view
        self.writer.add_text("config", "    " + text.rstrip("\n").replace("\n", "\n    "))

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()  # a step takes seconds or more: show it at once

    def image(self, name: str, picture: Image.Image, step: int, caption: str) -> None:
        import numpy as np

        self.writer.add_image(name, np.asarray(picture), step, dataformats="HWC")
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _WandB:
    def __init__(self, out_dir: Path, first_step: int) -> None:
        import wandb

        self.wandb = wandb
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "digen"),
            dir=str(out_dir),  # wandb makes <out>/wandb/ in it
            mode=wandb_mode(os.environ),
            # trainer.log holds the run's log; capturing stdout would wrap the progress bar
            settings=wandb.Settings(console="off"),
        )

    def config(self, cfg: Mapping[str, Any]) -> None:
        self.run.config.update(dict(cfg), allow_val_change=True)

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        self.run.log(dict(values), step=step)

    def image(self, name: str, picture: Image.Image, step: int, caption: str) -> None:
        self.run.log({name: self.wandb.Image(picture, caption=caption or None)}, step=step)

    def close(self) -> None:
        self.run.finish()


_BACKENDS: dict[str, type] = dict(zip(TRACKERS, (_TensorBoard, _WandB), strict=True))
