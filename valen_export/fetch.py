"""`valen-fetch`: download the pinned Valen-Preview-0923 checkpoint and its Qwen3.5 base, verify
them, and lay them out the way `valen-export` reads them.

What it does, in order (nothing is written to OUT before every check has passed):

1. Reads the pins (`valen-pins/1`, default `manifests/valen-preview-0923.json`). Revisions must be
   full 40-hex commits: a pin that can move is not a pin.
2. Checkpoint: `hf_hub_download` of each pinned file (`config.json`, `checkpoint.pt`) at the pinned
   revision, then `checkpoint.pt`'s SHA-256 against `checkpoint.checkpoint_sha256` and a
   `torch.load(weights_only=True, mmap=True)` of it (the exporter's own reader, `open_checkpoint`).
3. Base: the weight file names and hashes come from `payload["base_manifest"]["weight_sha256"]`
   (docs/valen-model.md), whose `revision` must equal the pinned base revision.
   `snapshot_download` at that revision with `allow_patterns` limited to those weight files, the
   index, and the config / tokenizer / processor / chat-template files; every weight file is
   hashed against the payload.
4. Writes OUT/checkpoint (config.json, checkpoint.pt), OUT/base (the base files plus a
   `valen_manifest.json` as `prepare_model.py` writes it, with `revision` and `weight_sha256`
   copied from the payload after the check) into `.OUT.partial-PID` beside OUT, then renames it
   into place. Files are hard links into the Hugging Face cache when possible, else copies; never
   symlinks (exports refuse them).

Cache and network: files are looked up in the Hugging Face cache first (pinned commits are
immutable, and every byte that matters is re-hashed anyway), so a second run needs no network.
Only missing files are downloaded, with the hub's own progress bars, retries and byte-range resume
of a dropped transfer. With `HF_HUB_OFFLINE=1`, or an endpoint that cannot be reached, a run that
needs files not yet cached fails at once with one line instead of retrying.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shlex
import shutil
import sys
from importlib import metadata
from pathlib import Path
from typing import Callable
from urllib.parse import unquote

import click

from valen_runtime.errors import ValenError
from valen_runtime.safetensors_file import sha256_file

from .errors import ExportError
from .atomic import AtomicDirectory, fsync_dir
from .export import DEFAULT_PINS
from .tensor_table import COPIED_FILES as TEXT_ASSETS, INDEX_FILE, REQUIRED_COPIED_FILES as REQUIRED_ASSETS
from .sources import load_pins, open_checkpoint

COMMIT = re.compile(r"^[0-9a-f]{40}$")
SHA256 = re.compile(r"^[0-9a-f]{64}$")
PROBE_TIMEOUT_S = 10.0
MANIFEST_NAME = "valen_manifest.json"
VERSION_DISTS = ("torch", "torchvision", "transformers", "peft", "huggingface-hub", "av")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _check_pins(pins: dict, where: Path) -> None:
    ck, base = pins["checkpoint"], pins["base"]
    for section, d in (("checkpoint", ck), ("base", base)):
        if not isinstance(d.get("repo"), str) or d["repo"].count("/") != 1:
            raise ExportError(f"{where}: {section}.repo must be 'owner/name', got {d.get('repo')!r}")
        if not isinstance(d.get("revision"), str) or not COMMIT.match(d["revision"]):
            raise ExportError(f"{where}: {section}.revision must be a full 40-hex commit, got {d.get('revision')!r}")
    files = ck.get("files")
    if not isinstance(files, list) or not {"config.json", "checkpoint.pt"} <= set(files) or not all(_plain_name(f) for f in files):
        raise ExportError(f"{where}: checkpoint.files must list plain file names incl. config.json and checkpoint.pt, got {files!r}")
    if not isinstance(ck.get("checkpoint_sha256"), str) or not SHA256.match(ck["checkpoint_sha256"]):
        raise ExportError(f"{where}: checkpoint.checkpoint_sha256 must be 64 lowercase hex digits")
    bfiles = base.get("files", [])
    if not isinstance(bfiles, list) or not all(_plain_name(f) for f in bfiles):
        raise ExportError(f"{where}: base.files must be a list of plain file names, got {bfiles!r}")


def _plain_name(name) -> bool:
    """A file name at the top of a repo: no directories, no dot-files, no control characters."""
    return (
        isinstance(name, str)
        and 0 < len(name) <= 255
        and "/" not in name
        and "\\" not in name
        and not name.startswith(".")
        and all(ord(c) >= 32 for c in name)
    )


def _check_destination(out: Path) -> None:
    if out.is_symlink() or (out.exists() and (not out.is_dir() or any(out.iterdir()))):
        raise ExportError(f"{out}: already exists and is not an empty directory; choose a new --out")


class _Hub:
    """The few huggingface_hub calls valen-fetch makes, cache first, with errors turned into one line."""

    def __init__(self, endpoint: str | None, cache_dir: Path | None, log: Callable[[str], None]):
        from huggingface_hub import constants

        self.constants = constants
        self.endpoint = (endpoint or constants.ENDPOINT).rstrip("/")
        self.cache_dir = Path(cache_dir) if cache_dir else Path(constants.HF_HUB_CACHE)
        self.log = log

    @property
    def offline(self) -> bool:
        return bool(self.constants.HF_HUB_OFFLINE)

    def _not_cached(self, repo: str, rev: str, names: list[str], why: str) -> ExportError:
        shown = ", ".join(names[:4]) + (f" (+{len(names) - 4} more)" if len(names) > 4 else "")
        return ExportError(
            f"{repo}@{rev[:12]}: {shown} not in the Hugging Face cache {self.cache_dir} and {why}; "
            "run valen-fetch once with network access"
        )

    def _translate(self, e: BaseException, repo: str, rev: str, what: str) -> ExportError:
        import httpx
        from huggingface_hub import errors as hf

        url = str(getattr(getattr(e, "response", None), "url", "") or "")
        if "/resolve/" in url:  # name the file a snapshot download failed on
            what = unquote(url.split("?")[0].rsplit("/resolve/", 1)[1].split("/", 1)[-1])
        at = f"{repo}@{rev[:12]}: {what}"
        if isinstance(e, hf.RevisionNotFoundError):
            return ExportError(f"{repo}: revision {rev} not found at {self.endpoint}")
        if isinstance(e, hf.RemoteEntryNotFoundError):
            return ExportError(f"{at}: not found at {self.endpoint}")
        if isinstance(e, hf.GatedRepoError):
            return ExportError(f"{repo}: gated repository at {self.endpoint}; accept its terms and log in (hf auth login)")
        if isinstance(e, hf.RepositoryNotFoundError):
            return ExportError(f"{repo}: repository not found at {self.endpoint} (private? log in with hf auth login)")
        if isinstance(e, hf.OfflineModeIsEnabled):
            return self._not_cached(repo, rev, [what], "offline mode is on (HF_HUB_OFFLINE=1)")
        if isinstance(e, hf.LocalEntryNotFoundError):
            return self._not_cached(repo, rev, [what], f"{self.endpoint} cannot be reached")
        if isinstance(e, hf.HfHubHTTPError):
            return ExportError(f"{at}: {_first_line(e)}")
        if isinstance(e, httpx.HTTPError):
            return ExportError(f"{at}: download failed ({type(e).__name__}: {_first_line(e)})")
        if isinstance(e, OSError) and e.errno:
            return ExportError(f"{at}: {os.strerror(e.errno)} (Hugging Face cache {self.cache_dir})")
        return ExportError(f"{at}: {type(e).__name__}: {_first_line(e)}")

    def _unreachable(self, repo: str, rev: str, name: str) -> str | None:
        """Why `name` cannot be downloaded now (offline mode, endpoint down), or None when it can."""
        import httpx
        from huggingface_hub import get_hf_file_metadata, hf_hub_url

        if self.offline:
            return "offline mode is on (HF_HUB_OFFLINE=1)"
        url = hf_hub_url(repo, name, revision=rev, endpoint=self.endpoint)
        try:
            # One HEAD, no retries: the library's own fallback would back off for tens of seconds.
            get_hf_file_metadata(url, timeout=PROBE_TIMEOUT_S, endpoint=self.endpoint)
        except (httpx.ConnectError, httpx.TimeoutException, httpx.NetworkError) as e:
            return f"{self.endpoint} cannot be reached ({type(e).__name__})"
        except Exception as e:  # noqa: BLE001 - every failure becomes one line
            raise self._translate(e, repo, rev, name) from None
        return None

    def files(self, repo: str, rev: str, names: list[str]) -> dict[str, Path]:
        """hf_hub_download each name at `rev`, cache first; returns name -> cached path."""
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        found: dict[str, Path] = {}
        for name in names:
            try:
                found[name] = Path(hf_hub_download(repo, name, revision=rev, cache_dir=self.cache_dir, local_files_only=True))
            except LocalEntryNotFoundError:
                pass
        missing = [n for n in names if n not in found]
        if missing:
            why = self._unreachable(repo, rev, missing[0])
            if why:
                raise self._not_cached(repo, rev, missing, why)
            for name in missing:
                self.log(f"downloading {repo}@{rev[:12]} {name}")
                try:
                    found[name] = Path(hf_hub_download(repo, name, revision=rev, cache_dir=self.cache_dir, endpoint=self.endpoint))
                except Exception as e:  # noqa: BLE001
                    raise self._translate(e, repo, rev, name) from None
        else:
            self.log(f"{repo}@{rev[:12]}: {', '.join(names)} found in the Hugging Face cache")
        for name, path in found.items():
            self._check_commit(repo, rev, name, path)
        return found

    def snapshot(self, repo: str, rev: str, patterns: list[str], required: list[str]) -> Path:
        """snapshot_download the files matching `patterns` at `rev`, cache first; every `required` name must exist."""
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import IncompleteSnapshotError, LocalEntryNotFoundError

        allow = [glob.escape(p) for p in patterns]
        try:
            # With the commit's tree listing cached this also checks that every matching file is there.
            folder = Path(snapshot_download(repo, revision=rev, cache_dir=self.cache_dir, allow_patterns=allow, local_files_only=True))
        except (LocalEntryNotFoundError, IncompleteSnapshotError):
            folder = None
        missing = self._missing(folder, required)
        if missing or not self._tree_cached(repo, rev):
            # Not cached, or cached by something that did not record the file list (optional files unknown).
            why = self._unreachable(repo, rev, missing[0] if missing else required[0])
            if why and missing:
                raise self._not_cached(repo, rev, missing, why)
            if not why:
                self.log(f"downloading {repo}@{rev[:12]} ({len(patterns)} file patterns)")
                try:
                    folder = Path(snapshot_download(repo, revision=rev, cache_dir=self.cache_dir, allow_patterns=allow, endpoint=self.endpoint))
                except Exception as e:  # noqa: BLE001
                    raise self._translate(e, repo, rev, "snapshot") from None
        else:
            self.log(f"{repo}@{rev[:12]}: base files found in the Hugging Face cache")
        missing = self._missing(folder, required)
        if missing:
            raise ExportError(f"{repo}@{rev[:12]}: the repository has no {', '.join(missing)} (needed by valen-export)")
        for name in required:
            self._check_commit(repo, rev, name, folder / name)
        return folder

    def _tree_cached(self, repo: str, rev: str) -> bool:
        from huggingface_hub import get_cached_repo_tree
        from huggingface_hub.errors import CachedRepoTreeNotFoundError

        try:
            get_cached_repo_tree(repo, revision=rev, cache_dir=self.cache_dir)
            return True
        except CachedRepoTreeNotFoundError:
            return False

    @staticmethod
    def _missing(folder: Path | None, names: list[str]) -> list[str]:
        return [n for n in names if folder is None or not (folder / n).is_file()]

    @staticmethod
    def _check_commit(repo: str, rev: str, name: str, path: Path) -> None:
        # The hub files a download under the commit the server reported (X-Repo-Commit).
        if path.parent.name != rev:
            raise ExportError(f"{repo}@{rev[:12]}: {name} was served for commit {path.parent.name}, not the pinned {rev}")


def _place(src: Path, dst: Path, copy: bool) -> str:
    """Hard-link (or copy) the real file behind a cache entry; never a symlink. Returns 'link' or 'copy'."""
    real = Path(os.path.realpath(src))
    if not real.is_file():
        raise ExportError(f"{src}: cached file is missing or not a regular file")
    if not copy:
        try:
            os.link(real, dst)
            return "link"
        except OSError:
            pass  # other filesystem, or links not allowed: copy instead
    shutil.copyfile(real, dst)
    return "copy"


def _versions() -> dict:
    out = {}
    for dist in VERSION_DISTS:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def _read_json(path: Path, what: str) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ExportError(f"{path}: {what} is not readable JSON ({_first_line(e)})") from None
    if not isinstance(data, dict):
        raise ExportError(f"{path}: {what} must be a JSON object")
    return data


def base_manifest(repo: str, folder: Path, payload_manifest: dict) -> dict:
    """valen_manifest.json the way prepare_model.py writes it (docs/valen-model.md)."""
    config = _read_json(folder / "config.json", "base config.json")
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    processor = None
    for name in ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json"):
        if (folder / name).is_file():
            processor = _read_json(folder / name, name).get("processor_class")
            if processor:
                break
    media = {
        name: _read_json(folder / name, name)
        for name in ("preprocessor_config.json", "video_preprocessor_config.json")
        if (folder / name).is_file()
    }
    return {
        "repo": repo,
        "revision": payload_manifest["revision"],
        "versions": _versions(),
        "weight_sha256": dict(payload_manifest["weight_sha256"]),
        "processor": processor,
        "hidden_size": text.get("hidden_size"),
        "media_defaults": media,
    }


def _check_payload_manifest(bm, pins: dict, where: Path) -> dict[str, str]:
    if not isinstance(bm, dict) or not bm:
        raise ExportError(f"{where}: payload has no base_manifest; cannot tell which base weights to fetch")
    if bm.get("revision") != pins["base"]["revision"]:
        raise ExportError(f"{where}: base_manifest.revision {bm.get('revision')!r} differs from the pinned base revision {pins['base']['revision']!r}")
    hashes = bm.get("weight_sha256")
    if not isinstance(hashes, dict) or not hashes:
        raise ExportError(f"{where}: base_manifest.weight_sha256 is missing or empty")
    for name, digest in hashes.items():
        if not _plain_name(name) or not name.endswith(".safetensors"):
            raise ExportError(f"{where}: base_manifest.weight_sha256 names {name!r}, not a plain *.safetensors file name")
        if not isinstance(digest, str) or not SHA256.match(digest):
            raise ExportError(f"{where}: base_manifest.weight_sha256[{name!r}] is not a sha256 hex digest")
    return dict(hashes)


def fetch(
    out: str | os.PathLike,
    pins_path: str | os.PathLike | None = None,
    endpoint: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    copy: bool = False,
    log: Callable[[str], None] | None = None,
) -> dict:
    """Fetch, verify and lay out; returns {"checkpoint": Path, "base": Path, "command": str}."""
    out = Path(out)
    log = log or (lambda msg: None)
    pins_file = Path(pins_path) if pins_path else DEFAULT_PINS
    pins = load_pins(pins_file)
    _check_pins(pins, pins_file)
    _check_destination(out)
    hub = _Hub(endpoint, Path(cache_dir) if cache_dir else None, log)

    ck = pins["checkpoint"]
    ck_files = hub.files(ck["repo"], ck["revision"], list(ck["files"]))
    log(f"verifying {ck['repo']}@{ck['revision'][:12]} checkpoint.pt (sha256, weights_only load)")
    checkpoint = open_checkpoint(ck_files["checkpoint.pt"].parent, pins)
    weight_hashes = _check_payload_manifest(checkpoint.base_manifest, pins, ck_files["checkpoint.pt"])

    base_pins = pins["base"]
    weights = sorted(weight_hashes)
    wanted = sorted(set(base_pins.get("files", [])) | set(TEXT_ASSETS) | {INDEX_FILE} | set(weights))
    required = sorted(set(REQUIRED_ASSETS) | set(weights))
    folder = hub.snapshot(base_pins["repo"], base_pins["revision"], wanted, required)
    for name in weights:
        log(f"hashing base {name}")
        digest = sha256_file(folder / name)
        if digest != weight_hashes[name]:
            raise ExportError(f"{folder / name}: sha256 {digest} does not match the checkpoint's base_manifest.weight_sha256 {weight_hashes[name]}")
    manifest = base_manifest(base_pins["repo"], folder, checkpoint.base_manifest)
    base_files = [n for n in wanted if (folder / n).is_file()]

    how = set()
    with AtomicDirectory(out) as job:
        tmp = job.tmp
        (tmp / "checkpoint").mkdir()
        (tmp / "base").mkdir()
        for name, path in ck_files.items():
            job.current = f"checkpoint/{name}"
            how.add(_place(path, tmp / "checkpoint" / name, copy))
        for name in base_files:
            job.current = f"base/{name}"
            how.add(_place(folder / name, tmp / "base" / name, copy))
        job.current = f"base/{MANIFEST_NAME}"
        with open(tmp / "base" / MANIFEST_NAME, "x", encoding="utf-8") as f:
            f.write(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        for d in (tmp / "checkpoint", tmp / "base"):
            fsync_dir(d)
        # Sizes of copies are re-checked (a copy is the one step that rewrote bytes).
        for name in weights + ["checkpoint.pt"]:
            dst = tmp / ("checkpoint" if name == "checkpoint.pt" else "base") / name
            src = ck_files[name] if name == "checkpoint.pt" else folder / name
            if dst.stat().st_size != Path(os.path.realpath(src)).stat().st_size:
                raise ExportError(f"{dst}: size differs from the cached file after placing it")
        job.commit("the fetched files", "did another run fill it?")

    cmd = ["valen-export", "--checkpoint", str(out / "checkpoint"), "--base", str(out / "base"), "--out", str(out) + "-export"]
    if pins_path and Path(pins_path).resolve() != DEFAULT_PINS.resolve():
        cmd += ["--pins", str(pins_path)]
    log(f"wrote {out} ({'hard links into' if how == {'link'} else 'copies from'} the Hugging Face cache {hub.cache_dir})")
    return {"checkpoint": out / "checkpoint", "base": out / "base", "command": shlex.join(cmd), "base_manifest": manifest}


@click.command(name="valen-fetch")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="New directory for checkpoint/ and base/ (must not exist or be empty).")
@click.option("--pins", "pins_path", type=click.Path(path_type=Path), default=None, help="Pins file (default: manifests/valen-preview-0923.json).")
@click.option("--endpoint", default=None, help="Hub endpoint (default: $HF_ENDPOINT or https://huggingface.co).")
@click.option("--copy", is_flag=True, help="Copy files out of the Hugging Face cache instead of hard-linking them.")
def main(out: Path, pins_path: Path | None, endpoint: str | None, copy: bool) -> None:
    """Download the pinned Valen-Preview-0923 checkpoint and its Qwen3.5-2B base, verify every pinned
    hash, and write OUT/checkpoint and OUT/base ready for valen-export.

    \b
    Uses the Hugging Face cache ($HF_HOME): a second run, or HF_HUB_OFFLINE=1, needs no network.
    Example:
      valen-fetch --out build/preview
    """
    try:
        result = fetch(out, pins_path=pins_path, endpoint=endpoint, copy=copy, log=lambda m: click.echo(m, err=True))
    except ValenError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    click.echo(f"fetched {result['checkpoint']} and {result['base']}; next:\n  {result['command']}")
