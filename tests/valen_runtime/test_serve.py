"""valen-serve: a real server process on 127.0.0.1 with the tiny export on the CPU, driven by real
HTTP clients (http.client, and raw sockets for hostile framing): every status code, limits at and
past each boundary, hostile bodies, admission (queue full -> 503 while /health stays ready),
SIGTERM mid-request, answers equal to valen-run's, one log line per request, no temporary files.
"""

from __future__ import annotations

import base64
import concurrent.futures
import hashlib
import http.client
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import zlib

import pytest
from click.testing import CliRunner

from valen_runtime.errors import RequestError
from valen_runtime.wire import MAX_BODY, MAX_IMAGE_BYTES, MAX_TEXT, MAX_VIDEO_BODY, encode_response, response_body

from .conftest import rest_of_stderr, start_serve

MODEL = "valen-preview-0923"
HEALTH = {"status": "ready", "model": MODEL, "modality": "multimodal"}
READ_TIMEOUT = 3.0  # the module server's --read-timeout: short, yet long enough to hold requests open on 2 busy cores
QUEUE_SIZE = 8
BODY_READS, BODY_READS_PER_CLIENT = 12, 10  # the module server's --max-body-reads and --max-body-reads-per-client
LARGE_BODY_READS = 1  # ... and its --max-large-body-reads


# ---------------------------------------------------------------- a server process


class Worker:
    """`python -m valen_runtime.serve` on a free port; its stderr JSON lines collected as they come."""

    def __init__(self, export, tmp_path, *options: str, device: str = "cpu"):
        self.tmpdir = tmp_path / "tmpdir"  # TMPDIR of the server: request-scoped files would land here
        self.tmpdir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, TMPDIR=str(self.tmpdir), PYTHONUNBUFFERED="1")
        self.proc = start_serve("--export", str(export), "--port", "0", "--device", device, *options, env=env)
        self.lines: list[dict] = []
        self.raw_lines: list[str] = []
        self._changed = threading.Condition()
        self._closed = False  # stderr reached its end
        threading.Thread(target=self._collect, daemon=True).start()
        # On CUDA the warmup compiles and captures every warmup shape: about 4 minutes on the H200
        # beside three other test processes compiling (gpu_run.sh's tests step).
        self.port = self.wait_for(lambda line: line.get("event") == "ready", 180 if device == "cpu" else 480)["port"]

    def _collect(self) -> None:
        for raw in self.proc.stderr:
            with self._changed:
                self.raw_lines.append(raw)
                try:
                    self.lines.append(json.loads(raw))
                except ValueError:
                    pass
                self._changed.notify_all()
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def wait_for(self, predicate, timeout: float = 30.0) -> dict:
        """The first log line matching `predicate`, waiting for it up to `timeout` seconds."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for line in self.lines:
                    if predicate(line):
                        return line
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    raise AssertionError(f"no matching log line; exit {self.proc.poll()}; log:\n{''.join(self.raw_lines)[-3000:]}")
                self._changed.wait(min(left, 0.5))

    def requests_logged(self, request_id: str) -> list[dict]:
        with self._changed:
            return [line for line in self.lines if line.get("event") == "request" and line.get("id") == request_id]

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout)


def http_call(port: int, method: str, path: str, body: bytes = b"", headers: dict | None = None, timeout: float = 120.0,
              source: str | None = None):
    """One request on its own connection (from the loopback address `source`): (status, headers, JSON body)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout, source_address=(source, 0) if source else None)
    conn.putrequest(method, path, skip_accept_encoding=True)
    sent = {"Content-Type": "application/json", "Content-Length": str(len(body))} if method == "POST" else {}
    sent.update(headers or {})
    for name, value in sent.items():
        if value is not None:
            conn.putheader(name, value)
    conn.endheaders(body or None)
    response = conn.getresponse()
    data = response.read()
    conn.close()
    return response.status, dict(response.getheaders()), data


def post(port: int, payload, headers: dict | None = None, source: str | None = None):
    body = payload if isinstance(payload, bytes) else json.dumps(payload, ensure_ascii=False).encode()
    status, response_headers, data = http_call(port, "POST", "/v1/systemone", body, headers, source=source)
    return status, json.loads(data), response_headers


def head_bytes(length: int | None, extra: bytes = b"", content_type: bytes = b"application/json") -> bytes:
    lines = [b"POST /v1/systemone HTTP/1.1", b"Host: 127.0.0.1", b"Connection: close"]
    if content_type:
        lines.append(b"Content-Type: " + content_type)
    if length is not None:
        lines.append(b"Content-Length: %d" % length)
    return b"\r\n".join(lines) + b"\r\n" + extra + b"\r\n"


def read_response(sock: socket.socket, timeout: float = 30.0) -> tuple[int, dict]:
    """Read until the server closes; the status and the JSON body of the first response."""
    sock.settimeout(timeout)
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = next(int(v) for k, v in (ln.split(b":", 1) for ln in head.split(b"\r\n")[1:]) if k.strip().lower() == b"content-length")
    return status, json.loads(rest[:length])


def raw_exchange(port: int, data: bytes, timeout: float = 30.0) -> tuple[int, dict]:
    """Send `data` while reading: the server may answer and close before a refused body is sent."""

    def send(sock):
        try:
            sock.sendall(data)
        except OSError:
            pass

    with socket.create_connection(("127.0.0.1", port)) as sock:
        sender = threading.Thread(target=send, args=(sock,), daemon=True)
        sender.start()
        answer = read_response(sock, timeout)
        sender.join(timeout)
        return answer


def open_partial(port: int, body: bytes, sent: int, source: str = "127.0.0.1") -> socket.socket:
    """A request (from the loopback address `source`) whose headers and first `sent` body bytes are
    on the wire; the rest is held back."""
    sock = socket.create_connection(("127.0.0.1", port), source_address=(source, 0))
    sock.sendall(head_bytes(len(body)) + body[:sent])
    return sock


def text_request(state: str = "The card was charged twice for one order.", questions: dict | None = None) -> dict:
    return {"model": MODEL, "state": state, "questions": questions or {"q": {"type": "choice", "instructions": "What should support do?", "criteria": {"refund": "Refund it", "wait": "Wait"}}}}


MIXED = {
    "next": {"type": "choice", "instructions": "What next?", "criteria": {"refund": "Refund it", "wait": "Wait", "ask": None}},
    "dup": {"type": "noul", "instructions": "Is it a duplicate?"},
    "urgency": {"type": "score", "instructions": "How urgent?", "criteria": ["low", "medium", "high"]},
}


def png_bytes(width: int, height: int, pad_to: int | None = None) -> bytes:
    """A PNG of a gradient; with pad_to, a private ancillary chunk makes the file exactly that long."""
    from PIL import Image

    image = Image.new("RGB", (width, height))
    image.putdata([((x * 9) % 256, (y * 13) % 256, (x * y) % 256) for y in range(height) for x in range(width)])
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    data = buffer.getvalue()
    if pad_to is None:
        return data
    n = pad_to - len(data) - 12  # a chunk is length (4) + type (4) + data + CRC (4)
    chunk_type = b"vaLn"  # lower-case first letter: ancillary, decoders skip it
    chunk = n.to_bytes(4, "big") + chunk_type + bytes(n) + zlib.crc32(chunk_type + bytes(n)).to_bytes(4, "big")
    padded = data[:33] + chunk + data[33:]  # after IHDR (8-byte signature + 25-byte IHDR chunk)
    assert len(padded) == pad_to
    return padded


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode("ascii")


def mp4_url(data: bytes) -> str:
    return "data:video/mp4;base64," + base64.b64encode(data).decode("ascii")


def _clip() -> bytes:
    from valen_export.clips import encode_clip

    return encode_clip("mp4", "libx264", 10, 30, 64, 48)  # 3 s: three frame pairs of 4 tokens


CLIP = _clip()


