"""Joining a running world with the run's join secret: a handshake through the rendezvous store.

A world that takes workers joining it while it runs (``ActorSystem(joiners=...)``) has a
secret, which the driver and every joiner hold and never send. Each side proves that it
knows it with an HMAC-SHA256 over fresh nonces, compared in constant time:

1. The driver puts its nonce under :data:`HELLO_KEY`; the key is there while it takes joins.
2. A joiner pushes an ask onto the queue :data:`ASKS_KEY`: its own nonce, where it runs, and
   ``proof(secret, "joiner", driver nonce, joiner nonce, host, pid)``.
3. The driver's :class:`JoinDesk` pops each ask. A wrong proof gets a refusal and nothing of
   the run, no name and no rank; a right one gets the next free name and rank with what the
   driver offers joiners (threads, timeouts, environment), and the driver's own proof over
   exactly that answer, ``proof(secret, "driver", driver nonce, joiner nonce, answer)``, under
   :func:`answer_key` of the joiner's nonce.
4. The joiner checks the driver's proof before it reads the answer or starts RPC, so a
   process that does not know the secret (a spoofed driver, another run at that address)
   never gets to send it anything that is unpickled. It joins the RPC world under the name
   and rank given, and its arrival call carries ``proof(secret, "arrive", driver nonce,
   joiner nonce, name)``, which the driver checks before it takes the worker: only then does
   it build actors there and send the run's config, prompts and weights.

The nonces make every proof good once: an ask or an answer seen on the wire cannot be
replayed to another run or another joiner, and an ask's nonce is taken once.

What the secret does not do: the rendezvous store and TensorPipe's ports take connections and
commands from anyone who reaches them, without it (that is how torch's RPC is built). The
secret gates joining the run through digen, in both directions; it does not make those ports
safe to expose. A run that takes joiners must be on a private network; see docs/RUNTIME.md.
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from digen.runtime.transport.actors._transport import (
    _RANKS_KEY,
    _TOKEN_KEY,
    _client_store,
    _release_token_of,
    _token,
    wire_name,
)
from digen.runtime.transport.join_secret import SECRET_ENV, proof, proven

HELLO_KEY = "digen/join/hello"
ASKS_KEY = "digen/join/asks"
_NONCE_HEX = 32  # 128 bits
_WAKE = b""  # pushed by :meth:`JoinDesk.close` to end the desk's wait for the next ask
_REFUSED_SECRET = "secret"


class JoinRefused(RuntimeError):
    """A running world did not take this process (none at the address, or it takes no
    joins, or it refused this one), or the process there could not prove it is the run."""


def answer_key(joiner_nonce: str) -> str:
    """The store key of the driver's answer to the ask with ``joiner_nonce``."""
    return f"digen/join/answer/{joiner_nonce}"


