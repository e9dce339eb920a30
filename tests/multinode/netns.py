"""Two "machines" on one Linux host, for the two-node drill: network namespaces, pid and
UTS namespaces, a private disk per node and an S3 server both nodes reach.

Topology (all names carry this process's pid, so concurrent runs never collide)::

    root namespace (the test)          tcn<pid>a  ("node A")                  tcn<pid>b  ("node B")
      tcn<pid>h 10.78.X.1/30 <--veth--> up0 10.78.X.2/30
                                        eth0 10.77.0.1/24 <------veth------> eth0 10.77.0.2/24
                                        moto S3 server on 0.0.0.0:9000

- Each node namespace has loopback up and an ``eth0`` (the same interface name on both, as on real
  machines: ``GLOO_SOCKET_IFNAME=eth0``). The nodes reach the S3 server at
  ``http://10.77.0.1:9000``; the test reaches it through the ``up0`` link at
  ``http://10.78.X.2:9000`` (no forwarding, no bridge: the host's iptables/br_netfilter rules never
  see the traffic). The server runs in node A's *network* namespace but not in its pid namespace:
  killing node A does not kill S3.
- A node "boots" into a fresh pid, UTS and mount namespace (``ip netns exec NS unshare --uts --pid
  --fork --mount-proc``): its init (pid 1 there) sets the host name and reaps orphans; every process
  of the node is started into those namespaces with ``nsenter``, so the trainer and the node's
  sidecar share one pid space and host name, and pids collide across nodes as on real machines.
  Killing the init (:meth:`Node.power_off`) makes the kernel SIGKILL every process of the node at
  once.
- Each node has its own disk directory (``<base>/disk_a``, ``<base>/disk_b``), bind-mounted inside
  the node at the same path (``<base>/local_disk``, :attr:`Cluster.mount_point`) on both nodes, as a
  node-local SSD at one path on every machine. The test reads a node's disk at :attr:`Node.disk`.

:meth:`Cluster.up` raises :class:`NamespacesRefused` (the caller skips) when this host refuses any
of it (not root, ``ip``/``unshare``/``nsenter``/``mount`` missing, EPERM); :meth:`Cluster.down`
always deletes the namespaces and links and kills every process group it started, and is idempotent.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from s3_infra import TEST_AWS_ENV, TEST_AWS_ENV_REMOVE
from spawn import child_env, python_cmd

#: The A<->B link (inside the namespaces only) and the interface name on both nodes.
NODE_ADDRS = {"a": "10.77.0.1", "b": "10.77.0.2"}
IFACE = "eth0"
S3_PORT = 9000
#: Environment a node's processes must not inherit (a proxy would be unreachable from the
#: namespace).
PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")

#: The node's pid 1: set the host name, say ready, reap every orphan until killed.
INIT_CODE = """\
import os, socket, sys, time
socket.sethostname(sys.argv[1])
print("ready", socket.gethostname(), os.getpid(), flush=True)
while True:
    try:
        os.wait()
    except ChildProcessError:
        time.sleep(0.1)
"""


class NamespacesRefused(RuntimeError):
    """This host does not let the test make namespaces (the message says why)."""


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if check and p.returncode != 0:
        raise subprocess.CalledProcessError(p.returncode, argv, p.stdout, p.stderr)
    return p


def children_of(pid: int) -> list[int]:
    """The live children of ``pid`` (global pids, from /proc)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        pass
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat", "rb") as f:
                    data = f.read()
            except OSError:
                continue
            if int(data[data.rfind(b")") + 2 :].split()[1]) == pid:
                out.append(int(d))
    return out


def _killpg(p: subprocess.Popen) -> None:
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


