"""TLS and mutual TLS on real servers and channels (certificates made in the session with
the ``cryptography`` package, ``pki``), the authorized-tokens file (parsing, minting,
revoking, re-reading while serving), the refusal to listen beyond loopback unprotected, and
servers that never share a port."""

from __future__ import annotations

import logging
import ssl
import sys
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from click.testing import CliRunner

from gridrl.common.auth_cli import main as auth_main
from gridrl.common.rpc.channel import connection_hint, dial
from gridrl.common.rpc.server import GrpcServer
from gridrl.common.security.minting import mint, revoke
from gridrl.common.security.policy import ExposedError, Security, check_exposure, is_loopback
from gridrl.common.security.tls import TlsError, TlsFiles
from gridrl.common.security.tokens import (
    AuthError,
    AuthorizedTokens,
    cert_fingerprint,
    certificate_file_fingerprint,
    parse_authorized_tokens,
    read_token_file,
    token_digest,
)
from gridrl.v1 import trainer_pb2, trainer_pb2_grpc

SERVICE = trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"].full_name


class _Trainer(trainer_pb2_grpc.TrainerServiceServicer):
    def GetRunStatus(self, request, context):
        return trainer_pb2.GetRunStatusResponse(run_name="r")


def _serve(security: Security | None, listen: str = "127.0.0.1:0", metrics_port: int = -1,
           ) -> GrpcServer:
    server = GrpcServer(listen, metrics_port=metrics_port, security=security, grace_s=0)
    server.add(trainer_pb2_grpc.add_TrainerServiceServicer_to_server, _Trainer(), SERVICE)
    return server.start()


def _call(address: str, security: Security | None) -> grpc.StatusCode:
    return _call_details(address, security)[0]


def _call_details(address: str, security: Security | None) -> tuple[grpc.StatusCode, str]:
    with dial(address, security) as channel:
        try:
            trainer_pb2_grpc.TrainerServiceStub(channel).GetRunStatus(
                trainer_pb2.GetRunStatusRequest(), timeout=5)
        except grpc.RpcError as e:
            return e.code(), e.details()
    return grpc.StatusCode.OK, ""


# ------------------------------------------------------------------------------------ TLS


def test_mutual_tls_accepts_only_clients_with_a_certificate_from_its_ca(pki) -> None:
    server = _serve(Security(tls=pki.tls("server")))
    try:
        assert server.security.tls.mutual
        ok = grpc.StatusCode.OK
        unavailable = grpc.StatusCode.UNAVAILABLE
        for client, want in ((Security(tls=pki.tls("client")), ok),
                             (Security(tls=pki.tls(None)), unavailable),       # no certificate
                             (Security(tls=pki.tls("rogue")), unavailable),    # another CA's
                             (None, unavailable),                              # plaintext
                             (Security(tls=TlsFiles(ca=str(pki.root / "rogue" / "ca.crt"))),
                              unavailable)):                                   # not trusting it
            assert _call(server.address, client) == want, client
    finally:
        server.stop(0)


def test_tls_without_client_certificates(pki) -> None:
    server = _serve(Security(tls=pki.tls("server", ca=False)))
    try:
        assert not server.security.tls.mutual
        assert _call(server.address, Security(tls=pki.tls(None))) == grpc.StatusCode.OK
        assert _call(server.address, None) == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(0)
    plain = _serve(None)
    try:  # and a TLS client against a plaintext server fails too
        assert _call(plain.address, Security(tls=pki.tls("client"))) == \
            grpc.StatusCode.UNAVAILABLE
    finally:
        plain.stop(0)


