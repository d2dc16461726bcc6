"""``python -m prefixmesh``: the same as the ``prefixmesh`` console script."""

from prefixmesh.cli import main

raise SystemExit(main())
