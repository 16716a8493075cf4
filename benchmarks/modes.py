"""Step time of the execution modes on this machine: the ablation of the runtime.

This is ``digen bench`` (``digen/run/bench.py``); the script passes its arguments on:

    python benchmarks/modes.py --steps 8 --size 128 --repeats 3 --json modes.json

is ``digen bench --steps 8 --size 128 --repeats 3 --json modes.json``. See ``digen bench
--help`` and docs/BENCHMARKS.md ("`digen bench`: the ablation ladder").
"""

from __future__ import annotations

import sys

from cli.main import main

if __name__ == "__main__":
    main(["bench", *sys.argv[1:]], prog_name="digen")
