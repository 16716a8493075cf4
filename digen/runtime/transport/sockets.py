"""Sockets and interfaces of the run's network: listening sockets for its rendezvous points
(the RPC world's store, process groups' stores), bound to the run's address alone, and the
network interface the transports (TensorPipe, gloo, NCCL's bootstrap) bind to, which is the
one carrying the run's address (or this machine's route to it), never the one the host name
happens to resolve to."""

from __future__ import annotations

import array
import contextlib
import ipaddress
import os
import socket
import struct
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

__all__ = [
    "INTERFACE_VARIABLES",
    "interface_addresses",
    "interface_env",
    "interface_for",
    "interface_toward",
    "is_loopback",
    "listening_socket",
    "local_address_toward",
    "loopback_interface",
]

INTERFACE_VARIABLES = ("TP_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
"""The variables by which TensorPipe, gloo and NCCL's bootstrap choose the interface they
listen on (read when a process joins the RPC world or forms a group)."""

_SIOCGIFCONF = 0x8912  # Linux: every IPv4 address of every interface that is up
_IFREQ_BYTES = 40 if struct.calcsize("P") == 8 else 32  # struct ifreq: name[16] + union


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host:port`` (port 0: a free one, chosen as it binds);
    closed again if it cannot bind."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except BaseException:
        sock.close()
        raise
    return sock


def is_loopback(address: str) -> bool:
    """Whether ``address`` (an IP address, or ``localhost``) is a loopback one."""
    ip = _ip(address)
    return ip.is_loopback if ip is not None else address == "localhost"


def loopback_interface() -> str:
    """The loopback interface's name on this platform."""
    return "lo0" if sys.platform == "darwin" else "lo"


def _ip(address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """``address`` as an IP address (an IPv6 zone such as ``%eth0`` dropped, an IPv4-mapped
    IPv6 address read as the IPv4 one); None when it is not one."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0].strip("[]"))
    except ValueError:
        return None
    mapped = getattr(ip, "ipv4_mapped", None)
    return mapped if mapped is not None else ip


def interface_for(address: str, interfaces: Mapping[str, Iterable[str]]) -> str | None:
    """The interface, among ``interfaces`` (name -> its addresses), that carries ``address``;
    None when none does, or ``address`` is not an IP address.

    Addresses are compared as addresses (``::1`` and ``0:0:0:0:0:0:0:1`` are one). A loopback
    address no interface lists (``127.0.0.2``: the whole of 127/8 is loopback) belongs to the
    interface that carries loopback addresses of its family."""
    ip = _ip(address)
    if ip is None:
        return None
    for name, addresses in interfaces.items():
        if any(_ip(a) == ip for a in addresses):
            return name
    if ip.is_loopback:
        for name, addresses in interfaces.items():
            for a in addresses:
                other = _ip(a)
                if other is not None and other.version == ip.version and other.is_loopback:
                    return name
    return None


def interface_addresses() -> dict[str, list[str]]:
    """This machine's interfaces and their IP addresses (Linux; elsewhere an empty map).

    IPv4 from the kernel's list of configured addresses (``SIOCGIFCONF``: secondary
    addresses too, an alias label such as ``eth0:1`` read as its interface), IPv6 from
    ``/proc/net/if_inet6``."""
    if not sys.platform.startswith("linux"):
        return {}
    out: dict[str, list[str]] = {}
    for name, address in [*_ipv4_addresses(), *_ipv6_addresses()]:
        out.setdefault(name, []).append(address)
    return out


def _ipv4_addresses() -> list[tuple[str, str]]:
    import fcntl

    count = 64
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        while True:
            buffer = array.array("B", bytes(count * _IFREQ_BYTES))
            request = struct.pack("iL", len(buffer), buffer.buffer_info()[0])
            try:
                answer = fcntl.ioctl(sock.fileno(), _SIOCGIFCONF, request)
            except OSError:
                return []
            used = struct.unpack("iL", answer)[0]
            if used < len(buffer):  # all of them fitted
                break
            count *= 2
    raw = buffer.tobytes()[:used]
    found = []
    for at in range(0, used, _IFREQ_BYTES):
        name = raw[at : at + 16].split(b"\0", 1)[0].decode(errors="replace").split(":", 1)[0]
        # the union holds a struct sockaddr_in: family (2 bytes), port (2), address (4)
        found.append((name, socket.inet_ntoa(raw[at + 20 : at + 24])))
    return found


def _ipv6_addresses() -> list[tuple[str, str]]:
    try:
        rows = Path("/proc/net/if_inet6").read_text().splitlines()
    except OSError:
        return []
    found = []
    for row in rows:
        cols = row.split()
        if len(cols) == 6 and len(cols[0]) == 32:
            found.append((cols[5], str(ipaddress.IPv6Address(bytes.fromhex(cols[0])))))
    return found


def local_address_toward(peer: str) -> str:
    """This machine's address on the route to ``peer`` (``peer`` itself when it is a
    loopback address or one of this machine's); ``peer`` when there is no route."""
    if is_loopback(peer):
        return peer
    family = socket.AF_INET6 if ":" in peer else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((peer, 9))  # a UDP connect sends nothing: it only picks the route
            return s.getsockname()[0]
    except OSError:
        return peer


def interface_toward(address: str) -> str | None:
    """The interface of this machine that carries ``address`` (on the driver's machine) or
    this machine's route to it (elsewhere); the loopback interface for a loopback address;
    None when it cannot be told (a name that does not resolve, a platform whose interfaces
    are not read here)."""
    if is_loopback(address):
        return interface_for(address, interface_addresses()) or loopback_interface()
    ip = _ip(address)
    if ip is None:  # a host name: the address it resolves to
        with contextlib.suppress(OSError, IndexError):
            address = socket.getaddrinfo(address, None, type=socket.SOCK_STREAM)[0][4][0]
        if _ip(address) is None:
            return None
        if is_loopback(address):
            return interface_toward(address)
    return interface_for(local_address_toward(address), interface_addresses())


def interface_env(address: str) -> dict[str, str]:
    """The variables (:data:`INTERFACE_VARIABLES`) that make a process's TensorPipe, gloo and
    NCCL listeners bind to :func:`interface_toward` ``address``, for the caller to set.

    On a loopback address all of them, whatever the environment says (a local run listens on
    loopback only); otherwise those the environment does not set already (a user's own
    choice stands), and none when the interface cannot be told (the transports then choose
    from the host name, as they do by themselves)."""
    name = interface_toward(address)
    if name is None:
        return {}
    if is_loopback(address):
        return dict.fromkeys(INTERFACE_VARIABLES, name)
    return {key: name for key in INTERFACE_VARIABLES if key not in os.environ}
