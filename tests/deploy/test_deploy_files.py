"""The Dockerfile, docker-compose.yml, the Kubernetes manifests and the nginx config, checked
without a Docker engine or a cluster: structure, images, ports, probes, and every command line
and LMSERVE_* variable parsed by the real parser of its role."""

from __future__ import annotations

import json
import re
import shlex

import pytest
from conftest import REPO
from deploy_helpers import (
    DEPLOY,
    KUBERNETES,
    check_nginx_config,
    compose,
    kubernetes_documents,
    parse_command,
    render_site,
    write_nginx_config,
)


def _compose_env(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    # ${NAME:-default} is filled in by compose from the host: take the default
    return {k: re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", str(v)) for k, v in env.items()}


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


# --- docker-compose.yml ----------------------------------------------------------------------

def test_compose_has_redis_worker_scalable_gateways_and_nginx():
    services = compose()["services"]
    assert set(services) == {"redis", "worker", "gateway", "nginx", "prometheus", "grafana"}
    # the metrics services run only with --profile metrics
    assert {name for name, s in services.items() if s.get("profiles")} == {"prometheus", "grafana"}
    redis = services["redis"]
    assert redis["image"].startswith("redis:")
    assert redis["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
    gateway = services["gateway"]
    assert "container_name" not in gateway and "ports" not in gateway  # `--scale gateway=3` must work
    assert gateway["expose"] == ["8080"]
    assert services["worker"]["image"] == gateway["image"] == "lmserve:latest"
    assert services["worker"]["build"] == gateway["build"] == "."
    nginx = services["nginx"]
    assert nginx["image"].startswith("nginx:")
    assert nginx["ports"] == ["8080:8080"]
    assert "./deploy/nginx.conf:/etc/nginx/conf.d/default.conf:ro" in nginx["volumes"]
    assert nginx["depends_on"]["gateway"]["condition"] == "service_healthy"


def test_compose_commands_and_environment_are_real_flags(monkeypatch):
    services = compose()["services"]
    _, worker = parse_command(services["worker"]["command"], _compose_env(services["worker"]), monkeypatch)
    assert worker.model == "/models/model.gguf" and worker.worker == "tcp://0.0.0.0:5557"
    assert any(volume.endswith(":/models:ro") for volume in services["worker"]["volumes"])
    assert worker.log_format == "json" and worker.ctx == 4096
    assert worker.kv_store == "redis://redis:6379/0"  # the redis service

    _, gateway = parse_command(services["gateway"]["command"], _compose_env(services["gateway"]), monkeypatch)
    # every replica of the worker service (`--scale worker=M`), by its name, on its bound port
    assert gateway.worker == "dns+tcp://worker:5557"
    assert "container_name" not in services["worker"] and "ports" not in services["worker"]
    assert (gateway.host, gateway.port) == ("0.0.0.0", 8080)
    assert gateway.allow_host == ["localhost", "127.0.0.1"]
    assert gateway.api_key == ""  # unset on the host: no key required
    assert gateway.drain_timeout < _seconds(services["gateway"]["stop_grace_period"])


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


def test_every_manifest_is_listed_in_the_kustomization():
    import yaml
    kustomization = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())
    files = {p.name for p in KUBERNETES.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == files
    kinds = sorted(doc["kind"] for doc in kubernetes_documents() if doc["kind"] != "Kustomization")
    assert kinds == ["Deployment", "Deployment", "HorizontalPodAutoscaler", "Ingress", "PodDisruptionBudget",
                     "Service", "Service", "Service", "StatefulSet"]


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


def test_gateway_reaches_every_worker_through_their_headless_service(monkeypatch):
    worker_set = _by_kind("StatefulSet")["lmserve-worker"]
    services = _by_kind("Service")
    headless = services[worker_set["spec"]["serviceName"]]
    assert headless["spec"]["clusterIP"] == "None"
    assert _labels_match(headless["spec"]["selector"], worker_set)
    worker = _container(worker_set, "worker")
    _, worker_args = parse_command(worker["command"], _env(worker), monkeypatch)
    assert worker_args.model == "/models/model.gguf" and worker_args.batch == 4
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
    assert redis["readinessProbe"]["exec"]["command"] == ["redis-cli", "ping"]
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
    worker_role, worker_args = parse_command(services["worker"]["command"], _compose_env(services["worker"]),
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
