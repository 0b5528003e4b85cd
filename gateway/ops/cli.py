"""The `slogate` command: `serve` runs the gateway, `check` validates a config, `sim` runs the
built-in engine simulator, `demo` runs both with a short load, `hash-key` hashes a gateway key.
Subcommands that live outside the gateway package (the simulator's `sim`) come through the
`slogate.commands` entry point group: the gateway imports nothing from backends/."""
from __future__ import annotations

import argparse
import sys
from importlib.metadata import entry_points

SERVE_DESCRIPTION = """\
Run the gateway. Apps point their OpenAI / Anthropic / Groq / Cerebras SDK at it.

The config is one TOML file: [server] (listen address, commit policy, body limit, drain),
[auth] (gateway keys or "open"), one [[backends]] table per engine replica or hosted API
(type, base_url, models, api_key_env), and optionally [timeouts], [retry], [breaker],
[fallbacks], [admission], [telemetry], [[slo_classes]] and [slo]. Examples, one per provider
family, are in gateway/examples/ (start from sim.toml or production.toml).

Every key can be overridden from the environment, applied before validation:
  SLOGATE_<SECTION>_<KEY>=value         e.g. SLOGATE_SERVER_PORT=9000
  SLOGATE_BACKEND_<NAME>_<KEY>=value    e.g. SLOGATE_BACKEND_VLLM_A_BASE_URL=http://10.0.0.5:8000/v1
(names upper-cased, "-" -> "_"; values parse as TOML values, else strings). Upstream keys
never live in the file: a backend's api_key_env names the variable that holds its key.
An unknown SLOGATE_* variable is warned about at start.

`slogate check --config FILE` prints the resolved config (overrides applied, secrets as ***)
without serving. The live console is at http://HOST:PORT/console once it runs."""

HASH_KEY_DESCRIPTION = """\
Read one gateway key from standard input (one line; the trailing newline is dropped) and
print its sha256, the value [[auth.keys]] sha256 wants. The key never appears on the command
line or in the shell history:
  printf %s "$KEY" | slogate hash-key
  slogate hash-key < key.txt
On a terminal it asks for the key without echoing it."""


def _install_uvloop() -> None:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency, but stay runnable without it
        return
    uvloop.install()


def build_parser() -> argparse.ArgumentParser:
    import gateway

    parser = argparse.ArgumentParser(prog="slogate", description=__doc__)
    parser.add_argument("--version", action="version", version=f"slogate {gateway.version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    raw = argparse.RawDescriptionHelpFormatter

    serve = sub.add_parser("serve", help="run the gateway", description=SERVE_DESCRIPTION,
                           formatter_class=raw)
    serve.add_argument("--config", required=True, help="TOML config file")
    serve.add_argument("--host", help="listen address (overrides [server].host)")
    serve.add_argument("--port", type=int, help="listen port (overrides [server].port)")
    serve.add_argument("--workers", metavar="N",
                       help="worker processes on one port (SO_REUSEPORT) under a supervisor "
                       "that restarts them and drains them all on SIGTERM; 'auto' = the "
                       "cores this process may use (default: [server] workers, else 1: a "
                       "single process)")
    serve.add_argument("--worker", help=argparse.SUPPRESS)  # the supervisor's, for one worker

    check = sub.add_parser("check", help="validate a config and print it resolved",
                           description="Validate a config file as `serve` would (environment "
                           "overrides applied) and print the resolved config, secrets as ***. "
                           "Exit status 0 when valid, 2 on an error.")
    check.add_argument("--config", required=True, help="TOML config file")

    sub.add_parser("hash-key", help="print the sha256 of a gateway key read from stdin "
                   "(for [[auth.keys]] sha256)", description=HASH_KEY_DESCRIPTION,
                   formatter_class=raw)

    demo = sub.add_parser("demo", help="simulator + gateway + a short load, then keep serving")
    demo.add_argument("--duration", type=float, help="exit after this many seconds")
    demo.add_argument("--port", type=int, default=8080, help="gateway port")
    demo.add_argument("--sim-port", type=int, default=8000, help="simulator port")
    demo.add_argument("--concurrency", type=int, default=8, help="concurrent client streams")

    from gateway.ops import bench, replay

    replay.add_arguments(sub.add_parser(
        "replay", help="replay a recorded trace against the current and alternative configs",
        description=replay.__doc__, formatter_class=raw))
    sub.choices["replay"].add_argument("trace", help="the JSON access log or flight-recorder "
                                       "JSONL to replay")
    bench.add_arguments(sub.add_parser(
        "bench", help="sweep offered load through the gateway and recommend admission settings",
        description=bench.__doc__, formatter_class=raw))

    for command in entry_points(group="slogate.commands"):
        command.load()(sub)  # each adds its subparser with a `run(args) -> int` default
    return parser


def _hash_key() -> int:
    from gateway.edge.auth import hash_key

    if sys.stdin.isatty():
        import getpass

        key = getpass.getpass("gateway key (not echoed): ").strip()
    else:
        key = sys.stdin.readline().strip()
    if not key:
        print("slogate hash-key: no key on stdin (try: printf %s \"$KEY\" | slogate hash-key)",
              file=sys.stderr)
        return 2
    print(hash_key(key))
    return 0


def _plugin(args: argparse.Namespace) -> int:
    """A subcommand from the entry point group; a port it cannot listen on is one line."""
    from gateway.transport.netdiag import describe_listen_error

    try:
        return int(args.run(args))
    except OSError as e:
        host: str = getattr(args, "host", "?")
        port: int = getattr(args, "port", 0)
        print(f"slogate: {describe_listen_error(e, host, port)}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "check":
        from gateway.ops import check
        return check.run(args.config)
    if args.command == "hash-key":
        return _hash_key()
    _install_uvloop()
    if getattr(args, "run", None) is not None:
        return _plugin(args)
    if args.command in ("replay", "bench"):
        from gateway.ops import bench, replay
        return int((replay if args.command == "replay" else bench).run(args))
    if args.command == "demo":
        from gateway.ops import demo
        return demo.run(args.duration, args.port, args.sim_port, args.concurrency)
    from gateway.ops import check, server, workers
    if args.worker is None:  # the supervisor's workers would say it again
        check.warn_infeasible(args.config)
    try:
        n = workers.parse_workers(args.workers) if args.workers is not None else None
    except ValueError as e:
        print(f"slogate: {e}", file=sys.stderr)
        return 2
    return server.run(args.config, host=args.host, port=args.port, workers=n,
                      worker=args.worker)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
