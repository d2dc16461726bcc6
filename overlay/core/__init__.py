"""The overlay's pure core: wire codecs, identities and signatures, digest records,
anti-entropy, partial replication, the peer cache index, routing and trust.

Pure means deterministic and free of IO: no trio, libp2p, llama_cpp or socket imports and
no clock reads (time is passed in as ``now``). ``tests/test_purity.py`` enforces it. The
node (``overlay/``, ``node/``) and the simulator (``bench/``) drive these same objects.
"""
