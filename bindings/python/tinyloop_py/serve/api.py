"""The OpenAI request bodies, checked field by field as ``tinyloop MODEL serve`` checks them, and
the response bodies it gives; plus the text side of a generation (streaming detokenization and
stop strings). Nothing here imports Ray.

Fields: ``prompt`` (a string, a one-string array, or an array of token ids) or ``messages``
(``role`` and ``content`` strings), ``max_tokens`` (also ``max_completion_tokens``; default 16
for completions, and for chat whatever fits in ``max_seq_len``), ``temperature`` (default 1; 0
is greedy), ``top_p``, ``seed``, ``stop`` (a string or up to 4 strings), ``stream``, ``n`` (1
only), ``return_token_ids`` (each choice also carries the ids of its tokens), and TinyLoop's
``loops`` and ``top_k``. Other fields (``model``, ``user``, ...) are accepted and ignored.

A model without a tokenizer takes token-id prompts only, with no ``messages`` and no ``stop``
strings; its choices carry empty text and always their token ids.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

COMPLETION = "completions"
CHAT = "chat_completions"

_ID_PREFIX = {COMPLETION: "cmpl", CHAT: "chatcmpl"}
_OBJECT = {COMPLETION: "text_completion", CHAT: "chat.completion"}
_CHUNK_OBJECT = {COMPLETION: "text_completion", CHAT: "chat.completion.chunk"}
_U64_MAX = 2**64 - 1


class ApiError(Exception):
    """A failed request: its HTTP status and message."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message

    def body(self) -> Dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": None, "code": None}}


def invalid(message: str) -> ApiError:
    return ApiError(400, message)


def from_library(e: BaseException) -> ApiError:
    """The status of a failure of the binding: bad arguments 400, a full queue 429 (the client
    may retry), a closed engine or a cancelled request 503, anything else 500."""
    import tinyloop_py as tl

    if isinstance(e, (tl.InvalidArgumentError, TypeError, ValueError)):
        status = 400
    elif isinstance(e, tl.BusyError):
        status = 429
    elif isinstance(e, (tl.ClosedError, tl.CancelledError)):
        status = 503
    else:
        status = 500
    return ApiError(status, str(e))


@dataclasses.dataclass
class Job:
    """A checked request, before tokenization (the replica tokenizes it)."""

    kind: str
    prompt: Union[str, List[int], None]
    messages: Optional[List[Tuple[str, str]]]
    max_tokens: Optional[int]
    temperature: float
    top_k: int
    top_p: float
    seed: Optional[int]
    loops: Optional[int]
    stop: List[str]
    stream: bool
    return_token_ids: bool

    @property
    def route_text(self) -> str:
        """A text that starts the same way exactly when two requests' prompts start the same
        way (at the same loops): what prefix-aware routing compares."""
        if self.messages is not None:
            body = "".join(f"{role}\x00{content}\x00" for role, content in self.messages)
        elif isinstance(self.prompt, list):
            body = "".join(f"{t}," for t in self.prompt)
        else:
            body = self.prompt or ""
        return f"{self.loops}\x01{body}"


def parse(kind: str, body: Any) -> Job:
    """Check a request body of endpoint ``kind`` (:data:`COMPLETION` or :data:`CHAT`); raises
    :class:`ApiError` (400) naming the first bad field."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    prompt, messages = None, None
    if kind == COMPLETION:
        prompt = _completion_prompt(body)
    else:
        messages = _messages(body)
    n = _uint(body, "n")
    if n is not None and n != 1:
        raise invalid(f"n is {n}: only n = 1 is served")
    max_tokens = _uint(body, "max_tokens")
    if max_tokens is None:
        max_tokens = _uint(body, "max_completion_tokens")
    if max_tokens is None and kind == COMPLETION:
        max_tokens = 16
    temperature = _number(body, "temperature")
    top_k = _uint(body, "top_k")
    top_p = _number(body, "top_p")
    return Job(
        kind=kind,
        prompt=prompt,
        messages=messages,
        max_tokens=max_tokens,
        temperature=1.0 if temperature is None else temperature,
        top_k=top_k or 0,
        top_p=1.0 if top_p is None else top_p,
        seed=_uint(body, "seed"),
        loops=_uint(body, "loops"),
        stop=_stop_strings(body),
        stream=bool(_boolean(body, "stream")),
        return_token_ids=bool(_boolean(body, "return_token_ids")),
    )


def _completion_prompt(body: Dict[str, Any]) -> Union[str, List[int]]:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        if all(_is_u64(v) for v in prompt):
            return list(prompt)
        if len(prompt) == 1 and isinstance(prompt[0], str):
            return prompt[0]
    if prompt is None and "prompt" not in body:
        raise invalid("prompt is missing")
    raise invalid("prompt must be a string, a one-string array or an array of token ids")


def _messages(body: Dict[str, Any]) -> List[Tuple[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise invalid("messages must be an array of messages")
    if not messages:
        raise invalid("messages is empty")
    out = []
    for i, m in enumerate(messages):
        fields = []
        for name in ("role", "content"):
            value = m.get(name) if isinstance(m, dict) else None
            if not isinstance(value, str):
                raise invalid(f"messages[{i}].{name} must be a string")
            fields.append(value)
        out.append((fields[0], fields[1]))
    return out


def _stop_strings(body: Dict[str, Any]) -> List[str]:
    stop = body.get("stop")
    if stop is None:
        stops: List[str] = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = list(stop)
    else:
        raise invalid("stop must be a string or an array of strings")
    if len(stops) > 4:
        raise invalid(f"stop has {len(stops)} strings: at most 4")
    for i, s in enumerate(stops):
        if not s:
            raise invalid(f"stop string {i} is empty")
    return stops


def _is_u64(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= _U64_MAX


def _uint(body: Dict[str, Any], name: str) -> Optional[int]:
    v = body.get(name)
    if v is None:
        return None
    if not _is_u64(v):
        raise invalid(f"{name} is {json.dumps(v)}: it must be a whole number >= 0")
    return v


def _number(body: Dict[str, Any], name: str) -> Optional[float]:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise invalid(f"{name} is {json.dumps(v)}: it must be a number")
    return float(v)


def _boolean(body: Dict[str, Any], name: str) -> Optional[bool]:
    v = body.get(name)
    if v is not None and not isinstance(v, bool):
        raise invalid(f"{name} is {json.dumps(v)}: it must be true or false")
    return v


# --------------------------------------------------------------------------------------------
# The model side: prompts to tokens, tokens to text


def read_metadata(path: Union[str, "os.PathLike[str]"]) -> Dict[str, Any]:
    """The ``metadata`` object of a ``.tinyloop`` file's header (docs/FORMAT.md "Layout")."""
    with open(path, "rb") as f:
        head = f.read(24)
        if len(head) < 24 or head[:8] != b"TINYLOOP":
            raise ValueError(f"{os.fspath(path)} is not a .tinyloop file")
        (length,) = struct.unpack("<Q", head[16:24])
        header = json.loads(f.read(length))
    return header.get("metadata") or {}


