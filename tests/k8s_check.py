#!/usr/bin/env python3
"""Checks caliban's Kubernetes manifests (deploy/kubernetes), offline.

Usage (needs the packages in tests/requirements-kubernetes.txt):

  k8s_check.py kustomization DIR [--kubectl PATH] [--containerfile PATH]
      Render DIR's kustomization with the subset of kustomize it uses (resources, namespace,
      images; any other field is an error, so the subset cannot silently fall behind), and,
      with --kubectl, render it with `kubectl kustomize` too and require the same objects.
      Then validate every object against the Kubernetes OpenAPI schemas of the newest release
      kubernetes-validate ships (strict: unknown fields fail), and check the invariants below.
      Every YAML file under DIR must be the kustomization, reachable from it, or the agent
      template (agent/job.yaml), which is checked in the next mode.
  k8s_check.py manifests FILE [--containerfile PATH]
      Validate and check the objects in FILE (YAML documents, JSON allowed), e.g. what
      control-plane.py renders for one agent.

Invariants, for every pod template: runs as non-root with a non-zero UID, read-only root
filesystem, no privilege escalation, every capability dropped, requests and limits for CPU
and memory, no service-account token, the image's state directory (Containerfile's
XDG_STATE_HOME) on a volume; an `http serve` container has readiness and liveness probes on
GET /healthz over its listening port (HTTPS when it serves TLS); an `agent serve` container
has a readiness probe on its port; no token, key or password appears in plain text: no
Secret objects in the kustomization, secret-looking variables only from secretKeyRef, TLS
files only from a Secret volume, no `Authorization` header in a probe. The agents' headless
Service and NetworkPolicy must select the template's pods, the Service name be their
subdomain, and the policy admit one port from the control plane only.

Prints `ok: …` and exits 0, or prints every problem and exits 1.
"""

import argparse
import copy
import json
import os
import re
import subprocess
import sys

import kubernetes_validate
import yaml

KUSTOMIZE_FIELDS = {"apiVersion", "kind", "namespace", "resources", "images"}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume",
                  "StorageClass", "CustomResourceDefinition", "PriorityClass"}
SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSWORD|API_KEY|PASSPHRASE", re.I)
TEMPLATE = os.path.join("agent", "job.yaml")
CONTROL_PLANE_LABEL = ("app.kubernetes.io/component", "caliban-control-plane")


class Problems(list):
    def add(self, where, what):
        self.append(f"{where}: {what}")


def load_docs(path):
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


# ---- the kustomize subset ---------------------------------------------------------------

def render(directory, seen):
    kfile = os.path.join(directory, "kustomization.yaml")
    seen.add(os.path.realpath(kfile))
    (k,) = load_docs(kfile)
    unknown = set(k) - KUSTOMIZE_FIELDS
    if unknown:
        raise SystemExit(f"{kfile}: fields outside the subset this checker renders: "
                         f"{sorted(unknown)} (teach tests/k8s_check.py, or use kubectl)")
    objects = []
    for res in k.get("resources", []):
        path = os.path.join(directory, res)
        if os.path.isdir(path):
            objects.extend(render(path, seen))
        else:
            seen.add(os.path.realpath(path))
            objects.extend(load_docs(path))
    if "namespace" in k:
        for obj in objects:
            if obj["kind"] not in CLUSTER_SCOPED:
                obj.setdefault("metadata", {})["namespace"] = k["namespace"]
    for image in k.get("images", []):
        for spec in pod_specs(objects):
            for c in containers(spec):
                name, _ = split_image(c["image"])
                if name == image["name"]:
                    new = image.get("newName", name)
                    if "digest" in image:
                        c["image"] = f"{new}@{image['digest']}"
                    elif "newTag" in image:
                        c["image"] = f"{new}:{image['newTag']}"
                    else:
                        c["image"] = new + c["image"][len(name):]
    return objects


def split_image(ref):
    """`name[:tag][@digest]` into name and the rest; a registry port is not a tag."""
    name = ref.split("@", 1)[0]
    slash = name.rfind("/")
    colon = name.rfind(":")
    if colon > slash:
        name = name[:colon]
    return name, ref[len(name):]


def canonical(objects):
    return sorted(json.dumps(o, sort_keys=True) for o in objects)


# ---- pods -------------------------------------------------------------------------------

