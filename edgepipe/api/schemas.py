"""Request and response schemas of the HTTP API (pydantic), shared by validation and ``/openapi.json``.

Every field a client sends is typed and range-checked here, before a request is admitted or
reaches the wire: strict types (``"5"`` is not an integer, ``true`` is not a number), finite
numbers only, integers within what the wire carries. Fields OpenAI defines that edgepipe does not
implement yet are declared too, and refused when set to anything but their neutral value, so a
parameter is never silently ignored. Unknown extra fields are ignored (clients send many).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAX_WIRE_INT = (1 << 31) - 1  # what a sampling field or a token id may be on the wire (int32)
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1
MAX_CHOICES = 16
MAX_STOP = 16  # OpenAI allows 4; evaluation harnesses send more
MAX_LOGIT_BIAS = 1024  # entries of logit_bias (OpenAI: 300)
MAX_TOP_LOGPROBS = 20


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


class Loose(BaseModel):  # responses: documented, never used to validate
    model_config = ConfigDict(extra="allow")


PositiveTokens = Annotated[int, Field(ge=1, le=MAX_WIRE_INT)]
TokenId = Annotated[int, Field(ge=0, le=MAX_WIRE_INT)]
StopString = Annotated[str, Field(min_length=1, max_length=256)]
FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]


# -- sampling fields shared by both OpenAI endpoints -----------------------------------------------
class StreamOptions(Strict):
    include_usage: bool = False


class Sampling(Strict):
    model: str | None = Field(None, max_length=256)
    max_tokens: PositiveTokens | None = Field(None, description="Tokens to generate at most (>= 1).")
    temperature: float | None = Field(None, ge=0, le=100, description="0 = greedy; absent = 0.8 (llama-server's default).")
    top_p: float | None = Field(None, gt=0, le=1, description="Absent = 0.95 (llama-server's default); 1 = off.")
    top_k: Annotated[int, Field(ge=0, le=MAX_WIRE_INT)] | None = Field(
        None, description="0 = no limit; absent = 40 (llama-server's default; an extension).")
    min_p: float | None = Field(None, ge=0, le=1, description="Keep the tokens at least this times as likely as the best; "
                                                           "0 = off; absent = 0.05 (llama-server's default; an extension).")
    seed: Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)] | None = Field(
        None, description="Absent: a random seed when sampling, reported back (a greedy request reports none).")
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = False
    return_token_ids: bool | None = Field(False, description="An extension (as in vLLM): each choice carries its token ids "
                                                            "(streamed: each chunk those since the previous one).")
    user: str | None = Field(None, max_length=256)
    presence_penalty: float | None = Field(None, ge=-2, le=2, description="Subtracted once from the logit of every token generated so far.")
    frequency_penalty: float | None = Field(None, ge=-2, le=2, description="Subtracted per occurrence from the logit of tokens generated so far.")
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100, le=100)]], Field(max_length=MAX_LOGIT_BIAS)] | None = Field(
        None, description="Token id (a decimal string) -> -100..100 added to its logit; -100 bans it, +100 all but forces it.")


# -- chat ------------------------------------------------------------------------------------------
class TextPart(Strict):
    type: Literal["text"]
    text: str


class FunctionCall(Strict):
    name: FunctionName
    arguments: str = Field(max_length=1 << 20, description="JSON text of the arguments.")


class ToolCall(Strict):
    id: str = Field(max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = Field(None, max_length=256)
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = Field(None, max_length=256)

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class FunctionDef(Strict):
    name: FunctionName
    description: str | None = Field(None, max_length=1 << 14)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(Strict):
    name: FunctionName


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = Field(None, description="With json_schema: {name, schema, strict} (api.structured).")


class ChatRequest(Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=4096)]
    max_completion_tokens: PositiveTokens | None = None
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = Field(False, description="Return each output token's log-probability (of the model's raw logits).")
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = Field(None, description="And its N best alternatives; needs logprobs.")
    response_format: ResponseFormat | None = None


# -- completions -----------------------------------------------------------------------------------
PromptText = Annotated[str, Field(max_length=1 << 22)]
PromptIds = Annotated[list[TokenId], Field(min_length=1, max_length=1 << 20)]


class CompletionRequest(Sampling):
    prompt: Union[PromptText, Annotated[list[PromptText], Field(min_length=1, max_length=64)], PromptIds,
                  Annotated[list[PromptIds], Field(min_length=1, max_length=64)]] = Field(
        description="A string, a list of strings, a list of token ids, or a list of token-id lists.")
    max_tokens: Annotated[int, Field(ge=0, le=MAX_WIRE_INT)] | None = Field(
        None, description="Tokens to generate at most; 0 with echo: the prompt (and its logprobs) only.")
    echo: bool | None = Field(False, description="Return the prompt before the completion (with its logprobs when logprobs is set).")
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = Field(
        None, description="Return each token's log-probability and the N best alternatives (plus the chosen one).")
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=1, le=MAX_CHOICES)] | None = None
    response_format: ResponseFormat | None = Field(None, description="An extension (as in vLLM): JSON output, as in chat.")


def unsupported(req: Sampling) -> tuple[str, str] | None:
    """(param, message) for the first OpenAI field set to a value edgepipe does not implement yet."""
    checks = []
    if isinstance(req, CompletionRequest):
        checks += [("suffix", bool(req.suffix)), ("best_of", req.best_of is not None and req.best_of != (req.n or 1))]
    for param, is_set in checks:
        if is_set:
            return param, f"'{param}' is not supported by this server yet"
    return None


# -- responses (documentation) ---------------------------------------------------------------------
class Usage(Loose):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(Loose):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Loose):
    content: list[TokenLogprob] | None
    refusal: None = None


class CompletionLogprobs(Loose):
    tokens: list[str]
    token_logprobs: list[float | None] = Field(description="None for the first echoed prompt token (nothing before it).")
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class ChatChoice(Loose):
    index: int
    message: dict[str, Any]
    finish_reason: Literal["stop", "length", "tool_calls"] | None
    logprobs: ChatLogprobs | None = None


class ChatCompletion(Loose):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: str
    seed: int | None = Field(None, description="The seed the sampling used (an extension): present when the request gave one or sampled.")
    choices: list[ChatChoice]
    usage: Usage


class CompletionChoice(Loose):
    index: int
    text: str
    finish_reason: Literal["stop", "length"] | None
    logprobs: CompletionLogprobs | None = None


class Completion(Loose):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str
    seed: int | None = Field(None, description="The seed the sampling used (an extension): present when the request gave one or sampled.")
    choices: list[CompletionChoice]
    usage: Usage


class Model(Loose):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(Loose):
    object: Literal["list"]
    data: list[Model]


class ErrorBody(Loose):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(Loose):
    error: ErrorBody


# -- turning a validation failure into one line ----------------------------------------------------
def first_error(exc: ValidationError, model: type[BaseModel] | None = None) -> tuple[str | None, str]:
    """(param, one-line message) for the first problem pydantic found."""
    errors = exc.errors(include_url=False, include_input=False)
    err = errors[0]
    if err["type"] == "json_invalid":
        return None, f"request body is not valid JSON: {err.get('ctx', {}).get('error', err['msg'])}"
    if not err["loc"] and err["type"] in ("model_type", "model_attributes_type", "dict_type"):
        return None, "request body must be a JSON object"
    path = _path(err["loc"])
    param = str(err["loc"][0]) if err["loc"] else None
    message = err["msg"]
    in_union = sum(_path(e["loc"]) == path for e in errors) > 1
    field = (model.model_fields.get(param) if model and param else None)
    if in_union and field is not None and field.description:  # several branches failed: say what is accepted
        message = f"must be {field.description[0].lower()}{field.description[1:]}"
    text = f"'{path}': {message}" if path else message
    return param, " ".join(text.split())[:300]


MEDIA_PART_TYPES = frozenset({"image_url", "image", "input_image", "input_audio", "audio", "file", "input_file", "document"})


def media_part(body) -> str | None:
    """Where a request body holds an image (or audio, a file): OpenAI's ``image_url`` / ``input_audio``
    parts, Anthropic's ``image`` / ``document`` blocks, Responses' ``input_image`` parts, Ollama's
    ``images``; None when it holds none. Asked only of a body that failed validation, to say why in
    one line rather than which union branch did not fit."""
    if not isinstance(body, dict):
        return None
    if body.get("images"):
        return "images"
    for key in ("messages", "input"):
        items = body.get(key)
        for i, item in enumerate(items if isinstance(items, list) else ()):
            if not isinstance(item, dict):
                continue
            if item.get("images"):
                return f"{key}[{i}].images"
            if item.get("type") in MEDIA_PART_TYPES:  # a Responses input item may itself be a part
                return f"{key}[{i}]"
            content = item.get("content")
            for j, part in enumerate(content if isinstance(content, list) else ()):
                if isinstance(part, dict) and part.get("type") in MEDIA_PART_TYPES:
                    return f"{key}[{i}].content[{j}]"
    return None


def _path(loc) -> str:
    """``messages[0].role`` from pydantic's loc, cut where a union-branch label (``str``, ``list[int]``...) starts."""
    out = ""
    for p in loc:
        if isinstance(p, int):
            out += f"[{p}]"
        elif p.isidentifier() and p.islower() and p not in ("str", "int", "float", "bool", "list", "dict", "none"):
            out += f".{p}" if out else p
        else:
            break
    return out