@dataclass
class Node:
    """One machine: network namespace ``netns`` (address :attr:`addr` on ``eth0``), a disk
    directory, and while booted an init process whose pid, UTS and mount namespaces every process of
    the node joins."""

    key: str  # "a" / "b"
    netns: str
    addr: str
    disk: Path  # this node's disk, as the test sees it
    mount_point: Path  # where the node sees its disk
    logs: Path
    hostname: str = ""
    init: subprocess.Popen | None = None
    init_pid: int | None = None  # the init's pid in the root pid namespace
    procs: list[subprocess.Popen] = field(default_factory=list)
    boots: int = 0

    # --- power

    def boot(self, hostname: str) -> None:
        """Start the node's init (fresh pid/UTS/mount namespaces, host name ``hostname``, its disk
        mounted at :attr:`mount_point`). Raises :class:`NamespacesRefused` if the host refuses
        it."""
        assert self.init is None, f"node {self.key} is already up"
        self.disk.mkdir(parents=True, exist_ok=True)
        self.boots += 1
        self.hostname = hostname
        script = 'mount --bind "$0" "$1" && exec "$2" -c "$3" "$4"'
        argv = [
            "ip",
            "netns",
            "exec",
            self.netns,
            "unshare",
            "--uts",
            "--pid",
            "--fork",
            "--mount-proc",
            "sh",
            "-c",
            script,
            str(self.disk),
            str(self.mount_point),
            python_cmd()[0],
            INIT_CODE,
            hostname,
        ]
        err = open(self.logs / f"init_{self.key}{self.boots}.err", "wb")
        self.init = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=err,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        err.close()
        line = self.init.stdout.readline().decode(errors="replace")  # type: ignore[union-attr]
        if not line.startswith("ready"):
            self.init.wait(timeout=10)
            reason = (
                (self.logs / f"init_{self.key}{self.boots}.err").read_text(errors="replace").strip()
            )
            self.init = None
            raise NamespacesRefused(
                f"node {self.key}: `ip netns exec ... unshare --uts --pid --fork "
                f"--mount-proc` failed: {reason or 'no output'}"
            )
        ns_pid = int(line.split()[2])
        if ns_pid != 1:
            raise NamespacesRefused(
                f"node {self.key}: init is pid {ns_pid} in its namespace, not 1"
            )
        deadline = time.monotonic() + 10
        while not (kids := children_of(self.init.pid)):
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"node {self.key}: cannot find the init process under {self.init.pid}"
                )
            time.sleep(0.01)
        self.init_pid = kids[0]

    def power_off(self) -> None:
        """SIGKILL the node's init: the kernel kills every process in its pid namespace at once (a
        node that loses power). Waits until they are gone. No-op when the node is down."""
        if self.init is None:
            return
        if self.init_pid is not None:
            try:
                os.kill(self.init_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in [*self.procs, self.init]:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                _killpg(p)
        if self.init.stdout is not None:
            self.init.stdout.close()
        self.init, self.init_pid, self.procs = None, None, []

    def replace_disk(self) -> None:
        """The node is replaced: its disk is gone, the new machine has an empty one (node must be
        down)."""
        assert self.init is None, "replace the disk of a node that is down"
        shutil.rmtree(self.disk, ignore_errors=True)
        self.disk.mkdir(parents=True)

    # --- processes

    def spawn(self, argv: list[str], *, env: dict[str, str], log: Path) -> subprocess.Popen:
        """Start ``argv`` on this node (its net, pid, UTS and mount namespaces), output to ``log``,
        in a process group of its own. :meth:`real_pid` gives its pid in the root pid namespace."""
        assert self.init_pid is not None, f"node {self.key} is down"
        cmd = [
            "nsenter",
            f"--target={self.init_pid}",
            "--net",
            "--pid",
            "--uts",
            "--mount",
            "--",
            *argv,
        ]
        with open(log, "ab") as out:
            p = subprocess.Popen(
                cmd,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=str(self.logs),
                start_new_session=True,
            )
        self.procs.append(p)
        return p

    def real_pid(self, p: subprocess.Popen, timeout: float = 10.0) -> int:
        """The root-namespace pid of the program :meth:`spawn` started (nsenter's child)."""
        deadline = time.monotonic() + timeout
        while True:
            kids = children_of(p.pid)
            if kids:
                return kids[0]
            if p.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"node {self.key}: no child under nsenter {p.pid} (exit {p.poll()})"
                )
            time.sleep(0.01)

    def env(self, endpoint: str, **extra: str) -> dict[str, str]:
        """The environment of a process on this node: the test's, dummy AWS credentials, S3 at
        ``endpoint`` (boto3's chain), ``GLOO_SOCKET_IFNAME``, one intra-op thread; no proxies."""
        env = child_env(**TEST_AWS_ENV)
        for name in (*TEST_AWS_ENV_REMOVE, *PROXY_VARS):
            env.pop(name, None)
        env.update(
            AWS_ENDPOINT_URL=endpoint,
            GLOO_SOCKET_IFNAME=IFACE,
            OMP_NUM_THREADS="1",
            PYTHONUNBUFFERED="1",
            **extra,
        )
        return env


