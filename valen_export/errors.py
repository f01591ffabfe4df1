"""The exporter's one exception type; the CLI prints its message (one line) and exits 2."""

from valen_runtime.errors import ValenError


class ExportError(ValenError):
    """Bad input or environment for an export; the message names the file, key and expectation."""
