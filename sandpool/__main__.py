"""python -m sandpool: the CLI."""

from sandpool.cli import main

main()
