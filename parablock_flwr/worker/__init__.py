"""The node worker (deployment): see ``server.py``. ``protocol.py`` is torch-free."""
