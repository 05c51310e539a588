"""The master's dashboard over real HTTP(S) and RunReportService over a real channel: what the
page's API shows of the fleet and the runs, and, on a protected master (real certificates and
credentials), that nothing is shown without a read credential."""

from __future__ import annotations

import http.client
import json
import ssl
import urllib.parse

import grpc
import pytest
from master_helpers import node_info
from waiting import wait_for

from gridrl.common.rpc.channel import dial
from gridrl.common.security.minting import revoke
from gridrl.common.security.policy import ExposedError, Security
from gridrl.common.security.tokens import AuthorizedTokens
from gridrl.master.fleet_view import fleet_rows
from gridrl.master.run_model import NodeView, RunInfo, RunSummary
from gridrl.master.server import Master
from gridrl.v1 import registry_pb2, registry_pb2_grpc, runs_pb2, runs_pb2_grpc, trainer_pb2

NODE, TRAINER = "127.0.0.1:7001", "127.0.0.1:7002"


def run_report(run_id: str, name: str, steps: range, **extra) -> runs_pb2.ReportRunRequest:
    request = runs_pb2.ReportRunRequest(run=runs_pb2.RunInfo(
        run_id=run_id, run_name=name, state=trainer_pb2.RUN_STATE_RUNNING, total_steps=10,
        trainer_address=TRAINER, model_id="tiny", task="reverse-words"), **extra)
    for n in steps:
        s = request.steps.add(report=trainer_pb2.StepReport(step=n, policy_version=n,
                                                            reward_mean=0.25))
        if n % 2 == 0:
            s.report.eval_score, s.eval_stderr = 0.5, 0.05
        s.nodes.add(address=NODE, samples=16)
    return request


class Http:
    """GET / POST on the dashboard; ``context``: TLS (None: plain HTTP)."""

    def __init__(self, port: int, context: ssl.SSLContext | None = None) -> None:
        self.port, self.context = port, context

    def request(self, method: str, path: str, body: str | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], str]:
        conn = (http.client.HTTPSConnection("127.0.0.1", self.port, context=self.context,
                                            timeout=10) if self.context else
                http.client.HTTPConnection("127.0.0.1", self.port, timeout=10))
        try:
            conn.request(method, path, body=body, headers=headers or {})
            response = conn.getresponse()
            return response.status, dict(response.getheaders()), response.read().decode()
        finally:
            conn.close()

    def get(self, path: str, **headers: str) -> tuple[int, dict[str, str], str]:
        return self.request("GET", path, headers={k.replace("_", "-"): v
                                                  for k, v in headers.items()})


def test_the_api_shows_the_fleet_the_runs_and_their_points(make_master):
    master = make_master(dashboard_port=0)
    channel = dial(master.address)
    registry = registry_pb2_grpc.RegistryServiceStub(channel)
    reports = runs_pb2_grpc.RunReportServiceStub(channel)
    node_id = registry.RegisterNode(registry_pb2.RegisterNodeRequest(
        node=node_info(NODE, adapter=("run-a", 3)))).node_id
    registry.RegisterNode(registry_pb2.RegisterNodeRequest(
        node=node_info(TRAINER, role=2, backend=0)))
    view = runs_pb2.RunNode(address=NODE, in_rotation=True, policy_version=3, staleness=1,
                            mismatch_kl=2e-3, mismatch_kl_bound=1e-3, tokens_per_s=120.0,
                            readmitted="at step 2: passed", last_step=4)
    assert reports.ReportRun(run_report("ra", "run-a", range(1, 5), nodes=[view])).last_step == 4
    assert reports.ReportRun(run_report("rb", "run-b", range(1, 3))).last_step == 2
    web = Http(master.dashboard_port)
    status, headers, body = web.get("/api/state")
    assert status == 200 and "script-src 'self'" in headers["Content-Security-Policy"]
    state = json.loads(body)
    assert {r["run_name"] for r in state["runs"]} == {"run-a", "run-b"}  # two trainers, two runs
    rows = {r["address"]: r for r in state["fleet"]}
    assert rows[NODE]["node_id"] == node_id and rows[NODE]["health"] == "healthy"
    assert (rows[NODE]["backend"], rows[NODE]["policy_version"]) == ("torch", 3)
    seen = rows[NODE]["trainer_view"]
    assert (seen["staleness"], seen["kl_level"], seen["tokens_per_s"]) == (1, "over", 120.0)
    assert seen["readmitted"] == "at step 2: passed" and seen["run_name"] == "run-a"
    assert rows[TRAINER]["role"] == "trainer" and rows[TRAINER]["run"]["run_name"] in (
        "run-a", "run-b")
    status, _, body = web.get("/api/runs/ra")
    detail = json.loads(body)
    assert [p["step"] for p in detail["steps"]] == [1, 2, 3, 4]
    assert [(p["step"], p["score"], p["stderr"]) for p in detail["evals"]] == [
        (2, 0.5, 0.05), (4, 0.5, 0.05)]
    assert detail["steps"][0]["nodes"] == {NODE: 16}
    # the node leaves: its row stays, marked, and the event line says so
    registry.DeregisterNode(registry_pb2.DeregisterNodeRequest(node_id=node_id))

    def left():
        rows = {r["address"]: r for r in json.loads(web.get("/api/state")[2])["fleet"]}
        return rows[NODE]["health"] == "left" and rows

    wait_for(left, 10, "the node's row to say it left")
    events = json.loads(web.get("/api/state")[2])["events"]
    assert [e["kind"] for e in events if e["node"] == NODE] == ["node_joined", "node_left"]
    assert web.get("/api/runs/nope")[0] == 404
    assert web.get("/api/runs/ra?since=x")[0] == 400
    status, headers, page = web.get("/")
    assert status == 200 and '<script src="/static/app.js"' in page
    assert json.loads(web.get("/api/state")[2])["protected"] is False
    assert web.get("/login")[:2][0] == 303  # nothing to sign in to
    channel.close()