def test_the_client_checks_the_name_in_the_server_certificate(pki) -> None:
    """The ``client`` certificate names client.test only: served, a client dialing 127.0.0.1
    refuses it (hostname verification), though the CA signed it."""
    server = _serve(Security(tls=pki.tls("client", ca=False)))
    try:
        with dial(server.address, Security(tls=pki.tls(None))) as channel, \
                pytest.raises(grpc.RpcError) as e:
            trainer_pb2_grpc.TrainerServiceStub(channel).GetRunStatus(
                trainer_pb2.GetRunStatusRequest(), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "Hostname Verification" in e.value.details()
        assert "does not name the host dialed" in connection_hint(
            "UNAVAILABLE", e.value.details(), Security(tls=pki.tls(None)))
    finally:
        server.stop(0)


def test_metrics_are_served_over_https_with_client_certificates_under_mutual_tls(pki) -> None:
    server = _serve(Security(tls=pki.tls("server")), metrics_port=0)
    url = f"https://127.0.0.1:{server.metrics_port}/metrics"
    try:
        context = ssl.create_default_context(cafile=pki.ca)
        with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
            urllib.request.urlopen(url, context=context, timeout=10).read()
        context.load_cert_chain(pki.crt("client"), pki.key("client"))
        body = urllib.request.urlopen(url, context=context, timeout=10).read().decode()
        assert "gridrl_rpc_requests_total" in body
        with pytest.raises((urllib.error.URLError, ConnectionError)):  # not plain http
            urllib.request.urlopen(url.replace("https", "http"), timeout=10).read()
    finally:
        server.stop(0)


def test_tls_files_are_checked_at_start_naming_the_flag(pki, tmp_path: Path) -> None:
    not_pem = tmp_path / "x.crt"
    not_pem.write_text("hello\n")
    cases = [
        (TlsFiles(pki.crt("server"), None, None), "server", "--tls-key: required with --tls-cert"),
        (TlsFiles(None, pki.key("server"), None), "server", "--tls-cert: required with --tls-key"),
        (TlsFiles(None, None, pki.ca), "server", "--tls-cert: a server given --tls-ca"),
        (TlsFiles(pki.crt("client"), pki.key("client"), None), "client",
         "--tls-ca: required with --tls-cert"),
        (TlsFiles(str(tmp_path / "missing.crt"), pki.key("server"), None), "server",
         "--tls-cert: cannot read"),
        (TlsFiles(str(not_pem), pki.key("server"), None), "server",
         f"--tls-cert: {not_pem} is not a PEM certificate"),
        (TlsFiles(pki.crt("server"), pki.key("client"), None), "server",
         f"--tls-key: {pki.key('client')} is not the key of {pki.crt('server')}"),
        (TlsFiles(pki.crt("server"), pki.key("server"), str(not_pem)), "server",
         f"--tls-ca: {not_pem} is not a PEM CA certificate"),
    ]
    for files, role, message in cases:
        with pytest.raises(TlsError) as e:
            files.check(role)
        assert str(e.value).startswith(message), (files, str(e.value))
    assert pki.tls("server").check("server").mutual


def test_an_encrypted_key_is_refused_without_prompting(pki, tmp_path: Path) -> None:
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_pem_private_key(Path(pki.key("server")).read_bytes(), None)
    encrypted = tmp_path / "enc.key"
    encrypted.write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"passphrase")))
    with pytest.raises(TlsError, match="--tls-key: the key is encrypted"):
        TlsFiles(pki.crt("server"), str(encrypted)).check("server")


# --------------------------------------------------------------------- authorized tokens


