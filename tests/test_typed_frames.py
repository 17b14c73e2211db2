"""No raw-dict protocol access outside the message module (issue 28).

Frames are typed once where they enter (``net.messages.parse``) and built through the ``Wire``
classes' ``to_message``, so a field's name and type live in one place. This reads the source of
``edgepipe/{cluster,worker,api}`` and ``edgepipe/serve.py`` (an AST walk, not a text grep) for
the ways a ``net.protocol.Message`` can still be read or built by hand:

- a call of ``Message(...)`` (a raw build), where ``Message`` is ``net.protocol``'s (the API's
  own chat ``Message`` models are other classes);
- ``.fields`` (the raw header dict);
- a subscript or ``.get(...)`` on a ``Message``: on a name bound to ``decode(...)`` or
  ``Message(...)`` or a parameter annotated ``Message``, on ``decode(...)`` itself, or on an
  attribute that a class of these packages annotates ``Message`` (a command's ``msg``).

The check is proved to bite on a snippet with each pattern.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.pure  # no process, no model: source reading only

ROOT = Path(__file__).resolve().parent.parent / "edgepipe"
SCANNED = sorted([*(ROOT / "cluster").rglob("*.py"), *(ROOT / "worker").rglob("*.py"), *(ROOT / "api").rglob("*.py"), ROOT / "serve.py"])
# Builds that must stay raw, with the reason: frames no Wire class may express.
ALLOWED_BUILDS = {("cluster/simulation/sim.py", "bad_frame"): "the simulation's malformed frames (out-of-range ids, NaN) test the coordinator's checks"}


def _protocol_names(tree: ast.Module) -> tuple[set[str], set[str], set[str]]:
    """Local names of net.protocol's Message and decode, and names the module itself is bound to."""
    message, decode, module = set(), set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            mod = node.module
            if mod == "protocol" or mod.endswith("net.protocol"):
                for alias in node.names:
                    if alias.name == "Message":
                        message.add(alias.asname or alias.name)
                    elif alias.name == "decode":
                        decode.add(alias.asname or alias.name)
            elif mod == "net" or mod.endswith(".net") or mod == "edgepipe.net":
                module |= {a.asname or a.name for a in node.names if a.name == "protocol"}
    return message, decode, module


def _is(node: ast.AST, names: set[str], module: set[str], attr: str) -> bool:
    """``node`` names the protocol's ``attr`` (a bare imported name or ``protocol.attr``)."""
    if isinstance(node, ast.Name):
        return node.id in names
    return isinstance(node, ast.Attribute) and node.attr == attr and isinstance(node.value, ast.Name) and node.value.id in module


def _annotated_message_attrs(trees: dict[str, ast.Module]) -> set[str]:
    """Attribute names that a class in the scanned packages annotates exactly ``Message``."""
    out = set()
    for tree in trees.values():
        message, _, module = _protocol_names(tree)
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            for stmt in cls.body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and _is(stmt.annotation, message, module, "Message"):
                    out.add(stmt.target.id)
    return out


def raw_access(source: str, where: str, message_attrs: set[str] = frozenset()) -> list[str]:
    """Every raw read or build of a protocol ``Message`` in ``source``, as ``where:line: what``."""
    tree = ast.parse(source)
    message, decode, module = _protocol_names(tree)
    found: list[str] = []

    def is_message(node: ast.AST, bound: set[str]) -> bool:
        if isinstance(node, ast.Name):
            return node.id in bound
        if isinstance(node, ast.Call):
            return _is(node.func, decode, module, "decode") or _is(node.func, message, module, "Message")
        return isinstance(node, ast.Attribute) and node.attr in message_attrs

    def visit(scope: ast.AST, name: str, bound: set[str]) -> None:
        bound = set(bound)
        if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = scope.args
            for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
                if arg.annotation is not None and _is(arg.annotation, message, module, "Message"):
                    bound.add(arg.arg)
        body = list(ast.iter_child_nodes(scope))
        # names bound to a Message anywhere in this scope (not nested scopes): assignment order does not matter here
        for node in _walk_scope(body):
            if isinstance(node, ast.Assign) and is_message(node.value, bound):
                bound |= {t.id for t in node.targets if isinstance(t, ast.Name)}
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and (
                    _is(node.annotation, message, module, "Message") or (node.value is not None and is_message(node.value, bound))):
                bound.add(node.target.id)
        for node in _walk_scope(body):
            line = f"{where}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Call) and _is(node.func, message, module, "Message") and (where, name) not in ALLOWED_BUILDS:
                found.append(f"{line}: Message(...) built by hand (use the Wire class's to_message)")
            elif isinstance(node, ast.Attribute) and node.attr == "fields" and isinstance(node.ctx, ast.Load):
                found.append(f"{line}: .fields read (the raw header dict)")
            elif isinstance(node, ast.Subscript) and is_message(node.value, bound):
                found.append(f"{line}: a Message subscripted (read the typed message from parse)")
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                  and is_message(node.func.value, bound)):
                found.append(f"{line}: Message.get (read the typed message from parse)")
        for node in _walk_scope(body, nested=True):
            visit(node, node.name if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else name, bound)

    visit(tree, "", set())
    return found


