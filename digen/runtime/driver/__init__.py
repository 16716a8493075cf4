"""What runs in the driver process: the one asyncio loop that schedules a disaggregated run.

- :mod:`~digen.runtime.driver.loop`: :class:`Driver`, the loop that admits micro-batches and
  sends generate / score / update work to the workers.
- :mod:`~digen.runtime.driver.cluster`: starts the worker processes and calls their actors.
- :mod:`~digen.runtime.driver.placement`: which device each worker gets.
- :mod:`~digen.runtime.driver.accounting` and :mod:`~digen.runtime.driver.metrics`: a
  step's book of work done and the metrics row written for it.

The driver holds no model: nothing here imports diffusers or peft
(``tests/runtime/test_driver_light.py`` checks). What it exchanges with the workers is in
:mod:`digen.runtime.messages`.
"""
