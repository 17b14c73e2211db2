"""The browser worker reads the protocol's constants from a generated file, kept current (issue 41).

``edgepipe/api/static/protocol.js`` is written from ``net/messages.py``, ``net/protocol.py`` and
``net/limits.py`` by ``python -m edgepipe.net.protocol_js --write``; these tests check the
committed file is the generated one (a field changed in Python fails until it is regenerated),
that it evaluates in JavaScript to the Python values, and that ``worker.js`` no longer writes
message types or error codes by hand.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from edgepipe import PROTOCOL_VERSION
from edgepipe.net import messages, protocol_js
from edgepipe.net.messages import ErrorCode, Wire, header_fields
from edgepipe.net.protocol import MessageType

STATIC = Path(protocol_js.__file__).resolve().parents[1] / "api" / "static"


@pytest.mark.pure
def test_committed_protocol_js_is_the_generated_one():
    assert protocol_js.TARGET == STATIC / "protocol.js"
    assert protocol_js.TARGET.read_text() == protocol_js.render(), \
        "edgepipe/api/static/protocol.js differs from edgepipe/net/messages.py: run python -m edgepipe.net.protocol_js --write"


@pytest.mark.pure
def test_a_changed_message_field_fails_until_regenerated(monkeypatch, tmp_path, capsys):
    stale = tmp_path / "protocol.js"
    stale.write_text(protocol_js.TARGET.read_text())
    assert protocol_js.main(["--check", "--file", str(stale)]) == 0

    @dataclass(frozen=True)
    class Pong2(Wire):  # Pong with a field renamed
        TYPE = MessageType.PONG
        t: float | None = None
        kv_bytes_held: int | None = None

    monkeypatch.setattr(messages, "Pong", Pong2)
    assert protocol_js.constants()["FIELDS"]["pong"] == ["t", "kv_bytes_held"]
    assert protocol_js.main(["--check", "--file", str(stale)]) == 1
    assert "--write" in capsys.readouterr().err
    assert protocol_js.main(["--write", "--file", str(stale)]) == 0
    assert protocol_js.main(["--check", "--file", str(stale)]) == 0
    assert '"pong": ["t", "kv_bytes_held"]' in stale.read_text()


@pytest.mark.pure
def test_every_message_type_and_field_is_in_the_constants():
    c = protocol_js.constants()
    assert c["VERSION"] == PROTOCOL_VERSION
    assert c["MESSAGE"] == {t.name: t.value for t in MessageType}
    assert c["ERROR"] == {e.name: e.value for e in ErrorCode}
    classes = [v for v in vars(messages).values() if isinstance(v, type) and issubclass(v, Wire) and v is not Wire]
    for cls in classes:
        assert c["FIELDS"][cls.TYPE.value] == [f.name for f in header_fields(cls)]
        assert set(c["REQUIRED"][cls.TYPE.value]) <= set(c["FIELDS"][cls.TYPE.value])
    assert "name" in c["REQUIRED"]["hello"] and "device" not in c["REQUIRED"]["hello"]


def test_protocol_js_evaluates_to_the_python_values():
    """The file as JavaScript (node), not only as text: frozen, and equal to the constants."""
    node = shutil.which("node") or shutil.which("nodejs")
    if node is None:
        pytest.skip("no node: the browser tests load protocol.js in chromium instead")
    script = ("global.self = global; require(process.argv[1]); const P = self.EdgepipeProtocol;"
              "if (!Object.isFrozen(P) || !Object.isFrozen(P.FIELDS.hello)) throw new Error('not frozen');"
              "process.stdout.write(JSON.stringify(P));")
    out = subprocess.run([node, "-e", script, str(protocol_js.TARGET)], capture_output=True, text=True, timeout=30, check=True).stdout
    assert json.loads(out) == protocol_js.constants()


@pytest.mark.pure
def test_worker_js_reads_the_constants_rather_than_writing_them():
    js = (STATIC / "worker.js").read_text()
    html = (STATIC / "worker.html").read_text()
    assert html.index('src="/static/protocol.js"') < html.index('src="/static/worker.js"')  # loaded first
    assert "self.EdgepipeProtocol" in js and "const PROTOCOL = 1" not in js
    types = {m.value for m in MessageType}
    literal_types = [name for name in re.findall(r'(?:send\(|case |type: )\s*"(\w+)"', js) if name in types]
    assert literal_types == [], f"worker.js names message types by hand: {literal_types}"
    codes = "|".join(e.value for e in ErrorCode)
    literal_codes = re.findall(rf'(?:,\s*|code:[^,]*)"({codes})"\s*[),}}]', js)  # an argument or a code: field
    assert literal_codes == [], f"worker.js names error codes by hand: {literal_codes}"
    assert "cluster/worker.py" not in js and "edgepipe/worker/core.py" in js  # the header points at the worker that exists
