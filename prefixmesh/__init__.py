"""prefixmesh: volunteer LLM inference nodes that reuse each other's prompt-prefix caches."""

__version__ = "0.1.0"
