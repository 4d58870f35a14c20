"""Local tooling around the app, not part of it: start and stop Flower processes on this machine
(``launch``), find the project and check run-config overrides (``app_config``), make TLS and
SuperNode credentials for a loopback deployment (``credentials``), build a tiny model for tests
and smoke runs (``tiny_model``).

The ServerApp and ClientApp never import this package.
"""