def pod_specs(objects):
    for obj in objects:
        spec = pod_spec(obj)
        if spec is not None:
            yield spec


def pod_spec(obj):
    kind = obj.get("kind")
    if kind == "Pod":
        return obj.get("spec")
    if kind in ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"):
        return obj["spec"]["template"]["spec"]
    if kind == "CronJob":
        return obj["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    return None


def pod_labels(obj):
    if obj.get("kind") == "Pod":
        return obj["metadata"].get("labels", {})
    return obj["spec"]["template"]["metadata"].get("labels", {})


def containers(spec):
    return spec.get("initContainers", []) + spec.get("containers", [])


def quantity(q):
    """A CPU or memory quantity as a number (cores or bytes)."""
    q = str(q)
    units = {"m": 1e-3, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,
             "k": 1e3, "M": 1e6, "G": 1e9}
    for unit, factor in sorted(units.items(), key=lambda u: -len(u[0])):
        if q.endswith(unit):
            return float(q[: -len(unit)]) * factor
    return float(q)


def containerfile_env(path):
    env = {}
    with open(path) as f:
        for line in f:
            if line.startswith("ENV "):
                for pair in line.split()[1:]:
                    key, _, value = pair.partition("=")
                    env[key] = value
    return env


def flag(args, name):
    if name in args and args.index(name) + 1 < len(args):
        return args[args.index(name) + 1]
    return None


def check_pod(obj, image_env, problems):
    where = f"{obj['kind']}/{obj['metadata']['name']}"
    spec = pod_spec(obj)
    psc = spec.get("securityContext", {})
    if spec.get("automountServiceAccountToken") is not False:
        problems.add(where, "automountServiceAccountToken is not false")
    if spec.get("hostNetwork") or spec.get("hostPID") or spec.get("hostIPC"):
        problems.add(where, "uses the host's namespaces")
    mounts_by_volume = {v["name"]: v for v in spec.get("volumes", [])}
    for c in containers(spec):
        cwhere = f"{where} container {c['name']}"
        sc = c.get("securityContext", {})
        if not (sc.get("runAsNonRoot", psc.get("runAsNonRoot")) is True):
            problems.add(cwhere, "runAsNonRoot is not true")
        uid = sc.get("runAsUser", psc.get("runAsUser"))
        if not isinstance(uid, int) or uid == 0:
            problems.add(cwhere, f"runAsUser is {uid!r}, not a non-zero UID")
        if sc.get("readOnlyRootFilesystem") is not True:
            problems.add(cwhere, "readOnlyRootFilesystem is not true")
        if sc.get("allowPrivilegeEscalation") is not False:
            problems.add(cwhere, "allowPrivilegeEscalation is not false")
        if sc.get("privileged"):
            problems.add(cwhere, "privileged")
        caps = sc.get("capabilities", {})
        if caps.get("drop") != ["ALL"] or caps.get("add"):
            problems.add(cwhere, f"capabilities are {caps}, not drop: [ALL]")
        res = c.get("resources", {})
        for part in ("cpu", "memory"):
            req = res.get("requests", {}).get(part)
            lim = res.get("limits", {}).get(part)
            if req is None or lim is None:
                problems.add(cwhere, f"no {part} request and limit")
            elif quantity(req) > quantity(lim):
                problems.add(cwhere, f"{part} request {req} above its limit {lim}")
        mounts = {m["mountPath"]: m for m in c.get("volumeMounts", [])}
        secret_dirs = [p for p, m in mounts.items()
                       if "secret" in mounts_by_volume.get(m["name"], {})]

        def from_secret_volume(path):
            return any(path.startswith(d.rstrip("/") + "/") for d in secret_dirs)

        for e in c.get("env", []):
            if SECRET_NAME.search(e["name"]) and "value" in e:
                problems.add(cwhere, f"{e['name']} is set in plain text, not from a Secret")
            if e["name"].endswith(("_TLS_KEY", "_TLS_CERT")) and not from_secret_volume(
                    e.get("value", "")):
                problems.add(cwhere, f"{e['name']} is not a file in a Secret volume")
        args = c.get("args", []) + c.get("command", [])
        for tls_flag in ("--tls-key", "--tls-cert"):
            path = flag(args, tls_flag)
            if path is not None and not from_secret_volume(path):
                problems.add(cwhere, f"{tls_flag} {path} is not a file in a Secret volume")
        state = image_env.get("XDG_STATE_HOME", "")
        if not any(state == p or state.startswith(p.rstrip("/") + "/") for p in mounts):
            problems.add(cwhere, f"the state directory {state} is on the read-only root")
        for probe_kind in ("readinessProbe", "livenessProbe", "startupProbe"):
            probe = c.get(probe_kind) or {}
            for h in probe.get("httpGet", {}).get("httpHeaders", []):
                if h["name"].lower() == "authorization":
                    problems.add(cwhere, f"{probe_kind} carries an Authorization header")
        ports = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}

        def port_of(probe_port):
            return ports.get(probe_port) if isinstance(probe_port, str) else probe_port

        if args[:2] == ["http", "serve"]:
            addr = flag(args, "--addr") or "127.0.0.1:8730"
            listen = int(addr.rsplit(":", 1)[1])
            scheme = "HTTPS" if "--tls-cert" in args else "HTTP"
            for probe_kind in ("readinessProbe", "livenessProbe"):
                get = (c.get(probe_kind) or {}).get("httpGet")
                if not get:
                    problems.add(cwhere, f"no {probe_kind} with httpGet")
                    continue
                if get.get("path") != "/healthz":
                    problems.add(cwhere, f"{probe_kind} is on {get.get('path')}, not /healthz")
                if port_of(get.get("port")) != listen:
                    problems.add(cwhere, f"{probe_kind} port is not the listening {listen}")
                if get.get("scheme", "HTTP") != scheme:
                    problems.add(cwhere, f"{probe_kind} scheme is not {scheme}")
            if addr.startswith("127.") or addr.startswith("[::1]"):
                problems.add(cwhere, "http serve listens on loopback only")
        if args[:2] == ["agent", "serve"]:
            listen = int(flag(args, "--listen").rsplit(":", 1)[1])
            probe = (c.get("readinessProbe") or {}).get("tcpSocket")
            if not probe or port_of(probe.get("port")) != listen:
                problems.add(cwhere, f"no readiness probe on the agent's port {listen}")
            names = {e["name"] for e in c.get("env", [])}
            for needed in ("CALIBAN_AGENT_TOKEN", "CALIBAN_AGENT_TLS_CERT",
                           "CALIBAN_AGENT_TLS_KEY"):
                if needed not in names:
                    problems.add(cwhere, f"{needed} is not set")
            token = next((e for e in c.get("env", []) if e["name"] == "CALIBAN_AGENT_TOKEN"),
                         {})
            if "secretKeyRef" not in token.get("valueFrom", {}):
                problems.add(cwhere, "CALIBAN_AGENT_TOKEN is not from a Secret")
            spec_file = flag(args, "--spec")
            if not spec_file or not any(
                    spec_file.startswith(p.rstrip("/") + "/") and "configMap" in
                    mounts_by_volume.get(m["name"], {}) for p, m in mounts.items()):
                problems.add(cwhere, "the spawn spec is not a file from a ConfigMap")


