"""Command-line knobs for `slogate sim` (the caller adds --host/--port)."""
from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from .config import KNOBS, SimConfig, coerce
from .server import build_app


def _opt(name: str) -> str:
    f = KNOBS[name]
    return f.metadata.get("cli") or "--" + name.replace("_", "-")


class _Flag(argparse.BooleanOptionalAction):
    """--x sets the knob, --no-x clears it; also for a knob whose own name starts with no_
    (argparse's action would read --no-terminator as a negation)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: str | Sequence[Any] | None, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, option_string == self.option_strings[0])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every SimConfig knob as a --kebab-case option (defaults shown are SimConfig's)."""
    defaults = SimConfig()
    group = parser.add_argument_group("engine simulator knobs")
    for f in dataclasses.fields(SimConfig):
        default = getattr(defaults, f.name)
        help_ = f"{f.metadata.get('help', '')} (default: {default!r})".replace("%", "%%")
        kw: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": help_}
        if f.type in ("bool", bool):
            group.add_argument(_opt(f.name), action=_Flag, **kw)
        elif f.type in ("list[str]",):
            group.add_argument(_opt(f.name), action="append", metavar="NAME", **kw)
        else:
            if "choices" in f.metadata:
                kw["choices"] = f.metadata["choices"]
            group.add_argument(_opt(f.name), type=functools.partial(_conv, f.name), **kw)


def _conv(name: str, value: str) -> Any:
    try:
        return coerce(name, value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def config_from_args(args: argparse.Namespace) -> SimConfig:
    """A validated SimConfig from parsed args; knobs not given keep their defaults."""
    vals = {name: getattr(args, name) for name in KNOBS if hasattr(args, name)}
    if "served_model_names" in vals:  # --served-model-name a --served-model-name b,c
        vals["served_model_names"] = [n for v in vals["served_model_names"]
                                      for n in coerce("served_model_names", v)]
    cfg = SimConfig(**vals)
    try:
        cfg.validate()
    except ValueError as e:
        sys.exit(f"slogate sim: {e}")
    return cfg


def run(cfg: SimConfig, host: str, port: int) -> None:
    """Serve the simulator until interrupted (blocking)."""
    app = build_app(cfg)

    shown = "[" + host + "]" if ":" in host else host

    def _print(msg: str) -> None:  # run_app's banner (once listening): ours, in one line
        print(f"slogate sim: serving {', '.join(cfg.served_model_names)} on http://{shown}:{port}",
              flush=True)

    web.run_app(app, host=host, port=port, handler_cancellation=True, access_log=None, print=_print)


def command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The `slogate sim` subcommand, found by the gateway's CLI through the `slogate.commands`
    entry point group (the gateway imports nothing from the simulator)."""
    sim = sub.add_parser("sim", help="run the built-in engine simulator (OpenAI-compatible)")
    sim.add_argument("--host", default="127.0.0.1")
    sim.add_argument("--port", type=int, default=8000)
    add_arguments(sim)
    sim.set_defaults(run=_run_command)


def _run_command(args: argparse.Namespace) -> int:
    run(config_from_args(args), args.host, args.port)
    return 0
