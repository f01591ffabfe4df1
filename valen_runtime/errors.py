"""Exceptions raised by the runtime. Each message is one line naming the file, field or key."""


class ValenError(Exception):
    """Base class for every expected failure; CLIs print str(e) and exit 2."""


class ConfigError(ValenError):
    """config.json or the manifest holds a value the runtime does not support."""


class WeightsError(ValenError):
    """An exported file is missing, mismatched, unsafe or malformed."""


class RequestError(ValenError):
    """A request failed validation. `field` names the offending JSON path (e.g. questions.q1.criteria)."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}" if field else message)
