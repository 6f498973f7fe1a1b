"""The Dockerfile, docker-compose.yml, the Kubernetes manifests and the nginx config, checked
without a Docker engine or a cluster: structure, images, ports, probes, every command line and
LMSERVE_* variable parsed by the real parser of its role, and what keeps the stack closed to its
own network: keys made by the real ``lmserve keys``, Redis's password checked against a real
redis-server, networks, NetworkPolicies, non-root read-only containers."""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path, PurePosixPath

import pytest
from conftest import REPO, free_port
from deploy_helpers import (
    DEPLOY,
    KEYS,
    KUBERNETES,
    DeployedRedis,
    check_nginx_config,
    compose,
    compose_interpolate,
    here,
    kubernetes_documents,
    kubernetes_expand,
    parse_command,
    redis_wrappers,
    render_site,
    write_nginx_config,
)

# what `lmserve keys --dir DIR worker gateway --kv-secret DIR/kv-secret --redis-password
# DIR/redis-password` writes, public and secret
KEY_FILES = {"worker.key": "public", "worker.key_secret": "secret", "gateway.key": "public",
             "gateway.key_secret": "secret", "kv-secret": "secret", "redis-password": "secret"}


def _compose_env(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def _image_user() -> str:
    return re.search(r"^USER (\S+)$", (REPO / "Dockerfile").read_text(), re.MULTILINE).group(1)


# --- Dockerfile ------------------------------------------------------------------------------

def test_dockerfile_builds_one_image_whose_command_picks_the_role(monkeypatch):
    text = (REPO / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim\b", text, re.MULTILINE)
    assert "pip install" in text and "ENTRYPOINT" not in text  # compose and k8s give `lmserve ROLE ...`
    assert re.search(r'^VOLUME \["/models"\]', text, re.MULTILINE)
    cmd = re.search(r"^CMD (\[.*\])$", text, re.MULTILINE)
    role, args = parse_command(json.loads(cmd.group(1)), {}, monkeypatch)
    assert role == "serve" and args.model.startswith("/models/") and args.host == "0.0.0.0"
    packages = re.findall(r'"(\w+)\*"', (REPO / "pyproject.toml").read_text())
    assert packages and all(re.search(rf"^COPY {p} ./{p}$", text, re.MULTILINE) for p in packages), \
        "the image lacks a package that pyproject.toml installs"
    ignored = (REPO / ".dockerignore").read_text().split()
    assert ".git" in ignored and "*.gguf" in ignored


def test_the_image_runs_as_a_numeric_user_who_owns_what_it_writes():
    text = (REPO / "Dockerfile").read_text()
    uid, gid = _image_user().split(":")
    assert int(uid) > 0 and int(gid) > 0  # numeric, so runAsNonRoot can check it without /etc/passwd
    assert re.search(rf"useradd .*--uid {uid} --gid {gid} ", text)
    # a fresh volume mounted on a directory of the image takes its owner: the keys service
    # writes /keys, the worker its compiled kernels under the cache
    chown = re.search(r"chown lmserve:lmserve (.*)$", text, re.MULTILINE).group(1).split()
    assert {KEYS, "/home/lmserve/.cache", "/models"} <= set(chown)


# --- docker-compose.yml ----------------------------------------------------------------------

def test_compose_has_redis_worker_scalable_gateways_and_nginx():
    services = compose()["services"]
    assert set(services) == {"keys", "redis", "worker", "gateway", "nginx", "prometheus", "grafana"}
    # the metrics services run only with --profile metrics
    assert {name for name, s in services.items() if s.get("profiles")} == {"prometheus", "grafana"}
    redis = services["redis"]
    assert redis["image"].startswith("redis:")
    gateway = services["gateway"]
    assert "container_name" not in gateway and "ports" not in gateway  # `--scale gateway=3` must work
    assert gateway["expose"] == ["8080"]
    assert services["worker"]["image"] == gateway["image"] == "lmserve:latest"
    assert services["worker"]["build"] == gateway["build"] == "."
    nginx = services["nginx"]
    assert nginx["image"].startswith("nginxinc/nginx-unprivileged:")  # runs as a user, pid file in /tmp
    assert nginx["ports"] == ["8080:8080"]
    assert "./deploy/nginx.conf:/etc/nginx/conf.d/default.conf:ro" in nginx["volumes"]
    assert nginx["depends_on"]["gateway"]["condition"] == "service_healthy"


def test_compose_commands_and_environment_are_real_flags(monkeypatch):
    services = compose()["services"]
    _, worker = parse_command(services["worker"]["command"], _compose_env(services["worker"]), monkeypatch)
    assert worker.model == "/models/model.gguf" and worker.worker == "tcp://0.0.0.0:5557"
    assert any(volume.endswith(":/models:ro") for volume in services["worker"]["volumes"])
    assert worker.log_format == "json"
    assert worker.kv_store == "redis://redis:6379/0"  # the redis service
    assert worker.wire_key == f"{KEYS}/worker.key_secret" and worker.wire_allow == [f"{KEYS}/gateway.key"]
    assert not worker.wire_insecure and worker.kv_secret == f"{KEYS}/kv-secret"

    _, gateway = parse_command(services["gateway"]["command"], _compose_env(services["gateway"]), monkeypatch)
    # every replica of the worker service (`--scale worker=M`), by its name, on its bound port
    assert gateway.worker == "dns+tcp://worker:5557"
    assert "container_name" not in services["worker"] and "ports" not in services["worker"]
    assert (gateway.host, gateway.port) == ("0.0.0.0", 8080)
    assert gateway.allow_host == ["localhost", "127.0.0.1"]
    assert gateway.api_key == []  # unset on the host: no key required
    assert gateway.drain_timeout < _seconds(services["gateway"]["stop_grace_period"])
    assert gateway.wire_key == f"{KEYS}/gateway.key_secret" and gateway.worker_key == f"{KEYS}/worker.key"


def test_compose_health_checks_probe_the_right_things():
    services = compose()["services"]
    gateway_check = " ".join(services["gateway"]["healthcheck"]["test"])
    assert "http://127.0.0.1:8080/health" in gateway_check
    worker_check = " ".join(services["worker"]["healthcheck"]["test"])
    assert "5557" in worker_check
    assert _seconds(services["worker"]["healthcheck"]["start_period"]) >= 120  # loading a big model


def test_nginx_upstream_names_the_compose_gateway_service():
    site = (DEPLOY / "nginx.conf").read_text()
    services = compose()["services"]
    port = services["gateway"]["command"][services["gateway"]["command"].index("--port") + 1]
    assert re.search(rf"^\s*server gateway:{port}\b", site, re.MULTILINE)
    assert re.search(r"^\s*listen 8080;", site, re.MULTILINE)


def _seconds(value: str) -> float:
    match = re.fullmatch(r"(\d+)(s|m)", str(value))
    assert match, value
    return int(match.group(1)) * (60 if match.group(2) == "m" else 1)


# --- docker-compose.yml: keys, networks, containers ----------------------------------------------

def _run(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, check=False, cwd=REPO, capture_output=True, text=True, timeout=120)


def _make_keys(folder: Path) -> subprocess.CompletedProcess:
    """Run the compose keys service here, its volume at ``folder``, with the real `lmserve keys`."""
    keys = compose()["services"]["keys"]
    folder.mkdir(exist_ok=True)
    result = _run(here(keys["entrypoint"] + keys["command"], folder))
    assert result.returncode == 0, result.stderr
    return result


def _named_keys(node) -> set[str]:
    """The files under /keys that a service or container names anywhere."""
    return set(re.findall(rf"{KEYS}/([\w.-]+)", json.dumps(node)))


def test_compose_keys_service_makes_every_key_once(tmp_path):
    keys = tmp_path / "keys"
    _make_keys(keys)
    assert {path.name for path in keys.iterdir()} == set(KEY_FILES)
    for name, kind in KEY_FILES.items():
        assert (keys / name).stat().st_mode & 0o777 == (0o600 if kind == "secret" else 0o644), name
    made = {name: (keys / name).read_bytes() for name in KEY_FILES}
    # a volume that holds them all is left alone: the stack keeps its keys from one `up` to the next
    assert "already" in _make_keys(keys).stdout
    assert {name: (keys / name).read_bytes() for name in KEY_FILES} == made
    # one missing: all of them anew, since a worker key and a gateway key belong together
    (keys / "gateway.key").unlink()
    _make_keys(keys)
    assert {path.name for path in keys.iterdir()} == set(KEY_FILES)
    assert all((keys / name).read_bytes() != made[name] for name in KEY_FILES)


def test_compose_starts_nothing_before_the_keys_and_mounts_them_read_only():
    config = compose()
    services = config["services"]
    keys = services["keys"]
    assert keys["restart"] == "no" and keys["network_mode"] == "none"  # one-shot, and offline
    assert keys["volumes"] == [f"lmserve-keys:{KEYS}"] and "lmserve-keys" in config["volumes"]
    wanted = {"redis": {"redis-password"}, "gateway": {"gateway.key_secret", "worker.key"},
              "worker": {"worker.key_secret", "gateway.key", "kv-secret", "redis-password"}}
    for name, files in wanted.items():
        service = services[name]
        assert service["depends_on"]["keys"]["condition"] == "service_completed_successfully", name
        assert f"lmserve-keys:{KEYS}:ro" in service["volumes"], name
        assert _named_keys(service) == files, name


def test_compose_keeps_workers_and_redis_off_the_network_nginx_is_on():
    config = compose()
    services, networks = config["services"], config["networks"]
    joined = {name: set(service.get("networks", [])) for name, service in services.items()}
    # every service names its networks, so none falls back to compose's default network
    assert not joined["keys"] and all(joined[name] for name in services if name != "keys")
    assert joined["redis"] == {"backend"} and networks["backend"]["internal"] is True
    assert {name for name, nets in joined.items() if "backend" in nets} == {"redis", "worker", "gateway"}
    # every network a worker is on is internal: no route out, no port published from it
    assert all(networks[network].get("internal") is True for network in joined["worker"])
    for outside in ("nginx", "grafana"):  # they publish ports
        assert not joined[outside] & (joined["worker"] | joined["redis"]), outside
    assert joined["gateway"] & joined["nginx"]
    # Prometheus scrapes the workers, and cannot reach Redis
    assert joined["prometheus"] & joined["worker"] and not joined["prometheus"] & joined["redis"]


def test_compose_containers_run_as_users_on_read_only_filesystems(monkeypatch):
    services = compose()["services"]
    for name, service in services.items():
        uid = service["user"].split(":")[0]
        assert uid.isdigit() and int(uid) > 0, name
        assert service["read_only"] is True and "/tmp" in service["tmpfs"], name
        assert service["cap_drop"] == ["ALL"] and "no-new-privileges:true" in service["security_opt"], name
    for name in ("keys", "worker", "gateway"):
        assert services[name]["user"] == _image_user(), name
    # the worker compiles its kernels into its cache directory: that must be a volume
    worker = services["worker"]
    writable = [volume.split(":")[1] for volume in worker["volumes"] if not volume.endswith(":ro")]
    assert _is_under(_worker_cache_dir(_compose_env(worker), monkeypatch), writable)


def _worker_cache_dir(env: dict[str, str], monkeypatch) -> str:
    """Where a worker of the image, under these variables, writes its compiled kernels."""
    from shared.default_model import cache_dir
    for name in ("LMSERVE_CACHE", "XDG_CACHE_HOME", "NUMBA_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", "/home/lmserve")  # the image user's (useradd --create-home lmserve)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return os.environ.get("NUMBA_CACHE_DIR") or str(cache_dir() / "kernels")


def _is_under(path: str, folders: list[str]) -> bool:
    return any(PurePosixPath(path).is_relative_to(folder) for folder in folders)


# --- Redis's password: the one the workers are given, checked by a real redis-server -------------

def _mount_keys(workload: dict, container: dict, keys: Path, folder: Path) -> Path:
    """The files a container finds at /keys, its Secrets made from ``keys`` as deploy/README.md
    says (`kubectl create secret generic NAME --from-file=keys/FILE`: each key a file's name)."""
    folder.mkdir()
    for path, (_, key) in _key_mounts(workload, container).items():
        (folder / path).write_bytes((keys / key).read_bytes())
    return folder


@pytest.mark.parametrize("deployment", ["compose", "kubernetes"])
def test_redis_answers_only_the_password_the_workers_are_given(deployment, tmp_path, monkeypatch):
    import redis

    keys = tmp_path / "keys"
    _make_keys(keys)
    if deployment == "compose":
        services = compose()["services"]
        redis_keys = worker_keys = keys  # one volume, mounted by both
        check = services["redis"]["healthcheck"]["test"]
        assert check[0] == "CMD-SHELL"
        server, probes, shim = services["redis"]["command"], [["sh", "-c", check[1]]], services["worker"]["entrypoint"]
    else:
        redis_set, worker_set = _by_kind("Deployment")["lmserve-redis"], _by_kind("StatefulSet")["lmserve-worker"]
        redis_container, worker_container = _container(redis_set, "redis"), _container(worker_set, "worker")
        redis_keys = _mount_keys(redis_set, redis_container, keys, tmp_path / "redis-pod")
        worker_keys = _mount_keys(worker_set, worker_container, keys, tmp_path / "worker-pod")
        server = [kubernetes_expand(arg, _env(redis_container)) for arg in redis_container["args"]]
        probes = [redis_container[probe]["exec"]["command"] for probe in ("readinessProbe", "livenessProbe")]
        shim = [kubernetes_expand(arg, _env(worker_container)) for arg in worker_container["command"]]

    port = free_port()
    monkeypatch.setenv("PATH", f"{redis_wrappers(tmp_path / 'bin', port)}{os.pathsep}{os.environ['PATH']}")
    server_process = DeployedRedis(here(server, redis_keys), tmp_path / "redis.log", port).start()
    try:
        server_process.wait_ready()
        # the worker's shim hands its command the password as LMSERVE_KV_STORE_PASSWORD
        show = [sys.executable, "-c", "import os; print(os.environ['LMSERVE_KV_STORE_PASSWORD'])"]
        result = _run(here(shim, worker_keys) + show)
        assert result.returncode == 0, result.stderr
        password = result.stdout.rstrip("\n")
        assert password and redis.Redis(port=port, password=password).ping()
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(port=port).ping()
        for probe in probes:
            assert _run(here(probe, redis_keys)).returncode == 0
            wrong = tmp_path / "wrong"
            wrong.mkdir(exist_ok=True)
            (wrong / "redis-password").write_text("not-the-password\n")
            assert _run(here(probe, wrong)).returncode != 0
        # without the password file the worker does not start at all
        started = tmp_path / "started"
        result = _run(here(shim, tmp_path / "no-keys") + ["touch", str(started)])
        assert result.returncode != 0 and not started.exists()
    finally:
        server_process.stop()


# --- nginx.conf ------------------------------------------------------------------------------

def test_nginx_config_streams_without_buffering():
    site = (DEPLOY / "nginx.conf").read_text()
    for directive in ("proxy_buffering off;", "proxy_http_version 1.1;", 'proxy_set_header Connection "";',
                      "proxy_read_timeout 3600s;", "keepalive 32;"):
        assert directive in site
    assert re.search(r"proxy_next_upstream error timeout non_idempotent;", site)


def test_nginx_accepts_the_config(tmp_path):
    main = write_nginx_config(tmp_path / "nginx", ["127.0.0.1:18081", "127.0.0.1:18082"], "127.0.0.1:18080")
    result = check_nginx_config(main)
    assert result.returncode == 0, result.stderr
    assert "syntax is ok" in result.stderr


def test_nginx_rejects_a_broken_config(tmp_path):
    main = write_nginx_config(tmp_path / "nginx", ["127.0.0.1:18081"], "127.0.0.1:18080")
    site = main.parent / "lmserve.conf"
    site.write_text(site.read_text().replace("proxy_buffering off;", "proxy_buffering sometimes;"))
    assert check_nginx_config(main).returncode != 0  # the check above can fail


def test_rendering_keeps_every_upstream_option():
    site = render_site(["127.0.0.1:1", "127.0.0.1:2"], "127.0.0.1:3")
    assert site.count("max_fails=1 fail_timeout=10s;") == 2
    assert "gateway:8080" not in site and "listen 127.0.0.1:3;" in site


# --- Kubernetes --------------------------------------------------------------------------------

def _by_kind(kind: str) -> dict[str, dict]:
    return {doc["metadata"]["name"]: doc for doc in kubernetes_documents() if doc["kind"] == kind}


def _container(workload: dict, name: str) -> dict:
    return next(c for c in workload["spec"]["template"]["spec"]["containers"] if c["name"] == name)


def _env(container: dict) -> dict[str, str]:
    return {item["name"]: item.get("value", "") for item in container.get("env", [])}


def _labels_match(selector: dict, workload: dict) -> bool:
    labels = workload["spec"]["template"]["metadata"]["labels"]
    return all(labels.get(k) == v for k, v in selector.items())


def _workloads() -> dict[str, dict]:
    return {**_by_kind("Deployment"), **_by_kind("StatefulSet")}


def _pod(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def _key_mounts(workload: dict, container: dict) -> dict[str, tuple[str, str]]:
    """What the container finds at /keys: file name -> (Secret, key), from the Secret volume (or
    projected Secrets) mounted there read-only."""
    [mount] = [m for m in container.get("volumeMounts", []) if m["mountPath"] == KEYS]
    assert mount["readOnly"] is True
    volume = next(v for v in _pod(workload)["volumes"] if v["name"] == mount["name"])
    if "projected" in volume:
        sources = [(s["secret"]["name"], s["secret"]) for s in volume["projected"]["sources"]]
        mode = volume["projected"]["defaultMode"]
    else:
        sources, mode = [(volume["secret"]["secretName"], volume["secret"])], volume["secret"]["defaultMode"]
    # the kubelet writes the files as root's; the process reads them through the pod's fsGroup
    assert mode & 0o040 and not mode & 0o007
    assert _pod(workload)["securityContext"]["fsGroup"] == container["securityContext"]["runAsGroup"]
    return {item["path"]: (secret, item["key"]) for secret, source in sources for item in source["items"]}


def _readme_secrets() -> dict[str, set[str]]:
    """The Secrets deploy/README.md has made, by `kubectl create secret generic NAME --from-file=...`."""
    text = (DEPLOY / "README.md").read_text().replace("\\\n", " ")
    made = re.findall(r"kubectl create secret generic (lmserve-[\w-]+)([^\n`]*)", text)
    return {name: set(re.findall(r"--from-file=keys/(\S+)", rest)) for name, rest in made if "--from-file" in rest}


def test_every_manifest_is_listed_in_the_kustomization():
    import yaml
    kustomization = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())
    files = {p.name for p in KUBERNETES.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == files
    kinds = sorted(doc["kind"] for doc in kubernetes_documents() if doc["kind"] != "Kustomization")
    assert kinds == ["Deployment", "Deployment", "HorizontalPodAutoscaler", "Ingress"] + ["NetworkPolicy"] * 4 + [
        "PodDisruptionBudget", "Service", "Service", "Service", "StatefulSet"]


def test_gateway_deployment_probes_health_and_parses(monkeypatch):
    deployment = _by_kind("Deployment")["lmserve-gateway"]
    gateway = _container(deployment, "gateway")
    assert gateway["image"] == "lmserve:latest"
    _, args = parse_command(gateway["command"], _env(gateway), monkeypatch)
    assert args.host == "0.0.0.0" and args.log_format == "json"
    port = next(p for p in gateway["ports"] if p["name"] == "http")
    assert port["containerPort"] == args.port
    readiness = gateway["readinessProbe"]["httpGet"]
    assert readiness["path"] == "/health" and readiness["port"] == "http"
    assert gateway["livenessProbe"]["httpGet"]["port"] == "http"
    # on a 0.0.0.0 bind with --allow-host the Host guard is armed: probes must send an allowed Host
    for probe in (gateway["readinessProbe"], gateway["livenessProbe"]):
        hosts = [h["value"] for h in probe["httpGet"].get("httpHeaders", []) if h["name"] == "Host"]
        assert hosts and hosts[0] in args.allow_host
    assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > args.drain_timeout
    secret = next(item for item in gateway["env"] if item["name"] == "LMSERVE_API_KEY")
    assert secret["valueFrom"]["secretKeyRef"]["optional"] is True
    assert args.wire_key == f"{KEYS}/gateway.key_secret" and args.worker_key == f"{KEYS}/worker.key"


def test_gateway_reaches_every_worker_through_their_headless_service(monkeypatch):
    worker_set = _by_kind("StatefulSet")["lmserve-worker"]
    services = _by_kind("Service")
    headless = services[worker_set["spec"]["serviceName"]]
    assert headless["spec"]["clusterIP"] == "None"
    assert _labels_match(headless["spec"]["selector"], worker_set)
    worker = _container(worker_set, "worker")
    # the shim that reads Redis's password, as compose's worker has it; then the worker
    assert worker["command"] == compose()["services"]["worker"]["entrypoint"]
    _, worker_args = parse_command(worker["args"], _env(worker), monkeypatch)
    assert worker_args.model == "/models/model.gguf" and worker_args.batch == 4
    assert worker_args.wire_key == f"{KEYS}/worker.key_secret" and worker_args.wire_allow == [f"{KEYS}/gateway.key"]
    assert not worker_args.wire_insecure and worker_args.kv_secret == f"{KEYS}/kv-secret"
    redis_port = services["lmserve-redis"]["spec"]["ports"][0]["port"]
    assert worker_args.kv_store == f"redis://lmserve-redis:{redis_port}/0"
    bound_port = int(worker_args.worker.rsplit(":", 1)[1])
    assert next(p for p in worker["ports"] if p["name"] == "zmq")["containerPort"] == bound_port
    assert headless["spec"]["ports"][0]["port"] == bound_port

    gateway = _container(_by_kind("Deployment")["lmserve-gateway"], "gateway")
    _, gateway_args = parse_command(gateway["command"], _env(gateway), monkeypatch)
    # the Service's name resolves to every ready worker pod; the gateways look it up again and again
    assert gateway_args.worker == f"dns+tcp://{headless['metadata']['name']}:{bound_port}"
    assert not headless["spec"].get("publishNotReadyAddresses", False)  # a loading worker is not listed
    assert worker_set["spec"]["replicas"] >= 2 and worker_set["spec"]["podManagementPolicy"] == "Parallel"
    budget = _by_kind("PodDisruptionBudget")["lmserve-worker"]
    assert budget["spec"]["maxUnavailable"] == 1
    assert _labels_match(budget["spec"]["selector"]["matchLabels"], worker_set)


def test_worker_keeps_the_model_on_a_volume_claim():
    worker_set = _by_kind("StatefulSet")["lmserve-worker"]
    claims = {c["metadata"]["name"]: c for c in worker_set["spec"]["volumeClaimTemplates"]}
    worker = _container(worker_set, "worker")
    mounts = {m["name"]: m["mountPath"] for m in worker["volumeMounts"]}
    assert mounts["models"] == "/models" and "models" in claims
    assert worker["startupProbe"]["tcpSocket"]["port"] == "zmq"


def test_autoscaler_scales_the_gateways_on_cpu():
    hpa = _by_kind("HorizontalPodAutoscaler")["lmserve-gateway"]
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "lmserve-gateway"}
    assert 1 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    gateway = _container(_by_kind("Deployment")["lmserve-gateway"], "gateway")
    assert gateway["resources"]["requests"]["cpu"]  # utilization needs a request to measure against


def test_services_select_their_pods_and_the_ingress_streams():
    services, deployments = _by_kind("Service"), _by_kind("Deployment")
    for name in ("lmserve-gateway", "lmserve-redis"):
        assert _labels_match(services[name]["spec"]["selector"], deployments[name])
    redis = _container(deployments["lmserve-redis"], "redis")
    assert redis["image"].startswith("redis:")
    assert redis["readinessProbe"]["exec"] == redis["livenessProbe"]["exec"]
    ingress = _by_kind("Ingress")["lmserve"]
    annotations = ingress["metadata"]["annotations"]
    assert annotations["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"
    assert int(annotations["nginx.ingress.kubernetes.io/proxy-read-timeout"]) >= 600
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend["name"] == "lmserve-gateway"
    assert backend["port"]["name"] in {p["name"] for p in services["lmserve-gateway"]["spec"]["ports"]}
    gateway = _container(deployments["lmserve-gateway"], "gateway")
    allowed = _env(gateway)["LMSERVE_ALLOW_HOST"].split(",")
    assert ingress["spec"]["rules"][0]["host"] in allowed


def test_each_pod_mounts_only_the_keys_it_names_from_the_documented_secrets():
    secrets = _readme_secrets()
    assert secrets == {"lmserve-wire": {"worker.key", "worker.key_secret", "gateway.key", "gateway.key_secret"},
                       "lmserve-kv": {"kv-secret", "redis-password"}}
    assert set().union(*secrets.values()) == set(KEY_FILES)
    wanted = {("lmserve-gateway", "gateway"): {"gateway.key_secret", "worker.key"},
              ("lmserve-worker", "worker"): {"worker.key_secret", "gateway.key", "kv-secret", "redis-password"},
              ("lmserve-redis", "redis"): {"redis-password"}}
    workloads = _workloads()
    for (workload, name), files in wanted.items():
        container = _container(workloads[workload], name)
        mounted = _key_mounts(workloads[workload], container)
        assert set(mounted) == files and _named_keys(container) == files, name
        for path, (secret, key) in mounted.items():
            assert path == key and key in secrets[secret], (name, path)


def test_every_kubernetes_container_runs_as_a_user_on_a_read_only_filesystem(monkeypatch):
    uid, gid = (int(part) for part in _image_user().split(":"))
    for name, workload in _workloads().items():
        pod = _pod(workload)
        assert pod["automountServiceAccountToken"] is False, name
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        for container in pod.get("initContainers", []) + pod["containers"]:
            context = container["securityContext"]
            assert context["runAsNonRoot"] is True and type(context["runAsUser"]) is int, container["name"]
            assert context["runAsUser"] > 0 and context["readOnlyRootFilesystem"] is True, container["name"]
            assert context["allowPrivilegeEscalation"] is False, container["name"]
            assert context["capabilities"] == {"drop": ["ALL"]}, container["name"]
            if container["image"].startswith("lmserve:"):
                assert (context["runAsUser"], context["runAsGroup"]) == (uid, gid), container["name"]
    # what the processes write is on an emptyDir: /tmp, and the worker's compiled kernels
    for name, container_name in (("lmserve-gateway", "gateway"), ("lmserve-worker", "worker")):
        workload = _workloads()[name]
        container = _container(workload, container_name)
        empty = {v["name"] for v in _pod(workload)["volumes"] if "emptyDir" in v}
        writable = [m["mountPath"] for m in container["volumeMounts"] if m["name"] in empty]
        assert "/tmp" in writable, name
    worker = _container(_workloads()["lmserve-worker"], "worker")
    assert _is_under(_worker_cache_dir(_env(worker), monkeypatch),
                     [m["mountPath"] for m in worker["volumeMounts"] if m["name"] == "cache"])
    assert any(v["name"] == "cache" and "emptyDir" in v for v in _pod(_workloads()["lmserve-worker"])["volumes"])


def _selects(selector: dict, labels: dict) -> bool:
    if any(labels.get(key) != value for key, value in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        value, operator = labels.get(expression["key"]), expression["operator"]
        if operator == "In" and value not in expression["values"]:
            return False
        if operator == "NotIn" and value in expression["values"]:
            return False
        if operator == "Exists" and value is None:
            return False
        if operator == "DoesNotExist" and value is not None:
            return False
    return True


def _peer(peer: dict) -> str:
    """A `from` entry: 'NAME' for the pods of that app.kubernetes.io/name in this namespace,
    'NAMESPACE/NAME' for those of another namespace."""
    assert set(peer) <= {"podSelector", "namespaceSelector"}  # no ipBlock: addresses say nothing of who
    pods = peer["podSelector"]["matchLabels"]["app.kubernetes.io/name"]
    if "namespaceSelector" not in peer:
        return pods
    return f'{peer["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]}/{pods}'


def _ingress_allowed(workload: dict) -> set[tuple[str, int]]:
    """(peer, container port) pairs the NetworkPolicies let reach this workload's pods."""
    labels = workload["spec"]["template"]["metadata"]["labels"]
    ports = {port["name"]: port["containerPort"] for c in _pod(workload)["containers"] for port in c.get("ports", [])}
    allowed, isolated = set(), False
    for policy in _by_kind("NetworkPolicy").values():
        if not _selects(policy["spec"]["podSelector"], labels):
            continue
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        isolated = True
        for rule in policy["spec"].get("ingress", []):
            assert rule.get("from") and rule.get("ports")  # either left out would allow every peer or port
            for port in rule["ports"]:
                assert port["protocol"] == "TCP"
                number = ports[port["port"]] if isinstance(port["port"], str) else port["port"]
                allowed |= {(_peer(peer), number) for peer in rule["from"]}
    assert isolated, "a pod no NetworkPolicy selects takes connections from anyone"
    return allowed


def test_network_policies_let_each_pod_be_reached_only_by_its_clients(monkeypatch):
    workloads = _workloads()
    gateway = _container(workloads["lmserve-gateway"], "gateway")
    _, gateway_args = parse_command(gateway["command"], _env(gateway), monkeypatch)
    worker = _container(workloads["lmserve-worker"], "worker")
    _, worker_args = parse_command(worker["args"], _env(worker), monkeypatch)
    wire_port = int(worker_args.worker.rsplit(":", 1)[1])
    redis_port = _container(workloads["lmserve-redis"], "redis")["ports"][0]["containerPort"]
    controller, prometheus = "ingress-nginx/ingress-nginx", "monitoring/prometheus"
    assert _ingress_allowed(workloads["lmserve-gateway"]) == {(controller, gateway_args.port),
                                                              (prometheus, gateway_args.port)}
    assert _ingress_allowed(workloads["lmserve-worker"]) == {("lmserve-gateway", wire_port),
                                                             (prometheus, worker_args.metrics_port)}
    assert _ingress_allowed(workloads["lmserve-redis"]) == {("lmserve-worker", redis_port)}
    # Prometheus may reach whatever port a pod asks it to scrape
    for workload in workloads.values():
        annotations = workload["spec"]["template"]["metadata"].get("annotations", {})
        if annotations.get("prometheus.io/scrape") == "true":
            assert (prometheus, int(annotations["prometheus.io/port"])) in _ingress_allowed(workload)
    # and the policy that denies by default covers every lmserve pod, so one added later starts closed
    deny = _by_kind("NetworkPolicy")["lmserve-default-deny"]["spec"]
    assert deny["policyTypes"] == ["Ingress"] and not deny.get("ingress")
    assert all(_selects(deny["podSelector"], w["spec"]["template"]["metadata"]["labels"]) for w in workloads.values())


# --- the worker's context: what the clients send fits ---------------------------------------------

# Claude Code's first request is ~16k tokens before its reply: a worker's --ctx is its own default
# (0: the model's trained context, as `lmserve serve` takes it) or a cap of at least this.
CLIENT_CONTEXT = 32768
# what a worker process holds beside its weights and KV: the interpreter, numba's compiled
# kernels, a batch's scratch
WORKER_RUNTIME = 1 << 30


def _worker_args(deployment: str, monkeypatch) -> argparse.Namespace:
    if deployment == "compose":
        worker = compose()["services"]["worker"]
        return parse_command(worker["command"], _compose_env(worker), monkeypatch)[1]
    worker = _container(_workloads()["lmserve-worker"], "worker")
    return parse_command(worker["args"], _env(worker), monkeypatch)[1]


def _memory_bytes(quantity: str) -> int:
    """A Kubernetes memory quantity (``8Gi``, ``512Mi``, ``1G``) in bytes."""
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "k": 10**3, "M": 10**6, "G": 10**9, "": 1}
    number, unit = re.fullmatch(r"(\d+)([KMGT]i|[kMG]|)", quantity).groups()
    return int(number) * units[unit]


@pytest.mark.parametrize("deployment", ["compose", "kubernetes"])
def test_the_worker_context_is_its_own_default_or_fits_claude_code(deployment, monkeypatch):
    ctx = _worker_args(deployment, monkeypatch).ctx
    assert ctx == 0 or ctx >= CLIENT_CONTEXT, f"{deployment}: --ctx {ctx} refuses Claude Code's first request"


def test_the_worker_memory_limit_holds_its_kv_slots_for_the_default_model(default_model, monkeypatch):
    """The worker sizes its context from the node's memory, which it sees instead of the pod's
    limit: the limit must hold the weights and every resident slot full, at the context the
    worker takes for the default model (its trained context, when --ctx is unset)."""
    from worker.engine import Engine
    from worker.main import AUTO_SLOTS
    from worker.kv_slots import resident_slot_count

    worker = _container(_workloads()["lmserve-worker"], "worker")
    args = _worker_args("kubernetes", monkeypatch)
    engine = Engine.load(default_model, kv_type=args.kv_type)
    ctx = args.ctx or engine.model.hp.context_length
    slots = resident_slot_count(args.kv_slots, args.batch) if args.kv_slots else max(AUTO_SLOTS[1], args.batch)
    needed = engine.model.weight_bytes + slots * engine.new_cache(1).full_bytes(ctx) + WORKER_RUNTIME
    limit = _memory_bytes(worker["resources"]["limits"]["memory"])
    assert needed <= limit, f"{slots} slots of {ctx} tokens need {needed / 2**30:.1f} GiB, over the {limit / 2**30:.1f} GiB limit"


def test_memory_quantities_read_as_kubernetes_reads_them():
    assert _memory_bytes("8Gi") == 8 * 2**30 and _memory_bytes("2560Mi") == 2560 * 2**20
    assert _memory_bytes("1G") == 10**9 and _memory_bytes("1024") == 1024


# --- the checks themselves can fail ------------------------------------------------------------

@pytest.mark.parametrize("command, env", [
    ("lmserve gateway --worker tcp://w:1 --no-such-flag", {}),
    ("lmserve gateway --worker tcp://w:1", {"LMSERVE_NO_SUCH_FLAG": "1"}),
    ("lmserve worker /m.gguf", {"LMSERVE_CTX": "many"}),
    ("lmserve worker /m.gguf", {"LMSERVE_API_KEY": "k"}),  # a gateway flag, not a worker one
])
def test_parse_command_catches_what_a_role_does_not_know(command, env, monkeypatch):
    with pytest.raises(AssertionError):
        parse_command(shlex.split(command), env, monkeypatch)


def test_compose_interpolation_is_compose_s():
    assert compose_interpolate('cat "$$f" ${MODEL_DIR:-./models} ${LMSERVE_API_KEY:-}') == 'cat "$f" ./models '
    with pytest.raises(AssertionError):  # compose refuses a lone $: a shell's $(...) must be $$(...)
        compose_interpolate('exec redis-server --requirepass "$(cat /keys/redis-password)"')
    assert kubernetes_expand('"$(cat /keys/x)" $(NAME) $$(NAME)', {"NAME": "v"}) == '"$(cat /keys/x)" v $(NAME)'


def test_network_policy_checks_see_an_open_pod():
    assert not _selects({"matchExpressions": [{"key": "a", "operator": "In", "values": ["x"]}]}, {"a": "y"})
    assert _selects({"matchLabels": {"a": "x"}}, {"a": "x", "b": "z"})
    opened = {"metadata": {"name": "open"}, "spec": {"template": {"metadata": {"labels": {"app": "other"}},
                                                                    "spec": {"containers": []}}}}
    with pytest.raises(AssertionError):
        _ingress_allowed(opened)


# --- metrics: Prometheus scrape config and the Grafana dashboard --------------------------------

def _series_names() -> set[str]:
    """Every series the gateways and the worker expose, with the suffixes the library adds."""
    from prometheus_client.metrics import MetricWrapperBase

    from gateway import metrics as gateway_metrics
    from worker import metrics as worker_metrics

    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}
    return {family.name + suffix
            for module in (gateway_metrics, worker_metrics) for value in vars(module).values()
            if isinstance(value, MetricWrapperBase)
            for family in value.describe() for suffix in suffixes[family.type]}


def test_the_dashboard_queries_series_that_exist():
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "lmserve.json").read_text())
    known = _series_names()
    used = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            used |= set(re.findall(r"\blmserve_[a-z_]+", target["expr"]))
    assert used and used <= known, used - known
    # every series is on some panel
    assert {name.removesuffix("_bucket").removesuffix("_count").removesuffix("_sum") for name in known} <= {
        name.removesuffix("_bucket").removesuffix("_count").removesuffix("_sum") for name in used}


def test_prometheus_scrapes_the_ports_the_roles_serve_metrics_on(monkeypatch):
    import yaml

    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    services = compose()["services"]
    _, worker_args = parse_command(services["worker"]["command"], _compose_env(services["worker"]),
                                             monkeypatch)
    assert jobs["lmserve-worker"]["dns_sd_configs"][0] == {"names": ["worker"], "type": "A",
                                                           "port": worker_args.metrics_port}
    _, gateway_args = parse_command(services["gateway"]["command"], _compose_env(services["gateway"]), monkeypatch)
    assert jobs["lmserve-gateway"]["dns_sd_configs"][0] == {"names": ["gateway"], "type": "A",
                                                            "port": gateway_args.port}
    provisioning = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text())
    assert provisioning["datasources"][0]["url"] == "http://prometheus:9090"
    for document in kubernetes_documents():
        template = document.get("spec", {}).get("template", {})
        annotations = template.get("metadata", {}).get("annotations", {})
        if annotations.get("prometheus.io/scrape") == "true":
            [container] = template["spec"]["containers"]
            ports = {port["containerPort"] for port in container["ports"]}
            assert int(annotations["prometheus.io/port"]) in ports, document["metadata"]["name"]
