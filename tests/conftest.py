import logging

pytest_plugins: list[str] = []
logging.getLogger("slogate.access").setLevel(logging.INFO)
