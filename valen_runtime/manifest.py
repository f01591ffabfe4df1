"""The export manifest `valen_export.json` (format `valen-native/1`): reading and file checks.

The reader owns the type: the exporter writes what this module accepts (docs/export-format.md).
Paths in the manifest must be plain relative names inside the export directory; symlinks,
`..`, absolute paths, unlisted files and size or hash mismatches are refused.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from .errors import WeightsError
from .safetensors_file import sha256_file

FORMAT = "valen-native/1"
MANIFEST_NAME = "valen_export.json"


def safe_member(root: Path, name: str, what: str) -> Path:
    """Resolve `name` inside `root`, refusing absolute paths, `..`, and symlinks anywhere on the way."""
    if not isinstance(name, str) or not name or name.startswith("/") or "\\" in name or "\0" in name:
        raise WeightsError(f"{root / MANIFEST_NAME}: {what} {name!r} is not a relative file name")
    parts = name.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise WeightsError(f"{root / MANIFEST_NAME}: {what} {name!r} leaves the export directory")
    path = root
    for p in parts:
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
        if not path.is_file():
            raise WeightsError(f"{path}: missing; not a complete valen-export directory")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise WeightsError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            got = data.get("format") if isinstance(data, dict) else None
            raise WeightsError(f"{path}: field 'format' is {got!r}, expected {FORMAT!r}")
        for key in ("files", "language", "lora", "vision", "head", "prompt"):
            if not isinstance(data.get(key), dict):
                raise WeightsError(f"{path}: missing object field {key!r}")
        m = cls(root, data)
        for name in m.files:
            safe_member(root, name, "files entry")
        return m

    @property
    def files(self) -> dict[str, dict]:
        return self.data["files"]

    def path(self, name: str) -> Path:
        """Path of a file the manifest lists; anything unlisted is refused."""
        if name not in self.files:
            raise WeightsError(f"{self.root / MANIFEST_NAME}: file {name!r} is not listed under 'files'")
        return safe_member(self.root, name, "file")

    def check_files(self, verify: str = "size") -> list[str]:
        """Check every listed file ('size' or 'full' = sizes + SHA-256); returns failure lines."""
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
            if not p.is_file():
                failures.append(f"{p}: missing (listed in the manifest)")
                continue
            size = p.stat().st_size
            if size != rec.get("size"):
                failures.append(f"{p}: size {size} does not match the manifest's {rec.get('size')}")
                continue
            if verify == "full":
                digest = sha256_file(p)
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
