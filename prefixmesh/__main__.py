"""``python -m prefixmesh`` and the ``prefixmesh`` console script (pyproject.toml).

The CLI is imported inside :func:`main`: a Ctrl-C while it is still being imported or
parsing its flags (the first ~50 ms of a start) exits with 130 and an empty line, as at
any later moment (``prefixmesh/cli.py``), instead of a KeyboardInterrupt traceback.
"""

import sys


def main() -> int:
    try:
        from prefixmesh.cli import main as cli_main

        return cli_main()
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
