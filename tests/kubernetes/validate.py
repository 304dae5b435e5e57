"""Checks the Kubernetes kit in deploy/kubernetes/ and the Dockerfile, offline.

Run by scripts/test with the virtual environment of tests/kubernetes/requirements.txt:

  python tests/kubernetes/validate.py [path/to/stormguard]

- Every object of every manifest is validated against its schema, strictly (a field the schema
  does not have is an error): the core kinds with kubernetes-validate's bundled schemas of
  Kubernetes K8S_VERSION; the Prometheus Operator's kinds (PrometheusRule, ServiceMonitor) with
  the openAPIV3Schema of the operator's own CRDs, kept in tests/kubernetes/crds/ (see the
  README there). A kind with neither is an error, not a skip.
- The check can fail: copies of sidecar.yaml and monitoring.yaml with a field misspelt
  (`containerz:`, `endpointz:`) or an unknown field added (`replicaz:`, `pathz:`) are refused.
- What the schemas cannot see: the PrometheusRule's groups are deploy/prometheus's, the dashboard
  ConfigMap holds deploy/grafana's dashboard, the ServiceMonitor finds the Services' admin port,
  the probes are on the config's admin port, terminationGracePeriodSeconds covers the preStop
  sleep and drain_timeout, and each pod runs as non-root on a read-only root filesystem with
  requests and limits. With the binary's path, `stormguard check-config` runs on each config.
- The Dockerfile: several stages, a non-root USER in the last, ENTRYPOINT ["stormguard"].
"""

import copy
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import tomllib

import jsonschema
import kubernetes_validate
import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
# The oldest Kubernetes the kit needs: native sidecars are on by default from 1.29 and the
# preStop `sleep` action from 1.30.
K8S_VERSION = "1.30.0"
MANIFESTS = ["sidecar.yaml", "fleet.yaml", "monitoring.yaml"]

failures = []


def fail(message):
    failures.append(message)
    print(f"FAIL {message}")


def load(path):
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


# ---- schemas -----------------------------------------------------------------------------------


