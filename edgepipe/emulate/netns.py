"""Kernel rate caps for emulated devices: one network namespace and veth pair per device.

Owns creating and tearing down ``ep-<name>`` namespaces, their 10.213.0.0/16 addresses and the
``tbf`` qdiscs that cap each end's egress (``shape_by_port``: one rate for a coordinator's port,
another for the rest), and running processes inside them. Needs root and
iproute2; without them it raises ``EmulationUnavailable``. The kernel here has no ``netem``, so
delay and loss come from ``edgepipe.emulate.shaper.DelayRelay`` placed in front of the device.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import subprocess
from typing import Any, ClassVar, Sequence

from edgepipe.emulate.shaper import format_rate, parse_rate

NAMESPACE_PREFIX = "ep-"
# Only addresses in this private block are ever assigned, so emulation cannot shadow a real network.
EMULATION_NETWORK = ipaddress.ip_network("10.213.0.0/16")
# Interface names are at most 15 bytes: "ep-" + name + "-h".
_NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9-]{0,9}$")
_STOP_TIMEOUT_S = 5.0


class EmulationUnavailable(RuntimeError):
    """This machine or user cannot create namespaces or qdiscs (not root, no iproute2, ...)."""


class NetnsCommandFailed(RuntimeError):
    """An ``ip`` or ``tc`` command failed while building or using an emulated host."""


def unavailable_reason(need_tc: bool = True) -> str | None:
    """Why kernel network emulation cannot run here, or None when it can (as far as can be told)."""
    if os.geteuid() != 0:
        return f"network namespaces need root (running as uid {os.geteuid()})"
    if shutil.which("ip") is None:
        return "the 'ip' binary (iproute2) is not on PATH"
    if need_tc and shutil.which("tc") is None:
        return "the 'tc' binary (iproute2) is not on PATH"
    return None


def require_netns(need_tc: bool = True) -> None:
    """Raise ``EmulationUnavailable`` with the reason when kernel emulation cannot run here."""
    reason = unavailable_reason(need_tc)
    if reason is not None:
        raise EmulationUnavailable(reason)


def namespace_name(name: str) -> str:
    """The namespace an emulated host called ``name`` lives in."""
    return NAMESPACE_PREFIX + name


def list_namespaces(prefix: str = NAMESPACE_PREFIX) -> list[str]:
    """Names of the existing network namespaces that start with ``prefix``, sorted."""
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    names = (line.split()[0] for line in listing.stdout.splitlines() if line.strip())
    return sorted(name for name in names if name.startswith(prefix))


def link_exists(interface: str, namespace: str | None = None) -> bool:
    """Whether ``interface`` exists in ``namespace`` (None: the root namespace)."""
    in_namespace = [] if namespace is None else ["-n", namespace]
    shown = subprocess.run(["ip", *in_namespace, "link", "show", interface], capture_output=True, check=False)
    return shown.returncode == 0


def remove_leftovers(name: str) -> None:
    """Delete the veth pair and namespace of host ``name`` if a crashed run left them; idempotent."""
    host_veth = f"{namespace_name(name)}-h"
    if link_exists(host_veth):
        # Deleting one end removes both at once; leaving it to namespace teardown is asynchronous.
        subprocess.run(["ip", "link", "del", host_veth], capture_output=True, check=False)
    if namespace_name(name) in list_namespaces():
        subprocess.run(["ip", "netns", "del", namespace_name(name)], capture_output=True, check=False)


def tbf_burst_bytes(rate_bytes_per_s: float) -> int:
    """A ``tbf`` burst: 10 ms at the rate, and never below ten full-size Ethernet frames."""
    return int(max(10 * 1514, rate_bytes_per_s / 100))


class NetnsHost:
    """An emulated device's network: namespace ``ep-<name>`` joined to the root one by a veth pair.

    ``ip`` is the address inside the namespace, ``peer_ip`` the root-namespace end; both must lie
    in one ``/prefix_len`` subnet of 10.213.0.0/16. With ``rate`` (``"1mbit"``, ``"128KB/s"``, see
    ``parse_rate``) each end's egress is capped by a ``tbf`` qdisc, so both directions are shaped.
    Use as a context manager: entering builds it (removing leftovers of a crashed run with the
    same name first), leaving stops the processes ``popen`` started and removes it all.
    """

    emulated: ClassVar[bool] = True

    def __init__(
        self,
        name: str,
        ip: str,
        peer_ip: str,
        rate: str | float | None = None,
        prefix_len: int = 30,
        tbf_latency_ms: float = 100,
    ) -> None:
        if not _NAME_PATTERN.match(name):
            raise ValueError(f"host name {name!r} must be 1-10 characters of [a-z0-9-], starting alphanumeric")
        inside = ipaddress.ip_interface(f"{ip}/{prefix_len}")
        outside = ipaddress.ip_interface(f"{peer_ip}/{prefix_len}")
        for role, interface in (("ip", inside), ("peer_ip", outside)):
            if interface.ip not in EMULATION_NETWORK or not interface.network.subnet_of(EMULATION_NETWORK):
                raise ValueError(f"{role} {interface} must lie in {EMULATION_NETWORK}, the emulation block")
        if inside.network != outside.network:
            raise ValueError(f"ip {inside} and peer_ip {outside} are not in one /{prefix_len} subnet")
        if inside.ip == outside.ip:
            raise ValueError(f"ip and peer_ip are both {inside.ip}")
        if inside.network.prefixlen < 31:
            reserved = {inside.network.network_address, inside.network.broadcast_address}
            for role, interface in (("ip", inside), ("peer_ip", outside)):
                if interface.ip in reserved:
                    raise ValueError(
                        f"{role} {interface.ip} is the network or broadcast address of {inside.network}"
                    )
        if not tbf_latency_ms > 0:
            raise ValueError(f"tbf_latency_ms must be positive, got {tbf_latency_ms}")
        self.name = name
        self.ip = str(inside.ip)
        self.peer_ip = str(outside.ip)
        self.prefix_len = prefix_len
        self.rate_bytes_per_s = None if rate is None else parse_rate(rate)
        self.tbf_latency_ms = tbf_latency_ms
        self._processes: list[subprocess.Popen] = []

    @property
    def namespace(self) -> str:
        return namespace_name(self.name)

    @property
    def host_veth(self) -> str:
        """The veth end in the root namespace (its egress is traffic into the device)."""
        return f"{self.namespace}-h"

    @property
    def device_veth(self) -> str:
        """The veth end inside the namespace (its egress is traffic out of the device)."""
        return f"{self.namespace}-n"

    @property
    def exec_prefix(self) -> list[str]:
        """Prepend to an argv to run it inside the namespace."""
        return ["ip", "netns", "exec", self.namespace]

    def label(self) -> str:
        rate = "unlimited rate" if self.rate_bytes_per_s is None else format_rate(self.rate_bytes_per_s)
        return f"emulated host {self.namespace} at {self.ip} ({rate}, kernel tbf)"

    def __enter__(self) -> "NetnsHost":
        require_netns(need_tc=self.rate_bytes_per_s is not None)
        remove_leftovers(self.name)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def popen(self, argv: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` inside the namespace; it is stopped when the host closes."""
        process = subprocess.Popen([*self.exec_prefix, *argv], **popen_kwargs)
        self._processes.append(process)
        return process

    def run(self, argv: Sequence[str], check: bool = True, **run_kwargs: Any) -> subprocess.CompletedProcess:
        """Run ``argv`` inside the namespace to completion."""
        return subprocess.run([*self.exec_prefix, *argv], check=check, **run_kwargs)

    def close(self) -> None:
        """Stop started processes, then delete the veth pair and the namespace; idempotent."""
        for process in self._processes:
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(_STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
            for stream in (process.stdin, process.stdout, process.stderr):
                if stream is not None:
                    stream.close()
        self._processes.clear()
        remove_leftovers(self.name)

    def _build(self) -> None:
        try:
            _run(["ip", "netns", "add", self.namespace])
        except NetnsCommandFailed as failure:
            if "permitted" in str(failure) or "denied" in str(failure):
                raise EmulationUnavailable(f"cannot create network namespaces here: {failure}") from failure
            raise
        _run(["ip", "link", "add", self.host_veth, "type", "veth",
              "peer", "name", self.device_veth, "netns", self.namespace])
        _run(["ip", "addr", "add", f"{self.peer_ip}/{self.prefix_len}", "dev", self.host_veth])
        _run(["ip", "link", "set", self.host_veth, "up"])
        _run(["ip", "-n", self.namespace, "addr", "add", f"{self.ip}/{self.prefix_len}", "dev", self.device_veth])
        _run(["ip", "-n", self.namespace, "link", "set", self.device_veth, "up"])
        _run(["ip", "-n", self.namespace, "link", "set", "lo", "up"])
        if self.rate_bytes_per_s is not None:
            tbf = self._tbf_arguments()
            _run(["tc", "qdisc", "add", "dev", self.host_veth, "root", *tbf])
            _run([*self.exec_prefix, "tc", "qdisc", "add", "dev", self.device_veth, "root", *tbf])

    def _tbf_arguments(self) -> list[str]:
        assert self.rate_bytes_per_s is not None
        return [
            "tbf",
            "rate", f"{round(self.rate_bytes_per_s * 8)}bit",
            "burst", str(tbf_burst_bytes(self.rate_bytes_per_s)),
            "latency", f"{self.tbf_latency_ms:g}ms",
        ]


SHAPED_MTU = 576  # a 2.3 KB activation is several frames, each waiting for its tokens


def shape_by_port(host: NetnsHost, port: int, port_rate: str | float, other_rate: str | float, mtu: int = SHAPED_MTU) -> None:
    """Cap ``host``'s traffic to or from root-namespace ``port`` (a coordinator's) at ``port_rate``
    and everything else (other workers' data ports) at ``other_rate``, both directions.

    Each veth end gets an ``htb`` root whose two classes only sort (u32 on the port: ``dport`` on
    the device's end, ``sport`` on the host's end, since each end shapes only what it sends) and a
    ``tbf`` in each class that shapes. An htb class rate alone does not: veth hands the qdisc GSO
    super-packets of up to 64 KB (there is no ethtool here to turn GSO off), htb lets one through
    whenever its class has any tokens and bills it afterwards, so short transfers ran at 1.4x the
    rate. tbf splits a GSO packet larger than its burst into MTU segments before queueing. Rates
    count whole Ethernet frames: through MTU 576 a TCP payload gets 524/590 of them.
    """
    rates = {1: parse_rate(port_rate), 2: parse_rate(other_rate)}
    for dev, prefix, field in ((host.host_veth, [], "sport"), (host.device_veth, host.exec_prefix, "dport")):
        _run([*prefix, "ip", "link", "set", "dev", dev, "mtu", str(mtu)])
        _run([*prefix, "tc", "qdisc", "replace", "dev", dev, "root", "handle", "1:", "htb", "default", "2"])
        for cls, rate in rates.items():
            _run([*prefix, "tc", "class", "add", "dev", dev, "parent", "1:", "classid", f"1:{cls}", "htb", "rate", "1gbit",
                  "quantum", "1514"])
            burst = int(max(mtu + 24, rate / 1000))  # one frame at low rates, 1 ms at high ones
            _run([*prefix, "tc", "qdisc", "add", "dev", dev, "parent", f"1:{cls}", "handle", f"{cls}0:", "tbf", "rate",
                  f"{round(rate * 8)}bit", "burst", str(burst), "latency", "2000ms"])
        _run([*prefix, "tc", "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32", "match", "ip",
              field, str(port), "0xffff", "flowid", "1:1"])


def port_shaped_bytes(host: NetnsHost) -> dict[str, dict[str, int]]:
    """Bytes each class of ``shape_by_port`` passed: {"into"|"out of": {"port"|"other": bytes}}."""
    import json

    out = {}
    for dev, prefix, way in ((host.host_veth, [], "into"), (host.device_veth, host.exec_prefix, "out of")):
        shown = subprocess.run([*prefix, "tc", "-s", "-j", "qdisc", "show", "dev", dev], capture_output=True, text=True, check=False)
        try:
            rows = json.loads(shown.stdout or "[]")
        except ValueError:
            continue
        names = {"10:": "port", "20:": "other"}
        out[way] = {names[r["handle"]]: int(r.get("bytes", 0)) for r in rows if r.get("kind") == "tbf" and r.get("handle") in names}
    return out


def _run(argv: list[str]) -> None:
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise NetnsCommandFailed(f"'{' '.join(argv)}' failed ({result.returncode}): {result.stderr.strip()}")
