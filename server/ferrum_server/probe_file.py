"""The probe file: where a health check inside the container should connect.

`serve --probe-file F` (or FERRUM_PROBE_FILE; the container image sets it) writes F once the
server is SERVING, as one JSON object:

    {"host": "<--host>", "port": <bound gRPC port>, "health_port": <bound plaintext health port,
     -1 when off>, "tls": <whether the gRPC port wants TLS>}

and removes it on exit. The image's HEALTHCHECK (deploy/healthcheck.py) reads it, so a `--port`,
`--health-port` or `--host` flag moves the health check with the server instead of leaving it on
the ports the environment names. Written atomically (a temporary file, then rename), so a reader
sees the old file, the new one or none.
"""

from __future__ import annotations

import json
import pathlib

from ferrum_server import logs

_LOG = logs.get(__name__)


def probe_target(host: str, port: int, health_port: int, tls: bool) -> dict[str, object]:
    return {"host": host, "port": port, "health_port": health_port, "tls": tls}


def write(path: str, target: dict[str, object]) -> bool:
    """Write the file; an unwritable path (a read-only root filesystem) is logged, not fatal:
    the health check then falls back to the environment, as it did before the file existed."""
    file = pathlib.Path(path)
    tmp = file.with_name(file.name + ".tmp")
    try:
        tmp.write_text(json.dumps(target))
        tmp.replace(file)
    except OSError as exc:
        _LOG.warning("probe_file_unwritable", path=path, error=exc.strerror or str(exc))
        return False
    return True


def remove(path: str) -> None:
    """Remove the file (a stale one from an earlier run must not be read as this run's)."""
    try:
        pathlib.Path(path).unlink(missing_ok=True)
    except OSError as exc:
        _LOG.warning("probe_file_unwritable", path=path, error=exc.strerror or str(exc))
