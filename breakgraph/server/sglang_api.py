"""SGLang's native routes, for clients written against an SGLang server.

``POST /generate`` (``text`` or ``input_ids``, one or a batch; ``sampling_params``;
``stream``), ``GET /get_model_info``, ``GET /get_server_info``, ``GET|POST /flush_cache``,
``POST /tokenize``, ``POST /detokenize``. Request and answer shapes follow SGLang's
(``{"text", "output_ids", "meta_info": {"id", "finish_reason": {"type", ...},
"prompt_tokens", "completion_tokens", "cached_tokens", "e2e_latency"}}``; a stream sends the
whole text so far in each event, as SGLang does). Errors keep this server's OpenAI shape.
``/generate`` is validated as a ``/v1/completions`` body (sampling fields keep their meaning),
errors naming SGLang's field (``sampling_params.max_new_tokens``). ``get_model_info`` names the
served model, not its folder on disk.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

import breakgraph
from breakgraph.server.protocol import (
    APIError,
    GenerateRequest,
    _bool,
    _unsupported,
    _wrong_type,
    check_fields,
    invalid,
    parse_completion,
)
from breakgraph.server.sse import EventStream, sse

GENERATE_FIELDS = frozenset({"text", "input_ids", "sampling_params", "stream", "rid", "return_logprob"})
# sampling_params key -> the /v1/completions field with the same meaning
SAMPLING_KEYS = {
    "max_new_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
    "min_p": "min_p", "stop": "stop", "stop_token_ids": "stop_token_ids", "ignore_eos": "ignore_eos",
    "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty", "min_new_tokens": "min_tokens", "n": "n", "sampling_seed": "seed",
    "logit_bias": "logit_bias",
}  # fmt: skip
# sampling_params keys accepted only at their neutral (SGLang default) value
NEUTRAL_SAMPLING = {
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "no_stop_trim": (False,),
}
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default
FLUSHED = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)


def parse_generate(body: dict[str, Any]) -> tuple[GenerateRequest, bool]:
    """Validate a ``/generate`` body; returns the request and whether it is a batch (then the
    answer is a list)."""
    check_fields(body, GENERATE_FIELDS)
    _unsupported(body, "return_logprob", (False,))
    has_text, has_ids = body.get("text") is not None, body.get("input_ids") is not None
    if has_text == has_ids:
        raise APIError(400, "send exactly one of 'text' and 'input_ids'", param="text",
                       code="missing_required_parameter")  # fmt: skip
    field = "text" if has_text else "input_ids"
    prompt = body[field]
    batch = isinstance(prompt, list) and bool(prompt) and (isinstance(prompt[0], str | list))
    sp = body.get("sampling_params")
    sp = {} if sp is None else sp
    if not isinstance(sp, dict):
        raise _wrong_type("sampling_params", "an object", sp)
    oai: dict[str, Any] = {
        "prompt": prompt,
        "max_tokens": DEFAULT_MAX_NEW_TOKENS,
        "stream": _bool(body, "stream", False),
    }
    for key, value in sp.items():
        if key in NEUTRAL_SAMPLING:
            _unsupported(sp, key, NEUTRAL_SAMPLING[key])
        elif key in SAMPLING_KEYS:
            oai[SAMPLING_KEYS[key]] = value
        else:
            raise APIError(400, f"'sampling_params.{key[:64]}' is not a parameter this server understands",
                           param=f"sampling_params.{key[:64]}", code="unsupported_parameter")  # fmt: skip
    if oai.get("top_k") == -1:  # SGLang's "no top-k"
        oai["top_k"] = 0
    try:
        spec = parse_completion(oai)
    except APIError as exc:
        raise _renamed(exc, field) from None
    spec.prompt_field = field
    if spec.stream and (batch or spec.n > 1):
        raise invalid("stream", "'stream' is supported for one prompt and n = 1")
    return spec, batch or spec.n > 1


def _renamed(exc: APIError, prompt_field: str) -> APIError:
    """``exc`` naming SGLang's field instead of the /v1/completions one it was checked as."""
    names = {"prompt": prompt_field, **{v: f"sampling_params.{k}" for k, v in SAMPLING_KEYS.items()}}
    param = exc.param
    if param in names:
        exc.message = exc.message.replace(f"'{param}'", f"'{names[param]}'")
        exc.param = names[param]
    return exc


def _finish_reason(reason: str | None, completion_tokens: int) -> dict[str, Any] | None:
    if reason is None:
        return None
    if reason == "length":
        return {"type": "length", "length": completion_tokens}
    return {"type": reason}


