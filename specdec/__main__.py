"""`python -m specdec <command> ...`: the command line, `specdec.cli`."""
from specdec.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
