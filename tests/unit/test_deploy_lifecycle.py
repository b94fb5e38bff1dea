"""The run's end: the reaper scales the inference Deployments to zero once the trainer has
finished, using only what its Role allows; every object name carries the run id."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from areal_hex.config import load_config
from areal_hex.plan import load_plan
from hexctl.deploy import render
from hexctl.deploy.config import DeployConfig
from hexctl.runtime.reaper import KubeApi, scale_to_zero, wait_for_trainer
from tests.k8s_schema import validate

ROOT = Path(__file__).resolve().parents[2]
PLAN = ROOT / "examples/plans/h800_h20.yaml"
CONFIG = ROOT / "examples/deploy/qwen3-8b.yaml"
TOKEN = "sa-token"


class ApiStub:
    """An API server answering the reaper's three calls from a scripted trainer state.
    (No Kubernetes API server runs here; this speaks its paths, verbs and status codes.)"""

    def __init__(self, states: list[dict | None]):
        self.states = states  # successive GET answers for the trainer (None: 404)
        self.calls: list[tuple[str, str, dict | None]] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):  # noqa: N802
                stub.calls.append(("GET", self.path, None))
                if self.headers["Authorization"] != f"Bearer {TOKEN}":
                    return self._answer(401, {})
                state = stub.states.pop(0) if len(stub.states) > 1 else stub.states[0]
                if state is None:
                    return self._answer(404, {"reason": "NotFound"})
                return self._answer(200, state)

            def do_PATCH(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stub.calls.append(("PATCH", self.path, body))
                assert self.headers["Content-Type"] == "application/merge-patch+json"
                gone = self.path.endswith("/gone/scale")
                return self._answer(404 if gone else 200, {} if gone else body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> KubeApi:
        self.thread.start()
        return KubeApi(f"http://127.0.0.1:{self.server.server_address[1]}", TOKEN)

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def _cond(kind: str) -> dict:
    return {"status": {"conditions": [{"type": kind, "status": "True"}]}}


RUNNING = {"status": {"conditions": [{"type": "Completed", "status": "False"}]}}


@pytest.mark.parametrize(
    ("states", "want"),
    [
        ([None, None, RUNNING, RUNNING, _cond("Completed")], "Completed"),  # created late
        ([RUNNING, _cond("Failed")], "Failed"),
        ([RUNNING, None], "Deleted"),
    ],
)
def test_reaper_waits_for_the_trainer_then_scales_servers_down(states, want):
    stub = ApiStub(states)
    with stub as api:
        how = wait_for_trainer(api, "rl", "JobSet", "r-trainer", poll_s=0.01, log=lambda m: None)
        scale_to_zero(api, "rl", ["r-rollout-0", "gone"], log=lambda m: None)
    assert how == want
    gets = [c for c in stub.calls if c[0] == "GET"]
    assert {c[1] for c in gets} == {
        "/apis/jobset.x-k8s.io/v1alpha2/namespaces/rl/jobsets/r-trainer"
    }
    patches = [c for c in stub.calls if c[0] == "PATCH"]
    assert patches == [
        (m, f"/apis/apps/v1/namespaces/rl/deployments/{n}/scale", {"spec": {"replicas": 0}})
        for m, n in [("PATCH", "r-rollout-0"), ("PATCH", "gone")]
    ]


def test_reaper_job_has_exactly_the_rights_it_uses(tmp_path):
    render("k8s", load_config(CONFIG), load_plan(PLAN), DeployConfig(), tmp_path)
    objs = list(yaml.safe_load_all((tmp_path / "50-lifecycle.yaml").read_text()))
    for o in objs:
        validate(o, "1.30.0")
    kinds = {o["kind"]: o for o in objs}
    assert set(kinds) == {"ServiceAccount", "Role", "RoleBinding", "Job"}
    trainer = next(yaml.safe_load_all((tmp_path / "30-trainer.yaml").read_text()))
    servers = [
        d["metadata"]["name"]
        for f in sorted(tmp_path.glob("15-inference-*.yaml"))
        for d in yaml.safe_load_all(f.read_text())
        if d["kind"] == "Deployment"
    ]
    jobset_rule, scale_rule = kinds["Role"]["rules"]
    assert jobset_rule == {
        "apiGroups": ["jobset.x-k8s.io"],
        "resources": ["jobsets"],
        "verbs": ["get"],
        "resourceNames": [trainer["metadata"]["name"]],
    }
    assert scale_rule["resources"] == ["deployments/scale"]
    assert sorted(scale_rule["resourceNames"]) == sorted(servers) and len(servers) == 12
    pod = kinds["Job"]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == kinds["ServiceAccount"]["metadata"]["name"]
    (c,) = pod["containers"]
    args = c["args"]
    assert args[args.index("--trainer") + 1] == trainer["metadata"]["name"]
    assert args[args.index("--trainer-kind") + 1] == "JobSet"
    assert sorted(a for i, a in enumerate(args) if args[i - 1] == "--deployment") == sorted(servers)
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    kust = yaml.safe_load((tmp_path / "kustomization.yaml").read_text())
    assert "50-lifecycle.yaml" in kust["resources"]


def _names(out: Path) -> set[str]:
    kust = yaml.safe_load((out / "kustomization.yaml").read_text())
    return {
        o["metadata"]["name"]
        for f in kust["resources"]
        for o in yaml.safe_load_all((out / f).read_text())
        if o["kind"] != "Namespace"
    }


def test_two_runs_of_one_name_share_no_object_name(tmp_path):
    plan = load_plan(PLAN)
    a, b = tmp_path / "a", tmp_path / "b"
    render("k8s", load_config(CONFIG), plan, DeployConfig(), a)
    render("k8s", load_config(CONFIG, ["trainer.lr=2e-6"]), plan, DeployConfig(), b)
    rid_a = yaml.safe_load((a / "resolved/config.yaml").read_text())["run"]["run_id"]
    rid_b = yaml.safe_load((b / "resolved/config.yaml").read_text())["run"]["run_id"]
    assert rid_a != rid_b and rid_a.startswith("qwen3-8b-gsm8k-")
    assert not _names(a) & _names(b)
    assert all(n.startswith(rid_a) for n in _names(a))
    # the same job rendered again keeps its id (and names): `kubectl apply` updates it
    render("k8s", load_config(CONFIG), plan, DeployConfig(), tmp_path / "a2")
    assert _names(tmp_path / "a2") == _names(a)


def test_reaper_takes_its_namespace_from_the_pod(monkeypatch, capsys):
    """No --namespace in the rendered args: the downward API's POD_NAMESPACE, so a
    kustomize overlay's namespace is the one it watches; neither given: exit 2."""
    from hexctl.deploy.k8s_lifecycle import NAMESPACE_ENV
    from hexctl.runtime import reaper

    assert reaper.NAMESPACE_ENV == NAMESPACE_ENV  # what the rendered Job sets
    seen = {}

    def fake_wait(api, ns, kind, name, poll_s):
        seen["ns"] = ns
        return "Completed"

    monkeypatch.setattr(reaper.KubeApi, "in_cluster", classmethod(lambda cls: cls("x", "t")))
    monkeypatch.setattr(reaper, "wait_for_trainer", fake_wait)
    monkeypatch.setattr(reaper, "scale_to_zero", lambda api, ns, names: seen.update(scaled=ns))
    monkeypatch.setenv(reaper.NAMESPACE_ENV, "team-b")
    assert reaper.main(["--trainer-kind", "JobSet", "--trainer", "r-trainer"]) == 0
    assert seen == {"ns": "team-b", "scaled": "team-b"}
    monkeypatch.delenv(reaper.NAMESPACE_ENV)
    with pytest.raises(SystemExit) as exc:
        reaper.main(["--trainer-kind", "JobSet", "--trainer", "r-trainer"])
    assert exc.value.code == 2 and "POD_NAMESPACE" in capsys.readouterr().err