def test_authorized_tokens_file_format_and_errors(tmp_path: Path) -> None:
    digest = token_digest("gridrl_example-token-123456")
    good = (f"# comment\n\n{digest}  node  mac-1  mac.lan:50051  # trailing\n"
            f"{token_digest('x' * 20)} read grafana\n")
    creds = parse_authorized_tokens(good, "f")
    assert [(c.id, c.scope, c.address) for c in creds] == [("mac-1", "node", "mac.lan:50051"),
                                                           ("grafana", "read", None)]
    bad = [
        (f"{digest} node", "f:1: expected 'sha256:<hex> SCOPE ID [ADDRESS] "
                           "[cert=sha256:<hex>]', got 2 fields"),
        (f"{digest} node x a:1 b:2", "f:1: expected 'sha256:<hex> SCOPE ID"),
        (f"{digest} node x cert={digest} cert={digest}", "f:1: expected 'sha256:<hex> SCOPE ID"),
        (f"{digest} trainer x cert=sha256:ab", "f:1: cert='sha256:ab' is not "
                                               "cert=sha256:<64 lowercase hex digits>"),
        (f"{digest} trainer x cert=md5:{'0' * 64}", "f:1: cert='md5:"),
        ("sha256:abc node x", "f:1: 'sha256:abc' is not sha256:<64 lowercase hex digits>"),
        (f"{digest} admin x", "f:1: scope 'admin' is not one of node, trainer, read"),
        (f"{digest} node -x", "f:1: id '-x' must match"),
        (f"{digest} read x h:1", "f:1: only node credentials are bound to an address"),
        (f"{digest} node x nohost", "f:1: address: 'nohost' is not host:port"),
        (f"{digest} node x\n{token_digest('y' * 20)} read x", "f:2: id 'x' appears twice"),
        (f"{digest} node x\n{digest} read y", "f:2: the same token appears twice"),
    ]
    for text, message in bad:
        with pytest.raises(AuthError) as e:
            parse_authorized_tokens(text, "f")
        assert str(e.value).startswith(message), (text, str(e.value))
    # a certificate binding: after the address or alone, and written back as read
    other = token_digest("gridrl_other-token-1234567")
    bound = parse_authorized_tokens(f"{digest} node n h:1 cert={other}\n"
                                    f"{token_digest('z' * 20)} trainer t cert={other}\n", "f")
    assert [(c.address, c.cert) for c in bound] == [("h:1", other), (None, other)]
    assert parse_authorized_tokens("\n".join(c.line() for c in bound), "f") == bound


def test_a_certificate_fingerprint_is_the_sha256_of_its_der(pki, tmp_path: Path) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes

    pem = Path(pki.crt("client")).read_bytes()
    want = "sha256:" + x509.load_pem_x509_certificate(pem).fingerprint(hashes.SHA256()).hex()
    assert cert_fingerprint(pem) == cert_fingerprint(pem.decode()) == want
    chain = tmp_path / "chain.pem"  # the leaf first, then its CA: the leaf's
    chain.write_bytes(pem + Path(pki.ca).read_bytes())
    assert certificate_file_fingerprint(chain) == want
    assert cert_fingerprint(Path(pki.crt("node")).read_bytes()) != want
    with pytest.raises(AuthError, match=r"^--cert: .*no PEM certificate"):
        certificate_file_fingerprint(Path(pki.key("client")))
    with pytest.raises(AuthError, match=r"^--cert: cannot read"):
        certificate_file_fingerprint(tmp_path / "missing.crt")


