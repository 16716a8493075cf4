"""The join secret's handshake (``digen/runtime/transport/actors/_join.py``) over a real
rendezvous store on loopback: the driver's desk gives a name, a rank and the offer only to an
ask proven with the secret, answers each nonce once, and takes an arrival only with the proof
that goes with the name it gave; a joiner takes nothing from a process that cannot prove it
knows the secret, and ``digen join`` says so in one line without starting RPC.

A whole run joined with and without the secret: ``tests/runtime/test_elastic.py``; a world
of real worker processes: ``tests/runtime/test_actors.py``.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist
from helpers import JOIN_SECRET, digen_join, said_one_line

from digen.runtime.transport.actors import JoinRefused
from digen.runtime.transport.actors._join import (
    ASKS_KEY,
    HELLO_KEY,
    JoinDesk,
    answer_key,
    ask_to_join,
)
from digen.runtime.transport.actors._transport import (
    _RANKS_KEY,
    _TOKEN_KEY,
    _client_store,
    _token,
)
from digen.runtime.transport.join_secret import SECRET_ENV, proof, proven

OFFER = {"threads": 2, "rpc_threads": 4, "rpc_timeout_s": 60.0, "env": {}, "local_paths": []}


@pytest.fixture
def store() -> Iterator[dist.TCPStore]:
    """A rendezvous store served on loopback (a free port), its rank counter at 2 (the
    driver's own workers took ranks 1 and 2)."""
    served = dist.TCPStore("127.0.0.1", 0, -1, True, timedelta(seconds=30), wait_for_workers=False)
    served.add(_RANKS_KEY, 2)
    yield served


@pytest.fixture
def desk(store: dist.TCPStore) -> Iterator[JoinDesk]:
    """A driver's desk on ``store``, answering asks for ``generator-1`` and on."""
    opened = JoinDesk(
        "127.0.0.1", store.port, JOIN_SECRET, pool="generator", first_number=1, offer=OFFER
    )
    opened.open()
    yield opened
    opened.close()


def _client(store: dist.TCPStore) -> Any:
    return _client_store("127.0.0.1", store.port, 30.0)


def _ask(store: dist.TCPStore, secret: str) -> Any:
    """Ask ``store``'s desk to join with ``secret`` (a generous backstop for its answer)."""
    deadline = time.monotonic() + 60.0
    return ask_to_join(_client(store), secret, "127.0.0.1:1", "here", 7, deadline)


def test_a_proof_is_bound_to_the_secret_and_to_every_part() -> None:
    signed = proof(JOIN_SECRET, "arrive", "a", "b", "generator-1")
    assert proven(JOIN_SECRET, signed, "arrive", "a", "b", "generator-1")
    assert not proven(JOIN_SECRET + "x", signed, "arrive", "a", "b", "generator-1")
    assert not proven(JOIN_SECRET, signed, "arrive", "a", "b", "generator-2")
    assert not proven(JOIN_SECRET, signed, "arrive", "a", "b", "generator-1", "")
    assert not proven(JOIN_SECRET, signed, "arrive", "a,b", "generator-1")  # no run-ons
    assert not proven(JOIN_SECRET, None, "arrive", "a", "b", "generator-1")
    assert not proven(JOIN_SECRET, "é", "arrive", "a", "b", "generator-1")


def test_the_secret_gets_a_name_a_rank_and_the_offer_and_its_arrival_is_taken_once(
    store: dist.TCPStore, desk: JoinDesk
) -> None:
    first, second = _ask(store, JOIN_SECRET), _ask(store, JOIN_SECRET)
    assert (first.name, first.rank, first.offer) == ("generator-1", 3, OFFER)
    assert (second.name, second.rank) == ("generator-2", 4)
    assert json.loads(store.get(HELLO_KEY))["nonce"] == desk.nonce
    # the arrival must carry the proof that goes with the name
    assert desk.admit("generator-1", second.arrival_proof) is not None
    assert desk.admit("generator-3", first.arrival_proof) is not None  # a name not given
    assert desk.admit("generator-1", first.arrival_proof) is None
    assert desk.admit("generator-1", first.arrival_proof) is not None  # taken once
    assert desk.admit("generator-2", second.arrival_proof) is None


def test_a_wrong_secret_is_refused_and_given_nothing(store: dist.TCPStore, desk: JoinDesk) -> None:
    with pytest.raises(JoinRefused) as refused:
        _ask(store, "not-the-secret-of-this-run")
    assert str(refused.value) == (
        "the run at 127.0.0.1:1 refused this process: its join secret is not the run's "
        f"(check --secret-file or {SECRET_ENV})."
    )
    assert int(store.add(_RANKS_KEY, 0)) == 2  # no rank taken
    assert _ask(store, JOIN_SECRET).name == "generator-1"  # no name taken either


def test_an_ask_is_answered_once_and_garbage_not_at_all(desk: JoinDesk) -> None:
    """Asks handed to the desk here (its answers read here, not from the store)."""
    joiner = "0123456789abcdef" * 2
    ask = {"nonce": joiner, "host": "h", "pid": 1}
    ask["proof"] = proof(JOIN_SECRET, "joiner", desk.nonce, joiner, "h", "1")
    answered = desk.answer(json.dumps(ask).encode())
    assert answered is not None and answered[0] == answer_key(joiner)
    body = json.loads(answered[1])["answer"]
    assert json.loads(body)["name"] == "generator-1"
    assert proven(JOIN_SECRET, json.loads(answered[1])["proof"], "driver", desk.nonce, joiner, body)
    assert desk.answer(json.dumps(ask).encode()) is None  # a replay gets nothing
    for garbage in (b"", b"\xff", b"[]", b"{}", b'{"nonce": "ab"}', b'{"nonce": 1}'):
        assert desk.answer(garbage) is None
    # an ask proven for another run (another driver nonce) is refused
    other = "fedcba9876543210" * 2
    stale = {
        **ask,
        "nonce": other,
        "proof": proof(JOIN_SECRET, "joiner", "x" * 32, other, "h", "1"),
    }
    refused = desk.answer(json.dumps(stale).encode())
    assert refused is not None and json.loads(refused[1]) == {"refused": "secret"}


def test_a_joiner_that_dies_holding_the_membership_token_does_not_block_later_joins(
    store: dist.TCPStore, desk: JoinDesk
) -> None:
    """A joiner that takes the world's membership token (torch's join does, with the wire
    name it was given) and dies there would make every later join wait for it: the desk
    releases it once it has been held for over ``hold_s`` (120 s here; the clock is the
    test's), and never a token it did not give out."""
    client = _client(store)
    slot = _ask(store, JOIN_SECRET)
    held_by_joiner = _token(slot.wire)
    assert client.compare_set(_TOKEN_KEY, "", held_by_joiner).decode() == held_by_joiner
    t0 = time.monotonic()
    assert desk.release_stuck_token(client, t0) is None  # seen held from now
    assert desk.release_stuck_token(client, t0 + 60) is None  # a join may take a while
    assert store.get(_TOKEN_KEY).decode() == held_by_joiner
    assert desk.release_stuck_token(client, t0 + 10_000) == slot.name
    assert store.get(_TOKEN_KEY) == b"" and store.get(held_by_joiner) == b"Done"  # waiters wake
    later = _token("generator_2:0")
    assert client.compare_set(_TOKEN_KEY, "", later).decode() == later  # the next join goes on
    client.set(_TOKEN_KEY, "")
    # the driver's own hold (editing the list of members) is not a joiner's: left alone
    driver = _token("driver-unlists-generator_1:0")
    client.compare_set(_TOKEN_KEY, "", driver)
    t1 = time.monotonic()
    assert desk.release_stuck_token(client, t1) is None
    assert desk.release_stuck_token(client, t1 + 10_000) is None
    assert store.get(_TOKEN_KEY).decode() == driver


def _spoof(store: dist.TCPStore, answer: dict[str, Any] | str) -> threading.Thread:
    """A process at the run's address that does not know the secret: it says hello, takes
    the first ask, and answers it with ``answer`` (whatever it can make without the secret;
    a string is written as it is)."""
    store.set(HELLO_KEY, json.dumps({"nonce": "0" * 32}))
    client = _client(store)
    client.set_timeout(timedelta(seconds=300))

    def serve() -> None:
        ask = json.loads(client.queue_pop(ASKS_KEY, True))
        text = answer if isinstance(answer, str) else json.dumps(answer)
        client.set(answer_key(ask["nonce"]), text)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


SPOOFED = {
    "forged proof": {
        "answer": json.dumps({"name": "generator-1", "rank": 1, "offer": OFFER}),
        "proof": "0" * 64,
    },
    "no proof": {"answer": json.dumps({"name": "generator-1", "rank": 1, "offer": OFFER})},
    "not an answer": {"rewards": [1.0]},
    "not JSON": "[" * 100_000,  # nested past what a JSON reader takes
}


@pytest.mark.parametrize("answer", list(SPOOFED.values()), ids=list(SPOOFED))
def test_digen_join_takes_nothing_from_a_process_that_cannot_prove_the_secret(
    store: dist.TCPStore, answer: dict[str, Any] | str
) -> None:
    """``digen join`` with the right secret, at an address where something else answers:
    one sentence, exit 1, and it never started RPC there (its rendezvous writes keys)."""
    spoof = _spoof(store, answer)
    where = f"127.0.0.1:{store.port}"
    done = digen_join(where, "--wait", "60", env={SECRET_ENV: JOIN_SECRET})
    said_one_line(
        done,
        1,
        f"error: the process at {where} could not prove that it knows the join secret, so it "
        "is not the run the secret is for: nothing was taken from it.",
    )
    spoof.join(timeout=60)
    assert not spoof.is_alive()
    keys = set(store.list_keys())  # hello, the rank counter, one answer: nothing of RPC's
    answers = {k for k in keys if k.startswith("digen/join/answer/")}
    assert len(answers) == 1 and keys - answers == {HELLO_KEY, _RANKS_KEY}, keys


def test_digen_join_leaves_an_address_whose_hello_is_not_a_runs(store: dist.TCPStore) -> None:
    store.set(HELLO_KEY, "[" * 100_000)
    where = f"127.0.0.1:{store.port}"
    done = digen_join(where, env={SECRET_ENV: JOIN_SECRET})
    said_one_line(done, 1, f"error: the process at {where} is not a digen run that takes joins.")
    assert store.queue_len(ASKS_KEY) == 0  # it asked nothing
