"""The one error type the harness raises for exit-2 problems."""

from __future__ import annotations


class UsageProblem(Exception):
    """Bad inputs (paths, unreadable export, no tolerance, reference cannot be built): exit 2, one line."""
