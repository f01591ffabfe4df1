"""The export manifest `valen_export.json` (format `valen-native/1`): reading and file checks.

The reader owns the type: the exporter writes what this module accepts (docs/export-format.md).
Paths in the manifest must be plain relative names inside the export directory; symlinks,
`..`, absolute paths, unlisted files and size or hash mismatches are refused. `Manifest.load` also
checks the manifest's own structure (types of every field a loader reads, every referenced file
listed under `files`, the language index naming exactly the language files) so that a damaged
manifest fails with one WeightsError line instead of a KeyError or TypeError deep in a loader.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from .errors import WeightsError
from .safetensors_file import reject_duplicate_keys, sha256_file

FORMAT = "valen-native/1"
MANIFEST_NAME = "valen_export.json"
# valen_export.json of a 2B export and its language index are tens of KiB; anything near this is not ours.
MAX_JSON_BYTES = 16 * 1024 * 1024
SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")


def read_json_object(path: Path, what: str) -> dict:
    """A bounded, strict JSON object read: size limit, UTF-8, no duplicate keys, no NaN/Infinity."""
    try:
        if path.stat().st_size > MAX_JSON_BYTES:
            raise WeightsError(f"{path}: {what} is larger than {MAX_JSON_BYTES} bytes")
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise WeightsError(f"{path}: cannot read {what} ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise WeightsError(f"{path}: {what} is not UTF-8 ({e.reason})") from None

    def no_constant(name):
        raise ValueError(f"non-standard JSON constant {name}")

    try:
        data = json.loads(text, object_pairs_hook=reject_duplicate_keys, parse_constant=no_constant)
    except (ValueError, RecursionError) as e:
        raise WeightsError(f"{path}: {what} is not valid JSON ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    if not isinstance(data, dict):
        raise WeightsError(f"{path}: {what} must be a JSON object")
    return data


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _name_problem(name) -> str | None:
    """Why `name` is not a plain relative path inside a directory, or None."""
    if not isinstance(name, str) or not name or name.startswith("/") or "\\" in name or "\0" in name:
        return "is not a relative file name"
    if any(p in ("", ".", "..") for p in name.split("/")):
        return "leaves the export directory"
    return None


def safe_member(root: Path, name: str, what: str) -> Path:
    """Resolve `name` inside `root`, refusing absolute paths, `..`, and symlinks anywhere on the way."""
    problem = _name_problem(name)
    if problem:
        raise WeightsError(f"{root / MANIFEST_NAME}: {what} {name!r} {problem}")
    path = root
    for p in name.split("/"):
        path = path / p
        if path.is_symlink():
            raise WeightsError(f"{path}: is a symlink; exports must hold regular files only")
    return path


@dataclass
class Manifest:
    root: Path
    data: dict

    @classmethod
    def load(cls, export_dir: str | os.PathLike) -> "Manifest":
        root = Path(export_dir)
        path = root / MANIFEST_NAME
        if not root.is_dir():
            raise WeightsError(f"{root}: not a directory")
        if path.is_symlink():
            raise WeightsError(f"{path}: is a symlink; exports must hold regular files only")
        if not path.is_file():
            raise WeightsError(f"{path}: missing; not a complete valen-export directory")
        data = read_json_object(path, "the export manifest")
        if data.get("format") != FORMAT:
            raise WeightsError(f"{path}: field 'format' is {data.get('format')!r}, expected {FORMAT!r}")
        for key in ("files", "language", "lora", "vision", "head", "prompt"):
            if not isinstance(data.get(key), dict):
                raise WeightsError(f"{path}: missing object field {key!r}")
        m = cls(root, data)
        for name, rec in m.files.items():
            safe_member(root, name, "files entry")
            if name == MANIFEST_NAME:
                raise WeightsError(f"{path}: files lists the manifest itself")
            if (
                not isinstance(rec, dict)
                or not _is_int(rec.get("size"))
                or rec["size"] < 0
                or not isinstance(rec.get("sha256"), str)
                or not SHA256_HEX.match(rec["sha256"])
            ):
                raise WeightsError(f"{path}: files[{name!r}] must be {{sha256: 64 lowercase hex, size: integer >= 0}}, got {rec!r}")
        m._check_layout()
        return m

    def _check_layout(self) -> None:
        """Types of the fields loaders read, and every file they name listed under `files`."""
        where = self.root / MANIFEST_NAME
        d = self.data

        def listed(value, field):
            if not isinstance(value, str) or value not in self.files:
                raise WeightsError(f"{where}: {field} {value!r} is not a file listed under 'files'")

        def text(value, field):
            if not isinstance(value, str):
                raise WeightsError(f"{where}: {field} must be a string, got {value!r}")

        lang = d["language"]
        text(lang.get("prefix"), "language.prefix")
        files = lang.get("files")
        if not isinstance(files, list) or not files or len(set(map(str, files))) != len(files):
            raise WeightsError(f"{where}: language.files must be a non-empty list of distinct file names, got {files!r}")
        for f in files:
            listed(f, "language.files entry")
        if lang.get("index") is not None:
            listed(lang["index"], "language.index")
            self._check_index(lang["index"], files)
        lora = d["lora"]
        if lora.get("mode") not in ("separate", "merged"):
            raise WeightsError(f"{where}: lora.mode {lora.get('mode')!r} is not separate or merged")
        if lora["mode"] == "separate":
            listed(lora.get("file"), "lora.file")
            text(lora.get("key_prefix"), "lora.key_prefix")
        listed(d["vision"].get("file"), "vision.file")
        text(d["vision"].get("prefix"), "vision.prefix")
        listed(d["head"].get("file"), "head.file")
        pd = d["head"].get("projection_dim")
        if not _is_int(pd) or pd <= 0:
            raise WeightsError(f"{where}: head.projection_dim must be a positive integer, got {pd!r}")
        fp = d.get("fp32_sources")
        if fp is not None:
            if not isinstance(fp, dict):
                raise WeightsError(f"{where}: fp32_sources must be an object")
            if fp.get("file") is not None:
                listed(fp["file"], "fp32_sources.file")
        ml = d["prompt"].get("max_length")
        if not _is_int(ml) or ml <= 0:
            raise WeightsError(f"{where}: prompt.max_length must be a positive integer, got {ml!r}")
        mk = d["prompt"].get("media_kwargs")
        if mk is not None and not isinstance(mk, dict):
            raise WeightsError(f"{where}: prompt.media_kwargs must be an object")

    def _check_index(self, index_name: str, language_files: list[str]) -> None:
        """The language index (what the native loader reads) may only name the listed language files."""
        path = safe_member(self.root, index_name, "language.index")
        index = read_json_object(path, "the language index")
        wm = index.get("weight_map")
        if not isinstance(wm, dict) or not wm:
            raise WeightsError(f"{path}: weight_map must be a non-empty object")
        for tensor, fname in wm.items():
            if not isinstance(fname, str):
                raise WeightsError(f"{path}: weight_map[{tensor!r}] must be a file name, got {fname!r}")
            if fname not in language_files:
                problem = _name_problem(fname)
                if problem:
                    raise WeightsError(f"{path}: weight_map[{tensor!r}] = {fname!r} {problem}")
                raise WeightsError(f"{path}: weight_map[{tensor!r}] names {fname!r}, not one of the language files {language_files}")
        unused = sorted(set(language_files) - set(wm.values()))
        if unused:
            raise WeightsError(f"{path}: language files {unused} hold no tensor of weight_map")

    @property
    def files(self) -> dict[str, dict]:
        return self.data["files"]

    def path(self, name: str) -> Path:
        """Path of a file the manifest lists; anything unlisted is refused."""
        if name not in self.files:
            raise WeightsError(f"{self.root / MANIFEST_NAME}: file {name!r} is not listed under 'files'")
        return safe_member(self.root, name, "file")

    def check_files(self, verify: str = "size", on_bytes=None) -> list[str]:
        """Check every listed file ('size' or 'full' = sizes + SHA-256); returns failure lines.
        on_bytes(n) reports hashing progress in bytes."""
        if verify not in ("none", "size", "full"):
            raise ValueError(f"verify must be none, size or full, got {verify!r}")
        failures = []
        if verify == "none":
            return failures
        for name, rec in sorted(self.files.items()):
            try:
                p = self.path(name)
            except WeightsError as e:
                failures.append(str(e))
                continue
            if not p.exists():
                failures.append(f"{p}: missing (listed in the manifest)")
                continue
            if not p.is_file():
                failures.append(f"{p}: not a regular file (listed in the manifest)")
                continue
            size = p.stat().st_size
            if size != rec.get("size"):
                failures.append(f"{p}: size {size} does not match the manifest's {rec.get('size')}")
                continue
            if verify == "full":
                digest = sha256_file(p, on_bytes=on_bytes)
                if digest != rec.get("sha256"):
                    failures.append(f"{p}: sha256 {digest} does not match the manifest's {rec.get('sha256')}")
        listed = set(self.files) | {MANIFEST_NAME}
        for p in sorted(self.root.rglob("*")):
            rel = p.relative_to(self.root).as_posix()
            if p.is_symlink():
                failures.append(f"{p}: is a symlink; exports must hold regular files only")
            elif p.is_file() and rel not in listed:
                failures.append(f"{p}: not listed in the manifest")
        return failures

    def require_files(self, verify: str = "size") -> None:
        failures = self.check_files(verify)
        if failures:
            more = f" (+{len(failures) - 1} more; run valen-verify)" if len(failures) > 1 else ""
            raise WeightsError(failures[0] + more)
