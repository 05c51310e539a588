"""A fleet on its own networks: each gridrl service in its own Linux network namespace, joined
to one switch by a rate-limited link, running the real CLIs with TLS and credentials.

    from netfleet import Fleet, unavailable_reason

    with Fleet(tmp_path) as fleet:                  # namespaces made, torn down on exit
        master = fleet.master()                     # gridrl-master serve, mutual TLS, tokens
        node = fleet.node("node-1", model_dir, profile="wifi")   # 100 Mbit/s link
        trainer = fleet.trainer(model_dir, ["--steps", "4"])     # gridrl-trainer run
        fleet.cut("node-1")                         # packets to and from it vanish (no RST)
        fleet.restore("node-1")
        fleet.cut_between("trainer", "master")      # only these two lose each other
        fleet.set_profile("node-1", "slow")         # 10 Mbit/s from now on
        node.pause(); node.resume()                 # SIGSTOP / SIGCONT: a sleeping laptop
        fleet.cli("gridrl-master", "nodes", "--master", master.address, "--json")

Topology: a *switch* namespace holds a bridge; every host (``master``, each node, the trainer,
and ``observer``, from which :meth:`Fleet.cli` runs the read-only CLIs a test looks through)
has its own namespace and one veth pair to the bridge. Each side of each pair shapes its egress
with ``tc tbf`` at the host's profile rate (:data:`PROFILES`, the one place they are named), so
both directions are limited. Addresses are in ``10.X.Y.0/24`` (random X, Y per fleet) and
exist only inside the fleet's namespaces: no interface, address or route is added to the
namespace the test runs in, and the fleet's namespaces have no route anywhere else, so nothing
a service sends can leave them. Proxy variables are dropped from the services' environment.

Names: every namespace is ``gnf<pid>x<6 hex>-<host>`` (the test process's pid and a random
tag), so parallel pytest workers and other users never collide; :func:`sweep_stale` removes
namespaces of fleets whose process died without tearing down (SIGKILL).

Teardown (:meth:`Fleet.close`, idempotent) stops every process (SIGCONT, SIGTERM, then
SIGKILL) and deletes every namespace (which deletes their veths and qdiscs). It runs on leaving
the ``with`` block, normal or not, at interpreter exit (``atexit``) and on SIGTERM/SIGHUP
(handlers chained to the previous ones, installed from the main thread only).

Requirements: root, ``ip`` and ``tc`` (iproute2), and a kernel that lets us create network
namespaces, veths, a bridge and tbf qdiscs. :func:`unavailable_reason` says which is missing
(tests skip with it: ``pytest.skip(reason)``); :class:`Fleet` raises :class:`FleetUnavailable`.
netem is not assumed (latency and loss are not modelled; a cut drops every packet).
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import json
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["PROFILES", "Fleet", "FleetUnavailable", "Host", "Proc", "sweep_stale",
           "unavailable_reason"]

BIN = Path(sys.executable).parent

# Link profiles: name -> tc rate. The one place link speeds are named.
PROFILES: dict[str, str] = {
    "lan": "1gbit",     # wired gigabit LAN
    "wifi": "100mbit",  # a Mac on Wi-Fi
    "slow": "10mbit",   # a weak Wi-Fi / VPN link
}
_RATE_BITS = {"kbit": 1_000, "mbit": 1_000_000, "gbit": 1_000_000_000}
NODE_PORT = 50051  # every node host listens here (hosts are namespaces of their own)
_PREFIX = "gnf"
_NOWHERE_MAC = "02:00:00:00:00:01"  # locally administered; no interface of a fleet has it
_PROXY_VARS = ("http_proxy", "https_proxy", "grpc_proxy", "all_proxy", "no_proxy")


class FleetUnavailable(RuntimeError):
    """This machine cannot host a fleet (not root, no ``ip``/``tc``, namespaces refused)."""


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr.strip()}")
    return proc


_checked: list[str | None] = []


def unavailable_reason() -> str | None:
    """Why this machine cannot host a :class:`Fleet` (one line), or None when it can. Checked
    once per process by making and deleting a namespace with a veth and a tbf qdisc."""
    if _checked:
        return _checked[0]
    reason = _probe_machine()
    _checked.append(reason)
    return reason


def _probe_machine() -> str | None:
    if sys.platform != "linux":
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return "network namespaces need root (run the tests as root, as CI does)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    ns = f"{_PREFIX}{os.getpid()}x{secrets.token_hex(3)}-probe"
    try:
        _sh("ip", "netns", "add", ns)
        _sh("ip", "-n", ns, "link", "add", "name", "va", "type", "veth", "peer", "name", "vb")
        _sh("ip", "-n", ns, "link", "add", "name", "br", "type", "bridge")
        _sh("tc", "-n", ns, "qdisc", "add", "dev", "va", "root", "tbf", "rate", "10mbit",
            "burst", "32kb", "latency", "100ms")
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        return f"cannot create a network namespace with a veth, a bridge and tbf: {e}"
    finally:
        _sh("ip", "netns", "del", ns, check=False)
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> list[str]:
    """Delete the namespaces of fleets whose process is gone (killed before its teardown);
    returns their names. Namespaces of live processes (other workers) are left alone."""
    out = _sh("ip", "netns", "list", check=False).stdout
    removed = []
    for line in out.splitlines():
        name = line.split()[0] if line.strip() else ""
        if not name.startswith(_PREFIX) or "x" not in name:
            continue
        pid = name[len(_PREFIX):].split("x", 1)[0]
        if pid.isdigit() and not _pid_alive(int(pid)):
            _sh("ip", "netns", "del", name, check=False)
            removed.append(name)
    return removed


def fleet_namespaces(tag: str | None = None) -> list[str]:
    """Names of the network namespaces of fleets (of the one with ``tag``, when given)."""
    out = _sh("ip", "netns", "list", check=False).stdout
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return [n for n in names if n.startswith(_PREFIX) and (tag is None or n.startswith(tag))]


def _burst_bytes(rate: str) -> int:
    """A tbf bucket that holds about 10 ms at ``rate`` (at least 8 KiB, a few MTUs), so a
    1 Gbit/s link is not capped by the timer tick and a 10 Mbit/s one passes no large burst."""
    for unit, bits in _RATE_BITS.items():
        if rate.endswith(unit):
            return max(8 * 1024, int(float(rate[:-len(unit)]) * bits / 8 / 100))
    raise ValueError(f"rate: {rate!r} is not <number>kbit|mbit|gbit")


@dataclass
class Host:
    """One machine of the fleet: its namespace, its address on the switch and its link."""

    name: str
    netns: str
    address: str        # IPv4 address on the fleet's /24
    port: str           # its veth's name in the switch namespace (the far side)
    profile: str        # key of PROFILES, or a raw tc rate


class Proc:
    """A process started in a host's namespace (``ip netns exec``, which execs the command,
    so ``proc.pid`` is the service's own pid)."""

    def __init__(self, name: str, host: Host, proc: subprocess.Popen, log_path: Path,
                 ready_path: Path | None = None) -> None:
        self.name = name
        self.host = host
        self.proc = proc
        self.log_path = log_path
        self.ready_path = ready_path
        self.info: dict = {}
        self.address: str = ""

    def wait_ready(self, timeout_s: float = 300) -> Proc:
        """Wait until the server is bound (its ``--ready-file``); sets ``info`` and
        ``address``; returns self.

        Raises:
            AssertionError: it exited first, or was not ready in ``timeout_s`` (then it is
                stopped), with its log's tail.
        """
        if self.address or self.ready_path is None:
            return self
        deadline = time.monotonic() + timeout_s
        while not self.ready_path.exists():
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited {self.proc.returncode} before it "
                                     f"was ready:\n{self.log()[-4000:]}")
            if time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"{self.name} not ready after {timeout_s}s:\n"
                                     f"{self.log()[-4000:]}")
            time.sleep(0.1)
        self.info = json.loads(self.ready_path.read_text())
        self.address = self.info["address"]
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def pause(self) -> None:
        """SIGSTOP: the process keeps its sockets but answers nothing (a sleeping laptop)."""
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT."""
        os.kill(self.proc.pid, signal.SIGCONT)

    def running(self) -> bool:
        return self.proc.poll() is None

    def wait(self, timeout_s: float) -> int:
        """Wait for exit; its status. Raises AssertionError with the log's tail on timeout."""
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name} still running after {timeout_s}s:\n"
                                 f"{self.log()[-4000:]}") from None

    def stop(self, timeout_s: float = 20) -> int | None:
        """SIGCONT (a paused process cannot die of SIGTERM), SIGTERM, then SIGKILL."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


_live: weakref.WeakSet[Fleet] = weakref.WeakSet()
_handlers_installed = False


def _close_all() -> None:
    for fleet in list(_live):
        fleet.close()


def _install_handlers() -> None:
    """atexit and SIGTERM/SIGHUP handlers closing every live fleet (once per process)."""
    global _handlers_installed
    if _handlers_installed:
        return
    _handlers_installed = True
    atexit.register(_close_all)
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGHUP):
        previous = signal.getsignal(sig)

        def handler(signum, frame, previous=previous):
            _close_all()
            if callable(previous):
                previous(signum, frame)
            elif previous == signal.SIG_DFL:
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)

        signal.signal(sig, handler)


class Fleet:
    """Namespaces, links and processes of one test (see the module docstring).

    Args:
        workdir: where certificates, tokens, logs and ready files go.
        keepalive_s, keepalive_timeout_s: not set here; pass the services' own flags.

    Raises:
        FleetUnavailable: the machine cannot host a fleet (:func:`unavailable_reason`).
    """

    def __init__(self, workdir: Path) -> None:
        reason = unavailable_reason()
        if reason:
            raise FleetUnavailable(reason)
        sweep_stale()
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.tag = f"{_PREFIX}{os.getpid()}x{secrets.token_hex(3)}"
        rng = random.SystemRandom()
        self.subnet = ipaddress.ip_network(f"10.{rng.randrange(16, 250)}."
                                           f"{rng.randrange(1, 250)}.0/24")
        self.hosts: dict[str, Host] = {}
        self.procs: list[Proc] = []
        self._closed = False
        self._lock = threading.Lock()
        self.switch = f"{self.tag}-switch"
        _live.add(self)
        _install_handlers()
        try:
            _sh("ip", "netns", "add", self.switch)
            _sh("ip", "-n", self.switch, "link", "add", "name", "br0", "type", "bridge")
            _sh("ip", "-n", self.switch, "link", "set", "br0", "up")
            self._pki()
            self.add_host("observer")
            self.token_file("observer", "read")  # also creates the authorized-tokens file
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop every process and delete every namespace of this fleet. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for p in reversed(self.procs):
            with contextlib.suppress(Exception):
                p.stop(timeout_s=10)
        for ns in fleet_namespaces(self.tag):
            _sh("ip", "netns", "del", ns, check=False)
        _live.discard(self)

    def namespaces(self) -> list[str]:
        """This fleet's namespaces that exist now."""
        return fleet_namespaces(self.tag)

    # ------------------------------------------------------------------ hosts and links

    def add_host(self, name: str, profile: str = "lan") -> Host:
        """A namespace for ``name`` with a link of ``profile`` to the switch."""
        if name in self.hosts:
            raise ValueError(f"name: host {name!r} exists")
        i = len(self.hosts) + 2
        if i > 250:
            raise ValueError("name: at most 249 hosts per fleet")
        ns, port = f"{self.tag}-{name}", f"p{i}"
        address = str(self.subnet.network_address + i)
        _sh("ip", "netns", "add", ns)
        _sh("ip", "-n", ns, "link", "set", "lo", "up")
        _sh("ip", "-n", ns, "link", "add", "name", "eth0", "type", "veth", "peer", "name", port,
            "netns", self.switch)
        _sh("ip", "-n", ns, "addr", "add", f"{address}/{self.subnet.prefixlen}", "dev", "eth0")
        _sh("ip", "-n", ns, "link", "set", "eth0", "up")
        _sh("ip", "-n", self.switch, "link", "set", port, "master", "br0")
        _sh("ip", "-n", self.switch, "link", "set", port, "up")
        host = self.hosts[name] = Host(name, ns, address, port, profile)
        self._shape(host)
        return host

    def _shape(self, host: Host) -> None:
        rate = PROFILES.get(host.profile, host.profile)
        burst = _burst_bytes(rate)
        for ns, dev in ((host.netns, "eth0"), (self.switch, host.port)):
            _sh("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
                "burst", str(burst), "latency", "200ms")

    def set_profile(self, name: str, profile: str) -> None:
        """Change host ``name``'s link rate to ``profile`` (a PROFILES key or a tc rate)."""
        host = self.hosts[name]
        host.profile = profile
        self._shape(host)

    def cut(self, name: str) -> None:
        """Cut host ``name``'s link silently: its switch port goes down, so every packet to
        or from it vanishes (no RST, no ICMP); its processes run on, unaware."""
        _sh("ip", "-n", self.switch, "link", "set", self.hosts[name].port, "down")

    def restore(self, name: str) -> None:
        """Bring host ``name``'s link back."""
        _sh("ip", "-n", self.switch, "link", "set", self.hosts[name].port, "up")

    def cut_between(self, a: str, b: str) -> None:
        """Cut hosts ``a`` and ``b`` from each other only, silently: each holds a permanent
        neighbour entry for the other with a MAC no interface has, so their frames reach no
        one (no RST, no ICMP) while both still reach every other host."""
        for here, there in ((a, b), (b, a)):
            _sh("ip", "-n", self.hosts[here].netns, "neigh", "replace",
                self.hosts[there].address, "lladdr", _NOWHERE_MAC, "dev", "eth0", "nud",
                "permanent")

    def restore_between(self, a: str, b: str) -> None:
        """Undo :meth:`cut_between` (the hosts find each other again by ARP)."""
        for here, there in ((a, b), (b, a)):
            _sh("ip", "-n", self.hosts[here].netns, "neigh", "del", self.hosts[there].address,
                "dev", "eth0", check=False)

    def host(self, name: str) -> Host:
        return self.hosts[name]

    # ------------------------------------------------------------------ credentials

    def _pki(self) -> None:
        from gridrl.common.security.certs import make_ca

        self.pki_dir = self.workdir / "pki"
        self.keys_dir = self.workdir / "keys"
        self.keys_dir.mkdir(exist_ok=True)
        self.authorized = self.keys_dir / "authorized_tokens"
        make_ca(self.pki_dir)
        self._certs: set[str] = set()

    def _cert(self, name: str, host: Host) -> None:
        from gridrl.common.security.certs import make_cert

        if name not in self._certs:
            make_cert(self.pki_dir, name, [host.address])
            self._certs.add(name)

    def tls_flags(self, name: str) -> list[str]:
        """``--tls-cert/--tls-key/--tls-ca`` of ``name``'s certificate (made on first use)."""
        self._cert(name, self.hosts[name])
        return ["--tls-cert", str(self.pki_dir / f"{name}.crt"),
                "--tls-key", str(self.pki_dir / f"{name}.key"),
                "--tls-ca", str(self.pki_dir / "ca.crt")]

    def token_file(self, name: str, scope: str, address: str | None = None) -> Path:
        """A token of ``scope`` for ``name`` (minted on first use; a trainer's is bound to
        its certificate, as ``gridrl-auth mint --cert`` does, a node's to ``address`` when
        given, as ``--address`` does)."""
        from gridrl.common.security.minting import mint
        from gridrl.common.security.tokens import cert_fingerprint

        path = self.keys_dir / f"{name}.token"
        if not path.exists():
            cert = None
            if scope == "trainer":
                self._cert(name, self.hosts[name])
                cert = cert_fingerprint((self.pki_dir / f"{name}.crt").read_bytes())
            mint(self.authorized, path, scope, name, address=address, cert=cert)
        return path

    def client_flags(self, name: str, scope: str, address: str | None = None) -> list[str]:
        return [*self.tls_flags(name), "--auth-token-file",
                str(self.token_file(name, scope, address))]

    def server_flags(self, name: str, scope: str, address: str | None = None) -> list[str]:
        """TLS, the authorized tokens and ``name``'s own client token."""
        return [*self.client_flags(name, scope, address), "--authorized-tokens",
                str(self.authorized)]

    # ------------------------------------------------------------------ processes

    def _env(self, env: dict[str, str] | None) -> dict[str, str]:
        base = {k: v for k, v in os.environ.items() if k.lower() not in _PROXY_VARS}
        base.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                     "TOKENIZERS_PARALLELISM": "false"})
        return {**base, **(env or {})}

    def spawn(self, host: str, argv: Sequence[str], name: str | None = None, *,
              ready: bool = True, wait: bool = True, timeout_s: float = 300,
              env: dict[str, str] | None = None) -> Proc:
        """Start ``argv`` (a gridrl console script and its arguments) in ``host``'s
        namespace; with ``ready``, add ``--ready-file`` and (with ``wait``) wait until the
        server is bound (else call :meth:`Proc.wait_ready`: start several, then wait).

        Raises:
            AssertionError: it exited first, or was not ready in ``timeout_s`` (log's tail).
        """
        name = name or host
        ns = self.hosts[host].netns
        log_path = self.workdir / f"{name}.log"
        ready_path = self.workdir / f"{name}.ready.json"
        ready_path.unlink(missing_ok=True)
        cmd = ["ip", "netns", "exec", ns, str(BIN / argv[0]), *argv[1:]]
        if ready:
            cmd += ["--ready-file", str(ready_path)]
        proc = subprocess.Popen(cmd, stdout=log_path.open("w"), stderr=subprocess.STDOUT,
                                env=self._env(env), start_new_session=True)
        p = Proc(name, self.hosts[host], proc, log_path, ready_path if ready else None)
        self.procs.append(p)
        if ready and wait:
            p.wait_ready(timeout_s)
        return p

    def cli(self, *argv: str, scope: str = "read", timeout_s: float = 30) -> (
            subprocess.CompletedProcess):
        """Run a client CLI (``gridrl-master nodes ...``) from the observer host with its
        own credential (scope ``read`` by default)."""
        flags = self.client_flags("observer", scope)
        return subprocess.run(["ip", "netns", "exec", self.hosts["observer"].netns,
                               str(BIN / argv[0]), *argv[1:], *flags], capture_output=True,
                              text=True, timeout=timeout_s, env=self._env(None))

    def cli_json(self, *argv: str, timeout_s: float = 30) -> dict | None:
        """:meth:`cli` with ``--json`` appended; the parsed output, or None when it failed."""
        out = self.cli(*argv, "--json", timeout_s=timeout_s)
        if out.returncode != 0:
            return None
        return json.loads(out.stdout)

    # ------------------------------------------------------------------ the services

    def master(self, *extra: str, name: str = "master", profile: str = "lan",
               env: dict[str, str] | None = None) -> Proc:
        """``gridrl-master serve`` on its own host, mutual TLS and credentials on."""
        host = self.add_host(name, profile)
        argv = ["gridrl-master", "serve", "--listen", f"{host.address}:0", "--metrics-port",
                "-1", "--store", "", *self.tls_flags(name), "--authorized-tokens",
                str(self.authorized), *extra]
        return self.spawn(name, argv, env=env)

    def node(self, name: str, model_dir: Path, *extra: str, master: Proc | None = None,
             profile: str = "lan", env: dict[str, str] | None = None,
             wait: bool = True) -> Proc:
        """``gridrl-rollout serve --backend torch`` on its own host (one thread), registered
        with ``master`` when given; ``wait=False``: returns at once (:meth:`Proc.wait_ready`)."""
        host = self.add_host(name, profile)
        # Each host is a namespace of its own, so every node listens on the default node port,
        # and its credential is bound to that address (README: a LAN's node credentials), which
        # also lets it read relayed adapters from the nodes before it (--relay).
        address = f"{host.address}:{NODE_PORT}"
        argv = ["gridrl-rollout", "serve", "--backend", "torch", "--model", str(model_dir),
                "--listen", address, "--metrics-port", "-1", "--threads", "1",
                "--adapter-root", str(self.workdir / f"{name}-adapters"),
                *self.server_flags(name, "node", address=address)]
        if master is not None:
            argv += ["--master", master.address]
        return self.spawn(name, [*argv, *extra], env=env, wait=wait)

    def trainer(self, model_dir: Path, *extra: str, name: str = "trainer",
                master: Proc | None = None, run_dir: Path | None = None, profile: str = "lan",
                env: dict[str, str] | None = None) -> Proc:
        """``gridrl-trainer run`` on its own host (one thread, its TrainerService on the
        fleet's network, metrics off), following ``master`` when given; returns once its
        TrainerService is bound. ``run_dir`` defaults to ``workdir/<name>-run``."""
        host = self.add_host(name, profile)
        run_dir = run_dir or self.workdir / f"{name}-run"
        argv = ["gridrl-trainer", "run", "--model", str(model_dir), "--device", "cpu",
                "--threads", "1", "--listen", f"{host.address}:0", "--metrics-port", "-1",
                "--run-dir", str(run_dir), *self.server_flags(name, "trainer")]
        if master is not None:
            argv += ["--master", master.address]
        return self.spawn(name, [*argv, *extra], env=env)


@contextlib.contextmanager
def fleet_or_skip(workdir: Path) -> Iterator[Fleet]:
    """A :class:`Fleet`, or ``pytest.skip`` with the one reason the machine cannot host it."""
    import pytest

    reason = unavailable_reason()
    if reason:
        pytest.skip(f"network fleet harness unavailable: {reason}")
    with Fleet(workdir) as fleet:
        yield fleet