def test_a_node_that_stops_heartbeating_turns_unhealthy_then_expires(make_master):
    master = make_master(dashboard_port=0)
    channel = dial(master.address)
    registry = registry_pb2_grpc.RegistryServiceStub(channel)
    registry.RegisterNode(registry_pb2.RegisterNodeRequest(node=node_info(NODE)))
    web = Http(master.dashboard_port)

    def health():
        return {r["address"]: r["health"] for r in json.loads(web.get("/api/state")[2])["fleet"]}

    assert health() == {NODE: "healthy"}
    wait_for(lambda: health() == {NODE: "unhealthy"}, 10, "the silent node to turn unhealthy")
    wait_for(lambda: health() == {NODE: "expired"}, 10, "the silent node to expire")
    kinds = [e["kind"] for e in json.loads(web.get("/api/state")[2])["events"]]
    assert kinds == ["node_joined", "node_unhealthy", "node_expired"]
    channel.close()


def test_fleet_rows_join_the_registry_with_what_trainers_see():
    view = NodeView(address="static:1", policy_version=2, flagged="stale", mismatch_kl=None,
                    mismatch_kl_bound=1e-3)
    rows = fleet_rows([], [RunSummary(RunInfo(run_id="r", run_name="x"), last_step=0,
                                      policy_version=0, report_age_s=0.0, nodes=(view,))],
                      {"gone:1": {"address": "gone:1", "health": "expired", "role": "rollout"}},
                      now=0.0)
    assert [(r["address"], r["health"]) for r in rows] == [("gone:1", "expired"),
                                                           ("static:1", "unregistered")]
    assert rows[1]["trainer_view"]["kl_level"] == "flagged"


def test_a_master_beyond_loopback_without_protection_is_refused():
    with pytest.raises(ExposedError):
        Master("0.0.0.0:0", dashboard_port=0)


# ------------------------------------------------------------------------ protected master


@pytest.fixture
def protected(pki, creds, tmp_path):
    """A master with mutual TLS and credentials (a copy of the authorized tokens, so a test
    may revoke), one node registered, one run reported; and HTTPS clients."""
    authorized = tmp_path / "authorized_tokens"
    authorized.write_text(creds.authorized.read_text())
    security = Security(tls=pki.tls("server"), authorized=AuthorizedTokens(authorized))
    master = Master("127.0.0.1:0", security=security, store_path=None,
                    dashboard_port=0).start()
    channel = dial(master.address, creds.security("trainer", tls=pki.tls("client")))
    registry_pb2_grpc.RegistryServiceStub(channel).RegisterNode(
        registry_pb2.RegisterNodeRequest(node=node_info(TRAINER, role=2, backend=0)))
    runs_pb2_grpc.RunReportServiceStub(channel).ReportRun(
        run_report("secret-run-id", "secret-run-name", range(1, 3)))
    context = ssl.create_default_context(cafile=pki.ca)
    context.load_cert_chain(pki.crt("client"), pki.key("client"))
    yield master, Http(master.dashboard_port, context), authorized
    channel.close()
    master.stop(0)


PROTECTED = ("/", "/index.html", "/static/app.js", "/api/state", "/api/runs/secret-run-id",
             "/api/runs/nope", "/nothing")


def assert_nothing_leaks(body: str) -> None:
    for secret in (TRAINER, "secret-run", "fleet", "reward"):
        assert secret not in body, (secret, body)


