"""`ferrum-executor serve`: its flags, the configuration they build, and the serving loop.

The `ferrum-executor` command line itself (serve plus the demo, generate and bench tools) is
`ferrum_server.tools.cli`; it registers `serve` through `add_serve_command`.

The flags are generated from the configuration dataclasses (EngineConfig, ServerConfig,
LogConfig, SecurityConfig): each field marked `flag(...)` in its metadata is one flag, its
default the field's. Every `serve` flag also reads the environment variable FERRUM_<FLAG>
(dashes as underscores), so containers can be configured either way; flags win over the
environment.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import pathlib
import signal
import sys
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from ferrum_server.config import EngineConfig, LogConfig, ServerConfig
from ferrum_server.config_flags import flag_info
from ferrum_server.security import SecurityConfig


def parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {text!r}")


# The parse function of a flag, by the type of its config field.
_PARSERS: dict[object, Callable[[str], Any]] = {
    bool: parse_bool,
    int: int,
    float: float,
    str: str,
}


@dataclass(frozen=True, slots=True)
class Flag:
    """A `serve` flag: one field of a configuration dataclass, described by its metadata."""

    config: type[Any]
    field: str
    name: str
    parse: Callable[[str], Any]
    default: Any
    help: str
    choices: tuple[str, ...] | None = None

    @property
    def env(self) -> str:
        return "FERRUM_" + self.name.upper().replace("-", "_")

    @property
    def dest(self) -> str:
        return self.name.replace("-", "_")

    @property
    def switch(self) -> bool:
        """Booleans also work as bare switches: --cuda-graphs / --no-cuda-graphs."""
        return self.parse is parse_bool

    @property
    def shown_default(self) -> str:
        if isinstance(self.default, bool):
            return "true" if self.default else "false"
        if isinstance(self.default, float):
            return f"{self.default:g}"
        return str(self.default)


def _flags_of(config: type[Any]) -> tuple[Flag, ...]:
    hints = typing.get_type_hints(config)
    flags = []
    for field in dataclasses.fields(config):
        info = flag_info(field)
        if info is None:
            continue
        if field.default is dataclasses.MISSING or hints[field.name] not in _PARSERS:
            raise TypeError(
                f"{config.__name__}.{field.name}: a flag needs a plain default and type"
            )
        flags.append(
            Flag(
                config,
                field.name,
                info.name or field.name.replace("_", "-"),
                _PARSERS[hints[field.name]],
                field.default,
                info.help,
                info.choices,
            )
        )
    return tuple(flags)


# The configuration `serve` builds, and the title of each one's flags in --help.
SECTIONS: dict[type[Any], str] = {
    EngineConfig: "engine",
    ServerConfig: "server",
    SecurityConfig: "security",
    LogConfig: "logging",
}
SERVE_FLAGS: tuple[Flag, ...] = tuple(flag for config in SECTIONS for flag in _flags_of(config))


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """The `serve` flags. A flag not given parses to None: `serve_configs` then falls back to
    its environment twin, else to the dataclass default."""
    for config, title in SECTIONS.items():
        group = parser.add_argument_group(title)
        for flag in SERVE_FLAGS:
            if flag.config is not config:
                continue
            text = f"{flag.help} [env {flag.env}, default {flag.shown_default}]"
            group.add_argument(
                f"--{flag.name}",
                type=flag.parse,
                default=None,
                choices=flag.choices,
                help=text.replace("%", "%%"),
                nargs="?" if flag.switch else None,
                const=True if flag.switch else None,
            )
            if flag.switch:
                group.add_argument(
                    f"--no-{flag.name}",
                    dest=flag.dest,
                    action="store_const",
                    const=False,
                    default=argparse.SUPPRESS,
                    help=f"same as --{flag.name} false",
                )
    parser.add_argument(
        "--port-file",
        type=pathlib.Path,
        default=None,
        help="write the bound port here once SERVING (for --port 0)",
    )


def _from_environment(flag: Flag, text: str) -> Any:
    """The value of FERRUM_<FLAG>, checked as the flag's own value would be."""
    try:
        value = flag.parse(text)
    except argparse.ArgumentTypeError as exc:
        raise ValueError(f"{flag.env}: {exc}") from None
    except ValueError:
        kind = getattr(flag.parse, "__name__", "")
        raise ValueError(f"{flag.env}: invalid {kind} value: {text!r}") from None
    if flag.choices is not None and value not in flag.choices:
        raise ValueError(
            f"{flag.env}: invalid choice: {text!r} (choose from {', '.join(flag.choices)})"
        )
    return value


_T = TypeVar("_T")


