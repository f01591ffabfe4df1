"""`python -m valen_runtime.serve`: the same command as `valen-serve`."""

from .cli import main

main()
