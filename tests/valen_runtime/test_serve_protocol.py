"""valen-serve's HTTP/1.1 protocol subclasses uvicorn's H11Protocol, which uvicorn does not document
as public: no uvicorn option times out a request's headers, answers the h11 parser's refusals in
the contract's JSON shape, or lets a connection refused mid-body linger until the client has read
the answer (serve/protocol.py). These tests pin what the subclass relies on, so a uvicorn upgrade
that changes it fails here, by name, rather than in a timing test of test_serve.py."""

from __future__ import annotations

import asyncio
import inspect
import re
from pathlib import Path

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol, RequestResponseCycle
from uvicorn.server import ServerState

from valen_runtime.serve.protocol import _protocol_class

ROOT = Path(__file__).resolve().parents[2]

# The overridden methods and the parameters the subclass calls them with (self first).
OVERRIDDEN = {
    "connection_made": ["self", "transport"],
    "connection_lost": ["self", "exc"],
    "data_received": ["self", "data"],
    "eof_received": ["self"],
    "handle_events": ["self"],
    "on_response_complete": ["self"],
    "send_400_response": ["self", "msg"],
}


def test_uvicorn_is_within_the_pinned_range():
    """pyproject.toml pins uvicorn below 1.0; the installed one is inside it."""
    pinned = re.search(r'"uvicorn>=([0-9.]+),<([0-9]+)"', (ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert pinned, "pyproject.toml no longer pins uvicorn with a lower and an upper bound"
    installed = tuple(int(part) for part in uvicorn.__version__.split(".")[:2])
    lower = tuple(int(part) for part in pinned.group(1).split(".")[:2])
    assert lower <= installed < (int(pinned.group(2)), 0)


def test_the_overridden_methods_exist_with_the_expected_parameters():
    for name, parameters in OVERRIDDEN.items():
        method = getattr(H11Protocol, name, None)
        assert callable(method), f"uvicorn's H11Protocol has no {name}"
        assert list(inspect.signature(method).parameters) == parameters, name
    protocol = _protocol_class(1.0)
    assert issubclass(protocol, H11Protocol) and set(OVERRIDDEN) <= set(vars(protocol))


def test_the_parser_refusals_go_through_send_400_response():
    """The JSON 400 relies on handle_events answering an h11 RemoteProtocolError via send_400_response."""
    source = inspect.getsource(H11Protocol.handle_events)
    assert "h11.RemoteProtocolError" in source and "self.send_400_response(" in source


def test_the_attributes_the_subclass_reads_are_set():
    """conn (an h11 server connection), cycle (None until a request's headers are complete), loop;
    transport once connected; a cycle's response_complete."""
    loop = asyncio.new_event_loop()
    try:
        config = uvicorn.Config(lambda scope, receive, send: None, lifespan="off", log_config=None)
        protocol = _protocol_class(1.0)(config=config, server_state=ServerState(), app_state={}, _loop=loop)
        assert isinstance(protocol.conn, h11.Connection) and protocol.conn.their_state is h11.IDLE
        assert protocol.cycle is None and protocol.loop is loop
        assert "response_complete" in inspect.getsource(RequestResponseCycle.__init__)
        assert "self.transport = transport" in inspect.getsource(H11Protocol.connection_made)
    finally:
        loop.close()


def test_a_body_json_cannot_hold_is_answered_500_in_the_contract_s_shape():
    """A response body with a NaN (a bug: the engine refuses NaN probabilities) is not sent as
    uvicorn's plain-text 500: the app answers {"detail": "inference failed"} and logs the error."""
    import json

    from valen_runtime.serve.app import WorkerApp
    from valen_runtime.serve.settings import Settings

    app = WorkerApp(executor=None, settings=Settings())
    app._health = lambda: (200, {"status": float("nan")})
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": "/health", "headers": []}
    asyncio.run(app(scope, receive, send))
    start, body = sent[0], b"".join(m.get("body", b"") for m in sent[1:])
    assert start["status"] == 500 and (b"content-type", b"application/json") in start["headers"]
    assert json.loads(body) == {"detail": "inference failed"}