def _build(
    config: Callable[..., _T],
    args: argparse.Namespace,
    environ: Mapping[str, str],
    **fixed: Any,
) -> _T:
    """One config: each flag field from the command line when given (flags win), else from
    its environment twin when set, else left to the dataclass default."""
    values: dict[str, Any] = {}
    for flag in SERVE_FLAGS:
        if flag.config is not config:
            continue
        given = getattr(args, flag.dest, None)
        if given is not None:
            values[flag.field] = given
        elif (text := environ.get(flag.env)) is not None:
            values[flag.field] = _from_environment(flag, text)
    return config(**values, **fixed)


@dataclass(frozen=True, slots=True)
class ServeConfigs:
    """Everything `serve` is configured with, built once at start-up."""

    engine: EngineConfig
    server: ServerConfig
    log: LogConfig


def serve_configs(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> ServeConfigs:
    """Build the configuration of `serve`, once, from parsed `serve` flags and the environment
    (os.environ unless given): the one place the FERRUM_<FLAG> twins are read."""
    env = os.environ if environ is None else environ
    engine = _build(EngineConfig, args, env)
    if engine.model != "tiny" and not pathlib.Path(engine.model).is_dir():
        raise ValueError(f"model path {engine.model} is not a folder")
    security = _build(SecurityConfig, args, env)
    server = _build(ServerConfig, args, env, security=security)
    return ServeConfigs(engine, server, _build(LogConfig, args, env))


async def _serve(engine: EngineConfig, server: ServerConfig, port_file: pathlib.Path | None) -> int:
    """Serve until SIGTERM (drain; exit code 0) or until a split model's group fails (abort;
    exit code 1, so the orchestrator restarts every rank)."""
    from ferrum_server import probe_file
    from ferrum_server.app import start_server
    from ferrum_server.process_gc import freeze_startup_objects

    if server.probe_file:
        probe_file.remove(server.probe_file)
    running = await start_server(engine, server)
    freeze_startup_objects()  # this process is the server: start-up's objects are never walked
    if port_file is not None:
        tmp = port_file.with_suffix(".tmp")
        tmp.write_text(str(running.port))
        tmp.replace(port_file)
    if server.probe_file:
        target = probe_file.probe_target(
            server.host, running.port, running.health_port, server.security.tls
        )
        probe_file.write(server.probe_file, target)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    count = 0

    def on_signal() -> None:
        nonlocal count
        count += 1
        if count > 1:
            os._exit(1)  # a second signal: exit at once, without draining
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    stopped = asyncio.ensure_future(stop.wait())
    failed = asyncio.ensure_future(running.group_failed.wait())
    await asyncio.wait((stopped, failed), return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    failed.cancel()
    if running.group_failed.is_set():
        await running.abort()
    else:
        await running.drain(server.grace_s)
    if server.probe_file:
        probe_file.remove(server.probe_file)
    return 1 if running.group_failed.is_set() else 0


def cmd_serve(args: argparse.Namespace) -> int:
    from ferrum_server import logs
    from ferrum_server.app import startup_event

    try:
        configs = serve_configs(args)
        logs.configure(configs.log.level, configs.log.format)
    except ValueError as exc:
        sys.stderr.write(f"ferrum-executor: invalid configuration: {exc}\n")
        return 2
    logs.get("ferrum_server").info("startup", **startup_event(configs.engine, configs.server))
    try:
        if configs.engine.rank > 0:  # a follower of a split model (one process per rank)
            from ferrum_server.parallel.follower import follow
            from ferrum_server.startup import check_split

            check_split(configs.engine)
            code = follow(configs.engine, configs.server)
        else:
            code = asyncio.run(_serve(configs.engine, configs.server, args.port_file))
    except (ValueError, OSError) as exc:
        sys.stderr.write(f"ferrum-executor: cannot start: {exc}\n")
        return 2
    if configs.engine.parallel_size > 1:
        exit_without_teardown(code)
    return code


def exit_without_teardown(code: int) -> typing.NoReturn:
    """End a split model's rank process once it has stopped, skipping the interpreter's
    teardown. torch.distributed's C++ threads (gloo's, the TCP store's) may still be alive
    then, and a joinable std::thread destroyed at exit aborts the process ("terminate called
    without an active exception", exit -6): CI saw it once, after rank 0 had logged "stopped".
    The server has released everything by now, the logs are written a line per write and
    flushed here, and the OS frees the rest."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def add_serve_command(subcommands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `serve` (its flags and `cmd_serve`) to a command line's subcommands."""
    serve = subcommands.add_parser("serve", help="run the executor gRPC server")
    add_serve_args(serve)
    serve.set_defaults(func=cmd_serve)
