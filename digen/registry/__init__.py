"""What digen ships, by name: one leaf of tables below the config, which validation, presets,
the CLI and the workers read without importing what the names stand for.

- :mod:`.algos`: the algorithms (``algo.name``) and the step kinds they sample with
  (``rollout.sde_type``);
- :mod:`.models`: the backbones (``model.name``) and their flavours;
- :mod:`.rewards`: the built-in rewards (``rewards[i].name``);
- :mod:`.trackers`: the experiment trackers (``logger``).

Each entry names the module that implements it, imported the first time it is used.
"""