def test_a_credential_bound_to_a_client_certificate_needs_that_certificate(
        pki, tmp_path: Path) -> None:
    """A token seen by someone else (a rollout node sees the trainer's on every call) is of no
    use to them when its credential is bound to the holder's client certificate: every server
    then takes it only on a connection that presented that certificate."""
    authorized = tmp_path / "authorized_tokens"
    mint(authorized, tmp_path / "bound.token", "read", "bound",
         cert=certificate_file_fingerprint(pki.crt("client")))
    mint(authorized, tmp_path / "free.token", "read", "free")
    bound = read_token_file(tmp_path / "bound.token")
    free = read_token_file(tmp_path / "free.token")
    tokens = AuthorizedTokens(authorized)
    mutual = _serve(Security(tls=pki.tls("server"), authorized=tokens))
    one_way = _serve(Security(tls=pki.tls("server", ca=False), authorized=tokens))
    plain = _serve(Security(authorized=tokens))
    ok = (grpc.StatusCode.OK, "")
    try:
        assert _call_details(mutual.address, Security(tls=pki.tls("client"), token=bound)) == ok
        # another certificate of the same CA (another machine of the cluster) with the token
        code, details = _call_details(mutual.address, Security(tls=pki.tls("node"), token=bound))
        assert code == grpc.StatusCode.UNAUTHENTICATED
        assert details == ("TrainerService/GetRunStatus: credential 'bound' is bound to another "
                           "client certificate than the one this connection presented")
        # no client certificate: TLS without one, or plaintext
        for address, security in ((one_way.address, Security(tls=pki.tls(None), token=bound)),
                                  (plain.address, Security(token=bound))):
            code, details = _call_details(address, security)
            assert code == grpc.StatusCode.UNAUTHENTICATED
            assert "credential 'bound' is bound to a client certificate and this connection " \
                "presented none" in details
        # an unbound credential still goes with any certificate, or none
        assert _call_details(mutual.address, Security(tls=pki.tls("node"), token=free)) == ok
        assert _call_details(one_way.address, Security(tls=pki.tls(None), token=free)) == ok
    finally:
        for server in (mutual, one_way, plain):
            server.stop(0)


def test_mint_and_revoke(tmp_path: Path) -> None:
    authorized = tmp_path / "authorized_tokens"
    cred = mint(authorized, tmp_path / "a.token", "node", "mac-1", "mac.lan:50051")
    token = read_token_file(tmp_path / "a.token")
    assert token.startswith("gridrl_") and len(token) == 7 + 43
    assert token_digest(token) == cred.digest and token not in authorized.read_text()
    assert oct((tmp_path / "a.token").stat().st_mode & 0o777) == "0o600"
    table = AuthorizedTokens(authorized)
    assert table.lookup(token) == cred and table.lookup(token + "x") is None
    # nothing half-written: a refused mint leaves neither a token nor a line
    for args, message in (((tmp_path / "b.token", "node", "mac-1"), "--id: 'mac-1' is already"),
                          ((tmp_path / "a.token", "read", "other"), "--out: "),
                          ((tmp_path / "c.token", "root", "c"), "--scope: scope 'root'"),
                          ((tmp_path / "d.token", "read", "d", "h:1"), "--address: only node"),
                          ((tmp_path / "e.token", "node", "mac-2", "mac.lan:50051"),
                           "--address: mac.lan:50051 is already bound to credential 'mac-1'")):
        before = authorized.read_text()
        with pytest.raises(AuthError) as e:
            mint(authorized, *args)
        assert str(e.value).startswith(message), str(e.value)
        assert authorized.read_text() == before
    assert not any((tmp_path / f"{x}.token").exists() for x in "bcde")
    assert revoke(authorized, "mac-1").id == "mac-1"
    assert "mac-1" not in authorized.read_text() and authorized.read_text().startswith("# ")
    with pytest.raises(AuthError, match="ID: no credential 'mac-1'"):
        revoke(authorized, "mac-1")


def test_token_files(tmp_path: Path, caplog) -> None:
    path = tmp_path / "t"
    for text, message in (("", "is empty"), ("two tokens", "not a token"),
                          ("short", "not a token")):
        path.write_text(text)
        with pytest.raises(AuthError) as e:
            read_token_file(path)
        assert str(e.value).startswith(f"--auth-token-file: {path}"), str(e.value)
        assert message in str(e.value)
    with pytest.raises(AuthError, match="--auth-token-file: cannot read"):
        read_token_file(tmp_path / "missing")
    path.write_text("gridrl_abcdefghijklmnopqrstuvwxyz\n")
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING):
        assert read_token_file(path) == "gridrl_abcdefghijklmnopqrstuvwxyz"
    assert "readable by other users; chmod 600" in caplog.text


