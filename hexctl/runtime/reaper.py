"""Give the inference GPUs back when training ends: a small Job beside the run waits for
the trainer (a JobSet or a Job) to finish, then scales the run's inference Deployments
to zero.

    python3 -m hexctl.runtime.reaper --trainer-kind JobSet \
        --trainer run-1-trainer --deployment run-1-rollout-h20-0 --deployment ...

The namespace is the pod's own (`POD_NAMESPACE`, set from `metadata.namespace` by the
downward API), so a kustomize overlay that moves the run moves the reaper's target too;
`--namespace` overrides it.

Owner references cannot do this (a Deployment created with the trainer cannot be owned
by it), so the Job talks to the API server with its service account, whose Role allows
only: get the trainer, get/patch the scale of the named Deployments. It uses the
standard library only (the controller image runs it). Finished means the trainer's
`Complete`/`Completed` or `Failed` condition is True, or the trainer was deleted after it
had been seen; a trainer not created yet is waited for.
"""

from __future__ import annotations

import argparse
import json
import os
import ssl
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
PATHS = {
    "Job": "/apis/batch/v1/namespaces/{ns}/jobs/{name}",
    "JobSet": "/apis/jobset.x-k8s.io/v1alpha2/namespaces/{ns}/jobsets/{name}",
}
DONE = {"Complete", "Completed", "Failed"}  # Job: Complete; JobSet: Completed
NAMESPACE_ENV = "POD_NAMESPACE"


@dataclass
class KubeApi:
    """The few API calls the reaper makes, over HTTPS with a bearer token."""

    base: str
    token: str
    context: ssl.SSLContext | None = None

    @classmethod
    def in_cluster(cls) -> KubeApi:
        host = os.environ["KUBERNETES_SERVICE_HOST"]
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        ctx = ssl.create_default_context(cafile=str(SA_DIR / "ca.crt"))
        token = (SA_DIR / "token").read_text().strip()
        return cls(f"https://{host}:{port}", token, ctx)

    def request(self, method: str, path: str, body: dict | None = None) -> dict | None:
        """The JSON answer, or None on 404."""
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base + path, data=data, method=method)
        req.add_header("Authorization", f"Bearer {self.token}")
        req.add_header("Accept", "application/json")
        if body is not None:
            req.add_header("Content-Type", "application/merge-patch+json")
        try:
            with urllib.request.urlopen(req, timeout=30, context=self.context) as resp:
                return json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise


def finished(obj: dict) -> str | None:
    """The terminal condition of a Job or JobSet, or None while it runs."""
    for c in obj.get("status", {}).get("conditions") or []:
        if c.get("type") in DONE and c.get("status") == "True":
            return str(c["type"])
    return None


def wait_for_trainer(
    api: KubeApi,
    ns: str,
    kind: str,
    name: str,
    poll_s: float,
    log: Callable[[str], None] = print,
) -> str:
    """Block until the trainer has finished; returns how it ended."""
    path = PATHS[kind].format(ns=ns, name=name)
    seen = False
    while True:
        try:
            obj = api.request("GET", path)
        except (urllib.error.URLError, TimeoutError) as exc:  # API server briefly away
            log(f"reaper: {kind} {name}: {exc}; retrying")
            obj = {} if seen else None
        if obj is None and seen:
            return "Deleted"
        if obj:
            seen = True
            state = finished(obj)
            if state is not None:
                return state
        time.sleep(poll_s)


def scale_to_zero(
    api: KubeApi, ns: str, deployments: list[str], log: Callable[[str], None] = print
) -> None:
    for name in deployments:
        path = f"/apis/apps/v1/namespaces/{ns}/deployments/{name}/scale"
        if api.request("PATCH", path, {"spec": {"replicas": 0}}) is None:
            log(f"reaper: deployment {name} is gone")
        else:
            log(f"reaper: scaled {name} to 0")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m hexctl.runtime.reaper")
    p.add_argument(
        "--namespace",
        default=os.environ.get(NAMESPACE_ENV),
        help=f"default: ${NAMESPACE_ENV} (the pod's namespace)",
    )
    p.add_argument("--trainer-kind", choices=sorted(PATHS), required=True)
    p.add_argument("--trainer", required=True, help="name of the trainer JobSet or Job")
    p.add_argument("--deployment", action="append", default=[], help="inference Deployment")
    p.add_argument("--poll-s", type=float, default=30.0)
    args = p.parse_args(argv)
    if not args.namespace:
        p.error(f"no namespace: expected --namespace or ${NAMESPACE_ENV} (the downward API)")
    api = KubeApi.in_cluster()
    how = wait_for_trainer(api, args.namespace, args.trainer_kind, args.trainer, args.poll_s)
    print(f"reaper: trainer {args.trainer}: {how}", flush=True)
    scale_to_zero(api, args.namespace, args.deployment)
    return 0


if __name__ == "__main__":
    sys.exit(main())