class Prompter:
    """Turns checked jobs into engine submissions for one model, as the Rust server does:
    completion text through the tokenizer with its special tokens; chat messages through the
    model's chat template (a byte-level model, which has none, takes them as ``role: content``
    lines followed by ``assistant:``); the tokenizer's end-of-sequence ids as stop tokens. A
    model without a tokenizer takes token ids only and gives its choices' token ids."""

    def __init__(self, model: Any, path: Union[str, "os.PathLike[str]"]):
        self.model = model
        config = model.config()
        self.vocab_size = int(config["vocab_size"])
        self.max_seq_len = int(config["max_seq_len"])
        metadata = read_metadata(path)
        kind = metadata.get("tokenizer")
        self.byte_level = kind == "bytes" or (kind != "huggingface" and self.vocab_size == 256)
        self.has_tokenizer = self.byte_level or kind == "huggingface"
        self.eos = self._eos(metadata) if kind == "huggingface" else []

    def _eos(self, metadata: Dict[str, Any]) -> List[int]:
        ids = (metadata.get("generation_config") or {}).get("eos_token_id")
        if isinstance(ids, int):
            return [ids]
        if isinstance(ids, list):
            return [int(i) for i in ids]
        token = (metadata.get("tokenizer_config") or {}).get("eos_token")
        if isinstance(token, dict):
            token = token.get("content")
        return [self.model.special_token(token)] if isinstance(token, str) else []

    def token_ids(self, job: Job) -> bool:
        """Whether ``job``'s choices carry their token ids."""
        return job.return_token_ids or not self.has_tokenizer

    def tokens(self, job: Job) -> List[int]:
        if not self.has_tokenizer:
            if job.messages is not None:
                raise invalid("chat completions need a tokenizer and the model has none: "
                              "send token ids to /v1/completions")
            if job.stop:
                raise invalid("stop is given, but the model has no tokenizer to find stop "
                              "strings in its text")
        if job.messages is not None:
            if self.byte_level:
                text = "".join(f"{r}: {c}\n" for r, c in job.messages) + "assistant:"
            else:
                text = self.model.apply_chat_template(
                    [{"role": r, "content": c} for r, c in job.messages]
                )
            # A rendered template carries its special tokens already.
            return self.model.tokenize(text, add_special_tokens=False).tolist()
        if isinstance(job.prompt, str):
            return self.model.tokenize(job.prompt, add_special_tokens=True).tolist()
        for i, t in enumerate(job.prompt or []):
            if t >= self.vocab_size:
                raise invalid(
                    f"prompt[{i}] is {t}: token ids are below vocab_size {self.vocab_size}")
        return list(job.prompt or [])

    def submit_args(self, job: Job, prompt: Sequence[int], loops: Optional[int]) -> Dict[str, Any]:
        """The keyword arguments of ``Engine.submit`` for ``job`` (``loops``: the deployment's
        default, for requests that name none)."""
        max_tokens = job.max_tokens
        if max_tokens is None:
            max_tokens = max(self.max_seq_len - len(prompt), 1)
        return dict(
            max_tokens=max_tokens,
            loops=job.loops if job.loops is not None else loops,
            temperature=job.temperature,
            top_k=job.top_k,
            top_p=job.top_p,
            seed=job.seed,
            stop=self.eos,
        )

    def text_stream(self) -> "TextStream":
        """Text of the tokens; none for a model without a tokenizer."""
        return TextStream(self.model if self.has_tokenizer else None)


