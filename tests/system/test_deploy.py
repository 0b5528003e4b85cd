"""deploy/ (Kubernetes): every overlay rendered by kustomize itself (tests/support/kustomize.py) and
every object validated against the Kubernetes OpenAPI schemas (kubernetes-validate, strict: an
unknown field is an error); the PrometheusRule's rules are the promtool-tested ones and pass
`promtool check rules`; the dashboard ConfigMap is the dashboard; and the pieces fit together
(probes, preStop vs readiness grace, grace period vs drain, keys from Secrets, selectors)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from gateway import config as config_mod
from tests.support import kustomize

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
OVERLAYS = ("in-cluster-redis", "production")
K8S_VERSION = "1.32"  # the oldest Kubernetes the manifests are written for (all GA APIs)
CRD_KINDS = {"ServiceMonitor", "PrometheusRule"}


def render(name: str) -> list[dict[str, Any]]:
    path = DEPLOY / "base" if name == "base" else DEPLOY / "overlays" / name
    return [d for d in yaml.safe_load_all(kustomize.build(path)) if d]


def one(objs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [o for o in objs if o["kind"] == kind and (name is None or
                                                        o["metadata"]["name"] == name)]
    assert len(found) == 1, (kind, name, [o["metadata"]["name"] for o in found])
    return found[0]


@pytest.fixture(scope="module", params=("base",) + OVERLAYS)
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render(request.param)


def test_generated_monitoring_files_are_current() -> None:
    r = subprocess.run([sys.executable, str(DEPLOY / "generate.py"), "--check"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_every_object_is_valid_against_the_kubernetes_schemas(rendered) -> None:
    name, objs = rendered
    kinds = {o["kind"] for o in objs}
    assert {"Deployment", "Service", "ConfigMap", "HorizontalPodAutoscaler",
            "PodDisruptionBudget"} <= kinds, kinds
    if name != "base":
        assert kinds >= CRD_KINDS
    for obj in objs:
        if obj["kind"] in CRD_KINDS:
            continue  # no OpenAPI schema in Kubernetes for the operator's CRDs: checked below
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_the_validator_is_real() -> None:
    """The schemas catch what a typo would do."""
    dep = one(render("base"), "Deployment")
    bad = json.loads(json.dumps(dep))
    bad["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)
    bad = json.loads(json.dumps(dep))
    bad["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_kustomize_reports_errors(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text(
        "resources: [missing.yaml]\n")
    with pytest.raises(kustomize.KustomizeError, match="missing.yaml"):
        kustomize.build(tmp_path)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_prometheus_rule_is_the_promtool_tested_rules(overlay: str, tmp_path: Path) -> None:
    objs = render(overlay)
    rule = one(objs, "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    source = yaml.safe_load((ROOT / "dashboards/prometheus/alerts.yml").read_text())
    assert rule["spec"] == {"groups": source["groups"]}
    # and the rendered groups are a valid Prometheus rules file
    promtool = shutil.which("promtool") or "/usr/bin/promtool"
    rules = tmp_path / "rules.yml"
    rules.write_text(yaml.safe_dump(rule["spec"], sort_keys=False))
    r = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr

    sm = one(objs, "ServiceMonitor")
    svc = one(objs, "Service", "slogate")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(sm["spec"]) == {"selector", "endpoints"}
    labels = svc["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in sm["spec"]["selector"]["matchLabels"].items())
    ports = {p["name"] for p in svc["spec"]["ports"]}
    for ep in sm["spec"]["endpoints"]:
        assert ep["port"] in ports and ep["path"] == "/metrics"
    # the Service's name is the job the rules select: job="slogate"
    assert svc["metadata"]["name"] == "slogate"
    assert 'job="slogate"' in (ROOT / "dashboards/prometheus/alerts.yml").read_text()

    dash = one(objs, "ConfigMap", "slogate-grafana-dashboard")
    assert dash["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert dash["data"]["slogate-dashboard.json"] == \
        (ROOT / "dashboards/grafana/slogate.json").read_text()
    json.loads(dash["data"]["slogate-dashboard.json"])


def _env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def test_the_deployment_fits_the_gateway(rendered, tmp_path: Path) -> None:
    name, objs = rendered
    dep = one(objs, "Deployment", "slogate")
    pod = dep["spec"]["template"]
    (c,) = pod["spec"]["containers"]
    cm_name = next(v["configMap"]["name"] for v in pod["spec"]["volumes"] if "configMap" in v)
    cm = one(objs, "ConfigMap", cm_name)  # the generated, hashed name is referenced
    toml_text = cm["data"]["slogate.toml"]
    env = _env(c)
    plain = {k: e["value"] for k, e in env.items() if "value" in e}
    secret_vars = {k for k, e in env.items() if "secretKeyRef" in e.get("valueFrom", {})}
    # The config is valid, with the overrides the Deployment sets (secrets: a placeholder).
    path = tmp_path / "slogate.toml"
    path.write_text(toml_text)
    cfg = config_mod.load(str(path), {**plain, **{k: "redis://x:6379/0" for k in secret_vars
                                                  if k.startswith("SLOGATE_")}})
    # Upstream keys come from Secrets, through each backend's api_key_env.
    for b in cfg.backends:
        if b.api_key_env:
            assert b.api_key_env in secret_vars, b.api_key_env
    assert "api_key =" not in toml_text
    # Probes and shutdown: liveness /healthz, readiness /readyz, preStop = readiness grace,
    # grace period above preStop + readiness grace + drain timeout.
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["lifecycle"]["preStop"]["exec"]["command"] == \
        ["sleep", str(int(cfg.server.readiness_grace_s))]
    assert cfg.server.readiness_grace_s > 0
    assert pod["spec"]["terminationGracePeriodSeconds"] > \
        int(c["lifecycle"]["preStop"]["exec"]["command"][1]) + cfg.server.readiness_grace_s + \
        cfg.server.drain_timeout_s
    assert dep["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    port = next(p for p in c["ports"] if p["name"] == "http")["containerPort"]
    assert port == cfg.server.port and cfg.server.host == "0.0.0.0"
    # Sized from the benchmark: a core per worker process, no CPU limit.
    workers = int(c["args"][c["args"].index("--workers") + 1])
    res = c["resources"]
    cpu = res["requests"]["cpu"]
    assert float(cpu) >= workers and "cpu" not in res.get("limits", {})
    assert res["requests"]["memory"] and res["limits"]["memory"]
    # /tmp is writable (--workers keeps its shared files there) under a read-only root.
    assert c["securityContext"]["readOnlyRootFilesystem"]
    assert any(m["mountPath"] == "/tmp" for m in c["volumeMounts"])
    # Selectors: the Service, the PDB and the HPA find these pods.
    pod_labels = pod["metadata"]["labels"]
    for kind in ("Service", "PodDisruptionBudget"):
        obj = one(objs, kind, "slogate")
        sel = obj["spec"]["selector"]
        sel = sel.get("matchLabels", sel)
        assert all(pod_labels.get(k) == v for k, v in sel.items()), (kind, sel, pod_labels)
    hpa = one(objs, "HorizontalPodAutoscaler", "slogate")
    assert hpa["spec"]["scaleTargetRef"]["name"] == dep["metadata"]["name"]
    metrics = {m["type"]: m for m in hpa["spec"]["metrics"]}
    assert metrics["Resource"]["resource"]["name"] == "cpu"
    if name == "production":
        assert metrics["Pods"]["pods"]["metric"]["name"] == "slogate_requests_in_flight"
        assert "slogate_requests_in_flight" in (ROOT / "gateway/telemetry/prometheus.py"
                                                ).read_text()
        assert "SLOGATE_ADMISSION_REDIS_URL" in secret_vars
    if name == "in-cluster-redis":
        url = plain["SLOGATE_ADMISSION_REDIS_URL"]
        redis_svc = one(objs, "Service", "slogate-redis")
        sts = one(objs, "StatefulSet", "slogate-redis")
        assert url == f"redis://{redis_svc['metadata']['name']}:6379/0"
        assert redis_svc["metadata"]["namespace"] == dep["metadata"]["namespace"]
        sts_labels = sts["spec"]["template"]["metadata"]["labels"]
        assert all(sts_labels.get(k) == v for k, v in redis_svc["spec"]["selector"].items())
        assert cfg.admission.redis_url == url


def test_base_toml_is_a_valid_config() -> None:
    raw = tomllib.loads((DEPLOY / "base/slogate.toml").read_text())
    config_mod.parse(raw, {})


def test_the_renderer_is_kustomize_itself() -> None:
    """The shared library embeds Go's build info: the kustomize modules it was built from."""
    data = kustomize.LIB.read_bytes()
    assert b"dep\tsigs.k8s.io/kustomize/api\tv0.21.3\t" in data
    assert b"dep\tsigs.k8s.io/kustomize/kyaml\tv0.21.3\t" in data