def test_without_a_read_credential_nothing_of_the_page_is_served(protected, creds):
    _, web, _ = protected
    for path in PROTECTED:
        for headers in ({}, {"Authorization": f"Bearer {creds.tokens['wrong']}"},
                        {"Authorization": "Basic abc"},
                        {"Cookie": "gridrl_session=forged"}):
            status, got, body = web.request("GET", path, headers=headers)
            assert status == 401, (path, headers, status)
            assert got["WWW-Authenticate"] == 'Bearer realm="gridrl"'
            assert_nothing_leaks(body)
            assert creds.tokens["wrong"] not in body
        status, _, body = web.request("HEAD", path)
        assert status == 401 and body == ""
        # a node credential is known, but its scope does not grant read
        status, _, body = web.get(path, Authorization=f"Bearer {creds.tokens['node']}")
        assert status == 403 and "scope node" in body
        assert_nothing_leaks(body)
    # the sign-in page is served, and holds no data either
    status, _, body = web.get("/login")
    assert status == 200 and 'name="token"' in body
    assert_nothing_leaks(body)
    assert web.get("/static/style.css")[0] == 200


def test_a_read_or_trainer_credential_sees_the_page(protected, creds):
    _, web, _ = protected
    for scope in ("read", "trainer"):
        status, _, body = web.get("/api/state", Authorization=f"Bearer {creds.tokens[scope]}")
        assert status == 200, body
        state = json.loads(body)
        assert [r["run_name"] for r in state["runs"]] == ["secret-run-name"]
        assert [r["address"] for r in state["fleet"]] == [TRAINER]
        assert web.get("/", Authorization=f"Bearer {creds.tokens[scope]}")[0] == 200


def test_signing_in_sets_a_session_cookie_that_ends_with_the_credential(protected, creds):
    _, web, authorized = protected
    form = {"Content-Type": "application/x-www-form-urlencoded"}

    def sign_in(token: str, **headers: str):
        return web.request("POST", "/login", urllib.parse.urlencode({"token": token}),
                           {**form, **headers})

    status, headers, body = sign_in(creds.tokens["node"])
    assert status == 403 and "Set-Cookie" not in headers and "scope node" in body
    status, headers, _ = sign_in(creds.tokens["wrong"])
    assert status == 401 and "Set-Cookie" not in headers
    # a cross-site form posting a good token is refused (login CSRF)
    status, headers, _ = sign_in(creds.tokens["read"], Origin="https://evil.example")
    assert status == 403 and "Set-Cookie" not in headers
    status, headers, _ = sign_in(creds.tokens["read"],
                                 Origin=f"https://127.0.0.1:{web.port}")
    assert status == 303 and headers["Location"] == "/"
    cookie = headers["Set-Cookie"]
    for attribute in ("HttpOnly", "Secure", "SameSite=Strict", "Path=/"):
        assert attribute in cookie, cookie
    session = cookie.split(";")[0]
    assert creds.tokens["read"] not in cookie  # the cookie is a session id, not the token
    status, _, body = web.get("/api/state", Cookie=session)
    assert status == 200 and "secret-run-name" in body
    # revoking the credential ends its sessions at once
    revoke(authorized, "reader")
    status, _, body = web.get("/api/state", Cookie=session)
    assert status == 401
    assert_nothing_leaks(body)


def test_signing_out_ends_the_session(protected, creds):
    _, web, _ = protected
    status, headers, _ = web.request("POST", "/login",
                                     urllib.parse.urlencode({"token": creds.tokens["trainer"]}),
                                     {"Content-Type": "application/x-www-form-urlencoded"})
    session = headers["Set-Cookie"].split(";")[0]
    assert web.get("/api/state", Cookie=session)[0] == 200
    status, headers, _ = web.request("POST", "/logout", headers={"Cookie": session})
    assert status == 303 and "Max-Age=0" in headers["Set-Cookie"]
    assert web.get("/api/state", Cookie=session)[0] == 401


def test_under_mutual_tls_a_client_without_a_certificate_gets_no_answer(protected, pki,
                                                                         creds):
    _, web, _ = protected
    bare = Http(web.port, ssl.create_default_context(cafile=pki.ca))
    with pytest.raises((ssl.SSLError, ConnectionError, http.client.HTTPException)):
        bare.get("/api/state", Authorization=f"Bearer {creds.tokens['read']}")


def test_only_a_trainer_credential_reports_runs(protected, pki, creds):
    master, _, _ = protected
    for scope, code in (("read", grpc.StatusCode.PERMISSION_DENIED),
                        ("node", grpc.StatusCode.PERMISSION_DENIED),
                        (None, grpc.StatusCode.UNAUTHENTICATED)):
        channel = dial(master.address, creds.security(scope, tls=pki.tls("client")))
        with pytest.raises(grpc.RpcError) as e:
            runs_pb2_grpc.RunReportServiceStub(channel).ReportRun(
                run_report("other", "other", range(1, 2)), timeout=10)
        assert e.value.code() == code, (scope, e.value.details())
        channel.close()
