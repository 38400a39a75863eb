"""Emulated nodes: network namespaces joined by a tc-shaped veth link.

A :class:`ShapedLink` gives each emulated *node* its own network namespace with
one interface (``ifname``) and one address from 198.18.0.0/15 (the range set
aside for benchmarking, RFC 2544). Every node's interface is shaped with a token
bucket (``tc tbf``) to ``rate_mbit`` in each direction, so traffic between nodes
behaves like a NIC of that speed while ranks inside a node still share memory.

Two nodes are joined by one veth pair. More than two hang off a bridge in a hub
namespace, like hosts on a switch; both ends of every veth are shaped, so each
node's NIC is the bottleneck in both directions.

Needs root, ``ip`` and ``tc``. Everything made is removed on exit, also after an
exception or Ctrl-C; processes started with :meth:`ShapedLink.popen` that are still
running at exit are killed first, because a namespace lives as long as its processes.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
from types import TracebackType

from fireflyer.hfreduce.transport.procs import pid_alive
from fireflyer.errors import UserError

CMD_TIMEOUT_S = 10.0
"""Timeout of every ``ip``/``tc`` call."""

_link_seq = itertools.count()
_veth_seq = itertools.count()


def _run(argv: list[str], *, check: bool = True, timeout: float = CMD_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """Run one ``ip``/``tc`` command; on failure raise a RuntimeError naming it and its stderr."""
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"`{' '.join(argv)}` timed out after {timeout:.0f} s") from exc
    except OSError as exc:
        raise RuntimeError(f"`{' '.join(argv)}` could not start: {exc}") from exc
    if check and proc.returncode != 0:
        err = (proc.stderr or proc.stdout).strip().replace("\n", "; ")
        raise RuntimeError(f"`{' '.join(argv)}` failed (exit {proc.returncode}): {err}")
    return proc


def list_namespaces() -> list[str]:
    """Names of the network namespaces that ``ip netns list`` shows."""
    out = _run(["ip", "netns", "list"]).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def netns_unavailable_reason() -> str | None:
    """None if this process can make shaped namespaces; otherwise a one-line reason why not."""
    if os.geteuid() != 0:
        return "network namespaces need root (run as root or under sudo)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found on PATH (install iproute2)"
    probe = f"ffr-probe-{os.getpid()}-{next(_link_seq)}"
    try:
        _run(["ip", "netns", "add", probe])
        _run(["ip", "-n", probe, "link", "set", "lo", "up"])
        _run(["tc", "-n", probe, "qdisc", "add", "dev", "lo", "root", "tbf",
              "rate", "1000mbit", "burst", "64kb", "latency", "10ms"])
    except RuntimeError as exc:
        return f"cannot create a shaped network namespace: {exc}"
    finally:
        _run(["ip", "netns", "del", probe], check=False)
    return None


def remove_stale_namespaces(prefix: str = "ffr") -> list[str]:
    """Delete namespaces ``<prefix>-<pid>-...`` whose creating process is gone (e.g. after SIGKILL)."""
    removed = []
    for name in list_namespaces():
        parts = name.split("-")
        if len(parts) < 3 or parts[0] != prefix or not parts[1].isdigit():
            continue
        pid = int(parts[1])
        if pid == os.getpid() or pid_alive(pid):
            continue
        _run(["ip", "netns", "del", name], check=False)
        removed.append(name)
    return removed


def tbf_params(rate_mbit: float) -> dict[str, int]:
    """Token-bucket sizes that let one TCP flow reach close to ``rate_mbit``.

    The bucket must hold at least one timer tick of traffic plus a few GSO
    super-packets (veth hands tbf up to 64 KiB at once); the queue holds about
    20 ms at line rate, enough for TCP's window to keep the pipe full without
    turning the link into a bufferbloat delay line.
    """
    rate_bps = rate_mbit * 1e6 / 8
    burst = max(256 * 1024, int(rate_bps * 0.002))
    limit = max(2 * burst, int(rate_bps * 0.020))
    return {"rate_bit": int(rate_mbit * 1e6), "burst": burst, "limit": limit}


class ShapedLink:
    """``nodes`` network namespaces, each with one interface shaped to ``rate_mbit`` each way.

    Use as a context manager::

        with ShapedLink(rate_mbit=1000) as link:
            server = link.popen(0, [sys.executable, "server.py", link.addrs[0]])
            client = link.popen(1, [sys.executable, "client.py", link.addrs[0]])
    """

    names: tuple[str, ...]
    addrs: tuple[str, ...]
    ifname: str

    def __init__(self, *, rate_mbit: float, nodes: int = 2, delay_ms: float = 0.0, prefix: str = "ffr") -> None:
        if not isinstance(rate_mbit, (int, float)) or not rate_mbit > 0:
            raise UserError(f"rate_mbit must be a positive number of Mbit/s, got {rate_mbit!r}")
        if not isinstance(nodes, int) or not 2 <= nodes <= 200:
            raise UserError(f"nodes must be an integer in 2..200, got {nodes!r}")
        if not delay_ms >= 0:
            raise UserError(f"delay_ms must be >= 0, got {delay_ms!r}")
        if not prefix or "-" in prefix or not prefix.isascii() or len(prefix) > 8:
            raise UserError(f"prefix must be 1..8 ASCII characters without '-', got {prefix!r}")
        self.rate_mbit = float(rate_mbit)
        self.nodes = nodes
        self.delay_ms = float(delay_ms)
        seq = next(_link_seq)
        base = f"{prefix}-{os.getpid()}-{seq}"
        self.names = tuple(f"{base}-n{i}" for i in range(nodes))
        self.hub = f"{base}-hub" if nodes > 2 else None
        subnet = seq % 256
        self.addrs = tuple(f"198.18.{subnet}.{i + 1}" for i in range(nodes))
        self.ifname = f"{prefix}0"
        self._made_ns: list[str] = []
        self._made_veth: list[str] = []  # root-namespace names at creation time
        self._procs: list[subprocess.Popen] = []
        self._open = False
        self._closed = False

    # -- lifecycle -------------------------------------------------------------

    def __enter__(self) -> ShapedLink:
        self.open()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def open(self) -> None:
        """Create the namespaces, links and shaping. On any failure, undo what was made."""
        if self._open or self._closed:
            raise RuntimeError("a ShapedLink can be opened once")
        self._open = True
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        for name in self.names + ((self.hub,) if self.hub else ()):
            _run(["ip", "netns", "add", name])
            self._made_ns.append(name)
            _run(["ip", "-n", name, "link", "set", "lo", "up"])
        if self.hub is None:
            a, b = self._new_veth_pair()
            self._place(a, self.names[0], self.ifname)
            self._place(b, self.names[1], self.ifname)
        else:
            _run(["ip", "-n", self.hub, "link", "add", "br0", "type", "bridge"])
            _run(["ip", "-n", self.hub, "link", "set", "br0", "up"])
            for i, name in enumerate(self.names):
                a, b = self._new_veth_pair()
                self._place(a, name, self.ifname)
                port = f"p{i}"
                self._place(b, self.hub, port)
                _run(["ip", "-n", self.hub, "link", "set", port, "master", "br0"])
                self._shape(self.hub, port)
        for name, addr in zip(self.names, self.addrs):
            _run(["ip", "-n", name, "addr", "add", f"{addr}/24", "dev", self.ifname])
            self._shape(name, self.ifname)

    def _new_veth_pair(self) -> tuple[str, str]:
        a = f"fv{os.getpid():x}-{next(_veth_seq):x}"
        b = f"fv{os.getpid():x}-{next(_veth_seq):x}"
        assert len(a) <= 15 and len(b) <= 15, (a, b)
        _run(["ip", "link", "add", a, "type", "veth", "peer", "name", b])
        self._made_veth.append(a)
        return a, b

    def _place(self, dev: str, ns: str, new_name: str) -> None:
        _run(["ip", "link", "set", dev, "netns", ns])
        _run(["ip", "-n", ns, "link", "set", dev, "name", new_name])
        _run(["ip", "-n", ns, "link", "set", new_name, "up"])

    def _shape(self, ns: str, dev: str) -> None:
        p = tbf_params(self.rate_mbit)
        _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "tbf",
              "rate", f"{p['rate_bit']}bit", "burst", str(p["burst"]), "limit", str(p["limit"])])
        if self.delay_ms > 0:
            # Needs the sch_netem kernel module; the error names the command if it is missing.
            _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:",
                  "netem", "delay", f"{self.delay_ms}ms"])

    def close(self) -> None:
        """Kill leftover children, delete every namespace and veth made. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._kill_children()
        for name in reversed(self._made_ns):
            _run(["ip", "netns", "del", name], check=False)
        for dev in self._made_veth:
            # Only left in the root namespace when creation stopped before moving it.
            if _run(["ip", "link", "show", dev], check=False).returncode == 0:
                _run(["ip", "link", "del", dev], check=False)
        self._made_ns.clear()
        self._made_veth.clear()

    def _kill_children(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                try:
                    proc.send_signal(signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in self._procs:
            try:
                proc.wait(timeout=CMD_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pass
        self._procs.clear()

    # -- use -------------------------------------------------------------------

    def exec_prefix(self, index: int) -> list[str]:
        """The argv prefix that runs a command inside namespace ``index``."""
        if not self._open or self._closed:
            raise RuntimeError("the ShapedLink is not open; use it inside `with ShapedLink(...)`")
        if not 0 <= index < self.nodes:
            raise IndexError(f"namespace index {index} is outside 0..{self.nodes - 1}")
        return [shutil.which("ip") or "ip", "netns", "exec", self.names[index]]

    def popen(self, index: int, argv: list[str], env: dict[str, str] | None = None,
              **kw: object) -> subprocess.Popen:
        """Start ``argv`` inside namespace ``index``; keyword arguments go to ``subprocess.Popen``."""
        proc = subprocess.Popen(self.exec_prefix(index) + list(argv), env=env, **kw)  # type: ignore[call-overload]
        self._procs.append(proc)
        return proc

    def run(self, index: int, argv: list[str], *, timeout: float = CMD_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
        """Run a short command inside namespace ``index`` and return its output; raises on failure."""
        return _run(self.exec_prefix(index) + list(argv), timeout=timeout)

    def __repr__(self) -> str:
        return f"ShapedLink(rate_mbit={self.rate_mbit:g}, nodes={self.nodes}, names={self.names})"