def add_sglang_routes(
    app: FastAPI,
    *,
    engine,
    engine_loop,
    settings,
    authorize: Callable[[Request], None],
    json_body: Callable[[Request], Any],
    check_spec: Callable[..., None],
    open_run: Callable[..., Any],
    stream_error: Callable[[Any], str],
) -> None:
    """Register the routes on ``app``, using the OpenAI server's request plumbing (passed in)."""
    name = settings.served_model_name

    def meta(c, rid: str, started: float, final: bool) -> dict[str, Any]:
        return {
            "id": rid, "finish_reason": _finish_reason(c.finish_reason, len(c.token_ids)) if final else None,
            "prompt_tokens": c.prompt_tokens, "completion_tokens": len(c.token_ids), "cached_tokens": c.cached_tokens,
            "e2e_latency": round(time.monotonic() - started, 6),
        }  # fmt: skip

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request) -> Response:
        authorize(request)
        started = time.monotonic()
        body = await json_body(request)
        spec, many = parse_generate(body)
        check_spec(spec, "sampling_params.max_new_tokens", "sampling_params.stop")
        rid = body.get("rid") if isinstance(body.get("rid"), str) else uuid.uuid4().hex
        run, close = await open_run(request, spec)
        if spec.stream:

            async def events() -> AsyncIterator[str]:
                async for c, ev, delta in run.events():
                    if delta or ev.finish_reason is not None:
                        final = ev.finish_reason is not None
                        yield sse({"text": c.text, "meta_info": meta(c, rid, started, final)})
                if run.disconnected:
                    return
                if run.failed is not None:
                    yield stream_error(run)
                yield "data: [DONE]\n\n"

            return EventStream(events(), on_close=close)
        if (gone := await run.wait(close)) is not None:
            return gone
        out = [
            {"text": c.text, "output_ids": c.token_ids, "meta_info": meta(c, f"{rid}-{c.index}" if many else rid, started, True)}
            for c in run.choices
        ]  # fmt: skip
        return JSONResponse(out if many else out[0])

    @app.get("/get_model_info")
    async def get_model_info(request: Request) -> JSONResponse:
        authorize(request)
        return JSONResponse({
            "model_path": name, "tokenizer_path": name, "is_generation": True, "preferred_sampling_params": None,
            "weight_version": "default", "has_image_understanding": False, "has_audio_understanding": False,
            "model_type": engine.config.model_type, "architectures": None,
        })  # fmt: skip

    @app.get("/get_server_info")
    async def get_server_info(request: Request) -> JSONResponse:
        authorize(request)
        stats = engine_loop.stats
        return JSONResponse({
            "served_model_name": name, "context_length": engine.context_length,
            "max_queued_requests": settings.max_queued_requests, "max_request_bytes": settings.max_request_bytes,
            "max_stop_strings": settings.max_stop_strings, "max_stop_length": settings.max_stop_length,
            "version": breakgraph.__version__,
            "internal_states": [{
                "num_running_reqs": stats.get("running", 0), "num_waiting_reqs": stats.get("waiting", 0),
                "kv_pages_used": stats.get("pages_used", 0), "kv_pages_total": stats.get("pages_total", 0),
            }],
        })  # fmt: skip

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(request: Request) -> Response:
        authorize(request)
        flushed = await asyncio.wrap_future(engine_loop.call(engine.flush_cache))
        if not flushed:
            return Response("Cache not flushed: requests are running or waiting.\n", status_code=400)
        return Response(FLUSHED)

    def tokenizer():
        if engine.tokenizer is None:
            raise APIError(400, f"the model {name} has no tokenizer", code="no_tokenizer")
        return engine.tokenizer

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        authorize(request)
        body = await json_body(request)
        check_fields(body, frozenset({"model", "prompt", "add_special_tokens"}))
        prompt = body.get("prompt")
        many = isinstance(prompt, list)
        texts = prompt if many else [prompt]
        if not texts or not all(isinstance(t, str) for t in texts):
            raise _wrong_type("prompt", "a string or an array of strings", prompt)
        special = _bool(body, "add_special_tokens", True)
        tok = tokenizer()
        ids = await asyncio.wrap_future(
            engine_loop.call(lambda: [tok.encode(t, add_special_tokens=special) for t in texts])
        )
        counts = [len(i) for i in ids]
        return JSONResponse({"tokens": ids if many else ids[0], "count": counts if many else counts[0],
                             "max_model_len": engine.context_length})  # fmt: skip

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        authorize(request)
        body = await json_body(request)
        check_fields(body, frozenset({"model", "tokens", "skip_special_tokens"}))
        tokens = body.get("tokens")
        many = isinstance(tokens, list) and bool(tokens) and isinstance(tokens[0], list)
        rows = tokens if many else [tokens]
        vocab = engine.config.vocab_size
        for row in rows:
            if not isinstance(row, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in row
            ):
                raise invalid("tokens", f"'tokens' must be an array (or arrays) of token ids in [0, {vocab})")
        skip = _bool(body, "skip_special_tokens", True)
        tok = tokenizer()
        texts = await asyncio.wrap_future(
            engine_loop.call(lambda: [tok.decode(r, skip_special_tokens=skip) for r in rows])
        )
        return JSONResponse({"text": texts if many else texts[0]})