def test_a_running_server_follows_revocations_and_survives_a_bad_edit(tmp_path: Path,
                                                                       caplog) -> None:
    authorized = tmp_path / "authorized_tokens"
    mint(authorized, tmp_path / "r.token", "read", "reader")
    mint(authorized, tmp_path / "s.token", "read", "second")
    token = read_token_file(tmp_path / "r.token")
    server = _serve(Security(authorized=AuthorizedTokens(authorized)))
    try:
        assert _call(server.address, Security(token=token)) == grpc.StatusCode.OK
        revoke(authorized, "reader")
        assert _call(server.address, Security(token=token)) == grpc.StatusCode.UNAUTHENTICATED
        mint(authorized, tmp_path / "n.token", "read", "newcomer")
        new = read_token_file(tmp_path / "n.token")
        assert _call(server.address, Security(token=new)) == grpc.StatusCode.OK
        # an edit that breaks the file keeps the credentials read before, and says so
        with authorized.open("a") as f:
            f.write("this line is not a credential\n")
        with caplog.at_level(logging.ERROR, logger="gridrl.common.security.tokens"):
            assert _call(server.address, Security(token=new)) == grpc.StatusCode.OK
            assert _call(server.address, Security(token=new)) == grpc.StatusCode.OK
        errors = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1 and "unusable" in errors[0].getMessage()
    finally:
        server.stop(0)


def test_gridrl_auth_cli(tmp_path: Path) -> None:
    runner = CliRunner()
    authorized = str(tmp_path / "authorized_tokens")
    out = runner.invoke(auth_main, ["ca", "--dir", str(tmp_path / "pki")])
    assert out.exit_code == 0, out.output
    out = runner.invoke(auth_main, ["cert", "--dir", str(tmp_path / "pki"), "m",
                                    "--host", "master.lan", "--host", "10.1.2.3"])
    assert out.exit_code == 0 and "for master.lan, 10.1.2.3" in out.output, out.output
    TlsFiles(str(tmp_path / "pki" / "m.crt"), str(tmp_path / "pki" / "m.key"),
             str(tmp_path / "pki" / "ca.crt")).check("server")
    out = runner.invoke(auth_main, ["cert", "--dir", str(tmp_path / "pki"), "m"])
    assert out.exit_code == 1 and "exists; not overwriting" in out.output
    out = runner.invoke(auth_main, ["mint", "--authorized-tokens", authorized, "--scope", "node",
                                    "--id", "mac", "--address", "mac.lan:50051",
                                    "--out", str(tmp_path / "mac.token")])
    assert out.exit_code == 0 and "bound to mac.lan:50051" in out.output, out.output
    token = (tmp_path / "mac.token").read_text().strip()
    assert token not in out.output
    out = runner.invoke(auth_main, ["mint", "--authorized-tokens", authorized, "--scope", "read",
                                    "--id", "mac", "--out", str(tmp_path / "x.token")])
    assert out.exit_code == 2 and "Invalid value for --id: 'mac' is already" in out.output
    out = runner.invoke(auth_main, ["list"], env={"GRIDRL_AUTHORIZED_TOKENS": authorized})
    assert out.exit_code == 0 and out.output.split() == ["mac", "node", "mac.lan:50051", "-"]
    crt = str(tmp_path / "pki" / "m.crt")
    out = runner.invoke(auth_main, ["mint", "--authorized-tokens", authorized, "--scope",
                                    "trainer", "--id", "t", "--cert", crt,
                                    "--out", str(tmp_path / "t.token")])
    assert out.exit_code == 0 and f"bound to certificate {crt}" in out.output, out.output
    fingerprint = certificate_file_fingerprint(crt)
    assert AuthorizedTokens(authorized).lookup(
        (tmp_path / "t.token").read_text().strip()).cert == fingerprint
    out = runner.invoke(auth_main, ["list", "--authorized-tokens", authorized])
    assert out.exit_code == 0 and out.output.splitlines()[1].split() == [
        "t", "trainer", "-", f"cert={fingerprint[:19]}..."], out.output
    out = runner.invoke(auth_main, ["mint", "--authorized-tokens", authorized, "--scope", "read",
                                    "--id", "r", "--cert", str(tmp_path / "pki" / "m.key"),
                                    "--out", str(tmp_path / "r.token")])
    assert out.exit_code == 2 and "Invalid value for --cert" in out.output, out.output
    assert not (tmp_path / "r.token").exists()
    out = runner.invoke(auth_main, ["revoke", "--authorized-tokens", authorized, "t"])
    assert out.exit_code == 0
    out = runner.invoke(auth_main, ["revoke", "--authorized-tokens", authorized, "mac"])
    assert out.exit_code == 0 and "revoked mac" in out.output
    out = runner.invoke(auth_main, ["list", "--authorized-tokens", authorized])
    assert out.exit_code == 2 and "lists no credential" in out.output


