"""ShapedLink: real network namespaces and a tc-shaped veth. Needs root; no timing asserts."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from fireflyer.testing.netns import ShapedLink, list_namespaces, netns_unavailable_reason

pytestmark = pytest.mark.integration

_REASON = netns_unavailable_reason()
needs_netns = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")

ECHO_SERVER = """
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 5300)); s.listen(1); s.settimeout(20)
print("ready", flush=True)
c, _ = s.accept(); c.settimeout(20)
data = b""
while not data.endswith(b"\\n"):
    chunk = c.recv(65536)
    if not chunk: break
    data += chunk
c.sendall(data); c.close()
"""

ECHO_CLIENT = """
import socket, sys
c = socket.create_connection((sys.argv[1], 5300), timeout=20)
msg = b"y" * 200000 + b"\\n"
c.sendall(msg)
got = b""
while len(got) < len(msg):
    chunk = c.recv(65536)
    if not chunk: break
    got += chunk
print("ok" if got == msg else f"mismatch {len(got)}", flush=True)
"""


def _leftovers(link: ShapedLink) -> tuple[set[str], list[str]]:
    namespaces = set(list_namespaces()) & set(link.names)
    veth_prefix = f"fv{os.getpid():x}-"
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=10).stdout
    veths = [line for line in links.splitlines() if veth_prefix in line]
    return namespaces, veths


@pytest.mark.root
@needs_netns
def test_tcp_echo_across_link() -> None:
    with ShapedLink(rate_mbit=200) as link:
        assert len(set(link.names)) == 2 and str(os.getpid()) in link.names[0]
        assert all(a.startswith("198.18.") or a.startswith("198.19.") for a in link.addrs)
        assert set(link.names) <= set(list_namespaces())
        addrs = link.run(1, ["ip", "-o", "-4", "addr", "show", "dev", link.ifname]).stdout
        assert link.addrs[1] in addrs
        assert "UP" in link.run(0, ["ip", "-o", "link", "show", "lo"]).stdout
        server = link.popen(0, [sys.executable, "-c", ECHO_SERVER, link.addrs[0]],
                            stdout=subprocess.PIPE, text=True)
        assert server.stdout is not None
        assert server.stdout.readline().strip() == "ready"
        client = link.popen(1, [sys.executable, "-c", ECHO_CLIENT, link.addrs[0]],
                            stdout=subprocess.PIPE, text=True)
        out, _ = client.communicate(timeout=60)
        assert out.strip() == "ok"
        assert server.wait(timeout=30) == 0
    assert _leftovers(link) == (set(), [])


@pytest.mark.root
@needs_netns
def test_three_nodes_through_hub() -> None:
    with ShapedLink(rate_mbit=100, nodes=3) as link:
        server = link.popen(2, [sys.executable, "-c", ECHO_SERVER, link.addrs[2]],
                            stdout=subprocess.PIPE, text=True)
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        client = link.popen(0, [sys.executable, "-c", ECHO_CLIENT, link.addrs[2]],
                            stdout=subprocess.PIPE, text=True)
        assert client.communicate(timeout=60)[0].strip() == "ok"
    assert _leftovers(link) == (set(), [])


@pytest.mark.root
@needs_netns
@pytest.mark.parametrize("exc_type", [RuntimeError, KeyboardInterrupt])
def test_teardown_after_exception_kills_children(exc_type: type[BaseException]) -> None:
    link = ShapedLink(rate_mbit=50)
    with pytest.raises(exc_type):
        with link:
            sleeper = link.popen(1, [sys.executable, "-c", "import time; time.sleep(60)"])
            raise exc_type("boom")
    assert sleeper.poll() is not None
    assert _leftovers(link) == (set(), [])
    link.close()  # idempotent


def test_bad_arguments_raise_value_error() -> None:
    for rate in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="rate_mbit"):
            ShapedLink(rate_mbit=rate)
    with pytest.raises(ValueError, match="nodes"):
        ShapedLink(rate_mbit=100, nodes=1)
    with pytest.raises(ValueError, match="delay_ms"):
        ShapedLink(rate_mbit=100, delay_ms=-1)
