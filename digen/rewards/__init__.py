"""Rewards: what scores a run's samples, from the name a config gives a reward to the batch's scores.

- the one table of built-in reward names and where each is implemented is
  :mod:`digen.registry.rewards` (no torch; config validation reads it).
- ``hooks``: what a reward hook is, loading one by name (built-in, ``module:function`` or
  ``path/to/file.py:function``), calling one (plain or async).
- ``scoring``: several hooks combined by weight, with time limits, retries and a failure
  policy (:func:`~digen.rewards.scoring.build_reward`).
- ``loop``: a run's rewards in the process that scores, set up once and closed at the end,
  on an event loop of their own (:class:`~digen.rewards.loop.RewardLoop`).
- built-ins: ``builtin`` (JPEG size), ``ocr`` (text read off the sample), ``clip`` (CLIP
  score, the worked example of a model reward), ``shapes`` (a GenEval-style judge of the
  shapes world's images), ``http`` (a client of a reward server).
- ``server``: the reward server of ``digen reward-server``.

Importing this package imports nothing: each module is imported where it is used.
"""
