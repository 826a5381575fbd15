#!/usr/bin/env python3
"""A control plane for caliban's networked agents, in the Python standard library plus kubectl.

    control-plane.py run NAME "PROMPT" --ca ca.pem [--namespace caliban] [--image IMG]
                     [--unattended] [--yes] [--direct] [--keep]
    control-plane.py render NAME [--namespace caliban] [--image IMG] [--unattended]

`run` creates one agent from agent/job.yaml (a Job, its token Secret and its spawn-spec
ConfigMap, the last two owned by the Job so they go with it), waits until its pod is ready,
connects over TLS (verifying the certificate against --ca and the name
NAME.agents.NAMESPACE.svc), sends the bearer preamble, then speaks ACP: `initialize`,
`session/new`, `session/prompt` with PROMPT, printing the agent's answer and its tool calls as
they stream. Permission prompts are refused unless --yes (or the agent is --unattended). When
the prompt is answered the connection closes; the agent exits on its idle timeout and the Job
is cleaned up after it (or at once with --delete).

By default it reaches the agent through `kubectl port-forward`, so it can run on a
workstation; --direct connects to NAME.agents.NAMESPACE.svc:7100 itself, for a control plane
running in the cluster in a pod labelled app.kubernetes.io/component=caliban-control-plane
(the only pods the NetworkPolicy admits).

`render` prints the manifests `run` would apply, with a placeholder where the token goes.
The environment variable KUBECTL names the kubectl to run (default `kubectl`).
"""

import argparse
import json
import os
import re
import secrets
import socket
import ssl
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TEMPLATE = os.path.join(HERE, "agent", "job.yaml")
PORT = 7100
# How long the pod may take to be scheduled, pull the image and listen.
READY_TIMEOUT_S = 180
# An ACP frame is one line; caliban caps its own lines at 16 MiB.
MAX_LINE = 16 << 20
NAME_RE = re.compile(r"^[a-z]([-a-z0-9]{0,50}[a-z0-9])?$")


def kubectl(*args, stdin=None, check=True):
    cmd = [os.environ.get("KUBECTL", "kubectl"), *args]
    out = subprocess.run(cmd, input=stdin, capture_output=True, text=True)
    if check and out.returncode != 0:
        sys.exit(f"control-plane: {' '.join(cmd)} failed: {out.stderr.strip()}")
    return out.stdout


def manifests(name, namespace, image, unattended, token):
    """The agent's three objects: the Job from the template, its Secret and ConfigMap."""
    with open(TEMPLATE) as f:
        job = f.read().replace("AGENT_NAME", name)
    if image:
        job = job.replace("image: caliban:latest", f"image: {image}")
    spec = {"drive_protocol": "acp", "label": name}
    if unattended:
        spec["permission_posture"] = "unattended"
    labels = {"app.kubernetes.io/name": "caliban-agent", "app.kubernetes.io/instance": name}
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": f"{name}-token", "namespace": namespace, "labels": labels},
        "type": "Opaque",
        "stringData": {"token": token},
    }
    config = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": f"{name}-spec", "namespace": namespace, "labels": labels},
        "data": {"spec.json": json.dumps(spec)},
    }
    return job, secret, config


def create(args, token):
    job, secret, config = manifests(args.name, args.namespace, args.image, args.unattended, token)
    ns = ["--namespace", args.namespace]
    # The token goes on stdin, never on a command line that `ps` shows.
    kubectl("apply", *ns, "-f", "-", stdin=json.dumps(secret))
    kubectl("apply", *ns, "-f", "-", stdin=json.dumps(config))
    kubectl("apply", *ns, "-f", "-", stdin=job)
    uid = kubectl("get", *ns, "job", args.name, "-o", "jsonpath={.metadata.uid}").strip()
    owner = {"metadata": {"ownerReferences": [
        {"apiVersion": "batch/v1", "kind": "Job", "name": args.name, "uid": uid}]}}
    for kind, obj in (("secret", secret), ("configmap", config)):
        kubectl("patch", *ns, kind, obj["metadata"]["name"], "--type", "merge",
                "-p", json.dumps(owner))