def check_objects(objects, image_env, problems, kustomized):
    for obj in objects:
        kind = obj.get("kind")
        where = f"{kind}/{obj.get('metadata', {}).get('name')}"
        try:
            kubernetes_validate.validate(obj, kubernetes_validate.latest_version(), strict=True)
        except kubernetes_validate.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            problems.add(where, f"not valid against the Kubernetes "
                                f"{kubernetes_validate.latest_version()} schema: {path}: "
                                f"{e.message}")
        except kubernetes_validate.SchemaNotFoundError as e:
            problems.add(where, f"no schema: {e}")
        if kind == "Secret" and kustomized:
            problems.add(where, "a Secret in the manifests: its data would be in plain text")
        if pod_spec(obj) is not None:
            check_pod(obj, image_env, problems)
        if kind == "Namespace":
            labels = obj["metadata"].get("labels", {})
            if labels.get("pod-security.kubernetes.io/enforce") != "restricted":
                problems.add(where, "does not enforce the restricted Pod Security Standard")
    text = json.dumps(objects)
    if re.search(r"Bearer\s+\S", text):
        problems.add("manifests", "a bearer token in plain text")


def check_agents(objects, template, problems):
    """The shared Service and NetworkPolicy against the agent template's pods."""
    (job,) = [o for o in template if o["kind"] == "Job"]
    labels = pod_labels(job)
    spec = pod_spec(job)
    port = spec["containers"][0]["ports"][0]["containerPort"]

    def selects(selector):
        return bool(selector) and all(labels.get(k) == v for k, v in selector.items())

    services = [o for o in objects if o["kind"] == "Service"
                and o["metadata"]["name"] == spec.get("subdomain")]
    if len(services) != 1:
        problems.add("agents", f"no Service named after the pods' subdomain {spec.get('subdomain')}")
    for svc in services:
        if svc["spec"].get("clusterIP") != "None":
            problems.add("Service/agents", "is not headless")
        if not selects(svc["spec"].get("selector")):
            problems.add("Service/agents", "does not select the agent pods")
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"
                and selects(o["spec"]["podSelector"].get("matchLabels"))]
    if not policies:
        problems.add("agents", "no NetworkPolicy selects the agent pods")
    for pol in policies:
        where = f"NetworkPolicy/{pol['metadata']['name']}"
        if "Ingress" not in pol["spec"].get("policyTypes", []):
            problems.add(where, "does not restrict ingress")
        for rule in pol["spec"].get("ingress", []):
            peers = rule.get("from", [])
            ok = peers and all(
                set(p) == {"podSelector"} and
                p["podSelector"].get("matchLabels") == dict([CONTROL_PLANE_LABEL])
                for p in peers)
            if not ok:
                problems.add(where, f"admits more than the control plane: {peers}")
            if [p.get("port") for p in rule.get("ports", [])] != [port]:
                problems.add(where, f"admits ports other than the agent's {port}")


