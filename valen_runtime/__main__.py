from valen_runtime.cli import main

main()
