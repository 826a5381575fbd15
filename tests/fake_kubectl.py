#!/usr/bin/env python3
"""A stand-in for kubectl that lets tests/deploy.rs drive deploy/kubernetes/control-plane.py
without a cluster. It answers the calls the control plane makes, records each one (and what
was applied) in $FAKE_KUBECTL_DIR, and for `port-forward` waits for the test to write the
port of the agent it started (from the applied Secret and ConfigMap) to $FAKE_KUBECTL_DIR/port
(written elsewhere and renamed, so it is whole when it appears).
Anything else is refused, so a new kubectl call in the control plane must be taught here."""

import json
import os
import sys
import time

DIR = os.environ["FAKE_KUBECTL_DIR"]
# How long port-forward waits for the test's agent, and then stays up at most.
WAIT_S = 60
STAY_S = 300


def main(args):
    call = {"args": args}
    verb = args[0] if args else ""
    if verb == "apply" and args[-2:] == ["-f", "-"]:
        call["stdin"] = sys.stdin.read()
        n = len([f for f in os.listdir(DIR) if f.startswith("applied-")])
        with open(os.path.join(DIR, f"applied-{n}.yaml"), "w") as f:
            f.write(call["stdin"])
    with open(os.path.join(DIR, "calls.jsonl"), "a") as f:
        f.write(json.dumps(call) + "\n")
    if verb == "apply":
        print("applied")
    elif verb == "get" and "job" in args:
        print("0b4a6e42-fake-uid", end="")
    elif verb == "get" and "pods" in args:
        job = next(a for a in args if a.startswith("job-name=")).split("=", 1)[1]
        print(f"{job}-x7k2p", end="")
    elif verb in ("wait", "patch", "delete"):
        pass
    elif verb == "port-forward":
        deadline = time.monotonic() + WAIT_S
        path = os.path.join(DIR, "port")
        while not os.path.exists(path):
            if time.monotonic() > deadline:
                sys.exit("fake kubectl: no agent port")
            time.sleep(0.05)
        with open(path) as f:
            print(f"Forwarding from 127.0.0.1:{f.read().strip()} -> 7100", flush=True)
        time.sleep(STAY_S)
    else:
        sys.exit(f"fake kubectl: not understood: {args}")


if __name__ == "__main__":
    main(sys.argv[1:])
