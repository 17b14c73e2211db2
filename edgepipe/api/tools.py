"""Chats with tools: rendering through the model's template, and tool calls parsed from the output.

Pure functions. The calls are written in the Hermes / Qwen convention that most open chat
templates use: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``. A template that knows
``tools`` (Qwen2.5, Llama 3.1, Hermes...) gets them as the ``tools`` variable, as Hugging Face's
``apply_chat_template`` passes them; a template that does not (SmolLM2) gets them described in a
system message in the same convention. ``tool_choice`` "required" or a named function is honoured by
starting the assistant's turn with the opening of the call (so the model only writes the rest);
"none" leaves the tools out.

:func:`call_grammar` holds the calls to the tools' ``parameters`` schemas (compiled by
``api.structured``, as ``response_format``): a named or required call is generated under it
from its first token, so its arguments always parse and validate; with "auto" the grammar is lazy,
starting where the model opens a call (``<tool_call>``). Several calls in one answer: "auto" lets
the model write as many as it likes; "required" only with ``parallel_tool_calls: true`` (the
default, as llama-server's, is one call: a small model left free to go on calling may be cut by
``max_tokens`` inside its last call).

Under "auto" a model may also write its call as the bare JSON the tools describe, without the
markers (Qwen2.5-Coder writes ``{"name": ..., "arguments": {...}}``, fenced as ```json or bare):
such an object (or a list of them) is a call when, as in Ollama's parser, its ``name`` is a
declared tool and its ``arguments`` validate against that tool's ``parameters`` schema
(:func:`text_calls`); anything else stays text. While streaming, text that may open such a call
(a fence whose block starts with ``{`` or ``[``, or a line that does) is held until the end.

Where the markers are single special tokens (Qwen2.5's ``<tool_call>``, ``</tool_call>``), the
tokenizer's decode drops them; :func:`decoder` writes them as their text so that streaming and
parsing see the calls, and the grammar accepts the token as well as the spelled-out text.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from datetime import date
from typing import Literal

from .structured import embedded_schema

OPEN, CLOSE = "<tool_call>", "</tool_call>"
CALL_START, CALL_MIDDLE = '{"name": "', '", "arguments": '  # a call's JSON up to its name, and from the name to the arguments


ToolMode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True)
class ChatPrompt:
    text: str  # the rendered prompt, ending where the model starts writing
    forced: str = ""  # what the assistant's turn was started with (part of the output, not yet a call)
    tool_names: tuple[str, ...] = ()
    stop: tuple[str, ...] = ()  # extra stop strings
    mode: ToolMode = "none"  # how tool_choice shaped the turn (``call_grammar``)
    named: str | None = None  # the function a named tool_choice forces
    schemas: tuple[tuple[str, str], ...] = ()  # (name, JSON text of its parameters schema) per tool: text_calls' check


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None
    tool_calls: list[dict] = field(default_factory=list)


def template_messages(messages, template_knows_tools: bool) -> list[dict]:
    """Plain dicts for the template: content never None, tool calls with arguments as objects."""
    out = []
    for m in messages:
        role = "system" if m.role == "developer" else m.role
        d = {"role": role, "content": m.text()}
        if m.tool_calls:
            calls = [{"name": c.function.name, "arguments": _as_object(c.function.arguments)} for c in m.tool_calls]
            if template_knows_tools:
                d["tool_calls"] = [{"id": c.id, "type": "function", "function": call} for c, call in zip(m.tool_calls, calls)]
            else:
                d["content"] = (d["content"] + "\n" if d["content"] else "") + "\n".join(
                    f"{OPEN}\n{json.dumps(call)}\n{CLOSE}" for call in calls)
        if role == "tool":
            if template_knows_tools:
                d["tool_call_id"] = m.tool_call_id or ""
            else:
                d = {"role": "user", "content": f"<tool_response>\n{d['content']}\n</tool_response>"}
        if m.name:
            d["name"] = m.name
        out.append(d)
    return out


def tools_system_text(tools: list[dict]) -> str:
    lines = "\n".join(json.dumps(t) for t in tools)
    return ("You may call one or more functions to assist with the user query.\n\n"
            f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{lines}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
            'XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def render(chat_template: str | None, format_chat, messages, tools, tool_choice) -> ChatPrompt:
    """The prompt for ``messages`` (pydantic ``ChatMessage``) with ``tools`` (pydantic ``Tool``) under ``tool_choice``."""
    knows_tools = bool(chat_template) and "tools" in chat_template
    use_tools = bool(tools) and tool_choice != "none"
    msgs = template_messages(messages, knows_tools)
    tool_dicts = [t.model_dump(exclude_none=True) for t in tools or []] if use_tools else []
    if tool_dicts and knows_tools:
        text = _render(chat_template, msgs, tool_dicts)
    else:
        if tool_dicts:
            system = tools_system_text(tool_dicts)
            if msgs and msgs[0]["role"] == "system":
                msgs[0] = {**msgs[0], "content": msgs[0]["content"] + "\n\n" + system}
            else:
                msgs.insert(0, {"role": "system", "content": system})
        text = format_chat(msgs)
    names = tuple(t["function"]["name"] for t in tool_dicts)
    forced, mode, named = "", "auto" if tool_dicts else "none", None
    if tool_dicts and not isinstance(tool_choice, str) and tool_choice is not None:
        named, mode = tool_choice.function.name, "named"
        forced = f'{OPEN}\n{{"name": {json.dumps(named)}, "arguments": '
    elif tool_dicts and tool_choice == "required":
        forced, mode = f'{OPEN}\n{{"name": "', "required"
    schemas = tuple((t["function"]["name"], json.dumps(t["function"].get("parameters") or {"type": "object"})) for t in tool_dicts)
    return ChatPrompt(text + forced, forced, names, mode=mode, named=named, schemas=schemas)


def special_markers(tok) -> dict[int, str]:
    """Token id -> text of the markers that are one special token of ``tok`` (a ``TextTokenizer``),
    which its decode drops (Qwen2.5's); empty when they are ordinary text (SmolLM2's)."""
    out = {}
    for text in (OPEN, CLOSE):
        token = tok.tokenizer.token_to_id(text)
        if token is not None and tok.decode([token]) == "":
            out[token] = text
    return out


def decoder(tok, prompt: ChatPrompt | None):
    """The decode for a sequence of this turn: ``tok.decode``, writing special-token markers as their text when tools are on."""
    markers = special_markers(tok) if prompt is not None and prompt.tool_names else {}
    if not markers:
        return tok.decode

    def decode(ids: list[int]) -> str:
        parts, start = [], 0
        for k, token in enumerate(ids):
            if token in markers:
                parts += [tok.decode(ids[start:k]), markers[token]]
                start = k + 1
        parts.append(tok.decode(ids[start:]))
        return "".join(parts)

    return decode


def call_grammar(tools, prompt: ChatPrompt, parallel: bool, markers: dict[int, str] | None = None) -> tuple[str, str | None] | None:
    """(Lark grammar, trigger) holding ``prompt``'s tool calls to the ``tools``' (pydantic ``Tool``)
    parameter schemas, continuing from ``prompt.forced``; the trigger (``<tool_call>``) makes it
    lazy ("auto"). ``markers`` (:func:`special_markers`): the markers' special tokens, accepted
    beside their text. None when the turn has no tools. ``SchemaError`` names a schema that cannot be used."""
    special = {text: token for token, text in (markers or {}).items()}

    def marker(text: str) -> str:
        return f"({_lit(text)} | <[{special[text]}]>)" if text in special else _lit(text)

    if prompt.mode == "none":
        return None
    by_name = {t.function.name: t.function for t in tools}
    order = [name for name in prompt.tool_names if name in by_name]
    rules = []
    for i, name in enumerate(order):
        fn = by_name[name]
        schema = fn.parameters if fn.parameters is not None else {"type": "object", "properties": {}}
        rules.append(f"args_{i}: %json {embedded_schema(schema, bool(fn.strict))}")
        rules.append(f"fn_{i}: {_lit(name + CALL_MIDDLE)} args_{i} {_lit('}')}")
    rules.append("fns: " + " | ".join(f"fn_{i}" for i in range(len(order))))
    rules.append(f"call: {_lit(CALL_START)} fns")
    if prompt.mode == "named":
        start = f"args_{order.index(prompt.named)} {_lit('}')}"
    elif prompt.mode == "required":
        between = f"{_lit(chr(10))} {marker(CLOSE)} {_lit(chr(10))} {marker(OPEN)} {_lit(chr(10))}"
        start = f"fns ({between} call)*" if parallel else "fns"
    else:  # after the trigger, as the Hermes convention writes a call
        start = f"{_lit(chr(10))}? call {_lit(chr(10))}? {marker(CLOSE)}"
    return "\n".join([f"start: {start}", *rules]) + "\n", (OPEN if prompt.mode == "auto" else None)


def _lit(text: str) -> str:
    """A Lark string literal (the names and markers are ASCII; JSON's escapes are Lark's)."""
    return json.dumps(text)


def _render(chat_template: str, messages: list[dict], tools: list[dict]) -> str:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ValueError(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: date.today().strftime(fmt)
    return env.from_string(chat_template).render(messages=messages, tools=tools, add_generation_prompt=True, bos_token="",
                                                 eos_token="")


def parse(output: str, prompt: ChatPrompt) -> ParsedOutput:
    """Content and tool calls of a finished answer (``output``: what the model wrote after ``prompt.forced``)."""
    text = prompt.forced + output
    if not prompt.tool_names:
        return ParsedOutput(text)
    if OPEN not in text:
        return (text_calls(text, prompt) if prompt.mode == "auto" else None) or ParsedOutput(text)
    calls, content, rest = [], [], text
    while OPEN in rest:
        before, _, after = rest.partition(OPEN)
        content.append(before)
        obj, source = _first_object(after.lstrip())
        if isinstance(obj, dict):  # the call's JSON (whatever its strings hold), then its closing tag if written
            body, rest = source, after.lstrip()[len(source):]
            closed = CLOSE if rest.lstrip().startswith(CLOSE) else ""
            rest = rest.lstrip()[len(CLOSE):] if closed else rest
        else:
            body, closed, rest = after.partition(CLOSE)
        call = _call(body, prompt.tool_names)
        if call is None:  # not a call after all: keep it as text
            content.append(OPEN + body + closed)
        else:
            calls.append(call)
    content.append(rest)
    text_part = "".join(content).strip()
    return ParsedOutput(text_part or None, calls)


_FENCE = "```"


def text_calls(text: str, prompt: ChatPrompt) -> ParsedOutput | None:
    """The calls ``text`` writes as bare JSON (fenced or not), without the markers; None when it
    writes none. A JSON object is a call when its ``name`` is one of the prompt's tools and its
    ``arguments`` (or ``parameters``) are an object that validates against that tool's schema; a
    list counts when every item is one. The content is the text around the calls (a fence that
    held only calls goes with them), None when nothing else was written."""
    schemas = dict(prompt.schemas)
    calls, keep, at = [], [], 0
    for start, end, value in _json_values(text):
        items = value if isinstance(value, list) else [value]
        found = [_checked_call(item, schemas) for item in items]
        if not items or any(f is None for f in found):
            continue
        calls += found
        start, end = _with_fence(text, start, end)
        keep.append(text[at:start])
        at = end
    if not calls:
        return None
    keep.append(text[at:])
    content = "".join(keep).strip()
    return ParsedOutput(content or None, calls)


def _checked_call(item, schemas: dict[str, str]) -> dict | None:
    """``item`` as a call of a declared tool whose arguments validate against its schema, else None."""
    if not isinstance(item, dict) or not isinstance(item.get("name"), str) or item["name"] not in schemas:
        return None
    args = item.get("arguments", item.get("parameters"))
    if isinstance(args, str):  # the OpenAI wire form: arguments as JSON text
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict) or set(item) - {"name", "arguments", "parameters", "type", "id"}:
        return None
    if not _validates(args, schemas[item["name"]]):
        return None
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function", "function": {"name": item["name"], "arguments": json.dumps(args)}}


def _validates(value, schema_text: str) -> bool:
    try:
        import jsonschema_rs
    except ImportError:  # no validator here: no text is taken for a call
        return False
    try:
        return jsonschema_rs.validator_for(json.loads(schema_text)).is_valid(value)
    except Exception:  # noqa: BLE001 (a schema the validator cannot read holds no call)
        return False


def _json_values(text: str):
    """``(start, end, value)`` of each top-level JSON object or array in ``text`` that starts a
    line (after spaces) or follows a fence line, in order, skipping what one already covers."""
    i = 0
    while i < len(text):
        ch = text[i]
        if ch in "{[" and _starts_line(text, i):
            value, source = _first_value(text[i:])
            if value is not None:
                yield i, i + len(source), value
                i += len(source)
                continue
        i += 1


def _starts_line(text: str, i: int) -> bool:
    line_start = text.rfind("\n", 0, i) + 1
    return not text[line_start:i].strip()


def _balanced_end(text: str, opening: str, closing: str) -> tuple[int, str] | None:
    """Where the bracket opening ``text`` closes (the index after it, and the closing character),
    counting ``opening`` and ``closing`` characters outside strings; None when it never closes."""
    depth, in_str, escape = 0, False, False
    for i, ch in enumerate(text):
        if in_str:
            if escape:
                escape = False
            elif ch == "\\":
                escape = True
            elif ch == '"':
                in_str = False
            continue
        if ch == '"':
            in_str = True
        elif ch in opening:
            depth += 1
        elif ch in closing:
            depth -= 1
            if depth == 0:
                return i + 1, ch
    return None


def _first_value(text: str):
    """The first balanced JSON object or array at the start of ``text``, and its source (None, "" if none parses)."""
    closing = _balanced_end(text, "{[", "}]")
    if closing is None or closing[1] != ("}" if text[0] == "{" else "]"):
        return None, ""
    try:
        return json.loads(text[:closing[0]]), text[:closing[0]]
    except json.JSONDecodeError:
        return None, ""


def _with_fence(text: str, start: int, end: int) -> tuple[int, int]:
    """``[start, end)`` widened to the fence around it when the fence holds nothing else."""
    line_start = text.rfind("\n", 0, start) + 1
    before = text[:line_start].rstrip()
    fence_line = before.rfind("\n") + 1
    opener = before[fence_line:].strip()
    if not (opener.startswith(_FENCE) and opener[3:].strip().isalnum() or opener == _FENCE):
        return start, end
    after = text[end:]
    stripped = after.lstrip()
    if not stripped.startswith(_FENCE):
        return start, end
    return fence_line, end + (len(after) - len(stripped)) + len(_FENCE)


def call_may_start(text: str, mode: ToolMode) -> int | None:
    """Where streamed ``text`` may be writing a call: the marker's position, or under "auto" the
    start of a line whose first character opens a JSON object (``{``, or ``[`` then ``{``) or of
    a fence whose block does, a line still being written counting as undecided; None when
    nothing so far may be one."""
    at = text.find(OPEN)
    if mode != "auto":
        return None if at == -1 else at
    limit = len(text) if at == -1 else at
    i = 0
    while i < limit:
        nl = text.find("\n", i)
        end = len(text) if nl == -1 else nl
        head = text[i:end].lstrip()
        writing = nl == -1  # the line may still grow
        if head.startswith("{"):
            return i
        if head.startswith("["):
            after = text[i + (end - i - len(head)) + 1:].lstrip()[:1]
            if not after or after == "{":
                return i
        elif head.startswith(_FENCE):
            first = "" if writing else text[end + 1:].lstrip()[:1]
            if not first or first in "{[":
                return i
        elif writing and head and _FENCE.startswith(head):  # "`" or "``": may become a fence
            return i
        i = end + 1
    return None if at == -1 else at


def _call(body: str, names: tuple[str, ...]) -> dict | None:
    obj, raw_args = _first_object(body.strip())
    if not isinstance(obj, dict):
        name, raw_args = _partial_call(body)
        if name is None:
            return None
    else:
        name = obj.get("name")
        args = obj.get("arguments", obj.get("parameters", {}))
        raw_args = args if isinstance(args, str) else json.dumps(args)
    if not isinstance(name, str):
        return None
    if name not in names:  # a forced call whose name the model misspelled: the declared name sharing the longest prefix
        name = max(names, key=lambda n: (_common_prefix(n, name), -names.index(n)))
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function", "function": {"name": name, "arguments": raw_args}}


def _partial_call(body: str) -> tuple[str | None, str]:
    """A call whose JSON does not parse as a whole: the name, and the arguments' object if it parses, else its text."""
    head = body.strip()
    if not head.startswith('{"name": "'):
        return None, ""
    name, _, tail = head[len('{"name": "'):].partition('"')
    _, found, args = tail.partition('"arguments":')
    if not found:
        return name, "{}"
    obj, raw = _first_object(args.strip())
    return name, json.dumps(obj) if isinstance(obj, dict) else raw


def _first_object(text: str):
    """The first balanced JSON object at the start of ``text`` and its source (None, text if none parses)."""
    if not text.startswith("{"):
        return None, text.strip()
    closing = _balanced_end(text, "{", "}")
    if closing is None:
        return None, text.strip()
    try:
        return json.loads(text[:closing[0]]), text[:closing[0]]
    except json.JSONDecodeError:
        return None, text[:closing[0]]


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _as_object(arguments: str):
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
    return value


@dataclass
class HeldCalls:
    """A streamed answer with tools: what may go out as content as it comes (everything before a
    call opens; text that may be the start of ``<tool_call>`` waits until it is known not to be),
    and at the end the parsed calls with whatever content was still held."""

    prompt: ChatPrompt
    full: str = ""  # everything the model wrote
    sent: int = 0  # characters of it sent as content
    held: bool = False  # a call has started: the rest waits for the end

    def __post_init__(self) -> None:
        self.held = bool(self.prompt.forced)

    def feed(self, text: str) -> str:
        """Take the next piece of output; the content that may be sent now ("" when none)."""
        self.full += text
        if self.held:
            return ""
        at = call_may_start(self.full, self.prompt.mode)
        if at is not None and at < self.sent:  # already sent as text (a line decided too early cannot be): from here
            at = self.sent
        end = at if at is not None else len(self.full) - holdback(self.full)
        self.held = at is not None and self.full.find(OPEN) != -1
        if end <= self.sent:
            return ""
        out, self.sent = self.full[self.sent:end], end
        return out

    def finish(self) -> tuple[ParsedOutput, str]:
        """The parsed answer, and the content not sent yet ("" when the answer holds calls)."""
        parsed = parse(self.full, self.prompt)
        if parsed.tool_calls:
            return parsed, ""
        return parsed, (self.prompt.forced if self.held else "") + self.full[self.sent:]


def holdback(text: str) -> int:
    """How many characters at the end of streamed ``text`` may be the start of ``<tool_call>`` (not sent yet)."""
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:k]):
            return k
    return 0
