"""A local run listens on loopback only: the RPC rendezvous, TensorPipe, and every process
group's store and transport (the trainers' group or device mesh, the weight-broadcast group,
the colocated workers' group), in every mode. The transports bind to the interface that
carries the run's address (:func:`interface_for`), not to the host name's.

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

from digen.runtime.transport.sockets import (
    INTERFACE_VARIABLES,
    interface_addresses,
    interface_env,
    interface_for,
    interface_toward,
    loopback_interface,
)

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
                "runtime.placement.trainer_parallel=fsdp",
                "runtime.transport.weight_sync=broadcast",
            ],
        ),
        # the replicated trainers' data-parallel group
        ("disaggregated", ["runtime.trainers=2", "runtime.schedule.tag=none"]),
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


MACHINE = {
    "lo": ["127.0.0.1", "::1"],
    "eth0": ["10.0.0.5", "fe80::1", "fd00::2"],
    "eth1": ["192.168.1.7", "192.168.1.8"],  # a secondary address
    "docker0": ["172.17.0.1"],
}


@pytest.mark.parametrize(
    ("address", "interface"),
    [
        ("10.0.0.5", "eth0"),
        ("192.168.1.8", "eth1"),
        ("172.17.0.1", "docker0"),
        ("fd00:0:0::2", "eth0"),  # compared as addresses, not as text
        ("::ffff:10.0.0.5", "eth0"),  # IPv4-mapped
        ("fe80::1%eth0", "eth0"),  # with a zone
        ("127.0.0.1", "lo"),
        ("127.0.0.2", "lo"),  # all of 127/8 is loopback
        ("0:0:0:0:0:0:0:1", "lo"),
        ("10.0.0.6", None),  # not this machine's
        ("localhost", None),  # a name, not an address
        ("", None),
    ],
)
def test_an_address_maps_to_the_interface_that_carries_it(address: str, interface: str) -> None:
    assert interface_for(address, MACHINE) == interface


def test_a_loopback_address_needs_a_loopback_interface_of_its_family() -> None:
    assert interface_for("::1", {"lo": ["127.0.0.1"], "eth0": ["fd00::2"]}) is None
    assert interface_for("127.0.0.3", {"eth0": ["10.0.0.5"]}) is None


def test_this_machines_addresses_map_to_their_interfaces(monkeypatch: pytest.MonkeyPatch) -> None:
    """Read from the kernel: each of this machine's IPv4 addresses is carried by the
    interface that lists it; a loopback run pins every transport to loopback, whatever the
    environment says."""
    found = interface_addresses()
    assert "127.0.0.1" in found[loopback_interface()]
    for name, addresses in found.items():
        for address in addresses:
            if ":" not in address:  # IPv4: routed to itself, so found from the route
                assert interface_toward(address) == name, (address, found)
    monkeypatch.setenv("TP_SOCKET_IFNAME", "eth9")
    assert interface_env("127.0.0.1") == dict.fromkeys(INTERFACE_VARIABLES, loopback_interface())
    others = [a for n, a in found.items() if n != loopback_interface()]
    for address in [a for group in others for a in group if ":" not in a][:1]:
        env = interface_env(address)  # a user's own choice stands off loopback
        assert "TP_SOCKET_IFNAME" not in env and env, env
