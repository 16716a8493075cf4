"""The user-facing side of a run, in the process the user starts.

- :mod:`~digen.run.runner`: :class:`DigenRunner`, which resolves the config and drives a run.
- :mod:`~digen.run.outputs`: the files a run leaves behind (metrics, samples, summary).
- :mod:`~digen.run.trackers`: metric trackers (W&B, TensorBoard, ...).
- :mod:`~digen.run.bench`: ``digen bench``, which times a ladder of runs.

The processes a run starts (driver loop, workers, transport) live in :mod:`digen.runtime`;
checkpoints, which both sides read and write, in :mod:`digen.checkpoint`.
"""
