"""Outside attackers: written from the wire specs (docs, module docstrings), not from our
encoders. Each speaks to real node processes through a plain py-libp2p host."""