# ------------------------------------------------------------------------ safe defaults


def test_loopback_detection() -> None:
    for host in ("127.0.0.1", "127.8.9.1", "::1", "[::1]", "localhost", "LOCALHOST"):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "::", "[::]", "10.0.0.5", "192.168.1.2", "box.lan", ""):
        assert not is_loopback(host), host


def test_a_server_beyond_loopback_needs_tls_and_credentials_or_insecure(pki, creds) -> None:
    tokens = AuthorizedTokens(creds.authorized)
    for security, missing in ((None, ["TLS", "credentials"]),
                              (Security(tls=pki.tls("server")), ["credentials"]),
                              (Security(authorized=tokens), ["TLS"])):
        with pytest.raises(ExposedError) as e:
            GrpcServer("0.0.0.0:0", security=security)
        message = str(e.value)
        assert message.startswith("--listen: 0.0.0.0 is reachable from other machines")
        for word in missing:
            assert f"no {word}" in message or f"and no {word}" in message, message
        assert "--insecure" in message and "127.0.0.1" in message
    check_exposure("0.0.0.0", Security(tls=pki.tls("server"), authorized=tokens))
    check_exposure("0.0.0.0", Security(insecure=True))
    check_exposure("127.0.0.1", None)


def test_an_insecure_server_beyond_loopback_warns_naming_its_real_address(pki, creds,
                                                                          caplog) -> None:
    """``--insecure`` lets a server listen beyond loopback unprotected; it then says so at
    WARNING with the address it really binds (its ``address`` shows 0.0.0.0 as 127.0.0.1) and
    what is missing. Loopback, and TLS with credentials, say nothing."""
    from gridrl.common.security.policy import exposure_warning

    caplog.set_level(logging.WARNING, logger="gridrl.common.rpc.server")
    tokens = AuthorizedTokens(creds.authorized)
    server = GrpcServer("0.0.0.0:0", security=Security(insecure=True), grace_s=0).start()
    try:
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any(m.startswith(f"listening on 0.0.0.0:{server.port}: reachable from other "
                                "machines with no TLS and no credentials") for m in warned), warned
    finally:
        server.stop(0)
    assert "cleartext" in exposure_warning("0.0.0.0", Security(authorized=tokens, insecure=True))
    assert "CA signed" in exposure_warning("0.0.0.0", Security(tls=pki.tls("server"),
                                                               insecure=True))
    assert exposure_warning("127.0.0.1", Security(insecure=True)) is None
    assert exposure_warning("0.0.0.0", Security(tls=pki.tls("server"), authorized=tokens)) is None


def test_a_writable_authorized_tokens_file_is_warned_about(tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="gridrl.common.security.tokens")
    authorized = tmp_path / "authorized_tokens"
    mint(authorized, tmp_path / "t", "read", "ops")
    authorized.chmod(0o644)
    AuthorizedTokens(authorized)
    assert not [r for r in caplog.records if "writable" in r.getMessage()]
    authorized.chmod(0o666)
    AuthorizedTokens(authorized)
    warned = [r.getMessage() for r in caplog.records if "writable" in r.getMessage()]
    assert warned == [f"--authorized-tokens: {authorized} is writable by group and others "
                      f"(mode 666): whoever can write it can add a credential; chmod go-w "
                      f"{authorized}"]