@pytest.fixture(scope="module")
def worker(tiny_export, tmp_path_factory):
    server = Worker(tiny_export["separate"], tmp_path_factory.mktemp("serve"), "--queue-size", str(QUEUE_SIZE),
                    "--read-timeout", str(READ_TIMEOUT), "--request-timeout", "120",
                    "--max-body-reads", str(BODY_READS), "--max-body-reads-per-client", str(BODY_READS_PER_CLIENT),
                    "--max-large-body-reads", str(LARGE_BODY_READS))
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def engine(tiny_export):
    from valen_runtime.engine import Engine
    from valen_runtime.options import EngineOptions

    return Engine.load(tiny_export["separate"], EngineOptions(device="cpu"))


_expected: dict[str, bytes] = {}


def expected_bytes(engine, request: dict) -> bytes:
    """The body valen-serve must send: the engine's answer as the wire body (computed once per request)."""
    key = json.dumps(request, sort_keys=True)
    if key not in _expected:
        _expected[key] = encode_response(response_body(engine.run(request).response))
    return _expected[key]


# A state at the 16,384-character limit that runs for seconds on the CPU (about 4,100 tokens):
# long enough to be mid-run when a signal or a timeout arrives.
HEAVY_STATE = ("The card was charged twice. " * 600)[:MAX_TEXT]


# ---------------------------------------------------------------- routes and answers


def test_health_and_unknown_routes(worker):
    status, headers, data = http_call(worker.port, "GET", "/health")
    assert status == 200 and json.loads(data) == HEALTH and headers["content-type"] == "application/json"
    for method, path in (("GET", "/nope"), ("POST", "/health"), ("GET", "/v1/systemone"), ("PUT", "/v1/systemone"), ("GET", "/health/")):
        status, _, data = http_call(worker.port, method, path, b"{}" if method != "GET" else b"",
                                    {"Content-Type": "application/json", "Content-Length": "2"} if method != "GET" else None)
        assert (status, json.loads(data)) == (404, {"detail": "unknown route"}), (method, path)


def test_answers_equal_valen_runs(worker, tiny_export, tmp_path, engine):
    from valen_runtime.cli import main as valen_run

    image = {"model": MODEL, "state": {"image": data_url(png_bytes(60, 40))}, "questions": MIXED}
    video = {"model": MODEL, "state": {"video": mp4_url(CLIP)}, "questions": MIXED}
    for name, request in (("text", text_request(questions=MIXED)), ("image", image), ("video", video)):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(request))
        printed = CliRunner().invoke(valen_run, ["--export", str(tiny_export["separate"]), "--device", "cpu", str(path)])
        assert printed.exit_code == 0, printed.output
        status, headers, data = http_call(worker.port, "POST", "/v1/systemone", path.read_bytes())
        assert status == 200
        assert data == printed.output.rstrip("\n").encode("utf-8")  # byte for byte, key order included
        assert list(json.loads(data)["answers"]["next"]) == ["type", "choice", "probabilities", "confidence"]
    messages = {"model": MODEL, "questions": {"q": {"type": "choice", "instructions": {"goal": "route"}, "criteria": {"a": "A", "b": ["b", 2]}}},
                "state": {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(png_bytes(30, 50))}},
                                                                    {"type": "text", "text": "Which? 哪个?"}]}]}}
    status, _, data = http_call(worker.port, "POST", "/v1/systemone", json.dumps(messages).encode())
    assert status == 200 and data == expected_bytes(engine, messages)


def test_concurrent_requests_answer_as_sequential_ones(worker, engine):
    requests = [text_request(f"Order {i} was charged {i % 3 + 2} times.", MIXED if i % 2 else None) for i in range(8)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda r: http_call(worker.port, "POST", "/v1/systemone", json.dumps(r).encode()), requests))
    for request, (status, _, data) in zip(requests, answers):
        assert status == 200 and data == expected_bytes(engine, request)


def test_one_log_line_per_request_with_its_id(worker):
    status, body, headers = post(worker.port, text_request(), {"X-Request-Id": "abc-123"})
    assert status == 200 and headers["x-request-id"] == "abc-123"
    worker.wait_for(lambda ln: ln.get("id") == "abc-123")  # logged once the answer is sent
    (line,) = worker.requests_logged("abc-123")
    assert line["status"] == 200 and line["method"] == "POST" and line["path"] == "/v1/systemone"
    assert line["input_tokens"] == body["usage"]["input_tokens"] and line["compute_tokens"] == body["internal_usage"]["compute_tokens"]
    assert line["ms"] >= line["run_ms"] >= line["model_ms"] > 0 and line["prepare_ms"] > 0 and "graph" not in line  # no CUDA graphs on the CPU
    status, body, headers = post(worker.port, text_request(state=""), {"X-Request-Id": "bad id with spaces"})
    assert status == 422 and headers["x-request-id"] != "bad id with spaces"
    worker.wait_for(lambda ln: ln.get("id") == headers["x-request-id"])
    (line,) = worker.requests_logged(headers["x-request-id"])
    assert line["status"] == 422 and line["detail"] == body["detail"]


# ---------------------------------------------------------------- headers: 411 / 400 / 413 / 415


def test_header_refusals(worker):
    port = worker.port
    chunked = head_bytes(None, b"Transfer-Encoding: chunked\r\n") + b"2\r\n{}\r\n0\r\n\r\n"
    assert raw_exchange(port, chunked) == (411, {"detail": "Content-Length is required; chunked request bodies are not accepted"})
    assert raw_exchange(port, head_bytes(None)) == (411, {"detail": "exactly one Content-Length header is required"})
    status, body = raw_exchange(port, head_bytes(2, b"Content-Length: 3\r\n") + b"{}")  # conflicting: the HTTP parser refuses the framing
    assert status == 400 and "malformed HTTP request" in body["detail"]
    status, body = raw_exchange(port, head_bytes(None, b"Content-Length: abc\r\n") + b"{}")
    assert status == 400 and set(body) == {"detail"}
    # Over the (video) body limit by its declared length: refused before a byte of the body is read.
    assert raw_exchange(port, head_bytes(MAX_VIDEO_BODY + 1)) == (413, {"detail": f"body is {MAX_VIDEO_BODY + 1} bytes; the limit is {MAX_VIDEO_BODY}"})
    assert raw_exchange(port, head_bytes(2, content_type=b"text/plain") + b"{}") == (415, {"detail": "Content-Type must be application/json"})
    assert raw_exchange(port, head_bytes(2, content_type=b"") + b"{}")[0] == 415
    for second in (b"text/plain", b"application/json"):  # a second Content-Type, conflicting or not
        two = raw_exchange(port, head_bytes(2, b"Content-Type: " + second + b"\r\n") + b"{}")
        assert two == (415, {"detail": "exactly one Content-Type header is allowed, got 2"}), second
    status, body, _ = post(port, text_request(), {"Content-Type": "Application/JSON; charset=utf-8"})
    assert status == 200 and body["model"] == MODEL


# ---------------------------------------------------------------- bodies: 400 / 413 / 422


@pytest.mark.parametrize("body, phrase", [
    (b"{not json", "invalid JSON"),
    (b'{"model": "valen-preview-0923", "state": NaN, "questions": {}}', "NaN"),
    (b'{"model": "valen-preview-0923", "state": "x", "state": "y", "questions": {}}', "duplicate key 'state'"),
    (b'{"a": Infinity}', "Infinity"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b'{"state": "\\ud83d"}', "lone surrogate"),
    (b'{"state": "\xff"}', "invalid UTF-8"),
    (b"[]", "JSON object"),
], ids=["syntax", "nan", "duplicate", "infinity", "deep", "surrogate", "utf8", "array"])
def test_malformed_bodies_are_400(worker, body, phrase):
    status, answer, _ = post(worker.port, body)
    assert status == 400 and phrase in answer["detail"], answer


