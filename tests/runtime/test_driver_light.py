"""The driver process holds no model: it never imports diffusers, transformers or peft (the
types it exchanges with workers live in the torch-light ``digen.runtime.messages``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

CODE = """
import sys
from digen.runtime.driver import accounting, cluster, loop  # noqa: F401
from digen.runtime import messages, metrics, notes, placement  # noqa: F401
print(sorted(m for m in ("diffusers", "peft") if m in sys.modules))
"""


def test_driver_modules_import_neither_diffusers_nor_peft() -> None:
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


RUN = """
import sys
from cli.main import main
main(["run", "--flavour", "tiny", "--mode", "disaggregated", "--steps", "1", "--quiet",
      "--out", sys.argv[1], "save_every=0", "rollout.n=2", "data.train_batch_size=1",
      "train.micro_batch_size=2"],
     standalone_mode=False)
print(sorted(m for m in ("diffusers", "peft", "transformers") if m in sys.modules))
"""


def test_a_disaggregated_runs_driver_process_never_imports_the_model_libraries(
    tmp_path: Path,
) -> None:
    """The whole command, not only the driver's modules: the actors' classes are named for
    the workers to import, and the loading bars are turned off without importing the
    libraries, so the process pays none of their seconds of import beside its workers."""
    out = subprocess.run(
        [sys.executable, "-c", RUN, str(tmp_path / "run")], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
    assert (tmp_path / "run" / "lora").is_dir()  # it ran: its workers loaded the model
