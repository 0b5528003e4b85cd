"""Helpers the tests share: real servers on loopback, scripted upstreams, clocks, waits."""
