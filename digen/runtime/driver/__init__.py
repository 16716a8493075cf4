"""What runs in the driver process: the one asyncio loop that schedules a disaggregated run.

- :mod:`~digen.runtime.driver.loop`: :class:`Driver`, the loop that admits micro-batches and
  sends generate / score / update work to the workers.
- :mod:`~digen.runtime.driver.cluster`: starts the worker processes and calls their actors.
- :mod:`~digen.runtime.driver.accounting`: a step's book of work done, its costs and trace,
  which becomes the step's metrics row (:mod:`digen.runtime.metrics`, shared with the
  colocated mode).

The driver holds no model: nothing here imports diffusers or peft
(``tests/runtime/test_driver_light.py`` checks). What it exchanges with the workers is in
:mod:`digen.runtime.messages`.
"""
