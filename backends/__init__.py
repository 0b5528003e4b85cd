"""What runs behind the gateway: the built-in engine simulator (backends/sim) and the launch
settings of the real engines that docker-compose and the tests use. Imports nothing from the
gateway: it is an engine, not part of the proxy."""
