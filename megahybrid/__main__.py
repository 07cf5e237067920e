"""`python -m megahybrid ...` is the `megahybrid` command."""
import sys

from megahybrid.cli import main

if __name__ == "__main__":
    sys.exit(main())