_REPLACEMENT = "\ufffd"


class TextStream:
    """Tokens to text pieces of whole characters: a token that leaves a character unfinished
    gives "" until the rest arrives. Special tokens are left out of the text. Without a model
    (one without a tokenizer) every piece is ""."""

    def __init__(self, model: Optional[Any]):
        self._model = model
        self._ids: List[int] = []
        self._context = 0
        self._context_text = ""

    def _decode(self, ids: List[int]) -> str:
        if not ids or self._model is None:
            return ""
        return self._model.detokenize(ids, skip_special_tokens=True)

    def push(self, token: int) -> str:
        self._ids.append(token)
        text = self._decode(self._ids)
        if text.endswith(_REPLACEMENT):
            return ""
        piece = self._after_context(text)
        del self._ids[: self._context]
        self._context = len(self._ids)
        self._context_text = self._decode(self._ids)
        return piece

    def finish(self) -> str:
        """The text of the tokens still held (unfinished characters decode to U+FFFD)."""
        if len(self._ids) == self._context:
            return ""
        piece = self._after_context(self._decode(self._ids))
        self._ids, self._context, self._context_text = [], 0, ""
        return piece

    def _after_context(self, text: str) -> str:
        # A decoder that rewrites earlier text once later tokens arrive cannot take back what
        # was given out: the piece starts where the two texts first differ.
        common = 0
        for a, b in zip(self._context_text, text):
            if a != b:
                break
            common += 1
        return text[common:]


class StopStrings:
    """Finds stop strings in streamed text. Text is released as soon as it cannot be part of
    a stop string; a stop string split across pieces is found all the same."""

    def __init__(self, stops: List[str]):
        self._stops = stops
        self._held = ""

    def push(self, piece: str) -> Tuple[str, bool]:
        """The text now safe to release, and whether a stop string completed (the text then
        ends where the earliest one starts)."""
        self._held += piece
        found = [i for i in (self._held.find(s) for s in self._stops) if i >= 0]
        if found:
            out, self._held = self._held[: min(found)], ""
            return out, True
        keep = self._partial_stop_len()
        out = self._held[: len(self._held) - keep]
        self._held = self._held[len(self._held) - keep :]
        return out, False

    def finish(self) -> str:
        out, self._held = self._held, ""
        return out

    def _partial_stop_len(self) -> int:
        for i in range(len(self._held)):
            tail = self._held[i:]
            if any(s.startswith(tail) for s in self._stops):
                return len(self._held) - i
        return 0


# --------------------------------------------------------------------------------------------
# Response bodies


@dataclasses.dataclass
class End:
    """How a generation ended."""

    finish: str
    prompt_tokens: int
    #: Prompt tokens taken from cached pages (None when a stop string ended the request).
    cached_tokens: Optional[int]
    completion_tokens: int


class Reply:
    """The fixed fields of one response and the bodies built from them."""

    def __init__(self, kind: str, model: str, request_id: str, token_ids: bool = False):
        self.kind = kind
        self.model = model
        self.id = f"{_ID_PREFIX[kind]}-{request_id}"
        self.created = int(time.time())
        #: Whether each choice carries ``token_ids``.
        self.token_ids = token_ids

    def _envelope(self, obj: str, choice: Dict[str, Any],
                  tokens: Sequence[int]) -> Dict[str, Any]:
        if self.token_ids:
            choice["token_ids"] = list(tokens)
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": [choice]}

    def chunk(self, text: str, finish: Optional[str] = None, role: Optional[str] = None,
              tokens: Sequence[int] = ()) -> Dict[str, Any]:
        """A server-sent chunk: a piece of text (with the tokens generated since the previous
        chunk), the chat's opening role, or (with ``finish``) the end."""
        if self.kind == COMPLETION:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        else:
            delta: Dict[str, Any] = {}
            if role is not None:
                delta["role"] = role
            if text or role is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return self._envelope(_CHUNK_OBJECT[self.kind], choice, tokens)

    def complete(self, text: str, end: End, tokens: Sequence[int] = ()) -> Dict[str, Any]:
        """The whole response of a request that was not streamed."""
        if self.kind == COMPLETION:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": end.finish}
        else:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": end.finish}
        body = self._envelope(_OBJECT[self.kind], choice, tokens)
        body["usage"] = {
            "prompt_tokens": end.prompt_tokens,
            "prompt_tokens_details": {"cached_tokens": end.cached_tokens},
            "completion_tokens": end.completion_tokens,
            "total_tokens": end.prompt_tokens + end.completion_tokens,
        }
        return body


def models_list(name: str) -> Dict[str, Any]:
    return {"object": "list",
            "data": [{"id": name, "object": "model", "created": int(time.time()),
                      "owned_by": "tinyloop"}]}
