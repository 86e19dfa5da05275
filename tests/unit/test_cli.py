"""The command line: `serve` flags generated from the configuration dataclasses (one default
each, an environment twin each, flags winning), and the subcommands of `ferrum-executor`."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

import pytest
from ferrum_server.cli import SERVE_FLAGS, Flag, ServeConfigs, add_serve_args, serve_configs
from ferrum_server.config import EngineConfig, LogConfig, ServerConfig
from ferrum_server.config_flags import NOT_A_FLAG, flag_info
from ferrum_server.security import SecurityConfig
from ferrum_server.tools.cli import build_parser

CONFIGS: tuple[type[Any], ...] = (EngineConfig, ServerConfig, SecurityConfig, LogConfig)

# Every flag `serve` had when the flags were still listed by hand in cli.py.
FLAG_NAMES = {
    "model", "host", "port", "device", "dtype", "block-size", "kv-cache-bytes",
    "gpu-memory-utilization", "max-batch-tokens", "max-batch-size", "max-sequence-length",
    "torch-threads", "kernel-backend", "prefix-caching", "cuda-graphs", "cuda-graph-max-batch",
    "launch-ahead", "swap-space-bytes", "grace-s", "metrics-port", "metrics-host",
    "liveness-timeout-s",
    "log-level", "log-format", "debug-reflection", "tls-cert", "tls-key", "tls-client-ca",
    "auth-token-file", "health-port", "max-message-bytes", "max-concurrent-rpcs",
    "max-concurrent-streams", "max-metadata-bytes", "require-fencing", "step-ledger-size",
    "release-on-disconnect", "cache-lease-s", "prefix-pending-s", "probe-file",
    "max-concurrent-rpcs-per-caller", "step-stream-window",
    # Added since (issue #17).
    "step-ledger-max-bytes", "step-ledger-evicted-ids",
    # Added since (issue #16).
    "tensor-parallel-size", "rank", "world-size", "dist-init", "collective-timeout-s",
    # Added since (issue #19).
    "kv-huge-pages",
}  # fmt: skip
# Fields set in code only.
NOT_FLAGS = {
    "EngineConfig.max_num_logprobs",
    "EngineConfig.seed",
    "ServerConfig.security",  # built from SecurityConfig's own flags
    "ServerConfig.liveness_interval_s",
}


def _samples(model_dir: Path) -> dict[str, tuple[str, Any]]:
    """A valid value for every flag, none of them its default: (text, parsed value)."""
    return {
        "model": (str(model_dir), str(model_dir)),
        "device": ("cuda:1", "cuda:1"),
        "dtype": ("bfloat16", "bfloat16"),
        "block-size": ("32", 32),
        "kv-cache-bytes": ("1048576", 1048576),
        "gpu-memory-utilization": ("0.5", 0.5),
        "max-batch-tokens": ("2048", 2048),
        "max-batch-size": ("64", 64),
        "max-sequence-length": ("1024", 1024),
        "torch-threads": ("2", 2),
        "kernel-backend": ("torch", "torch"),
        "prefix-caching": ("false", False),
        "swap-space-bytes": ("0", 0),
        "kv-huge-pages": ("off", False),
        "require-fencing": ("yes", True),
        "cache-lease-s": ("60", 60.0),
        "prefix-pending-s": ("0.5", 0.5),
        "cuda-graphs": ("off", False),
        "launch-ahead": ("on", True),
        "cuda-graph-max-batch": ("8", 8),
        "tensor-parallel-size": ("2", 2),
        "rank": ("1", 1),
        "world-size": ("2", 2),
        "dist-init": ("tcp://10.0.0.1:29500", "tcp://10.0.0.1:29500"),
        "collective-timeout-s": ("30", 30.0),
        "host": ("0.0.0.0", "0.0.0.0"),
        "port": ("50052", 50052),
        "grace-s": ("5", 5.0),
        "max-message-bytes": ("65536", 65536),
        "max-concurrent-rpcs": ("0", 0),
        "max-concurrent-rpcs-per-caller": ("8", 8),
        "step-stream-window": ("4", 4),
        "max-concurrent-streams": ("16", 16),
        "max-metadata-bytes": ("8192", 8192),
        "health-port": ("9401", 9401),
        "release-on-disconnect": ("0", False),
        "step-ledger-size": ("128", 128),
        "step-ledger-max-bytes": ("1048576", 1048576),
        "step-ledger-evicted-ids": ("1024", 1024),
        "metrics-port": ("-1", -1),
        "metrics-host": ("127.0.0.1", "127.0.0.1"),
        "probe-file": ("/tmp/ferrum-probe.json", "/tmp/ferrum-probe.json"),
        "debug-reflection": ("1", True),
        "liveness-timeout-s": ("60", 60.0),
        "tls-cert": ("/etc/ferrum/cert.pem", "/etc/ferrum/cert.pem"),
        "tls-key": ("/etc/ferrum/key.pem", "/etc/ferrum/key.pem"),
        "tls-client-ca": ("/etc/ferrum/ca.pem", "/etc/ferrum/ca.pem"),
        "auth-token-file": ("/etc/ferrum/tokens", "/etc/ferrum/tokens"),
        "log-level": ("warning", "warning"),
        "log-format": ("json", "json"),
    }


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_serve_args(parser)
    return parser.parse_args(argv)


def _field_value(configs: ServeConfigs, flag: Flag) -> Any:
    config = {
        EngineConfig: configs.engine,
        ServerConfig: configs.server,
        SecurityConfig: configs.server.security,
        LogConfig: configs.log,
    }[flag.config]
    return getattr(config, flag.field)


def _defaults() -> ServeConfigs:
    return ServeConfigs(EngineConfig(), ServerConfig(), LogConfig())


# -- one source: the dataclasses ----------------------------------------------------------


def test_every_config_field_is_a_flag_or_marked_not_a_flag() -> None:
    flagged = {(flag.config, flag.field) for flag in SERVE_FLAGS}
    not_flags = set()
    for config in CONFIGS:
        for field in dataclasses.fields(config):
            info = flag_info(field)  # raises for a field marked neither
            if info is None:
                assert field.metadata == NOT_A_FLAG
                not_flags.add(f"{config.__name__}.{field.name}")
            else:
                assert (config, field.name) in flagged
    assert not_flags == NOT_FLAGS
    assert len(SERVE_FLAGS) == sum(len(dataclasses.fields(c)) for c in CONFIGS) - len(NOT_FLAGS)


def test_every_existing_flag_name_and_env_twin_is_kept() -> None:
    names = [flag.name for flag in SERVE_FLAGS]
    assert len(names) == len(set(names))
    assert set(names) == FLAG_NAMES
    for flag in SERVE_FLAGS:
        assert flag.env == "FERRUM_" + flag.name.upper().replace("-", "_")
    renamed = {(f.config.__name__, f.field): f.name for f in SERVE_FLAGS if f.dest != f.field}
    assert renamed == {
        ("ServerConfig", "reflection"): "debug-reflection",
        ("LogConfig", "level"): "log-level",
        ("LogConfig", "format"): "log-format",
    }


def test_a_flag_default_is_the_dataclass_default() -> None:
    for flag in SERVE_FLAGS:
        field = {f.name: f for f in dataclasses.fields(flag.config)}[flag.field]
        assert flag.default == field.default, flag.name
    assert serve_configs(_parse([]), {}) == _defaults()


def test_help_shows_each_flag_env_twin_and_dataclass_default() -> None:
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    text = " ".join(parser.format_help().split())
    assert "[env FERRUM_METRICS_PORT, default 9400]" in text
    assert "[env FERRUM_PREFIX_CACHING, default true]" in text
    assert "[env FERRUM_SWAP_SPACE_BYTES, default 1073741824]" in text
    assert "[env FERRUM_GRACE_S, default 30]" in text
    for flag in SERVE_FLAGS:
        assert f"[env {flag.env}, default {flag.shown_default}]" in text


def test_the_metrics_port_default_is_the_one_serve_listened_on() -> None:
    """The flag said 9400 and ServerConfig said -1; `ferrum-executor serve` used 9400."""
    assert ServerConfig().metrics_port == 9400
    assert serve_configs(_parse([]), {}).server.metrics_port == 9400


# -- environment twins and flags ----------------------------------------------------------


def test_samples_cover_every_flag_and_differ_from_the_defaults(tmp_path: Path) -> None:
    samples = _samples(tmp_path)
    assert {flag.name for flag in SERVE_FLAGS} <= set(samples)
    for flag in SERVE_FLAGS:
        text, value = samples[flag.name]
        assert flag.parse(text) == value
        assert value != flag.default, flag.name


def test_every_env_twin_applies(tmp_path: Path) -> None:
    samples = _samples(tmp_path)
    environ = {flag.env: samples[flag.name][0] for flag in SERVE_FLAGS}
    configs = serve_configs(_parse([]), environ)
    for flag in SERVE_FLAGS:
        assert _field_value(configs, flag) == samples[flag.name][1], flag.env


@pytest.mark.parametrize("name", sorted(FLAG_NAMES))
def test_one_env_twin_applies_alone(name: str, tmp_path: Path) -> None:
    flag = next(f for f in SERVE_FLAGS if f.name == name)
    text, value = _samples(tmp_path)[name]
    environ = {flag.env: text}
    if name.startswith("tls-"):  # SecurityConfig wants a certificate and key together
        environ = {"FERRUM_TLS_CERT": "/c.pem", "FERRUM_TLS_KEY": "/k.pem", flag.env: text}
    configs = serve_configs(_parse([]), environ)
    assert _field_value(configs, flag) == value
    for other in (f for f in SERVE_FLAGS if f.env not in environ):
        assert _field_value(configs, other) == other.default, other.name


def test_every_flag_overrides_its_env_twin(tmp_path: Path) -> None:
    samples = _samples(tmp_path)
    environ = {flag.env: samples[flag.name][0] for flag in SERVE_FLAGS}
    argv = [f"--{flag.name}={flag.shown_default}" for flag in SERVE_FLAGS]
    assert serve_configs(_parse(argv), environ) == _defaults()
    # and a flag alone, over a twin alone, the other way round
    configs = serve_configs(_parse(["--port", "50052"]), {"FERRUM_PORT": "50053"})
    assert configs.server.port == 50052


def test_kernel_backend_auto_flag_overrides_a_torch_env_twin() -> None:
    environ = {"FERRUM_KERNEL_BACKEND": "torch"}
    assert serve_configs(_parse([]), environ).engine.kernel_backend == "torch"
    configs = serve_configs(_parse(["--kernel-backend", "auto"]), environ)
    assert configs.engine.kernel_backend == "auto"


def test_boolean_flags_are_also_switches() -> None:
    environ = {"FERRUM_PREFIX_CACHING": "true", "FERRUM_REQUIRE_FENCING": "false"}
    configs = serve_configs(_parse(["--no-prefix-caching", "--require-fencing"]), environ)
    assert configs.engine.prefix_caching is False
    assert configs.engine.require_fencing is True
    configs = serve_configs(_parse(["--cuda-graphs", "no"]), {"FERRUM_CUDA_GRAPHS": "1"})
    assert configs.engine.cuda_graphs is False


@pytest.mark.parametrize(
    ("environ", "fragment"),
    [
        ({"FERRUM_PORT": "abc"}, "FERRUM_PORT: invalid int value: 'abc'"),
        ({"FERRUM_PREFIX_CACHING": "maybe"}, "FERRUM_PREFIX_CACHING: expected a boolean"),
        ({"FERRUM_DTYPE": "float64"}, "FERRUM_DTYPE: invalid choice: 'float64'"),
        ({"FERRUM_BLOCK_SIZE": "0"}, "block size"),
        ({"FERRUM_MODEL": "/does/not/exist"}, "does/not/exist"),
        ({"FERRUM_TLS_KEY": "/k.pem"}, "--tls-cert and --tls-key"),
        ({"FERRUM_STEP_STREAM_WINDOW": "0"}, "step stream window must be >= 1"),
        ({"FERRUM_MAX_CONCURRENT_RPCS_PER_CALLER": "-1"}, "per caller) must be >= 0"),
    ],
)
def test_a_bad_env_twin_is_an_invalid_configuration(environ: dict[str, str], fragment: str) -> None:
    with pytest.raises(ValueError) as caught:
        serve_configs(_parse([]), environ)
    assert fragment in str(caught.value)


def test_the_environment_defaults_to_the_process_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FERRUM_MAX_BATCH_SIZE", "48")
    monkeypatch.setenv("FERRUM_KERNEL_BACKEND", "torch")
    configs = serve_configs(_parse(["--kernel-backend", "auto"]))
    assert configs.engine.max_batch_size == 48
    assert configs.engine.kernel_backend == "auto"


def test_configs_are_frozen() -> None:
    configs = serve_configs(_parse([]), {})
    for config in (configs, configs.engine, configs.server, configs.server.security, configs.log):
        name = dataclasses.fields(config)[0].name
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(config, name, getattr(config, name))


# -- the ferrum-executor command line -----------------------------------------------------


def test_every_subcommand_is_registered() -> None:
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(commands.choices) == {"serve", "demo", "generate", "bench"}
    args = parser.parse_args(["serve", "--kernel-backend", "torch", "--no-cuda-graphs"])
    assert args.command == "serve"
    assert args.kernel_backend == "torch" and args.cuda_graphs is False
    assert args.port is None  # not given: serve_configs picks the env twin or the default
    assert parser.parse_args(["demo"]).func.__name__ == "cmd_demo"
    assert parser.parse_args(["generate", "--local"]).func.__name__ == "cmd_generate"
    assert parser.parse_args(["bench", "--workload", "smoke"]).func.__name__ == "cmd_bench"