def _nonce() -> str:
    return secrets.token_hex(_NONCE_HEX // 2)


def _json(raw: bytes) -> Any:
    """``raw`` read as JSON; None when it is not (whoever reaches the store may write it)."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return None


def _is_nonce(value: object) -> bool:
    return (
        isinstance(value, str)
        and len(value) == _NONCE_HEX
        and all(c in "0123456789abcdef" for c in value)
    )


# --------------------------------------------------------------------------------------
# The driver's side
# --------------------------------------------------------------------------------------


class JoinDesk:
    """The driver's side of the handshake: answers each joiner's ask (popped from the
    rendezvous store at ``address:port`` on a thread of its own) and checks each arrival.

    ``pool`` names the joiners (``pool-first_number``, then the next numbers); ``offer`` is
    what every one is told besides its name and rank (JSON-able). Ranks are taken from the
    store's counter of ranks, as the driver's own restarts take theirs.

    A joiner that fails in the middle of torch's join keeps the world's membership token,
    and every later join would wait for it: a thread of the desk watches the token, and
    releases it on a joiner's behalf once that joiner has held it for ``hold_s`` (a join
    holds it for the seconds it takes to greet the members).
    """

    def __init__(
        self,
        address: str,
        port: int,
        secret: str,
        *,
        pool: str,
        first_number: int,
        offer: Mapping[str, Any],
        hold_s: float = 120.0,
    ) -> None:
        self._secret = secret
        self._nonce = _nonce()
        self._pool = pool
        self._number = first_number
        self._offer = dict(offer)
        self._lock = threading.Lock()
        self._pending: dict[str, str] = {}  # name given -> the nonce of the ask it answered
        self._seen: set[str] = set()  # joiner nonces taken
        self._closed = threading.Event()
        self._address, self._port = address, port
        self._store: Any = None
        self._thread: threading.Thread | None = None
        self._hold_s = hold_s
        self._tokens: dict[str, str] = {}  # the token a given name's join holds -> the name
        self._held: tuple[str, float] = ("", 0.0)  # the token seen held, and since when

    @property
    def nonce(self) -> str:
        """The driver's nonce for this run (what :data:`HELLO_KEY` holds)."""
        return self._nonce

    def open(self) -> None:
        """Start answering asks, and say so in the store (:data:`HELLO_KEY`)."""
        # Two connections of its own: one waits for the next ask, the other answers (and
        # wakes the first at close); the driver's RPC agent keeps its own.
        self._store = _client_store(self._address, self._port, 60.0)
        asks = _client_store(self._address, self._port, 60.0)
        asks.set_timeout(timedelta(days=1))  # an idle run waits for asks as long as it runs
        self._thread = threading.Thread(
            target=self._serve, args=(asks,), name="digen-join-desk", daemon=True
        )
        self._thread.start()
        watch = _client_store(self._address, self._port, 60.0)
        threading.Thread(
            target=self._watch, args=(watch,), name="digen-join-token", daemon=True
        ).start()
        self._store.set(HELLO_KEY, json.dumps({"nonce": self._nonce}))

    def close(self) -> None:
        """Stop answering asks (those not answered yet never are); idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self._store is not None:
            with contextlib.suppress(Exception):  # the store may be gone already
                self._store.delete_key(HELLO_KEY)
                self._store.queue_push(ASKS_KEY, _WAKE)

    def _serve(self, asks: Any) -> None:
        while not self._closed.is_set():
            try:
                raw = asks.queue_pop(ASKS_KEY, True)
            except Exception:  # noqa: BLE001 (the store is gone: the run is stopping)
                return
            if self._closed.is_set():
                return
            try:
                reply = self.answer(raw)
                if reply is not None:
                    self._store.set(*reply)
            except Exception:  # noqa: BLE001 (one ask's failure must not close the desk)
                logging.getLogger("digen").exception("a join ask could not be answered")

    def _watch(self, store: Any) -> None:
        while not self._closed.wait(1.0):
            try:
                self.release_stuck_token(store, time.monotonic())
            except Exception:  # noqa: BLE001 (the store is gone: the run is stopping)
                return

    def release_stuck_token(self, store: Any, now: float) -> str | None:
        """If a joiner has held the membership token for over ``hold_s`` by ``now`` (seen
        by the calls so far), release it on its behalf and return its name."""
        held = store.get(_TOKEN_KEY).decode() if store.check([_TOKEN_KEY]) else ""
        if held != self._held[0]:
            self._held = (held, now)
            return None
        with self._lock:
            name = self._tokens.get(held)
        if name is None or now - self._held[1] <= self._hold_s:
            return None
        if not _release_token_of(store, wire_name(name, 0)):
            return None
        logging.getLogger("digen").warning(
            f"{name} held the run's membership token for over {self._hold_s:g} s without "
            "finishing its join; it was released so that later joins go on."
        )
        return name

    def answer(self, raw: bytes) -> tuple[str, str] | None:
        """The answer to one ask, as ``(store key, value)``; None for what is not an ask, or
        an ask whose nonce was taken already (a replay: it gets nothing)."""
        ask = _json(raw)
        if not isinstance(ask, dict) or not _is_nonce(ask.get("nonce")):
            return None
        joiner, host, pid = ask["nonce"], str(ask.get("host", "?")), str(ask.get("pid", "?"))
        with self._lock:
            if joiner in self._seen:
                return None
            self._seen.add(joiner)
            if not proven(self._secret, ask.get("proof"), "joiner", self._nonce, joiner, host, pid):
                logging.getLogger("digen").warning(
                    f"a process (host {host[:64]!r}, pid {pid[:16]!r}) asked to join the run "
                    "without its join secret; it was refused and given nothing."
                )
                return answer_key(joiner), json.dumps({"refused": _REFUSED_SECRET})
            name = f"{self._pool}-{self._number}"
            self._number += 1
            self._pending[name] = joiner
            wire_as = wire_name(name, 0)  # a new name: its first incarnation
            self._tokens[_token(wire_as)] = name
        rank = self._store.add(_RANKS_KEY, 1)
        body = json.dumps({"name": name, "wire": wire_as, "rank": rank, "offer": self._offer})
        signed = proof(self._secret, "driver", self._nonce, joiner, body)
        return answer_key(joiner), json.dumps({"answer": body, "proof": signed})

    def admit(self, name: str, given: object) -> str | None:
        """Whether the process arriving as ``name`` with proof ``given`` is the joiner the
        name was given to: None if so (once per name), else why not."""
        with self._lock:
            joiner = self._pending.get(name)
            if joiner is None or not proven(
                self._secret, given, "arrive", self._nonce, joiner, name
            ):
                return f"{name!r} did not prove that it is the joiner the run gave that name to"
            del self._pending[name]
        return None


# --------------------------------------------------------------------------------------
# The joiner's side
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Slot:
    """What the driver gave this joiner: its name, the name it joins the RPC world under
    (``wire``) and its rank there, the offer, and the proof its arrival call carries."""

    name: str
    wire: str
    rank: int
    offer: dict[str, Any]
    arrival_proof: str


def ask_to_join(store: Any, secret: str, where: str, host: str, pid: int, deadline: float) -> Slot:
    """Ask the driver serving ``store`` (at ``where``; it has said hello) for a slot, and
    check that its answer comes from a process that knows ``secret``. Waits for the answer
    until ``time.monotonic()`` passes ``deadline``; raises :class:`JoinRefused` with one
    sentence."""
    hello = _json(store.get(HELLO_KEY))
    driver = hello.get("nonce") if isinstance(hello, dict) else None
    if not _is_nonce(driver):
        raise JoinRefused(f"the process at {where} is not a digen run that takes joins.")
    joiner = _nonce()
    ask = {
        "nonce": joiner,
        "host": host,
        "pid": pid,
        "proof": proof(secret, "joiner", driver, joiner, host, str(pid)),
    }
    store.queue_push(ASKS_KEY, json.dumps(ask))
    key = answer_key(joiner)
    while not store.check([key]):
        if time.monotonic() > deadline:
            raise JoinRefused(f"the run at {where} did not answer this process's ask to join.")
        time.sleep(0.1)
    reply = _json(store.get(key))
    if isinstance(reply, dict) and reply.get("refused") == _REFUSED_SECRET:
        raise JoinRefused(
            f"the run at {where} refused this process: its join secret is not the run's "
            f"(check --secret-file or {SECRET_ENV})."
        )
    body = reply.get("answer") if isinstance(reply, dict) else None
    if not isinstance(body, str) or not proven(
        secret, reply.get("proof"), "driver", driver, joiner, body
    ):
        raise JoinRefused(
            f"the process at {where} could not prove that it knows the join secret, so it is "
            "not the run the secret is for: nothing was taken from it."
        )
    given = json.loads(body)
    name = given["name"]
    arrival_proof = proof(secret, "arrive", driver, joiner, name)
    return Slot(name, given["wire"], int(given["rank"]), given["offer"], arrival_proof)
