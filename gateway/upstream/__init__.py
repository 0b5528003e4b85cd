"""The engine side: the replicas of each backend, how one is chosen (routing), and whether it
is healthy (health: breaker and active checks; incidents: what the operator is told)."""