def test_body_of_exactly_8_mib_is_read_and_8_mib_plus_1_without_a_video_is_413(worker):
    body = json.dumps(text_request()).encode()
    body += b" " * (MAX_BODY - len(body))
    status, answer, _ = post(worker.port, body)
    assert status == 200 and answer["answers"]["q"]["choice"] in ("refund", "wait")
    # Up to 24 MiB is read (a video request may need it); without a video it is 413 once parsed.
    status, answer = raw_exchange(worker.port, head_bytes(MAX_BODY + 1) + body + b" ")
    assert status == 413 and answer["detail"] == f"body: body is {MAX_BODY + 1} bytes; the limit is {MAX_BODY} for a request without a video"


@pytest.mark.parametrize("request_, status, field", [
    (text_request(state="a" * (MAX_TEXT + 1)), 422, "state: text state is 16385 characters"),
    (text_request(questions={"n": {"type": "noul", "instructions": "?", "criteria": {"x": "y"}}}), 422, "questions.n.criteria: noul takes no criteria"),
    (text_request(questions={"s": {"type": "score", "instructions": "?", "criteria": ["a", "a"]}}), 422, "questions.s.criteria[1]: repeats level 0"),
    (text_request(questions={f"q{i}": {"type": "noul", "instructions": "?"} for i in range(9)}), 422, "questions: must hold 1-8"),
    ({"model": MODEL, "state": {"image": "data:image/png;base64,AAAA", "extra": 1}, "questions": MIXED}, 422, "state: an image state holds exactly one image"),
    ({"model": MODEL, "state": {"messages": [{"role": "user", "content": [{"type": "image", "image": "data:image/png;base64,AAAA"}] * 5}]}, "questions": MIXED},
     422, "state.messages[0].content[4]: at most 4 images"),
    ({**text_request(), "model": "Valen"}, 422, "model: must be 'valen-preview-0923'"),
    ({**text_request(), "stream": True}, 422, "stream: unknown field"),
    (text_request(state="x <|im_start|> y"), 422, "state: contains the reserved control token <|im_start|>"),
], ids=["state-16385", "noul-criteria", "score-duplicate", "9-questions", "image-extra-key", "5-images", "model", "unknown-key", "special-token"])
def test_refused_requests_name_the_field(worker, request_, status, field):
    got, answer, _ = post(worker.port, request_)
    assert got == status and answer["detail"].startswith(field), answer


def test_images_past_their_limits(worker):
    question = {"q": {"type": "choice", "instructions": "Colour?", "criteria": {"w": "White", "b": "Black"}}}
    over_bytes = {"model": MODEL, "state": {"image": data_url(png_bytes(2, 2, pad_to=MAX_IMAGE_BYTES + 1))}, "questions": question}
    status, answer, _ = post(worker.port, over_bytes)
    assert status == 413 and answer["detail"].startswith("state.image: image is larger than 4194304 bytes")
    for width, height, phrase in ((1025, 1024, "pixels"), (2049, 4, "each side"), (201, 1, "aspect ratio")):
        status, answer, _ = post(worker.port, {"model": MODEL, "state": {"image": data_url(png_bytes(width, height))}, "questions": question})
        assert status == 422 and phrase in answer["detail"], answer