# ---- main -------------------------------------------------------------------------------

def main():
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="mode", required=True)
    k = sub.add_parser("kustomization")
    k.add_argument("dir")
    k.add_argument("--kubectl")
    m = sub.add_parser("manifests")
    m.add_argument("file")
    for p in (k, m):
        p.add_argument("--containerfile",
                       default=os.path.join(os.path.dirname(__file__), "..", "Containerfile"))
    args = parser.parse_args()
    image_env = containerfile_env(args.containerfile)
    problems = Problems()

    if args.mode == "manifests":
        objects = load_docs(args.file)
        check_objects(objects, image_env, problems, kustomized=False)
        summary = f"{len(objects)} objects"
    else:
        seen = set()
        objects = render(args.dir, seen)
        rendered_by = "the subset"
        if args.kubectl:
            out = subprocess.run([args.kubectl, "kustomize", args.dir],
                                 capture_output=True, text=True)
            if out.returncode != 0:
                raise SystemExit(f"kubectl kustomize failed: {out.stderr}")
            theirs = [d for d in yaml.safe_load_all(out.stdout) if d is not None]
            if canonical(theirs) != canonical(objects):
                mine, kube = set(canonical(objects)), set(canonical(theirs))
                problems.add("render", "kubectl kustomize differs from the subset:\n  only "
                             f"kubectl: {sorted(kube - mine)}\n  only subset: {sorted(mine - kube)}")
            rendered_by += " and kubectl kustomize"
        template_path = os.path.join(args.dir, TEMPLATE)
        seen.add(os.path.realpath(template_path))
        for root, _, files in os.walk(args.dir):
            for f in files:
                path = os.path.realpath(os.path.join(root, f))
                if f.endswith((".yaml", ".yml")) and path not in seen:
                    problems.add(path, "a manifest neither the kustomization nor the template")
        for root, _, files in os.walk(args.dir):
            for f in files:
                with open(os.path.join(root, f), errors="replace") as fh:
                    if re.search(r"Bearer\s+[A-Za-z0-9]", fh.read()):
                        problems.add(os.path.join(root, f), "a bearer token in plain text")
        template = [copy.deepcopy(d) for d in load_docs(template_path)]
        check_objects(objects, image_env, problems, kustomized=True)
        check_agents(objects, template, problems)
        summary = f"{len(objects)} objects rendered by {rendered_by}"

    if problems:
        print("\n".join(problems))
        return 1
    print(f"ok: {summary}, valid against Kubernetes {kubernetes_validate.latest_version()} "
          f"(strict), invariants hold")
    return 0


if __name__ == "__main__":
    sys.exit(main())
