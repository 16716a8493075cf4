"""A local run listens on loopback only: the RPC rendezvous, TensorPipe, and every process
group's store and transport (the trainers' group or device mesh, the weight-broadcast group,
the colocated workers' group), in every mode.

A reward hook looks while the run is under way: at its first call in a process, every
group of the run has formed. It lists the listening TCP sockets of the test process and all
its descendants (the driver, the fork server, every worker) from ``/proc``.
"""

from __future__ import annotations

import ipaddress
import json
import os
from pathlib import Path

import pytest
from helpers import run_config, tiny_config

_HOOK = '''
import json, os
from pathlib import Path
from digen.rewards.builtin import jpeg_incompressibility

LOOKED = []

def _listening():
    """(address, port) of each listening TCP socket of the root process and its descendants."""
    root = int(os.environ["DIGEN_TEST_ROOT_PID"])
    parent = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                parent[int(p.name)] = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except OSError:
                pass
    tree, grew = {root}, True
    while grew:
        more = {pid for pid, pp in parent.items() if pp in tree} - tree
        tree |= more
        grew = bool(more)
    inodes = set()
    for pid in tree:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                link = os.readlink(fd)
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        except OSError:
            pass
    out = []
    for table in ("tcp", "tcp6"):
        for row in Path(f"/proc/{root}/net/{table}").read_text().splitlines()[1:]:
            cols = row.split()
            if cols[3] == "0A" and cols[9] in inodes:  # LISTEN, one of the run's
                out.append(cols[1])
    return out

def reward(samples, prompts, metadata):
    if not LOOKED:
        LOOKED.append(1)
        path = Path(os.environ["DIGEN_TEST_LISTEN_OUT"]) / f"{os.getpid()}.json"
        path.write_text(json.dumps(_listening()))
    return jpeg_incompressibility(samples, prompts, metadata)
'''


def _address(hex_address: str) -> str:
    """``/proc/net/tcp{,6}``'s ``HEX:PORT`` local address as an IP address."""
    raw = bytes.fromhex(hex_address.split(":")[0])
    # each 32-bit word is in host (little-endian) order
    raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(raw))


COMMON = ["steps=1", "rollout.n=2", "train.micro_batch_size=2", "rollout.num_inference_steps=4"]
COMMON += ["data.train_batch_size=2", "train.mini_batch_size=null"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "extra"),
    [
        # RPC, the FSDP trainers' mesh (a default group) and the weight-broadcast group
        (
            "disaggregated",
            [
                "runtime.trainers=2",
                "runtime.trainer_parallel=fsdp",
                "runtime.weight_sync=broadcast",
            ],
        ),
        # the replicated trainers' data-parallel group
        ("disaggregated", ["runtime.trainers=2", "runtime.tag=none"]),
        # the colocated workers' default group
        ("colocated", ["train.num_devices=2"]),
    ],
    ids=["fsdp-broadcast", "replicate", "colocated"],
)
def test_only_loopback_listens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str, extra: list[str]
) -> None:
    hook = tmp_path / "look_hook.py"
    hook.write_text(_HOOK)
    seen = tmp_path / "seen"
    seen.mkdir()
    monkeypatch.setenv("DIGEN_TEST_ROOT_PID", str(os.getpid()))
    monkeypatch.setenv("DIGEN_TEST_LISTEN_OUT", str(seen))
    over = [*COMMON, *extra, f"rewards=[{{name: '{hook}:reward'}}]"]
    run_config(tiny_config("sd3", "flowgrpo", over, mode=mode), tmp_path / "run")
    looks = [json.loads(p.read_text()) for p in seen.iterdir()]
    assert looks  # the hook looked
    listening = [_address(a) for look in looks for a in look]
    assert len(listening) >= 2  # the stores of the run's groups, gloo's, TensorPipe's
    assert set(listening) == {"127.0.0.1"}, listening