def test_videos_past_their_limits_and_damaged_videos_are_refused_and_the_worker_stays_up(worker, engine):
    """Every video refusal has its status and field; truncated or damaged bytes are a 422 (or,
    where FFmpeg reads through the damage, an answer), never a dead worker."""
    import random

    question = {"q": {"type": "choice", "instructions": "Colour?", "criteria": {"w": "White", "b": "Black"}}}

    def video_request(url, where="state"):
        state = {"video": url} if where == "state" else {
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Look"}, {"type": "video_url", "video_url": {"url": url}}]}]}
        return {"model": MODEL, "state": state, "questions": question}

    # 16 MiB + 1 of video: 413 from the base64 length alone, in a body over 8 MiB (a video's may be).
    over = mp4_url(bytes(16 * 1024 * 1024 + 1))
    status, answer, _ = post(worker.port, video_request(over))
    assert status == 413 and answer["detail"].startswith("state.video: video is larger than 16777216 bytes"), answer
    cases = [
        (video_request(mp4_url(CLIP[: len(CLIP) // 2])), "state.video: video cannot be decoded as mp4"),
        (video_request("data:video/mp4;base64,@@@@"), "state.video: invalid base64 payload"),
        (video_request("data:video/ogg;base64,AAAA"), "state.video: must be a data:video/mp4;base64"),
        (video_request(mp4_url(CLIP), "messages") | {"state": {"video": mp4_url(CLIP), "image": data_url(png_bytes(4, 4))}},
         "state: a video state holds exactly one video"),
        ({"model": MODEL, "questions": question, "state": {"messages": [{"role": "user", "content": [
            {"type": "video_url", "video_url": mp4_url(CLIP)}, {"type": "image", "image": data_url(png_bytes(4, 4))}]}]}},
         "state.messages[0].content[1]: a state holds images or one video, not both"),
        ({"model": MODEL, "questions": question, "state": {"messages": [{"role": "user", "content": [
            {"type": "video_url", "video_url": mp4_url(CLIP)}, {"type": "video_url", "video_url": mp4_url(CLIP)}]}]}},
         "state.messages[0].content[1]: at most one video per request"),
    ]
    for request, detail in cases:
        status, answer, _ = post(worker.port, request)
        assert status == 422 and answer["detail"].startswith(detail), (detail, answer)
    rng = random.Random(0)
    for _ in range(3):  # random damage inside the clip: decodes or is refused, never kills the worker
        damaged = bytearray(CLIP)
        for _ in range(4):
            damaged[rng.randrange(len(damaged))] = rng.randrange(256)
        status, answer, _ = post(worker.port, video_request(mp4_url(bytes(damaged))))
        assert status == 200 or (status == 422 and answer["detail"].startswith("state.video: ")), answer
    status, _, data = http_call(worker.port, "GET", "/health")
    assert status == 200 and json.loads(data) == HEALTH
    request = video_request(mp4_url(CLIP))
    status, _, data = http_call(worker.port, "POST", "/v1/systemone", json.dumps(request).encode())
    assert status == 200 and data == expected_bytes(engine, request)


def test_limits_are_accepted_at_the_boundary(worker, engine):
    question = {"q": {"type": "choice", "instructions": "Colour?", "criteria": {"w": "White", "b": "Black"}}}
    at_bytes = {"model": MODEL, "state": {"image": data_url(png_bytes(2, 2, pad_to=MAX_IMAGE_BYTES))}, "questions": question}
    long_state = ("customer " * 2000)[:MAX_TEXT]  # about 1,800 tokens: well under max_length
    many = {f"q{i}": {"type": "noul", "instructions": f"Is claim {i} true?"} for i in range(8)}
    options = {"q": {"type": "choice", "instructions": "Pick one.", "criteria": {f"k{i}": None for i in range(255)}}}
    for request in (at_bytes, text_request(state=long_state), text_request(questions=many), text_request(questions=options)):
        status, _, data = http_call(worker.port, "POST", "/v1/systemone", json.dumps(request).encode())
        assert status == 200 and data == expected_bytes(engine, request)


def png_header_claiming(width: int, height: int) -> bytes:
    """A valid 8 x 8 PNG whose IHDR claims another size (CRC fixed up)."""
    data = bytearray(png_bytes(8, 8))
    data[16:24] = width.to_bytes(4, "big") + height.to_bytes(4, "big")
    data[29:33] = zlib.crc32(bytes(data[12:29])).to_bytes(4, "big")
    return bytes(data)


def test_library_warnings_keep_the_log_one_json_object_per_line(worker):
    """Pillow warns on a palette image with an alpha per entry, and on a header past its own
    (much higher) pixel guard; neither may put raw text between the log's JSON lines."""
    from PIL import Image

    palette = Image.new("P", (6, 4))
    palette.putpalette([v for i in range(4) for v in (60 * i, 255 - 60 * i, 30 * i)])
    palette.putdata([(x + y) % 4 for y in range(4) for x in range(6)])
    buffer = io.BytesIO()
    palette.save(buffer, "PNG", transparency=bytes([0, 128, 255, 64]))
    question = {"q": {"type": "choice", "instructions": "Colour?", "criteria": {"w": "White", "b": "Black"}}}
    status, _, _ = post(worker.port, {"model": MODEL, "state": {"image": data_url(buffer.getvalue())}, "questions": question},
                        {"X-Request-Id": "palette"})
    assert status == 200
    status, answer, _ = post(worker.port, {"model": MODEL, "state": {"image": data_url(png_header_claiming(10_000, 10_000))}, "questions": question},
                             {"X-Request-Id": "bomb-warning"})
    assert status == 422 and answer["detail"] == "state.image: image is 10000x10000; each side must be at most 2048"
    worker.wait_for(lambda ln: ln.get("id") == "bomb-warning")
    with worker._changed:
        raw = list(worker.raw_lines)
    for line in raw:
        assert isinstance(json.loads(line), dict), line


# ---------------------------------------------------------------- hostile framing: 408, mismatched lengths


def test_slow_headers_and_slow_bodies_are_408(worker):
    def slow_body():
        with socket.create_connection(("127.0.0.1", worker.port)) as sock:
            sock.sendall(head_bytes(100) + b'{"model": ')
            return read_response(sock, READ_TIMEOUT + 30)

    def slow_headers():
        with socket.create_connection(("127.0.0.1", worker.port)) as sock:
            sock.sendall(b"POST /v1/systemone HTTP/1.1\r\nHost: x\r\n")
            return read_response(sock, READ_TIMEOUT + 30)

    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        body, headers = pool.submit(slow_body), pool.submit(slow_headers)
        assert body.result() == (408, {"detail": f"request body timed out: 10 of 100 bytes in {READ_TIMEOUT:g} s"})
        assert headers.result() == (408, {"detail": f"request headers timed out after {READ_TIMEOUT:g} s"})
    assert READ_TIMEOUT <= time.monotonic() - t0 < READ_TIMEOUT + 20
    assert http_call(worker.port, "GET", "/health")[0] == 200


def test_mismatched_content_length(worker):
    body = json.dumps(text_request()).encode()
    # Declared shorter than sent: the declared bytes are the body (not JSON), the rest is not HTTP.
    status, answer = raw_exchange(worker.port, head_bytes(len(body) - 10) + body)
    assert status == 400 and "invalid JSON" in answer["detail"]
    # Declared longer than sent, then the client closes its side: nobody is left to answer.
    with socket.create_connection(("127.0.0.1", worker.port)) as sock:
        sock.sendall(head_bytes(len(body) + 10) + body)
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(30)
        assert sock.recv(1024) == b""
    worker.wait_for(lambda ln: ln.get("status") == 499)
    assert http_call(worker.port, "GET", "/health")[0] == 200


# ---------------------------------------------------------------- admission: 503 while healthy


def test_full_queue_is_503_while_health_stays_ready(worker, engine):
    """queue_size + 1 requests admitted (one running, the others read and waiting): one more gets
    503 before its body is read, /health stays ready, and the admitted ones are all answered."""
    two = {f"q{i}": {"type": "noul", "instructions": f"Is claim {i} true?"} for i in range(2)}
    waiting = [text_request(f"Customer {i} was charged twice.") for i in range(QUEUE_SIZE)]
    with concurrent.futures.ThreadPoolExecutor(QUEUE_SIZE + 1) as pool:
        running = pool.submit(post, worker.port, text_request(HEAVY_STATE, two))  # two branches of 4,100 tokens: seconds on 2 cores
        time.sleep(0.5)  # running by now, so the next ones wait behind it
        answers = [pool.submit(http_call, worker.port, "POST", "/v1/systemone", json.dumps(r).encode()) for r in waiting]
        time.sleep(0.3)  # their bodies read and parsed: admitted
        status, answer, _ = post(worker.port, text_request())
        assert status == 503 and answer["detail"].startswith(f"worker busy: {QUEUE_SIZE + 1} requests admitted"), answer
        assert http_call(worker.port, "GET", "/health")[:1] == (200,)
        assert running.result()[0] == 200
        for request, answered in zip(waiting, answers):
            status, _, data = answered.result()
            assert status == 200 and data == expected_bytes(engine, request)


def test_idle_bodies_hold_no_inference_capacity(worker, engine):
    """As many requests as the worker admits send their headers and half their bodies, then idle:
    they hold body-read slots only, so a complete request is still answered at once (it used to get
    503 worker busy until their read timeout), and they are answered once their bodies come."""
    requests = [text_request(f"Customer {i} was charged twice.") for i in range(QUEUE_SIZE + 1)]
    bodies = [json.dumps(r).encode() for r in requests]
    held = [open_partial(worker.port, body, len(body) // 2) for body in bodies]
    try:
        assert http_call(worker.port, "GET", "/health")[0] == 200
        time.sleep(0.3)  # the event loop has read each one's headers
        status, answer, _ = post(worker.port, text_request())
        assert status == 200, answer
        for sock, body in zip(held, bodies):
            sock.sendall(body[len(body) // 2:])
        for sock, request in zip(held, requests):
            status, answer = read_response(sock, 120)
            assert status == 200 and encode_response(answer) == expected_bytes(engine, request)
    finally:
        for sock in held:
            sock.close()


def test_body_read_caps_are_503_per_client_and_in_total_while_health_stays_ready(worker, engine):
    """--max-body-reads-per-client idle bodies from one address: that address's next request is 503,
    another address's body is read; --max-body-reads in all: every address's next request is 503.
    /health answers ready throughout, and the held requests are answered once their bodies come."""
    requests = [text_request(f"Order {i} arrived late.") for i in range(BODY_READS)]
    bodies = [json.dumps(r).encode() for r in requests]
    sources = ["127.0.0.1"] * BODY_READS_PER_CLIENT + ["127.0.0.2"] * (BODY_READS - BODY_READS_PER_CLIENT)
    held = []
    try:
        held += [open_partial(worker.port, body, 10, source) for body, source in zip(bodies, sources[:BODY_READS_PER_CLIENT])]
        assert http_call(worker.port, "GET", "/health")[0] == 200
        time.sleep(0.3)  # the event loop has read each one's headers
        status, answer, _ = post(worker.port, text_request())
        assert (status, answer["detail"]) == (503, f"too many request bodies being read from 127.0.0.1: {BODY_READS_PER_CLIENT} (--max-body-reads-per-client)")
        # Another address's body is still read (a broken one: answered at once, within the held ones' read timeout).
        assert post(worker.port, b"{broken", source="127.0.0.2")[0] == 400
        held += [open_partial(worker.port, body, 10, source)
                 for body, source in zip(bodies[BODY_READS_PER_CLIENT:], sources[BODY_READS_PER_CLIENT:])]
        assert http_call(worker.port, "GET", "/health")[0] == 200
        time.sleep(0.3)
        status, answer, _ = post(worker.port, text_request(), source="127.0.0.3")
        assert (status, answer["detail"]) == (503, f"too many request bodies being read: {BODY_READS} (--max-body-reads)")
        status, _, data = http_call(worker.port, "GET", "/health")
        assert status == 200 and json.loads(data) == HEALTH
        # More bodies are being read than the worker admits: the extra ones' clients give up, the
        # others finish sending and are answered.
        for sock in held[QUEUE_SIZE + 1:]:
            sock.close()
        for sock, body in zip(held[:QUEUE_SIZE + 1], bodies):
            sock.sendall(body[10:])
        for sock, request in zip(held[:QUEUE_SIZE + 1], requests):
            status, answer = read_response(sock, 120)
            assert status == 200 and encode_response(answer) == expected_bytes(engine, request)
    finally:
        for sock in held:
            sock.close()


def test_bodies_over_8_mib_have_their_own_read_cap(worker):
    """Only a video request may be over 8 MiB (up to 24 MiB): --max-large-body-reads such bodies are
    read at once; one more is 503 before its body is read, while small bodies are still read."""
    large = MAX_BODY + 1024
    held = socket.create_connection(("127.0.0.1", worker.port))
    try:
        held.sendall(head_bytes(large) + b'{"model": ')
        time.sleep(0.3)  # the event loop has read its headers
        with socket.create_connection(("127.0.0.1", worker.port)) as sock:
            sock.sendall(head_bytes(large))
            status, answer = read_response(sock, 60)
        assert (status, answer["detail"]) == (503, f"too many bodies over {MAX_BODY} bytes being read: {LARGE_BODY_READS} (--max-large-body-reads)")
        assert post(worker.port, text_request())[0] == 200
    finally:
        held.close()
    time.sleep(0.3)  # the held body's slot is given back
    padded = json.dumps(text_request()).encode()
    padded = padded[:-1] + b" " * (large - len(padded)) + b"}"  # a complete large body, but no video
    status, answer, _ = post(worker.port, padded)
    assert (status, answer["detail"]) == (413, f"body: body is {large} bytes; the limit is {MAX_BODY} for a request without a video")


# ---------------------------------------------------------------- files


def test_requests_leave_no_temporary_files(worker):
    before = sorted(p.name for p in worker.tmpdir.iterdir())
    image = {"model": MODEL, "state": {"image": data_url(png_bytes(50, 70))}, "questions": MIXED}
    assert post(worker.port, image)[0] == 200
    assert post(worker.port, {**image, "state": {"image": data_url(png_bytes(2049, 2))}})[0] == 422
    assert post(worker.port, b"{broken")[0] == 400
    assert sorted(p.name for p in worker.tmpdir.iterdir()) == before


# ---------------------------------------------------------------- lifecycle: SIGTERM, startup refusals, 500, request timeout


@pytest.mark.parametrize("signum, again", [(signal.SIGTERM, None), (signal.SIGHUP, None), (signal.SIGTERM, signal.SIGINT)],
                         ids=["SIGTERM", "SIGHUP", "SIGTERM-then-SIGINT"])
def test_a_stop_signal_mid_request_answers_then_exits_0(tiny_export, tmp_path, engine, signum, again):
    """SIGHUP drains like SIGTERM: its default used to kill the worker mid-request (exit 129, an
    empty reply, no "stopped" line). A second signal while it drains (Ctrl-C twice) is logged and
    changes nothing: uvicorn's forced exit used to answer the accepted requests with plain-text 500s."""
    server = Worker(tiny_export["separate"], tmp_path, "--read-timeout", "30")
    try:
        waiting = text_request("Waiting in its body.")
        body = json.dumps(waiting).encode()
        sock = open_partial(server.port, body, 10)
        running = text_request(HEAVY_STATE)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            in_flight = pool.submit(http_call, server.port, "POST", "/v1/systemone", json.dumps(running).encode(), {"X-Request-Id": "running"})
            # Both requests must be parsed (admitted) before the signal: a connection whose request
            # has not arrived yet is closed by the shutdown, which is right, but not this test.
            assert http_call(server.port, "GET", "/health")[0] == 200
            time.sleep(0.5)
            signalled_at = time.time()
            server.proc.send_signal(signum)
            deadline = time.monotonic() + 10
            while True:  # the listening socket closes: new connections are refused
                try:
                    socket.create_connection(("127.0.0.1", server.port), timeout=1).close()
                except ConnectionRefusedError:
                    break
                assert time.monotonic() < deadline, f"still accepting connections after {signum!r}"
                time.sleep(0.05)
            if again is not None:
                server.proc.send_signal(again)
                server.wait_for(lambda ln: ln.get("event") == "signal" and ln.get("signal") == again)
            sock.sendall(body[10:])
            status, answer = read_response(sock, 60)
            assert status == 200 and encode_response(answer) == expected_bytes(engine, waiting)
            status, _, data = in_flight.result(timeout=120)
            assert status == 200 and data == expected_bytes(engine, running)
        assert server.proc.wait(timeout=60) == 0
        server.wait_for(lambda ln: ln.get("event") == "stopped")
        (line,) = server.requests_logged("running")
        assert line["ts"] - line["run_ms"] / 1e3 < signalled_at  # it was running when the signal came
    finally:
        sock.close()
        server.stop()


def test_startup_refuses_a_damaged_export_and_a_taken_port(tiny_export, tmp_path):
    damaged = tmp_path / "damaged"
    shutil.copytree(tiny_export["separate"], damaged)
    head = damaged / "valen_head.safetensors"
    data = bytearray(head.read_bytes())
    data[-1] ^= 1  # same size: only the full hash check sees it
    head.write_bytes(bytes(data))
    cmd = [sys.executable, "-m", "valen_runtime.serve", "--export", str(damaged), "--port", "0", "--device", "cpu"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
    assert result.returncode == 2 and len(errors) == 1 and "sha256" in errors[0] and "valen_head.safetensors" in errors[0], result.stderr
    assert "Traceback" not in result.stderr and '"event": "ready"' not in result.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        cmd = [sys.executable, "-m", "valen_runtime.serve", "--export", str(tiny_export["separate"]), "--port", str(port), "--device", "cpu"]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1].startswith(f"error: cannot bind 127.0.0.1:{port}"), result.stderr
    cmd = [sys.executable, "-m", "valen_runtime.serve", "--export", str(tiny_export["separate"]), "--queue-size", "-1", "--device", "cpu"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1] == "error: --queue-size must be an integer >= 0, got -1", result.stderr


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_stop_signal_while_loading_exits_0_at_once(tiny_export, tmp_path, signum):
    proc = start_serve("--export", str(tiny_export["separate"]), "--port", "0", "--device", "cpu")
    first = proc.stderr.readline()  # the "loading" line comes before the export is read
    assert json.loads(first)["event"] == "loading", first
    proc.send_signal(signum)
    rest = rest_of_stderr(proc)
    assert proc.returncode == 0, rest
    assert '"event": "stopped"' in rest and '"event": "ready"' not in rest and "Traceback" not in rest, rest


def test_under_nohup_sighup_neither_stops_loading_nor_the_ready_worker(tiny_export, tmp_path):
    """nohup ignores SIGHUP so that a worker outlives its terminal: valen-serve keeps it ignored."""
    proc = start_serve("--export", str(tiny_export["separate"]), "--port", "0", "--device", "cpu", sighup=signal.SIG_IGN)
    try:
        assert json.loads(proc.stderr.readline())["event"] == "loading"
        proc.send_signal(signal.SIGHUP)  # while loading
        lines = [json.loads(proc.stderr.readline())]
        while lines[-1].get("event") != "ready":
            assert proc.poll() is None and lines[-1].get("event") != "stopped", lines
            lines.append(json.loads(proc.stderr.readline()))
        proc.send_signal(signal.SIGHUP)  # while ready
        status, body, _ = http_call(lines[-1]["port"], "GET", "/health")
        assert status == 200 and proc.poll() is None, body
    finally:
        proc.send_signal(signal.SIGTERM)
        rest = rest_of_stderr(proc)
        assert proc.returncode == 0 and '"event": "stopped"' in rest, rest


# The worker with its loading, and then its first warmup step, each held until a line comes on stdin.
GATED_WORKER = """
import sys
from valen_runtime.engine import Engine
from valen_runtime.serve.cli import main

load = Engine.load


def gated_load(*args, **kwargs):
    sys.stdin.readline()
    engine = load(*args, **kwargs)
    run = engine.run

    def first_run(request):
        engine.run = run
        sys.stdin.readline()
        return run(request)

    engine.run = first_run
    return engine


Engine.load = gated_load
main()
"""


def test_health_reports_loading_and_warmup_progress_and_requests_are_503_until_ready(tiny_export, engine):
    """The worker listens before it loads: while loading and warming up /health is 503 with how far
    warmup has got (answered beside the busy executor thread) and requests are refused at once; one
    log line per warmup step; then exactly the ready worker."""
    proc = start_serve("--export", str(tiny_export["separate"]), "--port", "0", "--device", "cpu", script=GATED_WORKER, stdin=subprocess.PIPE)

    def next_event(name: str) -> dict:
        for line in proc.stderr:
            entry = json.loads(line)
            if entry.get("event") == name:
                return entry
            lines.append(entry)
        raise AssertionError(f"no {name} line; exit {proc.poll()}")

    def health() -> tuple[int, dict]:
        status, _, data = http_call(port, "GET", "/health", timeout=10)
        return status, json.loads(data)

    lines: list[dict] = []
    try:
        port = next_event("loading")["port"]
        status, body = health()
        assert status == 503 and body["detail"] == "warming up", body
        assert {k: body["warmup"][k] for k in ("stage", "done", "total")} == {"stage": "loading", "done": 0, "total": None}
        request = text_request()
        assert post(port, request)[:2] == (503, {"detail": "warming up"})
        proc.stdin.write("\n")  # loading may finish
        proc.stdin.flush()
        total = next_event("loaded")["warmup_steps"]
        status, body = health()
        assert status == 503 and body["warmup"]["stage"] == "warmup" and (body["warmup"]["done"], body["warmup"]["total"]) == (0, total)
        assert body["warmup"]["elapsed_s"] >= 0
        proc.stdin.write("\n")  # the warmup may go on
        proc.stdin.flush()
        ready = next_event("ready")
        steps = [line for line in lines if line.get("event") == "warmup"]
        assert [line["done"] for line in steps] == list(range(1, total + 1)) and all(line["total"] == total for line in steps)
        assert ready["warmup_s"] >= 0 and ready["load_s"] >= 0 and ready["ready_s"] >= ready["warmup_s"] and "compile_cache" in ready
        assert health() == (200, HEALTH)
        status, answer, _ = post(port, request)
        assert status == 200 and encode_response(answer) == expected_bytes(engine, request)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        rest = rest_of_stderr(proc)  # closes stdin
    assert proc.returncode == 0 and '"event": "stopped"' in rest and "Traceback" not in rest, rest


def test_a_stop_signal_while_warming_up_exits_0_at_once(tiny_export):
    """The executor thread is inside its first warmup step (held): the signal does not wait for it."""
    proc = start_serve("--export", str(tiny_export["separate"]), "--port", "0", "--device", "cpu", script=GATED_WORKER, stdin=subprocess.PIPE)
    try:
        assert json.loads(proc.stderr.readline())["event"] == "loading"
        proc.stdin.write("\n")  # loading may finish; the first warmup step then waits
        proc.stdin.flush()
        while json.loads(proc.stderr.readline()).get("event") != "loaded":
            assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        rest = rest_of_stderr(proc, 30)
        assert proc.returncode == 0, rest
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdin.close()
    stopped = [json.loads(line) for line in rest.splitlines() if '"stopped"' in line]
    assert len(stopped) == 1 and stopped[0]["reason"] == f"signal {int(signal.SIGTERM)} before ready", rest
    assert '"ready"' not in rest and "Traceback" not in rest, rest


def _export_with_failing_template(source, tmp_path):
    """A copy of the export whose chat template emits a video token for one phrase; the manifest
    is updated, so the export loads and only such a request fails inside the compiler (500)."""
    broken = tmp_path / "broken-template"
    shutil.copytree(source, broken)
    template = broken / "chat_template.jinja"
    trap = ("{%- for m in messages -%}{%- for c in m.content -%}{%- if c.text is defined and 'trigger-500' in c.text -%}"
            "<|video_pad|>{%- endif -%}{%- endfor -%}{%- endfor -%}")
    template.write_text(trap + template.read_text(encoding="utf-8"), encoding="utf-8")
    manifest_path = broken / "valen_export.json"
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    manifest["files"]["chat_template.jinja"] = {"sha256": hashlib.sha256(template.read_bytes()).hexdigest(), "size": template.stat().st_size}
    manifest_path.write_text(json.dumps(manifest, indent=1), encoding="utf-8")
    return broken


# With HEAVY_STATE: eight branches of about 4,100 tokens each, 1 s or more each on 2 cores.
EIGHT_CLAIMS = {f"q{i}": {"type": "noul", "instructions": f"Is claim {i} true?"} for i in range(8)}


def assert_the_next_request_starts_at_once(server, engine) -> None:
    """After work was given up: an ordinary request is answered right, with nothing left running ahead of it."""
    request = text_request("An ordinary request afterwards.")
    status, _, data = http_call(server.port, "POST", "/v1/systemone", json.dumps(request).encode(), {"X-Request-Id": "next"})
    assert status == 200 and data == expected_bytes(engine, request)
    assert server.wait_for(lambda ln: ln.get("id") == "next")["queue_ms"] < 1000


def test_internal_failure_is_500_and_a_late_answer_is_503_and_stops_computing(tiny_export, tmp_path, engine):
    server = Worker(_export_with_failing_template(tiny_export["separate"], tmp_path), tmp_path, "--request-timeout", "3")
    try:
        status, answer, headers = post(server.port, text_request("please trigger-500 now"))
        assert (status, answer) == (500, {"detail": "inference failed"})
        server.wait_for(lambda ln: ln.get("id") == headers["x-request-id"])
        (line,) = server.requests_logged(headers["x-request-id"])
        assert line["status"] == 500 and line["error"].startswith("ConfigError: chat template emitted 1 <|video_pad|> for 0 videos")
        # Eight branches of about 4,100 tokens each (1 s or more each on 2 cores) against a 3 s
        # timeout: answered 503 at the timeout, and the executor stops it at its next layer instead
        # of finishing it, so the next request starts at once (it used to wait, or time out too).
        t0 = time.monotonic()
        status, answer, _ = post(server.port, text_request(HEAVY_STATE, EIGHT_CLAIMS), {"X-Request-Id": "late"})
        assert status == 503 and "not answered within 3 s" in answer["detail"]
        assert 3 <= time.monotonic() - t0 < 15
        late = server.wait_for(lambda ln: ln.get("id") == "late")
        assert late["status"] == 503 and late["executor"].startswith("still busy with it")
        stopped = server.wait_for(lambda ln: ln.get("event") == "cancelled")
        assert stopped["ids"] == ["late"] and stopped["ms_after_abandoned"] >= 0
        assert http_call(server.port, "GET", "/health")[0] == 200
        assert_the_next_request_starts_at_once(server, engine)
    finally:
        assert server.stop() == 0


def test_a_client_that_leaves_before_its_answer_is_499_and_its_work_stops(tiny_export, tmp_path, engine):
    """A client that sent its whole request and then closed the connection is logged 499 and its
    work is given up at the next layer, as a timed-out request's (it used to run to its end, and
    the requests behind it waited)."""
    server = Worker(tiny_export["separate"], tmp_path)
    try:
        body = json.dumps(text_request(HEAVY_STATE, EIGHT_CLAIMS)).encode()  # several seconds on 2 cores
        sock = open_partial(server.port, body, len(body))  # the whole request on the wire
        time.sleep(1.0)  # admitted and running
        sock.close()
        left = server.wait_for(lambda ln: ln.get("event") == "request" and ln.get("status") == 499, 30)
        assert left["detail"] == "client closed the connection before its answer" and left["executor"].startswith("still busy with it")
        stopped = server.wait_for(lambda ln: ln.get("event") == "cancelled", 30)
        assert stopped["ids"] == [left["id"]]
        assert_the_next_request_starts_at_once(server, engine)
    finally:
        assert server.stop() == 0


# ---------------------------------------------------------------- batching (--max-batch)


@pytest.fixture(scope="module")
def batching_worker(tiny_export, tmp_path_factory):
    """The fast path's shared-prefix mode on the CPU, where the executor sweeps waiting requests together."""
    server = Worker(tiny_export["separate"], tmp_path_factory.mktemp("serve-batch"), "--mode", "shared-prefix", "--kernels", "fast",
                    "--max-batch", "8", "--request-timeout", "120")
    yield server
    assert server.stop() == 0


def test_waiting_requests_run_in_one_sweep_and_a_bad_one_fails_alone(batching_worker, tiny_export, batch_requests, assert_truth_relative):
    """While a long request runs, five arrive: four different good ones and one whose image does not
    decode (it passes the wire checks; the engine's compile refuses it). They run as one batch: the
    bad one gets its own 422, the others 200 with answers within the parity gate's truth-relative
    bound (batch-mates change rounding only, docs/runtime.md)."""
    from valen_runtime.engine import Engine
    from valen_runtime.options import EngineOptions

    port = batching_worker.port
    ready = batching_worker.wait_for(lambda ln: ln.get("event") == "ready")
    assert ready["max_batch"] == 8 and ready["layout"] == "one-pass where a prefix is shared, else rows"
    # The longest state and eight long questions: about 8,000 rows in one sweep (on 2 CPU cores about a second).
    heavy = text_request(HEAVY_STATE, {f"q{i}": {"type": "noul", "instructions": f"Is claim {i} true? " + "Weigh every line of the account. " * 60}
                                       for i in range(8)})
    bad = {"model": MODEL, "state": {"image": "data:image/png;base64,iVBORw0KGgoAAAAA"}, "questions": MIXED}
    mates = [*batch_requests, bad]
    with concurrent.futures.ThreadPoolExecutor(len(mates) + 1) as pool:
        first = pool.submit(post, port, heavy, {"X-Request-Id": "batch-heavy"})
        time.sleep(0.2)  # parsed and running by now, so the next ones queue behind it and run together
        futures = [pool.submit(post, port, r, {"X-Request-Id": f"batch-{i}"}) for i, r in enumerate(mates)]
        answers = [f.result() for f in futures]
        assert first.result()[0] == 200
    assert answers[-1][0] == 422 and answers[-1][1]["detail"].startswith("state.image:"), answers[-1]
    assert all(status == 200 for status, _, _ in answers[:-1]), [a[:2] for a in answers]
    lines = [batching_worker.wait_for(lambda ln, i=i: ln.get("id") == f"batch-{i}") for i in range(len(mates))]
    assert batching_worker.wait_for(lambda ln: ln.get("id") == "batch-heavy")["batch"] == 1
    assert [ln["batch"] for ln in lines] == [len(mates)] * len(mates), lines  # one sweep, the bad one included
    truth = Engine.load(tiny_export["separate"], EngineOptions(device="cpu", dtype="fp32", mode="per-branch"))
    reference = Engine.load(tiny_export["separate"], EngineOptions(device="cpu", dtype="bf16", mode="per-branch"))
    assert_truth_relative([body for _, body, _ in answers[:-1]], truth, reference, batch_requests, "cpu")


@pytest.mark.parametrize("option, value, message", [
    ("--max-batch", "0", "error: --max-batch must be an integer >= 1, got 0"),
    ("--batch-wait-ms", "1500", "error: --batch-wait-ms must be between 0 and 1000, got 1500"),
    ("--max-body-reads-per-client", "0", "error: --max-body-reads-per-client must be an integer >= 1, got 0"),
])
def test_batching_options_are_checked_in_one_line(tiny_export, option, value, message):
    cmd = [sys.executable, "-m", "valen_runtime.serve", "--export", str(tiny_export["separate"]), option, value, "--device", "cpu"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1] == message, result.stderr


# ---------------------------------------------------------------- warmup


def test_every_warmup_request_is_valid_and_covers_the_shape_families(tiny_export):
    """A refused warmup request would stop the worker at startup; the full set must also reach each
    family the CUDA fast path specialises on: short and long states, one and several branches,
    images of two sizes."""
    from valen_runtime.request import Compiler
    from valen_runtime.serve import warmup_requests

    compiler = Compiler.from_dir(tiny_export["separate"])
    basic, full = warmup_requests(False), warmup_requests(True)
    assert basic == full[:2] and isinstance(basic[0]["state"], str) and list(basic[1]["state"]) == ["image"]  # as upstream
    compiled = [compiler.compile(r) for r in full]
    states = [len(c.state.input_ids) for c in compiled if c.state.image_grid_thw is None]
    branches = {sum(len(q.branches) for q in c.questions) for c in compiled}
    grids = {tuple(map(tuple, c.state.image_grid_thw.tolist())) for c in compiled if c.state.image_grid_thw is not None}
    assert min(states) < 64 <= max(states)  # the padded batch (no 64-token prefix) and the one-pass layout
    assert sum(s < 64 for s in states) >= 2 and sum(s >= 64 for s in states) >= 2  # two sizes of each
    assert {1, 7} <= branches
    assert len(grids) >= 3  # the 2 x 2 image and two more sizes


def test_warmup_batches_cover_the_combined_sweeps_families(tiny_export):
    """The full warmup's batches: one of states without a prefix only, one with several prefixes,
    one mixing images; at most --max-batch requests each; none for the basic warmup or --max-batch 1."""
    from valen_runtime.request import Compiler
    from valen_runtime.serve import warmup_batches, warmup_requests

    compiler = Compiler.from_dir(tiny_export["separate"])
    full = warmup_requests(True)
    assert warmup_batches(warmup_requests(False), 8) == [] and warmup_batches(full, 1) == []
    groups = [[compiler.compile(r) for r in group] for group in warmup_batches(full, 4)]
    prefixes = [sum(len(c.state.input_ids) >= 64 for c in group) for group in groups]
    images = [sum(c.state.image_grid_thw is not None for c in group) for group in groups]
    assert all(2 <= len(group) <= 4 for group in groups)
    assert 0 in prefixes and max(prefixes) >= 2 and max(images) >= 1


@pytest.mark.gpu
def test_first_requests_after_ready_do_not_compile(tiny_export, tmp_path):
    """On CUDA the warmup pays for torch.compile and graph capture: a request of a family it did not
    warm costs 10 s or more (docs/runtime.md), a warm one well under 1 s; 5 s tells them apart."""
    server = Worker(tiny_export["separate"], tmp_path, device="cuda")
    try:
        requests = [
            text_request(),
            text_request("A much longer account of what happened. " * 40, MIXED),
            {"model": MODEL, "state": {"messages": [{"role": "user", "content": [{"type": "image", "image": data_url(png_bytes(448, 448))},
                                                                                 {"type": "text", "text": "Which move?"}]}]}, "questions": MIXED},
            {"model": MODEL, "state": {"image": data_url(png_bytes(640, 480))}, "questions": {"q": MIXED["next"]}},
        ]
        for request in requests:
            t0 = time.monotonic()
            status, _, _ = http_call(server.port, "POST", "/v1/systemone", json.dumps(request).encode())
            assert status == 200 and time.monotonic() - t0 < 5.0, (request["questions"].keys(), time.monotonic() - t0)
    finally:
        assert server.stop() == 0


def test_accepted_connections_turn_nagles_algorithm_off():
    """Answers on kept-alive connections must not wait for a delayed ACK: asyncio sets TCP_NODELAY
    only on sockets created as TCP, which is what _bind must create."""
    import asyncio

    from valen_runtime.serve import _bind

    async def nodelay_of_an_accepted_connection() -> int:
        sock = _bind("127.0.0.1", 0)
        accepted = asyncio.get_running_loop().create_future()
        server = await asyncio.start_server(lambda reader, writer: accepted.set_result(writer), sock=sock)
        _, client = await asyncio.open_connection(*sock.getsockname()[:2])
        writer = await accepted
        value = writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        for w in (client, writer):
            w.close()
        server.close()
        await server.wait_closed()
        return value

    assert asyncio.run(nodelay_of_an_accepted_connection()) != 0


class _RecordingEngine:
    """What the executor calls on an engine, recorded; the first launch holds until `release` is set,
    so the test decides what is queued meanwhile. `done_after`: how many `device_done` questions
    a launched batch answers False (its device work still running) before True; None: it raises."""

    batches, mode, one_pass, graphs, kernels = True, "shared-prefix", True, None, {}

    def __init__(self, done_after: float | None = float("inf")):
        import threading

        self.calls: list[tuple[str, list]] = []
        self.release = threading.Event()
        self.launched = threading.Event()
        self.done_after, self.asked = done_after, 0
        self.second_release: "threading.Event | None" = None  # when set to an Event, the second launch holds until it is set
        self.second_launched = threading.Event()

    def warming_up(self):
        import contextlib

        return contextlib.nullcontext()

    def prepare_many(self, requests, between):
        from valen_runtime.engine import Batch

        for r in requests:  # one request's host work at a time, the executor's hook before each
            between()
            self.calls.append(("prepare", r["n"]))
        between()
        # a request named "invalid" fails to compile (its own RequestError), as bad input does
        return Batch([RequestError("state", "invalid") if r["n"] == "invalid" else r["n"] for r in requests], None, {})

    def device_done(self, batch):
        self.asked += 1
        if self.done_after is None:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")  # the batch's own
        return self.asked > self.done_after

    def launch(self, batch):
        self.calls.append(("launch", batch.prepared))
        launches = len([c for c in self.calls if c[0] == "launch"])
        if launches == 1:
            self.launched.set()
            assert self.release.wait(30)
        elif launches == 2 and self.second_release is not None:
            self.second_launched.set()
            assert self.second_release.wait(30)
        return batch

    def collect(self, batch):
        self.calls.append(("collect", batch.prepared))
        return [n if isinstance(n, Exception) else ValueError("bad") if n == "bad" else {"n": n} for n in batch.prepared]


def _queued_behind_one_in_flight(engine: _RecordingEngine, names, pipelined: bool):
    """An executor (batches of up to 8) whose first job {"n": 1} is held in its launch while jobs
    named `names` queue behind it: (executor, first job, later jobs)."""
    from valen_runtime.serve import Executor

    executor = Executor(lambda: engine, [], max_batch=8, pipelined=pipelined)
    executor.start()
    first = executor.submit({"n": 1})
    assert engine.launched.wait(30)
    return executor, first, [executor.submit({"n": n}) for n in names]


@pytest.mark.parametrize(
    "done_after, order",
    [
        # the device still busy with [1] through all of the next batch's host work: collected after it
        (float("inf"), [("prepare", 2), ("prepare", "bad"), ("prepare", 3), ("collect", [1])]),
        # done while the next batch's host work goes on: answered between two of its requests
        (1, [("prepare", 2), ("collect", [1]), ("prepare", "bad"), ("prepare", 3)]),
        # done before it began: answered first
        (0, [("collect", [1]), ("prepare", 2), ("prepare", "bad"), ("prepare", 3)]),
        # asking raised (a CUDA error of that batch): collected at once, so the error reaches its own jobs
        (None, [("collect", [1]), ("prepare", 2), ("prepare", "bad"), ("prepare", 3)]),
    ],
)
def test_the_pipelined_executor_answers_the_batch_in_flight_once_the_device_is_done(done_after, order):
    """With pipelining (CUDA's default) the host work of the jobs that arrived meanwhile runs while
    the batch before them is in flight; that batch is collected as soon as the device is done with
    it (asked before each request's host work), at the latest before the new batch is launched. A
    request failing in collect fails alone."""
    engine = _RecordingEngine(done_after)
    executor, first, later = _queued_behind_one_in_flight(engine, (2, "bad", 3), pipelined=True)
    engine.release.set()
    assert first.future.result(30) == {"n": 1}
    assert [j.future.result(30) for j in (later[0], later[2])] == [{"n": 2}, {"n": 3}]
    with pytest.raises(ValueError, match="bad"):
        later[1].future.result(30)
    executor.stop()
    assert engine.calls == [("prepare", 1), ("launch", [1]), *order, ("launch", [2, "bad", 3]), ("collect", [2, "bad", 3])]
    assert [j.batch for j in [first, *later]] == [1, 3, 3, 3] and executor.batches_run == 1


def test_a_request_that_fails_to_compile_is_answered_before_its_batch_runs():
    """A bad request's 4xx does not wait for its batch-mates' device work: it is answered once the
    batch's host work is done, before the batch is launched (here held in flight by the batch before
    it), and its batch-mates are answered as before."""
    engine = _RecordingEngine()
    engine.second_release = threading.Event()
    executor, first, later = _queued_behind_one_in_flight(engine, (2, "invalid", 3), pipelined=False)
    engine.release.set()
    assert engine.second_launched.wait(30)  # the batch [2, invalid, 3] is held in its launch
    with pytest.raises(RequestError, match="invalid"):
        later[1].future.result(0)  # already answered
    assert not later[0].future.done() and not later[2].future.done()
    engine.second_release.set()
    assert [j.future.result(30) for j in (first, later[0], later[2])] == [{"n": 1}, {"n": 2}, {"n": 3}]
    executor.stop()
    assert [c[0] for c in engine.calls[-2:]] == ["launch", "collect"] and [j.batch for j in later] == [3, 3, 3]


def test_batch_wait_lets_an_idle_executor_gather_requests_that_come_soon_after():
    """--batch-wait-ms: the first request wakes the executor, which waits that long (here 2 s) for
    more before it launches; two that come 0.1 s later join the first one's batch."""
    from valen_runtime.serve import Executor

    engine = _RecordingEngine()
    engine.release.set()
    executor = Executor(lambda: engine, [], max_batch=8, pipelined=False, batch_wait=2.0)
    executor.start()
    t0 = time.monotonic()
    jobs = [executor.submit({"n": 1})]
    time.sleep(0.1)
    jobs += [executor.submit({"n": n}) for n in (2, 3)]
    assert [j.future.result(30) for j in jobs] == [{"n": 1}, {"n": 2}, {"n": 3}]
    assert time.monotonic() - t0 >= 2.0  # a partial batch waited the whole time for a fuller one
    executor.stop()
    assert engine.calls[:3] == [("prepare", 1), ("prepare", 2), ("prepare", 3)] and [j.batch for j in jobs] == [3, 3, 3]


def test_the_warmup_runs_inside_the_engines_warming_up_context():
    """Every warmup step (requests, then batches) runs inside `engine.warming_up()`, where CUDA
    graphs capture on first use, and a request served after ready runs outside it."""
    import contextlib

    from valen_runtime.serve import Executor

    class WarmupRecorder:
        batches, mode, one_pass, graphs, kernels = True, "shared-prefix", True, None, {}

        def __init__(self):
            self.warming, self.calls = False, []

        @contextlib.contextmanager
        def warming_up(self):
            self.warming = True
            try:
                yield
            finally:
                self.warming = False

        def run(self, request):
            self.calls.append(("run", request["n"], self.warming))

        def run_many(self, requests):
            self.calls.append(("run_many", [r["n"] for r in requests], self.warming))
            return [None for _ in requests]

        def prepare_many(self, requests, between=None):
            from valen_runtime.engine import Batch

            self.calls.append(("prepare", [r["n"] for r in requests], self.warming))
            return Batch([r["n"] for r in requests], None, {})

        def launch(self, batch):
            self.calls.append(("launch", batch.prepared, self.warming))
            return batch

        def collect(self, batch):
            self.calls.append(("collect", batch.prepared, self.warming))
            return [{"n": n} for n in batch.prepared]

    engine = WarmupRecorder()
    warmup = [{"n": n} for n in range(12)]  # warmup_batches groups the full warmup's requests
    executor = Executor(lambda: engine, warmup, max_batch=4, pipelined=False)
    executor.start()
    assert executor.ready.result(30) is None
    assert executor.submit({"n": "client"}).future.result(30) == {"n": "client"}
    executor.stop()
    warmup_calls = [c for c in engine.calls if c[0] in ("run", "run_many")]
    served = [c for c in engine.calls if c[0] in ("prepare", "launch", "collect")]
    assert [c[:2] for c in warmup_calls[:12]] == [("run", n) for n in range(12)]
    assert any(c[0] == "run_many" for c in warmup_calls)  # the batches ran too, after the requests
    assert all(c[2] for c in warmup_calls)
    assert [c[0] for c in served] == ["prepare", "launch", "collect"] and not any(c[2] for c in served)