def test_servers_never_share_a_port() -> None:
    """Two servers on one port: the second fails to bind (grpc's default SO_REUSEPORT would let
    it bind silently and split the calls between them, as the raw servers below show)."""
    from concurrent import futures

    first = _serve(None)
    try:
        second = GrpcServer(f"127.0.0.1:{first.port}", grace_s=0)
        with pytest.raises(OSError, match=f"listen: could not bind 127.0.0.1:{first.port}"):
            second.start()
    finally:
        first.stop(0)
    if not sys.platform.startswith("linux"):  # grpc sets SO_REUSEPORT by default on Linux
        return
    raw = [grpc.server(futures.ThreadPoolExecutor(1)) for _ in range(2)]
    port = raw[0].add_insecure_port("127.0.0.1:0")
    try:
        assert raw[1].add_insecure_port(f"127.0.0.1:{port}") == port  # what we turned off
    finally:
        for server in raw:
            server.stop(None)


def test_a_taken_port_is_probed_without_the_token(tmp_path: Path) -> None:
    """A server starting on a port something else already holds asks the holder what it is
    (reflection) before refusing: it never sends its bearer token to it, which a local user
    who grabbed the port first would otherwise read."""
    from concurrent import futures

    import click

    from gridrl.common.cli import check_ports_free
    from gridrl.common.rpc.probe import list_services

    seen: list[tuple] = []

    class Recorder(grpc.GenericRpcHandler):
        def service(self, handler_call_details):
            seen.append(tuple(handler_call_details.invocation_metadata))
            return None  # UNIMPLEMENTED

    squatter = grpc.server(futures.ThreadPoolExecutor(2), handlers=[Recorder()])
    port = squatter.add_insecure_port("127.0.0.1:0")
    squatter.start()
    token = "gridrl_" + "s3cret" * 6
    try:
        assert list_services(f"127.0.0.1:{port}", Security(token=token), timeout_s=5) is None
        with pytest.raises(click.BadParameter, match=f"127.0.0.1:{port} is already in use"):
            check_ports_free("127.0.0.1", port, -1, Security(token=token))
    finally:
        squatter.stop(None)
    assert len(seen) == 2  # both asked
    assert not any(key == "authorization" or token in str(value)
                   for metadata in seen for key, value in metadata)


def test_errors_carry_their_flag_and_the_serve_flags_name_it(tmp_path: Path, pki) -> None:
    """AuthError and TlsError hold the flag at fault apart from the problem (the message is
    ``"<flag>: <problem>"``); a serve command's error names the flag and shows the problem."""
    import click

    from gridrl.common.cli import server_options

    empty = tmp_path / "empty.token"
    empty.write_text("\n")
    with pytest.raises(AuthError) as auth:
        read_token_file(empty)
    assert (auth.value.field, auth.value.problem) == ("--auth-token-file", f"{empty} is empty")
    assert str(auth.value) == f"--auth-token-file: {empty} is empty"
    with pytest.raises(TlsError) as tls:
        TlsFiles(pki.crt("server"), None, None).check("server")
    assert (tls.value.flag, tls.value.problem) == ("--tls-key", "required with --tls-cert")

    @click.command()
    @server_options("master", "127.0.0.1:0", -1, client=True)
    def serve(**_kwargs) -> None:
        pass

    out = CliRunner().invoke(serve, ["--auth-token-file", str(empty)])
    assert out.exit_code == 2 and (f"Invalid value for --auth-token-file: {empty} is empty"
                                   in out.output), out.output
    out = CliRunner().invoke(serve, ["--tls-cert", pki.crt("server")])
    assert out.exit_code == 2 and ("Invalid value for --tls-key: required with --tls-cert"
                                   in out.output), out.output