class Cluster:
    """The two namespaces, their links and the S3 server; ``with Cluster(base) as c:`` or
    up()/down()."""

    def __init__(self, base: Path) -> None:
        self.base = base
        tag = f"tcn{os.getpid()}"
        self.netns = {"a": f"{tag}a", "b": f"{tag}b"}
        self.root_link = f"{tag}h"  # root side of the root<->A link
        self.mount_point = base / "local_disk"
        self.logs = base / "logs"
        self.nodes = {
            k: Node(
                k, self.netns[k], NODE_ADDRS[k], base / f"disk_{k}", self.mount_point, self.logs
            )
            for k in ("a", "b")
        }
        self.endpoint = f"http://{NODE_ADDRS['a']}:{S3_PORT}"  # as the nodes reach S3
        self.test_endpoint = ""  # as this process reaches S3 (set by up)
        self._made_ns: list[str] = []
        self._made_links: list[str] = []
        self.s3: subprocess.Popen | None = None
        #: what a process on each node saw at up(): host name, pid, S3 reachable, its disk's listing
        self.probe: dict[str, dict] = {}

    @property
    def a(self) -> Node:
        return self.nodes["a"]

    @property
    def b(self) -> Node:
        return self.nodes["b"]

    def __enter__(self) -> Cluster:
        try:
            self.up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    # --- setup

    @staticmethod
    def check_host() -> None:
        """Raise :class:`NamespacesRefused` when this host cannot run the harness at all."""
        if not hasattr(os, "geteuid") or os.geteuid() != 0:
            raise NamespacesRefused("network namespaces need root (euid is not 0)")
        missing = [t for t in ("ip", "unshare", "nsenter", "mount") if shutil.which(t) is None]
        if missing:
            raise NamespacesRefused(
                f"missing tools: {', '.join(missing)} (iproute2, util-linux, mount)"
            )

    def _ip(self, *args: str) -> None:
        try:
            _run("ip", *args)
        except subprocess.CalledProcessError as e:
            raise NamespacesRefused(
                f"`ip {' '.join(args)}` failed: {e.stderr.strip() or e.returncode}"
            ) from None

    def _free_subnet(self) -> int:
        """A third octet X for 10.78.X.0/30 that no root-namespace address uses yet."""
        used = _run("ip", "-4", "-o", "addr", "show", check=False).stdout
        start = os.getpid() % 250
        for i in range(250):
            x = (start + i) % 250 + 1
            if f"10.78.{x}." not in used:
                return x
        raise NamespacesRefused("no free 10.78.X.0/30 subnet in the root namespace")

    def up(self) -> None:
        self.check_host()
        self.mount_point.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(parents=True, exist_ok=True)
        for k, ns in self.netns.items():
            self._ip("netns", "add", ns)
            self._made_ns.append(ns)
            self._ip("-n", ns, "link", "set", "lo", "up")
        na, nb = self.netns["a"], self.netns["b"]
        # A <-> B: eth0 on both sides (renamed once inside its namespace)
        tmp_a, tmp_b = f"{na}0", f"{nb}0"
        self._ip("link", "add", tmp_a, "type", "veth", "peer", "name", tmp_b)
        self._made_links.append(tmp_a)
        for ns, dev in ((na, tmp_a), (nb, tmp_b)):
            self._ip("link", "set", dev, "netns", ns)
            self._ip("-n", ns, "link", "set", dev, "name", IFACE)
        for k, ns in self.netns.items():
            self._ip("-n", ns, "addr", "add", f"{NODE_ADDRS[k]}/24", "dev", IFACE)
            self._ip("-n", ns, "link", "set", IFACE, "up")
        # root <-> A: the test's way to the S3 server
        x = self._free_subnet()
        self._ip("link", "add", self.root_link, "type", "veth", "peer", "name", f"{na}u")
        self._made_links.append(self.root_link)
        self._ip("link", "set", f"{na}u", "netns", na)
        self._ip("-n", na, "link", "set", f"{na}u", "name", "up0")
        self._ip("addr", "add", f"10.78.{x}.1/30", "dev", self.root_link)
        self._ip("link", "set", self.root_link, "up")
        self._ip("-n", na, "addr", "add", f"10.78.{x}.2/30", "dev", "up0")
        self._ip("-n", na, "link", "set", "up0", "up")
        self.test_endpoint = f"http://10.78.{x}.2:{S3_PORT}"
        self._start_s3()
        self._probe_nodes()

    def _start_s3(self) -> None:
        env = self.a.env(self.endpoint)
        out = open(self.logs / "moto_server.log", "wb")
        self.s3 = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                self.netns["a"],
                *python_cmd("-m", "moto.server", "-H", "0.0.0.0", "-p", str(S3_PORT)),
            ],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        out.close()
        deadline = time.monotonic() + 60
        while True:
            if self.s3.poll() is not None:
                raise RuntimeError(
                    "moto server exited: "
                    + (self.logs / "moto_server.log").read_text(errors="replace")[-2000:]
                )
            try:
                with urllib.request.urlopen(self.test_endpoint + "/moto-api/", timeout=2):
                    return
            except urllib.error.HTTPError:
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"moto server at {self.test_endpoint} did not answer in 60 s"
                    ) from None
                time.sleep(0.1)

    def _probe_nodes(self) -> None:
        """Boot both nodes once, check they are two machines (host names, pid spaces, disks,
        network, S3), and power them off again. Raises :class:`NamespacesRefused` if the host
        refuses."""
        code = (
            "import json, os, socket, sys, urllib.request, urllib.error\n"
            "try:\n"
            "    urllib.request.urlopen(sys.argv[1] + '/moto-api/', timeout=5); s3 = True\n"
            "except urllib.error.HTTPError:\n"
            "    s3 = True\n"
            "except OSError as e:\n"
            "    s3 = repr(e)\n"
            "open(os.path.join(sys.argv[2], 'probe'), 'w').write(socket.gethostname())\n"
            "print(json.dumps({'host': socket.gethostname(), 'pid': os.getpid(), 's3': s3,\n"
            "                  'disk': sorted(os.listdir(sys.argv[2]))}))\n"
        )
        for k, node in self.nodes.items():
            node.boot(f"probe-{k}")
        try:
            for k, node in self.nodes.items():
                log = self.logs / f"probe_{k}.out"
                p = node.spawn(
                    python_cmd("-c", code, self.endpoint, str(self.mount_point)),
                    env=node.env(self.endpoint),
                    log=log,
                )
                p.wait(timeout=60)
                text = log.read_text(errors="replace").strip()
                if p.returncode != 0:
                    raise NamespacesRefused(
                        f"node {k}: a process started with nsenter failed: {text[-1500:]}"
                    )
                self.probe[k] = json.loads(text.splitlines()[-1])
        finally:
            for node in self.nodes.values():
                node.power_off()
        for k, node in self.nodes.items():
            (node.disk / "probe").unlink()

    # --- teardown

    def down(self) -> None:
        """Kill every process this cluster started, delete its links and namespaces. Idempotent."""
        for node in self.nodes.values():
            try:
                node.power_off()
            except Exception:  # noqa: BLE001 - teardown goes on
                pass
            for p in node.procs:
                _killpg(p)
        if self.s3 is not None:
            _killpg(self.s3)
            self.s3 = None
        for link in self._made_links:
            _run("ip", "link", "del", link, check=False)  # gone with its namespace already, usually
        self._made_links = []
        for ns in self._made_ns:
            _run("ip", "netns", "del", ns, check=False)
        self._made_ns = []
