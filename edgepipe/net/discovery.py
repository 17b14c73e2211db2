"""Finding a coordinator on the local network by mDNS / DNS-SD (``zeroconf``).

The coordinator advertises ``_edgepipe._tcp.local.`` with its HTTP port; ``edgepipe worker``
started without ``--coordinator`` browses for it and joins the first one that answers.
"""

from __future__ import annotations

import socket
import threading

SERVICE = "_edgepipe._tcp.local."


def advertised_addresses(host: str) -> list[str]:
    if host not in ("0.0.0.0", "::", ""):
        return [host]
    import ifaddr

    return sorted({ip.ip for adapter in ifaddr.get_adapters() for ip in adapter.ips if isinstance(ip.ip, str)}) or ["127.0.0.1"]


def loopback_only(host: str) -> bool:
    """Whether a server bound to ``host`` is reachable from this machine only."""
    import ipaddress

    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name: it may resolve to any interface


def address_for_others(host: str) -> str:
    """The address another machine reaches a server bound to ``host`` at (for a wildcard bind,
    this machine's first address beyond loopback; its name when it has none)."""
    if host not in ("0.0.0.0", "::", ""):
        return f"[{host}]" if ":" in host else host
    beyond = [a for a in advertised_addresses(host) if ":" not in a and not a.startswith("127.")]
    return beyond[0] if beyond else socket.gethostname()


class Advertiser:
    """Registers the coordinator's service while the server runs (asyncio side)."""

    def __init__(self, host: str, port: int, model: str, token_required: bool, cluster: str = "edgepipe"):
        from zeroconf import ServiceInfo

        self.info = ServiceInfo(
            SERVICE, f"edgepipe-{socket.gethostname()}-{port}.{SERVICE}",
            addresses=[socket.inet_aton(a) for a in advertised_addresses(host) if ":" not in a], port=port,
            properties={"path": "/v1/worker", "model": model, "token": "required" if token_required else "none", "cluster": cluster},
        )
        self.zc = None

    async def start(self) -> None:
        from zeroconf.asyncio import AsyncZeroconf

        self.zc = AsyncZeroconf()
        await self.zc.async_register_service(self.info)

    async def stop(self) -> None:
        if self.zc:
            await self.zc.async_unregister_service(self.info)
            await self.zc.async_close()


def find_coordinator(timeout: float = 10.0, cluster: str = "edgepipe") -> str:
    """``http://ip:port`` of the first coordinator of ``cluster`` found; TimeoutError if none answers."""
    from zeroconf import ServiceBrowser, ServiceStateChange, Zeroconf

    found: list[str] = []
    done = threading.Event()
    zc = Zeroconf()

    def on_change(zeroconf, service_type, name, state_change):
        if state_change is not ServiceStateChange.Added or done.is_set():
            return
        info = zeroconf.get_service_info(service_type, name, timeout=3000)
        props = {k.decode(): (v or b"").decode() for k, v in (info.properties or {}).items()} if info else {}
        if info and info.parsed_addresses() and props.get("cluster", "edgepipe") == cluster:
            addresses = info.parsed_addresses()
            local = [a for a in addresses if a.startswith("127.")]
            found.append(f"http://{(local or addresses)[0]}:{info.port}")
            done.set()

    browser = ServiceBrowser(zc, SERVICE, handlers=[on_change])
    try:
        if not done.wait(timeout):
            raise TimeoutError(f"no coordinator of cluster {cluster!r} answered on the local network within {timeout:.0f} s (mDNS {SERVICE})")
        return found[0]
    finally:
        browser.cancel()
        zc.close()
