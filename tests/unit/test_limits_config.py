"""The trust boundary's config keys: safe defaults, validated like every other key."""
from __future__ import annotations

import pytest

from gateway import config

BACKEND = {"name": "a", "base_url": "http://127.0.0.1:8000/v1"}
OPEN = {"mode": "open"}


def test_defaults_are_safe_on_the_internet() -> None:
    s = config.parse({"backends": [BACKEND], "auth": OPEN}).server
    assert s.header_timeout_s == 15 and s.body_timeout_s == 60
    assert s.idle_connection_timeout_s <= 75
    assert s.max_connections == 8192 and s.max_connections_per_client == 4096
    assert s.max_event_bytes == 8 << 20 and s.max_response_bytes == 32 << 20
    assert s.backlog == 4096


def test_keys_parse_and_env_overrides_apply() -> None:
    cfg = config.parse({"backends": [{**BACKEND, "forward_headers": ["OpenAI-Organization"],
                                      "deny_headers": ["anthropic-beta"]}],
                        "auth": OPEN, "server": {"max_connections": 10}},
                       env={"SLOGATE_SERVER_MAX_CONNECTIONS_PER_CLIENT": "0",
                            "SLOGATE_SERVER_HEADER_TIMEOUT_S": "2.5"})
    assert cfg.server.max_connections == 10 and cfg.server.max_connections_per_client == 0
    assert cfg.server.header_timeout_s == 2.5
    assert cfg.backends[0].forward_headers == ("openai-organization",)
    assert cfg.backends[0].deny_headers == ("anthropic-beta",)


@pytest.mark.parametrize("server,backend,key,fragment", [
    ({"max_connections": 0}, {}, "server.max_connections", "integer >= 1"),
    ({"max_connections_per_client": -1}, {}, "server.max_connections_per_client", ">= 0"),
    ({"header_timeout_s": 0}, {}, "server.header_timeout_s", "positive"),
    ({"body_timeout_s": "slow"}, {}, "server.body_timeout_s", "positive"),
    ({"max_event_bytes": 10}, {}, "server.max_event_bytes", ">= 1024"),
    ({"max_response_bytes": 1.5}, {}, "server.max_response_bytes", "integer"),
    ({"backlog": 0}, {}, "server.backlog", "integer >= 1"),
    ({}, {"forward_headers": "OpenAI-Organization"}, "backends[0].forward_headers", "list"),
    ({}, {"deny_headers": ["bad: name"]}, "backends[0].deny_headers", "header names"),
    ({}, {"forward_headers": ["x-*-sim"]}, "backends[0].forward_headers", "prefixes"),
    ({}, {"forward_headers": ["*"]}, "backends[0].forward_headers", "prefixes"),
])
def test_bad_values_name_the_key(server, backend, key, fragment) -> None:
    with pytest.raises(config.ConfigError) as e:
        config.parse({"backends": [{**BACKEND, **backend}], "auth": OPEN, "server": server},
                     env={})
    assert e.value.key == key and fragment in e.value.expected
