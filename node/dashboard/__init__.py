"""The node's web dashboard: static files served at ``/dashboard`` (``node/http_gateway.py``)."""