def wait_ready(args):
    """The agent's pod, once the kubelet finds it listening (its readiness probe)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    ns = ["--namespace", args.namespace]
    while True:
        pod = kubectl("get", *ns, "pods", "-l", f"job-name={args.name}",
                      "-o", "jsonpath={.items[0].metadata.name}", check=False).strip()
        if pod:
            left = max(1, int(deadline - time.monotonic()))
            out = subprocess.run(
                [os.environ.get("KUBECTL", "kubectl"), "wait", *ns, "--for=condition=Ready",
                 f"pod/{pod}", f"--timeout={left}s"], capture_output=True, text=True)
            if out.returncode == 0:
                return pod
        if time.monotonic() > deadline:
            sys.exit(f"control-plane: agent {args.name} was not ready within "
                     f"{READY_TIMEOUT_S} s (kubectl describe job/{args.name})")
        time.sleep(1)


def port_forward(args, pod):
    """Starts `kubectl port-forward` to the pod and returns (process, local port)."""
    proc = subprocess.Popen(
        [os.environ.get("KUBECTL", "kubectl"), "port-forward", "--namespace", args.namespace,
         f"pod/{pod}", f":{PORT}"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline()  # "Forwarding from 127.0.0.1:PORT -> 7100"
    found = re.search(r"127\.0\.0\.1:(\d+)", line)
    if not found:
        proc.kill()
        sys.exit(f"control-plane: kubectl port-forward said {line.strip()!r}")
    return proc, int(found.group(1))


class Agent:
    """One ACP connection to an agent: TLS, the bearer preamble, JSON-RPC lines."""

    def __init__(self, host, port, name, ca, token):
        ctx = ssl.create_default_context(cafile=ca)  # checks the chain and the name
        raw = socket.create_connection((host, port), timeout=600)
        self.tls = ctx.wrap_socket(raw, server_hostname=name)
        self.lines = self.tls.makefile("rb")
        self.next_id = 0
        self.send({"bearer": token})

    def send(self, msg):
        self.tls.sendall((json.dumps(msg) + "\n").encode())

    def recv(self):
        line = self.lines.readline(MAX_LINE)
        if not line:
            sys.exit("control-plane: the agent closed the connection")
        return json.loads(line)

    def request(self, method, params, on_message):
        """Sends a request; hands every other message to `on_message` until its answer."""
        self.next_id += 1
        self.send({"jsonrpc": "2.0", "id": self.next_id, "method": method, "params": params})
        while True:
            msg = self.recv()
            if msg.get("id") == self.next_id and "method" not in msg:
                if "error" in msg:
                    sys.exit(f"control-plane: {method}: {msg['error']}")
                return msg["result"]
            on_message(self, msg)

    def close(self):
        self.lines.close()
        self.tls.close()


def show(agent, msg, allow):
    """Prints what a session/update says; answers permission prompts."""
    method = msg.get("method")
    if method == "session/update":
        update = msg["params"]["update"]
        kind = update.get("sessionUpdate")
        if kind == "agent_message_chunk" and update["content"].get("type") == "text":
            print(update["content"]["text"], end="", flush=True)
        elif kind == "tool_call":
            print(f"\n[tool] {update.get('title', '')}", flush=True)
        elif kind == "tool_call_update" and update.get("status") in ("completed", "failed"):
            print(f"[tool {update['status']}]", flush=True)
    elif method == "session/request_permission":
        wanted = "allow_once" if allow else "reject_once"
        option = next(o for o in msg["params"]["options"] if o["kind"] == wanted)
        title = msg["params"].get("toolCall", {}).get("title", "")
        print(f"\n[permission] {title}: {option['name']}", flush=True)
        agent.send({"jsonrpc": "2.0", "id": msg["id"],
                    "result": {"outcome": {"outcome": "selected", "optionId": option["optionId"]}}})


def converse(agent, prompt, cwd, allow):
    on_message = lambda a, m: show(a, m, allow)
    agent.request("initialize", {"protocolVersion": 1, "clientCapabilities": {}}, on_message)
    session = agent.request("session/new", {"cwd": cwd, "mcpServers": []}, on_message)
    result = agent.request(
        "session/prompt",
        {"sessionId": session["sessionId"], "prompt": [{"type": "text", "text": prompt}]},
        on_message)
    print(f"\n[done] stopReason={result['stopReason']}", flush=True)
    return result["stopReason"]


def run(args):
    token = secrets.token_urlsafe(32)
    create(args, token)
    print(f"[created] job/{args.name} in {args.namespace}", flush=True)
    pod = wait_ready(args)
    print(f"[ready] pod/{pod}", flush=True)
    name = f"{args.name}.agents.{args.namespace}.svc"
    forward = None
    try:
        if args.direct:
            host, port = name, PORT
        else:
            forward, port = port_forward(args, pod)
            host = "127.0.0.1"
        agent = Agent(host, port, name, args.ca, token)
        try:
            stop = converse(agent, args.prompt, args.cwd, args.yes)
        finally:
            agent.close()
    finally:
        if forward:
            forward.kill()
            forward.wait()
    if args.delete:
        kubectl("delete", "--namespace", args.namespace, "job", args.name,
                "--cascade=foreground", "--wait=false")
    return 0 if stop == "end_turn" else 1


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for command in ("run", "render"):
        p = sub.add_parser(command)
        p.add_argument("name", help="the agent's name: a DNS label, e.g. agent-1")
        if command == "run":
            p.add_argument("prompt")
            p.add_argument("--ca", required=True, help="the CA that signed the agents' certificate")
            p.add_argument("--yes", action="store_true", help="allow every permission prompt")
            p.add_argument("--direct", action="store_true",
                           help="connect to the agent's Service name, not a port-forward")
            p.add_argument("--cwd", default="/workspace",
                           help="the session's directory: the agent's workspace (-C) or below")
            p.add_argument("--delete", action="store_true",
                           help="delete the Job (and its Secret and ConfigMap) at the end")
        p.add_argument("--namespace", default="caliban")
        p.add_argument("--image", help="the caliban image (default: the template's)")
        p.add_argument("--unattended", action="store_true",
                       help="permission_posture unattended: the agent asks nobody")
    args = parser.parse_args()
    if not NAME_RE.match(args.name):
        parser.error("NAME must be a lowercase DNS label of at most 52 characters")
    if args.command == "render":
        job, secret, config = manifests(args.name, args.namespace, args.image,
                                        args.unattended, "TOKEN-GOES-HERE")
        print(job.rstrip() + "\n---\n" + json.dumps(secret) + "\n---\n" + json.dumps(config))
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
