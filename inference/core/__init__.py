"""The engine's pure core: block hashes and the radix tree of cached prefixes.

Pure as in ``prefixmesh.overlay.core``: no IO, no clock reads, enforced by
``tests/test_purity.py``. The KV store and the simulator share these objects.
"""
