"""`python -m llama_scratch.download`: fetch a checkpoint. The fetching itself is `sources/fetch.py`, which the
commands that resolve `--model` use too; this module is only the command line."""

import sys

from .sources.fetch import main

if __name__ == "__main__":
    sys.exit(main())
