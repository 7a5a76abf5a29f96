"""The OpenAI request surface: parsing and validating ``/v1/completions`` and
``/v1/chat/completions`` bodies, and the error type every endpoint answers with.

Validation is by hand, not by a schema library, so that each error names the field at fault
and the value it got, in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``.
Fields this server does not implement are refused (400) when set to anything but their
neutral value, never silently ignored; purely informational ones (``user``) are ignored; a
field this server does not know at all is refused too, as OpenAI does.

Bodies are checked before any field is read: nested at most :data:`MAX_JSON_DEPTH` deep, and
no string (key or value) holds a lone UTF-16 surrogate (``"\\ud800"`` decodes to one, and no
UTF-8 text can carry it); either is a 400 naming the field.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

MAX_N = 128
MAX_TOP_LOGPROBS = 20
MAX_JSON_DEPTH = 32  # OpenAI bodies nest 5 deep at most (messages[i].content[j].text)


class APIError(Exception):
    """An error answered to the client as ``status`` with an OpenAI-shaped JSON body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.headers = headers
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(param: str, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """Decode a request body: UTF-8 text holding one JSON object, nested at most
    :data:`MAX_JSON_DEPTH` deep, without lone surrogates in any string."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(
            400,
            f"the request body is not valid UTF-8 (bad byte at offset {exc.start})",
            code="invalid_encoding",
        ) from exc
    if not text.strip():
        raise APIError(400, "the request body is empty; send a JSON object", code="invalid_json")
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise APIError(
            400,
            f"the request body is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})",
            code="invalid_json",
        ) from exc
    except RecursionError as exc:  # the decoder recurses once per level of nesting
        raise _too_deep() from exc
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {_kind(body)}", code="invalid_json")
    _check_tree(body)
    return body


_SURROGATE = re.compile("[\ud800-\udfff]")


def _too_deep() -> APIError:
    return APIError(400, f"the request body is nested deeper than {MAX_JSON_DEPTH} levels", code="invalid_json")


def _check_tree(body: dict[str, Any]) -> None:
    """Refuse nesting deeper than :data:`MAX_JSON_DEPTH` and lone surrogates anywhere (the
    error names the field: ``messages[0].content``). Iterative, so depth costs no stack."""
    stack: list[tuple[Any, str, int]] = [(body, "", 1)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                raise _surrogate(path or "body")
        elif isinstance(value, dict | list):
            if depth > MAX_JSON_DEPTH:
                raise _too_deep()
            if isinstance(value, dict):
                for key, item in value.items():
                    if _SURROGATE.search(key):
                        raise _surrogate(f"{path}.<key>" if path else "<key>")
                    name = key[:64]  # a path is for reading: a huge key is cut
                    stack.append((item, f"{path}.{name}" if path else name, depth + 1))
            else:
                stack.extend((item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value))


def _surrogate(path: str) -> APIError:
    return APIError(
        400,
        f"'{path}' holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape); send valid Unicode",
        param=path,
        code="invalid_encoding",
    )


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return {
        bool: "boolean",
        int: "integer",
        float: "number",
        str: "string",
        list: "array",
        dict: "object",
    }.get(type(value), type(value).__name__)


def _wrong_type(name: str, want: str, value: Any) -> APIError:
    return invalid(
        name, f"'{name}' must be {want}, got {_kind(value)} {json.dumps(value)[:80]}", code="invalid_type"
    )


SEED_RANGE = 2**63  # seeds a torch.Generator accepts


def _int(
    body: dict, name: str, default: int | None, lo: int | None = None, hi: int | None = None
) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise _wrong_type(name, "an integer", value)
    if lo is not None and value < lo:
        raise invalid(name, f"'{name}' must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise invalid(name, f"'{name}' must be <= {hi}, got {value}")
    return value


def _float(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _wrong_type(name, "a number", value)
    value = float(value)
    if not math.isfinite(value) or value > hi or value < lo or (lo_open and value == lo):
        lower = f"> {lo}" if lo_open else f">= {lo}"
        raise invalid(name, f"'{name}' must be {lower} and <= {hi}, got {value}")
    return value


def _bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _wrong_type(name, "a boolean", value)
    return value


def _is_token_ids(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def _unsupported(body: dict, name: str, neutral: tuple) -> None:
    value = body.get(name)
    if value is not None and value not in neutral and not (isinstance(value, dict | list) and not value):
        raise APIError(
            400,
            f"'{name}' is not supported by this server (got {json.dumps(value)[:80]})",
            param=name,
            code="unsupported_parameter",
        )


# Every field each endpoint understands (implemented, informational, or refused unless neutral);
# any other field is refused by name rather than ignored.
_SAMPLING_FIELDS = frozenset({
    "model", "n", "best_of", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
    "stop_token_ids", "ignore_eos", "stream", "stream_options", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "logit_bias", "min_tokens", "user", "tools", "functions", "suffix",
})  # fmt: skip
COMPLETION_FIELDS = _SAMPLING_FIELDS | {"prompt", "logprobs", "echo"}
CHAT_FIELDS = _SAMPLING_FIELDS | {
    "messages", "max_completion_tokens", "logprobs", "top_logprobs", "response_format", "tool_choice",
    "function_call", "parallel_tool_calls", "chat_template_kwargs",
}  # fmt: skip
# chat_template_kwargs keys that are arguments of apply_chat_template itself, not template variables
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})  # fmt: skip


def check_fields(body: dict[str, Any], known: frozenset[str]) -> None:
    """Refuse (400, naming it) the first field of ``body`` that is not in ``known``."""
    for name in body:
        if name not in known:
            raise APIError(
                400,
                f"'{name[:64]}' is not a parameter this server understands",
                param=name[:64],
                code="unsupported_parameter",
            )


def check_stop_limits(stop: list[str], max_count: int, max_length: int, field: str = "stop") -> None:
    """Refuse more than ``max_count`` stop strings or one longer than ``max_length`` characters
    (``serve --max-stop-strings``, ``--max-stop-length``)."""
    if len(stop) > max_count:
        raise invalid(field, f"'{field}' has {len(stop)} strings; this server accepts at most {max_count}")
    for i, s in enumerate(stop):
        if len(s) > max_length:
            raise invalid(
                field, f"'{field}[{i}]' is {len(s)} characters long; this server accepts at most {max_length}"
            )


def _refuse_chat_unsupported(body: dict[str, Any]) -> None:
    """Chat fields this server does not implement: refused unless set to their neutral value."""
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        _unsupported(body, "response_format", ())
    for name, neutral in (("tool_choice", ("none",)), ("function_call", ("none",)),
                          ("parallel_tool_calls", (False, True))):  # fmt: skip
        _unsupported(body, name, neutral)


def _template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise _wrong_type("chat_template_kwargs", "an object", kwargs)
    for key in kwargs:
        if key in _RESERVED_TEMPLATE_KWARGS or not key.isidentifier():
            raise invalid(
                f"chat_template_kwargs.{key[:64]}",
                f"'{key[:64]}' cannot be passed to the chat template (only template variables can)",
            )
    return kwargs


@dataclass
class GenerateRequest:
    """A validated completion or chat request.

    ``prompts``: what to complete (text, or token ids for completions); a chat request has
    one, its rendered messages, filled in by the caller. Each prompt gets ``n`` choices,
    numbered ``prompt_index * n + i``. ``logprobs``: how many top alternatives to report per
    token (``None``: no log-probabilities at all). ``echo``: the completion repeats the prompt
    (with its tokens' log-probabilities when ``logprobs`` is set); ``prompt_only``: ``max_tokens``
    was 0 with ``echo``, so one token is generated internally and none is reported.
    ``template_kwargs``: extra chat-template variables (``chat_template_kwargs``).
    """

    chat: bool
    model: str | None
    prompts: list[str | list[int]]
    prompt_field: str
    n: int
    max_tokens: int | None
    sampling: dict[str, Any]
    stream: bool
    include_usage: bool
    logprobs: int | None
    messages: list[dict[str, str]] = field(default_factory=list)
    echo: bool = False
    prompt_only: bool = False
    template_kwargs: dict[str, Any] = field(default_factory=dict)

    def choice_sampling(self, choice: int) -> dict[str, Any]:
        """``SamplingParams`` fields (all but ``max_new_tokens``) for choice ``choice``; its seed
        is offset per choice so that ``n`` seeded samples differ yet reproduce."""
        kw = dict(self.sampling)
        if kw.get("seed") is not None:
            kw["seed"] = (kw["seed"] + choice) % SEED_RANGE
        return kw


def _common(body: dict, chat: bool) -> dict[str, Any]:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _wrong_type("model", "a string", model)
    for name, neutral in (("suffix", ("",)), ("tools", ()), ("functions", ())):
        _unsupported(body, name, neutral)
    n = _int(body, "n", 1, 1, MAX_N)
    best_of = _int(body, "best_of", None, 1)
    if best_of is not None and best_of != n:
        raise APIError(
            400,
            f"'best_of' other than n is not supported (got best_of={best_of}, n={n})",
            param="best_of",
            code="unsupported_parameter",
        )
    if chat and body.get("max_completion_tokens") is not None:
        max_tokens = _int(body, "max_completion_tokens", None, 1)
    else:
        max_tokens = _int(body, "max_tokens", None, 1)
    temperature = _float(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _float(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    top_k = _int(body, "top_k", 0, -1)
    min_p = _float(body, "min_p", 0.0, 0.0, 1.0)
    min_tokens = _int(body, "min_tokens", 0, 0)
    if max_tokens is not None and min_tokens > max_tokens:
        raise invalid("min_tokens", f"'min_tokens' ({min_tokens}) must not exceed 'max_tokens' ({max_tokens})")
    seed = _int(body, "seed", None, 0, SEED_RANGE - 1)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise _wrong_type("stop", "a string or an array of strings", stop)
    if any(s == "" for s in stop):
        raise invalid("stop", "'stop' strings must not be empty")
    stop_token_ids = body.get("stop_token_ids") or []
    if stop_token_ids and not _is_token_ids(stop_token_ids):
        raise _wrong_type("stop_token_ids", "an array of integers", stop_token_ids)
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise invalid("stream_options", "'stream_options' is only allowed when 'stream' is true")
        if not isinstance(options, dict):
            raise _wrong_type("stream_options", "an object", options)
        include_usage = _bool(options, "include_usage", False)
    return {
        "model": model, "n": n, "max_tokens": max_tokens, "stream": stream, "include_usage": include_usage,
        "sampling": {"temperature": temperature, "top_p": top_p, "top_k": max(top_k, 0), "min_p": min_p, "seed": seed,
                      "stop": stop, "stop_token_ids": stop_token_ids, "ignore_eos": _bool(body, "ignore_eos", False),
                      "min_tokens": min_tokens, "logit_bias": _logit_bias(body), **_penalties(body)},
    }  # fmt: skip


MAX_PENALTY = 2.0  # presence/frequency penalties in [-2, 2], as OpenAI's
MAX_REPETITION_PENALTY = 10.0
MAX_LOGIT_BIAS = 100.0  # a bias in [-100, 100], as OpenAI's


def _penalties(body: dict) -> dict[str, float]:
    return {
        "presence_penalty": _float(body, "presence_penalty", 0.0, -MAX_PENALTY, MAX_PENALTY),
        "frequency_penalty": _float(body, "frequency_penalty", 0.0, -MAX_PENALTY, MAX_PENALTY),
        "repetition_penalty": _float(body, "repetition_penalty", 1.0, 0.0, MAX_REPETITION_PENALTY, lo_open=True),
    }


def _logit_bias(body: dict) -> dict[int, float]:
    """``logit_bias``: an object from token id (a decimal string, as JSON keys are) to a bias.
    Whether the ids are in the vocabulary is checked by the engine."""
    value = body.get("logit_bias")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _wrong_type("logit_bias", "an object mapping token ids to numbers", value)
    bias = {}
    for key, b in value.items():
        if not (key.isascii() and key.isdigit()):
            raise invalid("logit_bias", f"'logit_bias' keys must be token ids (decimal integers), got {json.dumps(key)[:80]}")
        if isinstance(b, bool) or not isinstance(b, int | float) or not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS:
            raise invalid("logit_bias", f"'logit_bias[{key}]' must be a number in [-100, 100], got {json.dumps(b)[:80]}")
        bias[int(key)] = float(b)
    return bias


def parse_completion(body: dict[str, Any]) -> GenerateRequest:
    """Validate a ``/v1/completions`` body. ``prompt`` may be a string, an array of token ids,
    or an array of either (a batch). With ``echo``, ``max_tokens`` may be 0 (the prompt's
    log-probabilities only, as loglikelihood evaluations ask)."""
    check_fields(body, COMPLETION_FIELDS)
    echo = _bool(body, "echo", False)
    prompt_only = echo and type(body.get("max_tokens")) is int and body["max_tokens"] == 0
    if prompt_only:
        body = {**body, "max_tokens": 1}
    common = _common(body, chat=False)
    if echo and common["stream"]:
        raise APIError(400, "'echo' is not supported with 'stream'", param="echo", code="unsupported_parameter")
    if "prompt" not in body or body["prompt"] is None:
        raise APIError(400, "'prompt' is required", param="prompt", code="missing_required_parameter")
    prompt = body["prompt"]
    if isinstance(prompt, list) and not prompt:
        raise invalid("prompt", "'prompt' is empty")
    if isinstance(prompt, str) or _is_token_ids(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and all(isinstance(p, str) or _is_token_ids(p) or p == [] for p in prompt):
        prompts = prompt  # a batch
    else:
        raise _wrong_type("prompt", "a string, an array of token ids, or an array of those", prompt)
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise invalid("prompt", "'prompt' is empty" if len(prompts) == 1 else f"'prompt[{i}]' is empty")
    logprobs = body.get("logprobs")
    if logprobs is not None:
        logprobs = _int(body, "logprobs", None, 0, MAX_TOP_LOGPROBS)
    return GenerateRequest(
        chat=False, prompts=prompts, prompt_field="prompt", logprobs=logprobs, echo=echo, prompt_only=prompt_only,
        **common,
    )  # fmt: skip


def parse_chat(body: dict[str, Any]) -> GenerateRequest:
    """Validate a ``/v1/chat/completions`` body; the caller renders ``messages`` into the
    prompt with the model's chat template."""
    check_fields(body, CHAT_FIELDS)
    _refuse_chat_unsupported(body)
    template_kwargs = _template_kwargs(body)
    common = _common(body, chat=True)
    messages = body.get("messages")
    if messages is None:
        raise APIError(400, "'messages' is required", param="messages", code="missing_required_parameter")
    if not isinstance(messages, list):
        raise _wrong_type("messages", "an array of messages", messages)
    if not messages:
        raise invalid("messages", "'messages' is empty; send at least one message")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise _wrong_type(f"messages[{i}]", "an object with 'role' and 'content'", m)
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str):
            raise _wrong_type(f"messages[{i}].role", "a string", role)
        if isinstance(content, list):  # content parts: only text is understood
            texts = []
            for j, part in enumerate(content):
                if (
                    not isinstance(part, dict)
                    or part.get("type") != "text"
                    or not isinstance(part.get("text"), str)
                ):
                    raise invalid(
                        f"messages[{i}].content[{j}]",
                        f"only text content parts are supported, got {json.dumps(part)[:80]}",
                    )
                texts.append(part["text"])
            content = "".join(texts)
        elif content is None and role == "assistant":
            content = ""
        elif not isinstance(content, str):
            raise _wrong_type(f"messages[{i}].content", "a string or an array of text parts", content)
        clean.append({"role": role, "content": content})
    logprobs = None
    if _bool(body, "logprobs", False):
        logprobs = _int(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS)
    elif body.get("top_logprobs") is not None:
        raise invalid("top_logprobs", "'top_logprobs' needs 'logprobs': true")
    return GenerateRequest(
        chat=True, prompts=[], prompt_field="messages", logprobs=logprobs, messages=clean,
        template_kwargs=template_kwargs, **common,
    )  # fmt: skip
