"""Your own strategies, shipped with the app: every ``.py`` file here goes into the bundle Flower runs (``fab-include``
in pyproject.toml), so the ServerApp imports it in a simulation (``flwr run .``, ``parablock-flwr simulate``) and in a
deployment alike. Name a class as ``strategy = "extensions.MODULE:CLASS"`` (docs/extending.md)."""
