"""valen-fetch against a real HTTP endpoint: a small threaded server on 127.0.0.1 that serves the
tiny fixture's files the way the Hugging Face Hub does for huggingface-hub 1.33 (resolve HEAD/GET
with X-Repo-Commit / ETag / X-Linked-Etag / X-Linked-Size / Content-Length, byte ranges, the
revision and tree API endpoints). The library is not mocked; only its offline switch
(`huggingface_hub.constants.HF_HUB_OFFLINE`, read once at import) is flipped per test, and the
cache lives in tmp. One test runs the `valen-fetch` console script end to end in a subprocess.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from click.testing import CliRunner

from valen_export.errors import ExportError
from valen_export.export import export
from valen_export.fetch import fetch, main
from valen_export.verify import verify_export

VENV_BIN = Path(sys.executable).parent


class HubServer:
    """Serves {repo_id: (revision, {filename: bytes})} like huggingface.co's resolve and API routes."""

    def __init__(self, repos: dict[str, tuple[str, dict[str, bytes]]]):
        self.repos = repos
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range header)
        self.drop_once: set[tuple[str, str]] = set()  # GET sends half the body, then drops the connection
        self.forbid: set[tuple[str, str]] = set()  # GET answers 403
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_HEAD(self):
                server._handle(self, head=True)

            def do_GET(self):
                server._handle(self, head=False)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()

    def gets(self, filename: str) -> list[tuple[str, str, str | None]]:
        return [r for r in self.requests if r[0] == "GET" and "/resolve/" in r[1] and r[1].endswith("/" + filename)]

    # -- routes ---------------------------------------------------------------------------
    @staticmethod
    def _send(h, status: int, body: bytes = b"", headers: dict | None = None, head: bool = False) -> None:
        h.send_response(status)
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        if "Content-Length" not in (headers or {}):
            h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if not head and body:
            h.wfile.write(body)

    def _json(self, h, obj, head: bool) -> None:
        self._send(h, 200, json.dumps(obj).encode(), {"Content-Type": "application/json"}, head)

    def _error(self, h, code: str, head: bool, commit: str | None = None) -> None:
        headers = {"X-Error-Code": code, "X-Error-Message": code, "Content-Type": "application/json"}
        if commit:
            headers["X-Repo-Commit"] = commit
        self._send(h, 404, json.dumps({"error": code}).encode(), headers, head)

    def _handle(self, h, head: bool) -> None:
        path = urlsplit(h.path).path
        with self.lock:
            self.requests.append(("HEAD" if head else "GET", path, h.headers.get("Range")))
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/(revision|tree)/([^/]+)(?:/.*)?", path)
        if m:
            repo, kind, rev = m.group(1), m.group(2), unquote(m.group(3))
            if repo not in self.repos:
                return self._error(h, "RepoNotFound", head)
            commit, files = self.repos[repo]
            if rev not in (commit, "main"):
                return self._error(h, "RevisionNotFound", head)
            if kind == "revision":
                return self._json(h, {"id": repo, "sha": commit, "siblings": [{"rfilename": f} for f in sorted(files)]}, head)
            tree = [
                {
                    "type": "file",
                    "path": f,
                    "size": len(data),
                    "oid": hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest(),
                    "lfs": {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134},
                }
                for f, data in sorted(files.items())
            ]
            return self._json(h, tree, head)
        m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if not m:
            return self._error(h, "RepoNotFound", head)
        repo, rev, name = m.group(1), unquote(m.group(2)), unquote(m.group(3))
        if repo not in self.repos:
            return self._error(h, "RepoNotFound", head)
        commit, files = self.repos[repo]
        if rev not in (commit, "main"):
            return self._error(h, "RevisionNotFound", head)
        if name not in files:
            return self._error(h, "EntryNotFound", head, commit)
        data = files[name]
        sha = hashlib.sha256(data).hexdigest()
        headers = {
            "X-Repo-Commit": commit,
            "ETag": f'"{sha}"',
            "X-Linked-Etag": f'"{sha}"',
            "X-Linked-Size": str(len(data)),
            "Accept-Ranges": "bytes",
            "Content-Type": "application/octet-stream",
        }
        if head:
            return self._send(h, 200, b"", {**headers, "Content-Length": str(len(data))}, head=True)
        key = (repo, name)
        if key in self.forbid:
            return self._send(h, 403, b'{"error": "forbidden"}', {"X-Error-Message": "Access forbidden (test)"})
        rng = h.headers.get("Range")
        if rng:
            start = int(re.fullmatch(r"bytes=(\d+)-", rng).group(1))
            body = data[start:]
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            return self._send(h, 206, body, headers)
        if key in self.drop_once:
            self.drop_once.discard(key)
            h.send_response(200)
            for k, v in {**headers, "Content-Length": str(len(data))}.items():
                h.send_header(k, v)
            h.end_headers()
            h.wfile.write(data[: len(data) // 2])
            h.wfile.flush()
            h.close_connection = True
            h.connection.shutdown(socket.SHUT_RDWR)
            return None
        return self._send(h, 200, data, headers)


# -- fixtures -------------------------------------------------------------------------------


def repo_files(folder: Path, skip=()) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file() and p.name not in skip}


@pytest.fixture(scope="module")
def hub_repos(tiny_fixture):
    """What the two hub repos hold: the fixture's checkpoint folder, and its base folder without the
    locally written valen_manifest.json plus two files valen-fetch must not download."""
    pins = json.loads(tiny_fixture.pins.read_text())
    base = repo_files(tiny_fixture.base, skip={"valen_manifest.json"})
    base["README.md"] = b"# decoy\n"
    base["consolidated.safetensors"] = b"not needed"
    return pins, {
        pins["checkpoint"]["repo"]: (pins["checkpoint"]["revision"], repo_files(tiny_fixture.checkpoint)),
        pins["base"]["repo"]: (pins["base"]["revision"], base),
    }


@pytest.fixture()
def online(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


@pytest.fixture()
def offline(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def dead_endpoint() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now: connections are refused at once
    return f"http://127.0.0.1:{port}"


def assert_nothing_written(out: Path) -> None:
    assert not out.exists()
    assert not list(out.parent.glob(f".{out.name}.partial-*"))


# -- tests ----------------------------------------------------------------------------------


def test_fetch_then_export(hub_repos, tiny_fixture, tmp_path, online):
    pins, repos = hub_repos
    out, cache = tmp_path / "preview", tmp_path / "hf" / "hub"
    with HubServer(repos) as hub:
        result = fetch(out, pins_path=tiny_fixture.pins, endpoint=hub.url, cache_dir=cache)
    # Only the pinned checkpoint files and the needed base files were downloaded.
    got = {r[1].rsplit("/", 1)[1] for r in hub.requests if r[0] == "GET" and "/resolve/" in r[1]}
    assert "README.md" not in got and "consolidated.safetensors" not in got and "valen_manifest.json" not in got
    assert {"checkpoint.pt", "config.json", "model.safetensors-00001-of-00001.safetensors", "tokenizer.json"} <= got
    assert sorted(p.name for p in (out / "checkpoint").iterdir()) == ["checkpoint.pt", "config.json"]
    assert {p.name for p in (out / "base").iterdir()} == set(repo_files(tiny_fixture.base)) - {"README.md"}
    for p in list((out / "base").iterdir()) + list((out / "checkpoint").iterdir()):
        assert p.is_file() and not p.is_symlink()
    for p in (out / "checkpoint").iterdir():
        assert p.read_bytes() == (tiny_fixture.checkpoint / p.name).read_bytes()
    # The base manifest the reference expects: revision and weight hashes from the payload, the rest read from the files.
    m = json.loads((out / "base" / "valen_manifest.json").read_text())
    ref = json.loads((tiny_fixture.base / "valen_manifest.json").read_text())
    assert set(m) == {"repo", "revision", "versions", "weight_sha256", "processor", "hidden_size", "media_defaults"}
    for key in ("repo", "revision", "weight_sha256", "processor", "hidden_size", "media_defaults"):
        assert m[key] == ref[key], key
    assert m["versions"]["huggingface-hub"] and m["versions"]["torch"]
    assert result["command"].startswith("valen-export --checkpoint ")
    assert f"--pins {tiny_fixture.pins}" in result["command"]
    export_dir = tmp_path / "export"
    export(out / "checkpoint", out / "base", export_dir, pins_path=tiny_fixture.pins, progress=False)
    assert verify_export(export_dir) == []


def test_wrong_checkpoint_sha_is_refused(hub_repos, tiny_fixture, tmp_path, online):
    pins, repos = hub_repos
    commit, files = repos[pins["checkpoint"]["repo"]]
    bad = dict(files, **{"checkpoint.pt": files["checkpoint.pt"][:-1] + bytes([files["checkpoint.pt"][-1] ^ 1])})
    out = tmp_path / "preview"
    with HubServer({**repos, pins["checkpoint"]["repo"]: (commit, bad)}) as hub:
        with pytest.raises(ExportError, match=r"checkpoint\.pt: sha256 [0-9a-f]{64} does not match the pinned"):
            fetch(out, pins_path=tiny_fixture.pins, endpoint=hub.url, cache_dir=tmp_path / "hf")
    assert_nothing_written(out)


def test_wrong_base_weight_hash_is_refused(hub_repos, tiny_fixture, tmp_path, online):
    pins, repos = hub_repos
    commit, files = repos[pins["base"]["repo"]]
    name = "model.safetensors-00001-of-00001.safetensors"
    data = bytearray(files[name])
    data[-5] ^= 0xFF
    out = tmp_path / "preview"
    with HubServer({**repos, pins["base"]["repo"]: (commit, dict(files, **{name: bytes(data)}))}) as hub:
        with pytest.raises(ExportError, match=name + r": sha256 [0-9a-f]{64} does not match the checkpoint's base_manifest.weight_sha256"):
            fetch(out, pins_path=tiny_fixture.pins, endpoint=hub.url, cache_dir=tmp_path / "hf")
    assert_nothing_written(out)


def test_second_run_uses_the_cache_without_network(hub_repos, tiny_fixture, tmp_path, monkeypatch, online):
    from huggingface_hub import constants

    pins, repos = hub_repos
    cache = tmp_path / "hf"
    with HubServer(repos) as hub:
        fetch(tmp_path / "first", pins_path=tiny_fixture.pins, endpoint=hub.url, cache_dir=cache)
    # Offline mode, and separately a dead endpoint with offline mode off: both are served by the cache.
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    fetch(tmp_path / "offline", pins_path=tiny_fixture.pins, endpoint=hub.url, cache_dir=cache)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    fetch(tmp_path / "dead", pins_path=tiny_fixture.pins, endpoint=dead_endpoint(), cache_dir=cache)
    for run in ("offline", "dead"):
        for sub in ("checkpoint", "base"):
            a, b = tmp_path / "first" / sub, tmp_path / run / sub
            assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())
            for p in a.iterdir():
                if p.name != "valen_manifest.json":
                    assert p.read_bytes() == (b / p.name).read_bytes()


@pytest.mark.parametrize("mode", ["offline", "dead-endpoint"])
def test_no_cache_fails_fast_with_one_line(tiny_fixture, tmp_path, monkeypatch, mode):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", mode == "offline")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    out = tmp_path / "preview"
    t0 = time.monotonic()
    result = CliRunner().invoke(main, ["--out", str(out), "--pins", str(tiny_fixture.pins), "--endpoint", dead_endpoint()])
    elapsed = time.monotonic() - t0
    assert result.exit_code == 2, result.output
    errors = [ln for ln in result.output.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.output
    assert "not in the Hugging Face cache" in errors[0] and "checkpoint.pt" in errors[0]
    assert ("HF_HUB_OFFLINE=1" if mode == "offline" else "cannot be reached") in errors[0]
    assert elapsed < 5, f"took {elapsed:.1f}s"
    assert_nothing_written(out)


def test_dropped_connection_resumes_with_a_range_request(hub_repos, tiny_fixture, tmp_path, monkeypatch, online):
    from huggingface_hub import constants

    # The hub writes what it received in DOWNLOAD_CHUNK_SIZE pieces (10 MiB); the tiny checkpoint is
    # under 1 MiB, so use smaller pieces to get the multi-GB case's behaviour: resume mid-file.
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 64 * 1024)
    pins, repos = hub_repos
    with HubServer(repos) as hub:
        hub.drop_once.add((pins["checkpoint"]["repo"], "checkpoint.pt"))
        fetch(tmp_path / "preview", pins_path=tiny_fixture.pins, endpoint=hub.url, cache_dir=tmp_path / "hf")
    gets = hub.gets("checkpoint.pt")
    size = len(repos[pins["checkpoint"]["repo"]][1]["checkpoint.pt"])
    assert len(gets) == 2 and gets[0][2] is None
    start = int(re.fullmatch(r"bytes=(\d+)-", gets[1][2]).group(1))
    assert 0 < start < size  # resumed from the bytes already received, not from zero
    assert (tmp_path / "preview" / "checkpoint" / "checkpoint.pt").read_bytes() == (tiny_fixture.checkpoint / "checkpoint.pt").read_bytes()


def test_failed_run_leaves_nothing_and_the_rerun_downloads_only_what_is_missing(hub_repos, tiny_fixture, tmp_path, online):
    pins, repos = hub_repos
    weights = "model.safetensors-00001-of-00001.safetensors"
    out, cache = tmp_path / "preview", tmp_path / "hf"
    with HubServer(repos) as hub:
        hub.forbid.add((pins["base"]["repo"], weights))
        with pytest.raises(ExportError, match=weights):
            fetch(out, pins_path=tiny_fixture.pins, endpoint=hub.url, cache_dir=cache)
        assert_nothing_written(out)
        hub.forbid.clear()
        fetch(out, pins_path=tiny_fixture.pins, endpoint=hub.url, cache_dir=cache)
    assert len(hub.gets("checkpoint.pt")) == 1  # cached by the failed run, not downloaded again
    assert len(hub.gets(weights)) == 2
    assert (out / "base" / weights).read_bytes() == (tiny_fixture.base / weights).read_bytes()


def test_refusals_before_any_download(hub_repos, tiny_fixture, tmp_path, online):
    pins, repos = hub_repos
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("user data")
    with HubServer(repos) as hub:
        with pytest.raises(ExportError, match="not an empty directory"):
            fetch(busy, pins_path=tiny_fixture.pins, endpoint=hub.url, cache_dir=tmp_path / "hf")
        moving = json.loads(tiny_fixture.pins.read_text())
        moving["checkpoint"]["revision"] = "main"
        (tmp_path / "pins.json").write_text(json.dumps(moving))
        with pytest.raises(ExportError, match="must be a full 40-hex commit"):
            fetch(tmp_path / "o1", pins_path=tmp_path / "pins.json", endpoint=hub.url, cache_dir=tmp_path / "hf")
        moving["checkpoint"]["revision"] = "e" * 40
        (tmp_path / "pins.json").write_text(json.dumps(moving))
        with pytest.raises(ExportError, match="revision e{40} not found"):
            fetch(tmp_path / "o2", pins_path=tmp_path / "pins.json", endpoint=hub.url, cache_dir=tmp_path / "hf")
    assert not hub.gets("checkpoint.pt")
    assert (busy / "keep.txt").read_text() == "user data"
    assert_nothing_written(tmp_path / "o2")


@pytest.mark.slow
def test_cli_end_to_end_in_subprocesses(hub_repos, tiny_fixture, tmp_path):
    """The installed console scripts with HF_HOME / HF_ENDPOINT in the environment, then offline."""
    pins, repos = hub_repos
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    env.update(HF_HOME=str(tmp_path / "hf-home"), HF_HUB_OFFLINE="0", HF_HUB_DISABLE_TELEMETRY="1")
    with HubServer(repos) as hub:
        r = subprocess.run([VENV_BIN / "valen-fetch", "--out", tmp_path / "a", "--pins", tiny_fixture.pins],
                           env={**env, "HF_ENDPOINT": hub.url}, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    command = r.stdout.strip().splitlines()[-1].strip()
    assert command.startswith("valen-export ")
    args = shlex.split(command)
    r2 = subprocess.run([VENV_BIN / args[0], *args[1:]], env=env, capture_output=True, text=True, timeout=120)
    assert r2.returncode == 0, r2.stderr
    assert verify_export(tmp_path / "a-export") == []
    r3 = subprocess.run([VENV_BIN / "valen-fetch", "--out", tmp_path / "b", "--pins", tiny_fixture.pins],
                        env={**env, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=120)
    assert r3.returncode == 0, r3.stderr
    shutil.rmtree(tmp_path / "hf-home")
    r4 = subprocess.run([VENV_BIN / "valen-fetch", "--out", tmp_path / "c", "--pins", tiny_fixture.pins],
                        env={**env, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=120)
    assert r4.returncode == 2 and r4.stderr.count("error:") == 1 and "HF_HUB_OFFLINE=1" in r4.stderr
    assert not (tmp_path / "c").exists()