def strict(schema):
    """The CRD's structural schema with unknown fields refused, as kubernetes-validate's strict
    schemas do for the core kinds (the API server prunes them silently instead)."""
    if isinstance(schema, dict):
        if (
            "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            schema["additionalProperties"] = False
        for key in ("properties",):
            for sub in schema.get(key, {}).values():
                strict(sub)
        for key in ("items", "additionalProperties", "not"):
            if isinstance(schema.get(key), dict):
                strict(schema[key])
        for key in ("anyOf", "allOf", "oneOf"):
            for sub in schema.get(key, []):
                strict(sub)
    return schema


def crd_validators():
    out = {}
    for path in sorted((ROOT / "tests/kubernetes/crds").glob("*.yaml")):
        for crd in load(path):
            spec = crd["spec"]
            for version in spec["versions"]:
                schema = strict(copy.deepcopy(version["schema"]["openAPIV3Schema"]))
                api_version = f"{spec['group']}/{version['name']}"
                out[(api_version, spec["names"]["kind"])] = jsonschema.Draft7Validator(schema)
    return out


CRDS = crd_validators()


def schema_errors(doc):
    """Why `doc` does not fit its kind's schema, or [] when it does."""
    key = (doc.get("apiVersion"), doc.get("kind"))
    if key in CRDS:
        errors = [
            f"{'.'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}"
            for e in CRDS[key].iter_errors(doc)
        ]
        if not doc.get("metadata", {}).get("name"):
            errors.append("metadata.name: missing")
        return errors
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{'.'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}"]
    except kubernetes_validate.SchemaNotFoundError as e:
        return [e.message]
    return []


def validate_file(name, docs):
    bad = 0
    for doc in docs:
        for error in schema_errors(doc):
            fail(f"deploy/kubernetes/{name}: {doc.get('kind')}/{doc.get('metadata', {}).get('name')}: {error}")
            bad += 1
    if not bad:
        kinds = ", ".join(d["kind"] for d in docs)
        print(f"ok   deploy/kubernetes/{name}: {len(docs)} objects valid ({kinds})")


def must_be_refused(name, right, wrong, mention):
    """The validation refuses `name` with `right` replaced by `wrong`, naming `mention`: the
    check can fail, on the field that was broken."""
    text = (ROOT / "deploy/kubernetes" / name).read_text()
    assert right in text, f"{name} has no {right!r} to break"
    docs = [d for d in yaml.safe_load_all(text.replace(right, wrong, 1)) if d]
    errors = [e for d in docs for e in schema_errors(d) if mention in e]
    field = re.findall(r"(\w+):", wrong)[-1]
    if errors:
        print(f"ok   a copy of {name} with `{field}` is refused: {errors[0]}")
    else:
        fail(f"a copy of {name} with `{field}` passed validation")


# ---- what the schemas cannot see ---------------------------------------------------------------


def seconds(duration):
    """A stormguard duration ("10s", "500ms", "2m") in seconds."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m)", duration)
    if not m:
        raise ValueError(f"not a duration: {duration!r}")
    return float(m.group(1)) * {"ms": 0.001, "s": 1, "m": 60}[m.group(2)]


def check_pods(name, docs, binary):
    config_maps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
    for deploy in (d for d in docs if d["kind"] == "Deployment"):
        where = f"deploy/kubernetes/{name}: Deployment/{deploy['metadata']['name']}"
        pod = deploy["spec"]["template"]["spec"]
        containers = pod.get("initContainers", []) + pod["containers"]
        sec = pod.get("securityContext", {})
        if not sec.get("runAsNonRoot") or not sec.get("runAsUser"):
            fail(f"{where}: the pod must set runAsNonRoot and a non-zero runAsUser")
        for c in containers:
            csec = c.get("securityContext", {})
            if not csec.get("readOnlyRootFilesystem") or csec.get("allowPrivilegeEscalation", True):
                fail(f"{where}: {c['name']}: needs readOnlyRootFilesystem and no privilege escalation")
            res = c.get("resources", {})
            if not res.get("requests") or not res.get("limits", {}).get("memory"):
                fail(f"{where}: {c['name']}: needs resource requests and a memory limit")
        proxies = [c for c in pod.get("initContainers", []) if c["name"] == "stormguard"]
        if not proxies:
            continue
        proxy = proxies[0]
        if proxy.get("restartPolicy") != "Always":
            fail(f"{where}: the stormguard init container must be a sidecar (restartPolicy: Always)")
        if proxy.get("args") != ["proxy", "--config", "/etc/stormguard/stormguard.toml"]:
            fail(f"{where}: stormguard's args: {proxy.get('args')}")
        mount = next(m for m in proxy["volumeMounts"] if m["mountPath"] == "/etc/stormguard")
        volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
        text = config_maps[volume["configMap"]["name"]]["data"]["stormguard.toml"]
        config = tomllib.loads(text)

        admin_port = int(config["admin"].rsplit(":", 1)[1])
        ports = {p["name"]: p["containerPort"] for p in proxy["ports"]}
        if ports.get("admin") != admin_port:
            fail(f"{where}: the container's admin port {ports.get('admin')} is not the config's {admin_port}")
        for probe, path in [("startupProbe", "/healthz"), ("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")]:
            get = proxy.get(probe, {}).get("httpGet", {})
            if get.get("path") != path or get.get("port") not in ("admin", admin_port):
                fail(f"{where}: {probe} must be GET {path} on the admin port, not {get}")

        drain = seconds(config.get("drain_timeout", "10s"))
        pre_stop = max(
            (c.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0) for c in containers),
            default=0,
        )
        grace = pod.get("terminationGracePeriodSeconds", 30)
        if grace <= pre_stop + drain:
            fail(f"{where}: terminationGracePeriodSeconds {grace} must exceed the preStop sleep {pre_stop} s plus drain_timeout {drain:g} s")
        else:
            print(f"ok   {where}: grace {grace} s > preStop {pre_stop} s + drain_timeout {drain:g} s; probes on admin port {admin_port}")

        # Each env:NAME the config reads is given to the container.
        wanted = {v[4:] for v in config.values() if isinstance(v, str) and v.startswith("env:")}
        for dep in config.get("dependency", []):
            wanted |= {v[4:] for v in dep.values() if isinstance(v, str) and v.startswith("env:")}
        given = {e["name"] for e in proxy.get("env", [])}
        if wanted - given:
            fail(f"{where}: the config reads {sorted(wanted - given)} from the environment, which the container does not set")

        if binary:
            with tempfile.TemporaryDirectory() as tmp:
                path = pathlib.Path(tmp) / "stormguard.toml"
                path.write_text(text)
                env = {k: v for k, v in os.environ.items() if not k.startswith("STORMGUARD_")}
                out = subprocess.run([binary, "check-config", str(path)], capture_output=True, text=True, env=env)
            if out.returncode != 0:
                fail(f"{where}: stormguard check-config refuses its config:\n{out.stdout}{out.stderr}")
            else:
                print(f"ok   {where}: stormguard check-config passes its ConfigMap's stormguard.toml")


def check_monitoring(docs, services):
    by_kind = {d["kind"]: d for d in docs}
    rules = yaml.safe_load((ROOT / "deploy/prometheus/stormguard-alerts.yaml").read_text())
    if by_kind["PrometheusRule"]["spec"]["groups"] != rules["groups"]:
        fail("monitoring.yaml: the PrometheusRule's groups differ from deploy/prometheus/stormguard-alerts.yaml")
    dashboard = json.loads((ROOT / "deploy/grafana/stormguard.json").read_text())
    cm = by_kind["ConfigMap"]
    if cm["metadata"].get("labels", {}).get("grafana_dashboard") != "1":
        fail('monitoring.yaml: the dashboard ConfigMap needs the label grafana_dashboard: "1"')
    if json.loads(cm["data"]["stormguard.json"]) != dashboard:
        fail("monitoring.yaml: the dashboard ConfigMap differs from deploy/grafana/stormguard.json")
    monitor = by_kind["ServiceMonitor"]["spec"]
    selector = monitor["selector"]["matchLabels"]
    ports = {e["port"] for e in monitor["endpoints"]}
    selected = [
        s for s in services if selector.items() <= s["metadata"].get("labels", {}).items()
    ]
    admin = [s for s in services if any(p["name"] == "admin" for p in s["spec"]["ports"])]
    if {s["metadata"]["name"] for s in selected} != {s["metadata"]["name"] for s in admin}:
        fail(f"monitoring.yaml: the ServiceMonitor selects {[s['metadata']['name'] for s in selected]}, the Services with an admin port are {[s['metadata']['name'] for s in admin]}")
    for s in selected:
        names = {p["name"] for p in s["spec"]["ports"]}
        if not ports <= names:
            fail(f"monitoring.yaml: Service {s['metadata']['name']} has no port {sorted(ports - names)}")
    if not failures:
        print(f"ok   monitoring.yaml: rules and dashboard are deploy/'s; the ServiceMonitor scrapes {sorted(s['metadata']['name'] for s in selected)}")


def check_dockerfile():
    text = (ROOT / "Dockerfile").read_text()
    lines = [l.strip() for l in text.splitlines() if l.strip() and not l.lstrip().startswith("#")]
    stages = [i for i, l in enumerate(lines) if l.upper().startswith("FROM ")]
    last = lines[stages[-1]:] if stages else []
    users = [l.split(None, 1)[1] for l in last if l.upper().startswith("USER ")]
    entry = [l.split(None, 1)[1] for l in last if l.upper().startswith("ENTRYPOINT ")]
    problems = []
    if len(stages) < 2:
        problems.append("a builder stage and a runtime stage")
    if not users or users[-1].split(":")[0] in ("0", "root"):
        problems.append("a non-root USER in the last stage")
    if not entry or json.loads(entry[-1]) != ["stormguard"]:
        problems.append('ENTRYPOINT ["stormguard"]')
    if problems:
        fail(f"Dockerfile: needs {', '.join(problems)}")
    else:
        print(f"ok   Dockerfile: {len(stages)} stages, USER {users[-1]}, ENTRYPOINT {entry[-1]}")


def main():
    binary = sys.argv[1] if len(sys.argv) > 1 else None
    if binary and not os.access(binary, os.X_OK):
        print(f"{binary}: no such executable: build it first (cargo build -p stormguard)", file=sys.stderr)
        return 2
    files = {name: load(ROOT / "deploy/kubernetes" / name) for name in MANIFESTS}
    shipped = sorted(p.name for p in (ROOT / "deploy/kubernetes").glob("*.y*ml"))
    if shipped != sorted(MANIFESTS):
        fail(f"deploy/kubernetes holds {shipped}; this check knows {MANIFESTS}: add the new file here")
    for name, docs in files.items():
        validate_file(name, docs)
    # A misspelt field: the required one is missing and the misspelt one is unknown.
    must_be_refused("sidecar.yaml", "      containers:\n", "      containerz:\n", "containers")
    must_be_refused("monitoring.yaml", "  endpoints:\n", "  endpointz:\n", "endpoint")
    # An unknown field beside the right ones: refused only because the check is strict.
    must_be_refused("sidecar.yaml", "  replicas: 2\n", "  replicas: 2\n  replicaz: 2\n", "replicaz")
    must_be_refused("monitoring.yaml", "      path: /metrics\n", "      path: /metrics\n      pathz: /metrics\n", "pathz")
    for name in ("sidecar.yaml", "fleet.yaml"):
        check_pods(name, files[name], binary)
    services = [d for name in ("sidecar.yaml", "fleet.yaml") for d in files[name] if d["kind"] == "Service"]
    check_monitoring(files["monitoring.yaml"], services)
    check_dockerfile()
    if failures:
        print(f"{len(failures)} problem(s) in the Kubernetes kit", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
