"""Test-side helpers around the one cluster launcher (``edgepipe.bench.cluster``): ``Server`` and
``free_port`` are re-exported from there; what only tests need stays here."""

from __future__ import annotations

import contextlib

from edgepipe.bench.cluster import Server, free_port

__all__ = ["Server", "free_port", "remember_device", "server_for"]


def remember_device(home, manifest, identity: list, speed: float = 0.05, overhead_s: float = 0.05) -> None:
    """A calibration for a device (``identity`` as ``WorkerInfo.identity`` gives it), merged into
    the home's calibration file: a coordinator recalls it instead of timing the device again (a
    software GPU or a tab would take minutes). The first plan's stages are still timed."""
    import json

    path = home / "calibrations" / f"{manifest.name}.json"
    data = json.loads(path.read_text()) if path.is_file() else {"model": manifest.name, "devices": []}
    data["devices"] = [row for row in data["devices"] if row["identity"] != identity]
    data["devices"].append({"identity": identity, "speed": speed, "overhead_s": overhead_s, "bandwidth_bytes_per_s": None, "trusted": True})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


@contextlib.contextmanager
def server_for(request, home, workers: int):
    """The session's shared ``serve --workers 3 --placement memory`` for 3, a server of its own otherwise."""
    if workers == 3:
        yield request.getfixturevalue("three_workers")
    else:
        with Server(home, workers=workers, args=("--placement", "memory")) as server:
            yield server
