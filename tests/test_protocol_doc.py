"""docs/protocol.md lists every typed wire message with exactly its fields and types.

The message tables are generated from ``edgepipe/net/messages.py`` (``python -m
edgepipe.net.protocol_doc --write``); these tests check the committed doc equals the generated
section, and independently walk every message dataclass and the ``ErrorCode`` enum against
the tables as they read in the doc.
"""

from __future__ import annotations

import re
from dataclasses import MISSING, dataclass

import pytest

from edgepipe.net import messages, protocol_doc
from edgepipe.net.messages import ErrorCode, Wire, header_fields
from edgepipe.net.protocol import MessageType


def doc_text() -> str:
    return protocol_doc.DOC.read_text()


def field_tables(doc: str) -> dict[str, dict[str, tuple[str, str]]]:
    """``### type`` sections of the generated part -> {field: (type, required|optional)}."""
    body = doc[doc.index(protocol_doc.BEGIN):doc.index(protocol_doc.END)]
    tables: dict[str, dict[str, tuple[str, str]]] = {}
    current = None
    for line in body.splitlines():
        if m := re.match(r"^### (\w+)$", line):
            current = tables.setdefault(m.group(1), {})
        elif current is not None and (m := re.match(r"^\| `(\w+)` \| ([^|]+) \| (required|optional) \|", line)):
            current[m.group(1)] = (m.group(2).strip(), m.group(3))
    return tables


def test_committed_doc_is_the_generated_one():
    assert protocol_doc.check() == []
    doc = doc_text()
    assert doc == protocol_doc.splice(doc, protocol_doc.render()), \
        "docs/protocol.md differs from edgepipe/net/messages.py: run python -m edgepipe.net.protocol_doc --write"


def test_every_message_type_is_listed_with_exactly_its_fields():
    tables = field_tables(doc_text())
    classes = [v for v in vars(messages).values() if isinstance(v, type) and issubclass(v, Wire) and v is not Wire]
    assert {cls.TYPE for cls in classes} == set(MessageType)  # one dataclass per message type
    for cls in classes:
        name = cls.TYPE.value
        assert name in tables, f"docs/protocol.md has no section for {name}"
        want = {}
        for f in header_fields(cls):
            required = f.default is MISSING and f.default_factory is MISSING
            parts = [t for t in str(f.type).split(" | ") if t != "None"]
            base = {"str": "string", "float": "number", "dict": "map", "NextHop": "map", "Mapping": "map",  # NextHop travels as a map
                    "tuple[str, ...]": "list"}.get(parts[0], parts[0])
            nullable = "None" in str(f.type).split(" | ")
            want[f.name] = (f"{base} or null" if nullable and required else base, "required" if required else "optional")
        assert tables[name] == want, f"{name}: doc {tables[name]} != dataclass {want}"
    # The summary table names every type once.
    for t in MessageType:
        assert doc_text().count(f"| [`{t.value}`](#{t.value}) |") == 1


def test_every_error_code_is_listed_with_its_retry_rule():
    doc = doc_text()
    for code in ErrorCode:
        row = re.search(rf"^\| `{code.value}` \| (yes|no) \|", doc, re.M)
        assert row, f"error code {code.value} is not in docs/protocol.md"
        assert (row.group(1) == "yes") == (code in messages.RETRYABLE)


def test_a_field_added_without_a_description_is_caught(monkeypatch):
    @dataclass(frozen=True)
    class Bye2(Wire):
        TYPE = MessageType.BYE
        final: bool | None = None
        reason: str | None = None

    monkeypatch.setattr(messages, "Bye", Bye2)
    monkeypatch.setitem(protocol_doc.DOCS, Bye2, protocol_doc.MessageDoc("either", "leaving", {"final": "for good", "gone": "no such field"}))
    problems = protocol_doc.check()
    assert "messages.Bye2.reason is not described in edgepipe/net/protocol_doc.py" in problems
    assert "protocol_doc describes Bye2.gone, which messages.Bye2 lacks" in problems
    with pytest.raises(ValueError, match="reason is not described"):
        protocol_doc.render()


def test_check_mode_fails_on_a_stale_doc(tmp_path, capsys):
    stale = tmp_path / "protocol.md"
    stale.write_text(doc_text().replace("| `final` |", "| `finale` |"))
    assert protocol_doc.main(["--check", "--doc", str(stale)]) == 1
    assert "--write" in capsys.readouterr().err
    assert protocol_doc.main(["--write", "--doc", str(stale)]) == 0
    assert protocol_doc.main(["--check", "--doc", str(stale)]) == 0
    assert stale.read_text() == doc_text()