def _walk_scope(nodes: list[ast.AST], nested: bool = False):
    """The nodes of one scope (``nested``: the function and class definitions directly inside it instead)."""
    stack = list(nodes)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):  # a lambda's body is read with its scope
            if nested:
                yield node
            continue
        if not nested:
            yield node
        stack.extend(ast.iter_child_nodes(node))


def test_no_raw_protocol_access_in_the_cluster_worker_and_api():
    assert len(SCANNED) > 40 and all(p.is_file() for p in SCANNED)
    trees = {str(p.relative_to(ROOT)): ast.parse(p.read_text()) for p in SCANNED}
    attrs = _annotated_message_attrs(trees)
    assert "msg" in attrs  # the worker core's SendControl.msg: a built frame, read by no one but the encoder
    found = [hit for p in SCANNED for hit in raw_access(p.read_text(), str(p.relative_to(ROOT)), attrs)]
    assert found == [], "raw protocol access outside edgepipe/net/messages.py:\n" + "\n".join(found)


def test_the_check_finds_each_raw_pattern():
    source = '''
from ..net import protocol
from ..net.protocol import Message as M, MessageType as T, decode


class Command:
    msg: M


def reads(raw, cmd: Command, given: M):
    msg = decode(raw)
    a = msg["plan"]
    b = msg.get("batch")
    c = decode(raw).get("x")
    d = given["seq"]
    e = cmd.msg["ok"]
    f = msg.fields
    g = protocol.decode(raw)["move"]
    return M(T.PING, {"t": 1.0})


def fine(typed, items):
    return typed.plan, items.get("seq"), {"a": 1}["a"]
'''
    found = raw_access(source, "x.py", {"msg"})
    assert sorted(int(hit.split(":")[1]) for hit in found) == [12, 13, 14, 15, 16, 17, 18, 19], found


def test_the_drafter_answers_with_typed_drafted_frames():
    """The drafter role builds its answers as ``Drafted`` (a fake draft model: no model, no process)."""
    import asyncio

    import numpy as np

    from edgepipe.net.messages import Draft, Drafted, parse
    from edgepipe.worker.drafter import UNKNOWN, DrafterRole

    class FakeDrafter:
        def prime(self, seq, ids):
            self.primed = (seq, list(ids))

        def draft(self, seq, ids, k, params, step):
            return [len(ids) + i for i in range(k)]

    sent = []

    async def send(message):
        sent.append(parse(message))

    async def play():
        role = DrafterRole(None, None, send, threads=1)
        await role.draft(Draft(1, "s", 0, 2, 0), np.array([3, 4], np.int32))  # no draft model yet
        role.drafter = FakeDrafter()
        await role.draft(Draft(2, "s", 5, 2, 0), None)  # keeps 5 ids it never had
        await role.draft(Draft(3, "s", 0, 0, 0), np.array([3, 4], np.int32))  # a prompt: primed only
        await role.draft(Draft(4, "s", 2, 3, 2), np.array([7], np.int32))
        role.close()

    asyncio.run(play())
    assert [type(m) for m in sent] == [Drafted] * 4
    assert (sent[0].ok, sent[0].error) == (False, "no draft model loaded") and (sent[1].ok, sent[1].error) == (False, UNKNOWN)
    assert sent[2].ok and sent[2].tokens == [] and sent[2].compute_s >= 0
    assert (sent[3].id, sent[3].tokens) == (4, [3, 4, 5]) and sent[3].compute_s >= 0
