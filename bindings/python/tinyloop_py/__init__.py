"""TinyLoop from Python: ctypes bindings over libtinyloop's C ABI (docs/ABI.md).

>>> import tinyloop_py
>>> with tinyloop_py.Model("model.tinyloop", max_seq_len=2048) as model:   # doctest: +SKIP
...     tokens = model.generate([82, 79, 77, 69, 79, 58], max_tokens=16)

A :class:`Model` is a model plus its default session: one call at a time (a second concurrent
call raises :class:`BusyError`). For concurrency, give each thread its own :class:`Session`
from :meth:`Model.new_session`; sessions share the model's weights. Every call releases the GIL
while it runs. Every ``loops`` keyword is also accepted as ``n_loops`` (and, in
:meth:`Model.generate_speculative` and :meth:`Model.generate_speculative_no_cache`, as
``verify_loops``).

Models that carry a tokenizer (a Hugging Face tokenizer stored in the file, or byte-level) also
take and give text: :meth:`Model.tokenize`, :meth:`Model.detokenize`,
:meth:`Model.apply_chat_template`, ``generate(text=...)`` (a str),
``generate_stream(text=...)`` (str pieces) and :meth:`Model.score_text`.
"""

from __future__ import annotations

import ctypes
import functools
import numbers
import os
import queue
import random
import threading
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import _lib as _c

__all__ = [
    "Model",
    "Session",
    "Engine",
    "Request",
    "PrefixCache",
    "ResumeHandle",
    "CtxTier",
    "load",
    "abi_version",
    "library_path",
    "TinyLoopError",
    "InvalidArgumentError",
    "ClosedError",
    "BusyError",
    "CancelledError",
    "ABI_VERSION",
]
__version__ = "0.1.0"

ABI_VERSION = _c.ABI_VERSION
_dll = _c.load_library()

Tokens = Union[Sequence[int], np.ndarray]


# --------------------------------------------------------------------------------------------
# Errors


class TinyLoopError(RuntimeError):
    """A failed libtinyloop call. ``status`` is the ``tl_status`` code, ``status_name`` its name."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status
        self.status_name = _c.STATUS_NAMES.get(status, "TL_UNKNOWN_STATUS")


class InvalidArgumentError(TinyLoopError, ValueError):
    """TL_ERR_INVALID_ARGUMENT: both a :class:`TinyLoopError` and a ``ValueError``."""


class ClosedError(TinyLoopError):
    """TL_ERR_CLOSED: the model or session was closed; construct a new one."""


class BusyError(TinyLoopError):
    """TL_ERR_BUSY: another call is running on the same model or session."""


class CancelledError(TinyLoopError):
    """TL_ERR_CANCELLED: the call was stopped by ``cancel()``."""


_ERROR_CLASSES = {
    _c.TL_ERR_INVALID_ARGUMENT: InvalidArgumentError,
    _c.TL_ERR_CLOSED: ClosedError,
    _c.TL_ERR_BUSY: BusyError,
    _c.TL_ERR_CANCELLED: CancelledError,
}


def _error(status: int, message: str) -> TinyLoopError:
    return _ERROR_CLASSES.get(status, TinyLoopError)(message, status)


def _check(status: int, method: str, what: str = "model") -> None:
    """Raise for a failed status. Must run on the thread that made the call (the message is
    thread-local)."""
    if status == _c.TL_OK:
        return
    if status == _c.TL_ERR_CLOSED:
        raise _closed(method, what)
    # The C message names the C function and the failure point.
    raise _error(status, (_dll.tl_last_error_message() or b"").decode("utf-8", "replace"))


def _closed(method: str, what: str) -> ClosedError:
    cls = what.capitalize()
    return ClosedError(
        f"{method}() called on a closed {what}; construct a new {cls}", _c.TL_ERR_CLOSED
    )


def abi_version() -> int:
    """The C ABI version of the loaded library (equal to :data:`ABI_VERSION`)."""
    return int(_dll.tl_abi_version())


def library_path() -> str:
    """The path of the loaded libtinyloop."""
    return str(_dll._name)


# --------------------------------------------------------------------------------------------
# Argument conversion

_I32P = ctypes.POINTER(ctypes.c_int32)
_F32P = ctypes.POINTER(ctypes.c_float)
_U32_MAX = 2**32 - 1
_I32_MAX = 2**31 - 1


def _int(value: Any, name: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    value = int(value)
    if not lo <= value <= hi:
        raise InvalidArgumentError(
            f"{name} must be in {lo}..={hi}, got {value}", _c.TL_ERR_INVALID_ARGUMENT
        )
    return value


def _tokens(tokens: Tokens, name: str = "tokens") -> np.ndarray:
    """Token ids as a contiguous 1-D int32 array (numpy arrays and sequences of ints)."""
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise InvalidArgumentError(
            f"{name} must be 1-D, got shape {arr.shape}", _c.TL_ERR_INVALID_ARGUMENT
        )
    if arr.size == 0:
        return np.zeros(0, dtype=np.int32)
    if not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.dtype != np.int32:
        if arr.min() < -(2**31) or arr.max() > _I32_MAX:
            raise InvalidArgumentError(
                f"{name} holds values outside int32", _c.TL_ERR_INVALID_ARGUMENT
            )
    return np.ascontiguousarray(arr, dtype=np.int32)


def _utf8(text: Any, name: str) -> bytes:
    """A str argument as the NUL-terminated UTF-8 the C ABI reads."""
    if not isinstance(text, str):
        raise TypeError(f"{name} must be a str, got {type(text).__name__}")
    if "\0" in text:
        raise InvalidArgumentError(
            f"{name} contains a NUL character", _c.TL_ERR_INVALID_ARGUMENT
        )
    return text.encode("utf-8")


def _ptr(arr: np.ndarray, kind=_I32P):
    return arr.ctypes.data_as(kind)


def _loops(loops: Optional[int]) -> int:
    if loops is None:
        return _c.LOOPS_DEFAULT
    return _int(loops, "loops", 1, _I32_MAX)


def _loops_also_as(*aliases: str):
    """Accept each of ``aliases`` as another name of the ``loops`` keyword: the reference pages
    write ``n_loops`` on every scoring and generation call, and ``verify_loops`` for the depth
    that verifies speculative drafts."""

    def wrap(method):
        @functools.wraps(method)
        def call(self, *args, **kwargs):
            for alias in aliases:
                if alias in kwargs:
                    if "loops" in kwargs:
                        raise TypeError(f"{method.__name__}() got both loops and {alias}")
                    kwargs["loops"] = kwargs.pop(alias)
            return method(self, *args, **kwargs)

        return call

    return wrap


class CtxTier:
    """A CTX-TIER policy for a generation call (``ctx_tier=``; a dict with the same keys works
    too): the loop body is re-packed to INT2 once the sequence reaches ``long_t`` tokens and
    back to INT4 on a call whose first step is below ``short_t``. ``verbose`` adds every
    transition to the summary on stderr; ``file`` receives the summary as JSON."""

    _KEYS = ("short_t", "long_t", "long_bits", "verbose", "file")

    def __init__(
        self,
        short_t: int = 512,
        long_t: int = 2048,
        long_bits: int = 2,
        verbose: bool = False,
        file: Optional[Union[str, "os.PathLike[str]"]] = None,
    ):
        self.short_t = _int(short_t, "ctx_tier short_t", 0, _U32_MAX)
        self.long_t = _int(long_t, "ctx_tier long_t", 0, _U32_MAX)
        self.long_bits = _int(long_bits, "ctx_tier long_bits", 0, _U32_MAX)
        self.verbose = bool(verbose)
        self.file = None if file is None else os.fsencode(file)

    @classmethod
    def of(cls, value: Union["CtxTier", Dict[str, Any]]) -> "CtxTier":
        if isinstance(value, CtxTier):
            return value
        if isinstance(value, dict):
            unknown = set(value) - set(cls._KEYS)
            if unknown:
                raise ValueError(f"ctx_tier: unknown keys {sorted(unknown)} (known: {cls._KEYS})")
            return cls(**value)
        raise TypeError(f"ctx_tier must be a CtxTier or a dict, got {type(value).__name__}")

    def _params(self) -> "_c.CtxTierParams":
        p = _c.CtxTierParams()
        _check(_dll.tl_ctx_tier_default_params(ctypes.byref(p)), "generate")
        p.short_t, p.long_t, p.long_bits = self.short_t, self.long_t, self.long_bits
        p.verbose = self.verbose
        p.file = self.file
        return p


#: A generation call's ``beta_monitor``: None or False (monitored only when the environment
#: says so), True (BETA-MON with the default thresholds), or a dict of thresholds
#: (``low_entropy_bits``, ``high_entropy_bits``, ``agreement_floor``; missing ones take their
#: defaults).
BetaMonitor = Union[None, bool, Dict[str, float]]

_BETA_KEYS = ("low_entropy_bits", "high_entropy_bits", "agreement_floor")


def _set_beta_monitor(p: "_c.GenerateParams", beta_monitor: BetaMonitor) -> None:
    if beta_monitor is None or beta_monitor is False:
        return
    p.beta_monitor = True
    if beta_monitor is True:
        return
    if not isinstance(beta_monitor, dict):
        raise TypeError(
            f"beta_monitor must be a bool or a dict of thresholds, got {type(beta_monitor).__name__}"
        )
    for key, value in beta_monitor.items():
        if key not in _BETA_KEYS:
            raise ValueError(f"beta_monitor: unknown key {key!r} (known: {', '.join(_BETA_KEYS)})")
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"beta_monitor[{key!r}] must be a number, got {type(value).__name__}")
        setattr(p, "beta_mon_" + key, float(value))


def _set_exit(
    p: "_c.GenerateParams",
    threshold: Optional[float],
    rule: Optional[str],
    policy: Optional[str],
) -> None:
    """Adaptive exit (docs/ABI.md "Adaptive exit"); the library checks the combination."""
    if threshold is not None:
        if isinstance(threshold, bool) or not isinstance(threshold, numbers.Real):
            raise TypeError(
                f"exit_threshold must be a number or None, got {type(threshold).__name__}"
            )
        # The C ABI reads a negative threshold as none; here that is None.
        if threshold < 0:
            raise InvalidArgumentError(
                f"exit_threshold {threshold} must lie in [0, 1] (None: no threshold)",
                _c.TL_ERR_INVALID_ARGUMENT,
            )
        p.exit_threshold = float(threshold)
    if rule is not None:
        p.exit = _utf8(rule, "exit")
    if policy is not None:
        p.exit_policy = _utf8(policy, "exit_policy")


class _Call:
    """The converted arguments of one generation call (kept alive while C uses them)."""

    def __init__(
        self,
        tokens: Tokens,
        max_tokens: int,
        loops: Optional[int],
        temperature: float,
        top_k: int,
        top_p: float,
        seed: Optional[int],
        stop: Optional[Iterable[int]],
        prefix_cache: Optional["PrefixCache"] = None,
        ctx_tier: Optional[Union["CtxTier", Dict[str, Any]]] = None,
        beta_monitor: BetaMonitor = None,
        exit_threshold: Optional[float] = None,
        exit: Optional[str] = None,
        exit_policy: Optional[str] = None,
    ):
        self.tokens = _tokens(tokens)
        p = _c.GenerateParams()
        _check(_dll.tl_generate_default_params(ctypes.byref(p)), "generate")
        p.max_tokens = _int(max_tokens, "max_tokens", 0, _U32_MAX)
        p.loops = _loops(loops)
        p.temperature = float(temperature)
        p.top_k = _int(top_k, "top_k", 0, _U32_MAX)
        p.top_p = float(top_p)
        if seed is None:
            # Greedy decoding ignores the seed; sampling draws one from Python's `random`, so
            # `random.seed(...)` makes sampled output reproducible.
            seed = random.getrandbits(64) if p.temperature != 0.0 else 0
        p.seed = _int(seed, "seed", 0, 2**64 - 1)
        stop = [] if stop is None else list(stop)
        #: Stop strings (text calls only); the ints of ``stop`` are stop tokens.
        self.stop_strings = [s for s in stop if isinstance(s, str)]
        self.stop = _tokens([s for s in stop if not isinstance(s, str)], "stop")
        if self.stop.size:
            p.stop_tokens = _ptr(self.stop)
            p.n_stop_tokens = self.stop.size
        if prefix_cache is not None:
            if not isinstance(prefix_cache, PrefixCache):
                raise TypeError(
                    f"prefix_cache must be a PrefixCache, got {type(prefix_cache).__name__}"
                )
            p.prefix_cache = prefix_cache._pointer("generate")
        self.prefix_cache = prefix_cache
        self.ctx_tier = None if ctx_tier is None else CtxTier.of(ctx_tier)._params()
        if self.ctx_tier is not None:
            p.ctx_tier = ctypes.addressof(self.ctx_tier)
        _set_beta_monitor(p, beta_monitor)
        _set_exit(p, exit_threshold, exit, exit_policy)
        self.params = p

    def args(self):
        return (_ptr(self.tokens), self.tokens.size, ctypes.byref(self.params))

    def text_args(self, text: str, add_special_tokens: bool, skip_special_tokens: bool):
        """The arguments of a text call after the handle: prompt, params, text params."""
        self.prompt = _utf8(text, "text")
        t = _c.TextParams()
        _check(_dll.tl_text_default_params(ctypes.byref(t)), "generate")
        self.stop_array = (ctypes.c_char_p * max(len(self.stop_strings), 1))(
            *[_utf8(s, "stop string") for s in self.stop_strings]
        )
        t.stop = ctypes.cast(self.stop_array, ctypes.POINTER(ctypes.c_char_p))
        t.n_stop = len(self.stop_strings)
        t.add_special_tokens = bool(add_special_tokens)
        t.skip_special_tokens = bool(skip_special_tokens)
        self.text_params = t
        return (self.prompt, ctypes.byref(self.params), ctypes.byref(t))

    def check_tokens(self, tokens: Any) -> None:
        """A call on tokens: they are given, and ``stop`` holds no strings."""
        if tokens is None:
            raise TypeError("pass the prompt as tokens, or as text=")
        if self.stop_strings:
            raise InvalidArgumentError(
                "stop strings work on text: pass the prompt as text=", _c.TL_ERR_INVALID_ARGUMENT
            )


# --------------------------------------------------------------------------------------------
# Handles


def _beta_mon(stats: "_c.GenerateStats") -> Dict[str, Any]:
    """The BETA-MON summary of a monitored call as a dict."""
    names = [name for name, _ in _c.GenerateStats._fields_ if name.startswith("beta_mon_")]
    summary: Dict[str, Any] = {name[len("beta_mon_"):]: getattr(stats, name) for name in names}
    summary["agreement_rate"] = stats.agreement if stats.drafted > 0 else None
    return summary


class _Handle:
    """A C handle shared by threads: calls hold it active; close() releases the native
    resources (cancelling a running call) and the handle is freed once no call is active."""

    def __init__(self, ptr: int, what: str, close_fn, free_fn):
        self._ptr = ptr
        self._what = what
        self._close_fn = close_fn
        self._free_fn = free_fn
        self._lock = threading.Lock()
        self._active = 0
        self._closed = False
        #: Set when close() starts: stream callbacks then stop waiting for their consumer.
        self.closing = threading.Event()

    @property
    def closed(self) -> bool:
        return self._closed

    def acquire(self, method: str) -> int:
        with self._lock:
            if self._closed:
                raise _closed(method, self._what)
            self._active += 1
            return self._ptr

    def release(self) -> None:
        with self._lock:
            self._active -= 1
            if not (self._closed and self._active == 0 and self._ptr is not None):
                return
            ptr, self._ptr = self._ptr, None
        self._free_fn(ptr)

    def close(self) -> None:
        self.closing.set()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._active += 1  # close itself uses the pointer below
            ptr = self._ptr
        try:
            self._close_fn(ptr)
        finally:
            self.release()


class _Closing:
    """Closed by its ``close()`` at the end of a ``with`` block, or when collected."""

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc_value, traceback) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: the library may already be gone
            pass


class _Owner(_Closing):
    """An object that owns a :class:`_Handle` in ``self._h``."""

    _h: Optional[_Handle]

    @property
    def closed(self) -> bool:
        return self._h is None or self._h.closed

    def close(self) -> None:
        """Release the native resources. Idempotent. A call running in another thread is
        cancelled first; every later call raises :class:`ClosedError` (a RuntimeError)."""
        if self._h is not None:
            self._h.close()


#: The C names of the methods whose name differs (without the tl_ / tl_session_ prefix).
_C_NAMES = {
    "build_prefix_cache": "prefix_cache_new",
    "build_resume_handle": "resume_handle_new",
    "generate_speculative_no_cache": "generate_speculative",
}


class _Runner(_Owner):
    """Calls shared by Model (default session) and Session."""

    _what = "model"
    _fn: Dict[str, str] = {}

    def __init__(self) -> None:
        self._h: Optional[_Handle] = None

    def _handle(self, method: str) -> _Handle:
        if self._h is None:
            raise _closed(method, self._what)
        return self._h

    def _run(self, method: str, fn_key: str, *args, bound: Optional["_Bound"] = None) -> None:
        self._call(method, self._fn[fn_key], *args, bound=bound)

    def _call(self, method: str, fn_name: str, *args, bound: Optional["_Bound"] = None) -> None:
        """Call ``fn_name`` on this handle. TL_ERR_CLOSED while this handle is open means the
        ``bound`` prefix cache or resume handle was released (freed, or its model closed)."""
        h = self._handle(method)
        ptr = h.acquire(method)
        try:
            status = getattr(_dll, fn_name)(ptr, *args)
            if status == _c.TL_ERR_CLOSED and bound is not None and not h.closed:
                raise bound._released(method)
            _check(status, method, self._what)
        finally:
            h.release()

    def cancel(self) -> None:
        """Stop the call running in another thread: a generation at its next token, a score
        call at its next block application; it then raises :class:`CancelledError`. Does
        nothing when no call is running."""
        self._run("cancel", "cancel")

    @_loops_also_as("n_loops")
    def generate(
        self,
        tokens: Optional[Tokens] = None,
        max_tokens: int = 128,
        loops: Optional[int] = None,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: Optional[int] = None,
        stop: Optional[Iterable[Union[int, str]]] = None,
        prefix_cache: Optional["PrefixCache"] = None,
        ctx_tier: Optional[Union["CtxTier", Dict[str, Any]]] = None,
        beta_monitor: BetaMonitor = None,
        exit_threshold: Optional[float] = None,
        exit: Optional[str] = None,
        exit_policy: Optional[str] = None,
        text: Optional[str] = None,
        add_special_tokens: bool = True,
        skip_special_tokens: bool = True,
    ) -> Union[np.ndarray, str]:
        """Generate up to ``max_tokens`` tokens after ``tokens``; returns only the new tokens
        (np.int32), without the stop token that ended generation, if any. With
        ``prefix_cache`` (from :meth:`Model.build_prefix_cache`, at the same loops) the tokens
        are generated after its prefix: the same tokens as from prefix + ``tokens``. With
        ``ctx_tier`` (a :class:`CtxTier` or a dict of its fields) the loop body runs at INT2
        once the sequence is long (CTX-TIER; every generation call takes it). With
        ``beta_monitor`` (True, or a dict of thresholds) the call's BETA-MON summary is
        ``last_generate_stats()["beta_mon"]``.

        Adaptive exit: ``exit_threshold`` (in [0, 1]) or ``exit`` ("gate": the model's own
        threshold, or "gate:T") takes each token from the first loop iteration whose
        cumulative exit probability reaches the threshold, on a model with an exit gate (Ouro).
        ``exit`` also takes Huginn's criteria, on any model: "entropy-diff", "latent-diff",
        "cosine", "kl", "minp-kl" (each optionally ":T") and "argmax-stability" or "argmax"
        (optionally ":N"), which stop each call at the first iteration where they fire
        (docs/ABI.md "Adaptive exit"). ``exit_policy`` "reference" (the default: the model's
        own code's semantics) or "skip" (generated tokens stop at their exit iteration and copy
        its KV into the slots they skip). ``last_generate_stats()`` then counts
        ``exit_tokens`` and their ``exit_mean_steps``. With ``prefix_cache``, the gate only (a
        criterion would stop the prompt's calls, which the prefix never did).

        ``text=`` instead of ``tokens``: the prompt as a str, tokenized by the model's
        tokenizer (with its special tokens unless ``add_special_tokens`` is False, as for a
        prompt from :meth:`Model.apply_chat_template`); returns the generated text (a str,
        special tokens left out unless ``skip_special_tokens`` is False). Generation then also
        ends at the tokenizer's end-of-sequence tokens and at the str entries of ``stop``
        (stop strings: the text ends before the first one found); int entries stay stop tokens."""
        call = _Call(
            () if text is not None or tokens is None else tokens, max_tokens, loops, temperature,
            top_k, top_p, seed, stop, prefix_cache, ctx_tier, beta_monitor,
            exit_threshold, exit, exit_policy,
        )
        if text is not None:
            if tokens is not None:
                raise TypeError("generate() takes tokens or text=, not both")
            args = call.text_args(text, add_special_tokens, skip_special_tokens)
            size = self._required("generate_text", *args)
            buf = ctypes.create_string_buffer(size)
            n = ctypes.c_size_t(0)
            self._looped("generate_text", *args, buf, size, ctypes.byref(n))
            return buf.raw[: n.value - 1].decode("utf-8")
        call.check_tokens(tokens)
        out = np.empty(max(call.params.max_tokens, 1), dtype=np.int32)
        n = ctypes.c_size_t(0)
        self._run(
            "generate", "generate", *call.args(), _ptr(out), out.size, ctypes.byref(n),
            bound=prefix_cache,
        )
        return out[: n.value].copy()

    @_loops_also_as("n_loops")
    def generate_stream(
        self,
        tokens: Optional[Tokens] = None,
        max_tokens: int = 128,
        loops: Optional[int] = None,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: Optional[int] = None,
        stop: Optional[Iterable[Union[int, str]]] = None,
        prefix_cache: Optional["PrefixCache"] = None,
        ctx_tier: Optional[Union["CtxTier", Dict[str, Any]]] = None,
        beta_monitor: BetaMonitor = None,
        exit_threshold: Optional[float] = None,
        exit: Optional[str] = None,
        exit_policy: Optional[str] = None,
        text: Optional[str] = None,
        add_special_tokens: bool = True,
        skip_special_tokens: bool = True,
    ) -> Iterator[Union[int, str]]:
        """Like :meth:`generate`, yielding each token (an int) as soon as it exists; with
        ``text=``, each piece of generated text (a str of whole characters, never part of a
        stop string). Arguments are checked now; generation starts at the first ``next()``.
        Leaving the loop early stops generation after at most one more token."""
        call = _Call(
            () if text is not None or tokens is None else tokens, max_tokens, loops, temperature,
            top_k, top_p, seed, stop, prefix_cache, ctx_tier, beta_monitor,
            exit_threshold, exit, exit_policy,
        )
        h = self._handle("generate_stream")
        if h.closed:
            raise _closed("generate_stream", self._what)
        if text is not None:
            if tokens is not None:
                raise TypeError("generate_stream() takes tokens or text=, not both")
            args = call.text_args(text, add_special_tokens, skip_special_tokens)
            fn = getattr(_dll, self._prefix + "generate_text_stream")
            piece = lambda ptr, n: ctypes.string_at(ptr, n).decode("utf-8")  # noqa: E731
            return self._stream(h, call, fn, args, _c.TEXT_CALLBACK, piece)
        call.check_tokens(tokens)
        fn = getattr(_dll, self._fn["generate_stream"])
        return self._stream(h, call, fn, call.args(), _c.TOKEN_CALLBACK, int)

    def _stream(self, h: _Handle, call: _Call, fn, args, callback_type, to_item) -> Iterator[Any]:
        """Run the stream function ``fn(handle, *args, callback, NULL)`` in a thread, yielding
        ``to_item(*callback arguments but user_data)`` for each callback."""
        ptr = h.acquire("generate_stream")
        # A one-slot queue: generation runs at most a token or two ahead of the consumer and
        # holds the session until the consumer is done (or leaves the loop).
        tokens: "queue.Queue[object]" = queue.Queue(maxsize=1)
        stop = threading.Event()
        done = object()
        failure = []

        def hand_over(item: object) -> bool:
            while not (stop.is_set() or h.closing.is_set()):
                try:
                    tokens.put(item, timeout=0.05)
                    return True
                except queue.Full:
                    pass
            return False

        def on_item(*values) -> bool:
            return hand_over(to_item(*values[:-1]))

        callback = callback_type(on_item)

        def worker() -> None:
            try:
                status = fn(ptr, *args, callback, None)
                if h.closing.is_set():
                    raise ClosedError(
                        f"generate_stream() interrupted: the {self._what} was closed",
                        _c.TL_ERR_CLOSED,
                    )
                if status == _c.TL_ERR_CLOSED and call.prefix_cache is not None:
                    raise call.prefix_cache._released("generate_stream")
                _check(status, "generate_stream", self._what)
            except BaseException as e:  # handed to the consumer
                failure.append(e)
            finally:
                hand_over(done)

        thread = threading.Thread(target=worker, name="tinyloop-stream", daemon=True)
        try:
            thread.start()
            while True:
                try:
                    item = tokens.get(timeout=0.05)
                except queue.Empty:
                    if thread.is_alive():
                        continue
                    break  # the worker ended without handing over `done` (closing)
                if item is done:
                    break
                yield item  # type: ignore[misc]
            thread.join()
            if failure:
                raise failure[0]
        finally:
            stop.set()
            if thread.ident is not None:
                thread.join()
            h.release()

    @_loops_also_as("n_loops")
    def score_last(self, tokens: Tokens, loops: Optional[int] = None) -> np.ndarray:
        """Logits ``[vocab_size]`` (np.float32) at the last position of ``tokens``."""
        arr = _tokens(tokens)
        out = np.empty(self._vocab("score_last"), dtype=np.float32)
        n = ctypes.c_size_t(0)
        self._run(
            "score_last", "score_last", _ptr(arr), arr.size, _loops(loops),
            _ptr(out, _F32P), out.size, ctypes.byref(n),
        )
        return out

    @_loops_also_as("n_loops")
    def score(
        self,
        tokens: Tokens,
        loops: Optional[int] = None,
        *,
        exit_threshold: Optional[float] = None,
        exit: Optional[str] = None,
        exit_policy: Optional[str] = None,
        prompt_len: Optional[int] = None,
    ) -> np.ndarray:
        """Logits ``[len(tokens), vocab_size]`` (np.float32) for every position. With an exit
        rule (``exit_threshold``, ``exit``, ``exit_policy`` as in :meth:`generate`), each
        position's logits are those of its exit iteration: :meth:`score_exit`'s logits."""
        if (exit_threshold, exit, exit_policy, prompt_len) != (None, None, None, None):
            return self.score_exit(
                tokens, loops, exit_threshold=exit_threshold, exit=exit,
                exit_policy=exit_policy, prompt_len=prompt_len,
            )[0]
        arr = _tokens(tokens)
        vocab = self._vocab("score")
        out = np.empty((max(arr.size, 1), vocab), dtype=np.float32)
        n = ctypes.c_size_t(0)
        self._run(
            "score", "score", _ptr(arr), arr.size, _loops(loops),
            _ptr(out, _F32P), out.size, ctypes.byref(n),
        )
        return out[: arr.size]

    @_loops_also_as("n_loops")
    def score_exit(
        self,
        tokens: Tokens,
        loops: Optional[int] = None,
        *,
        exit_threshold: Optional[float] = None,
        exit: Optional[str] = None,
        exit_policy: Optional[str] = None,
        prompt_len: Optional[int] = None,
    ) -> Tuple[np.ndarray, np.ndarray]:
        """Score under an exit rule (``exit_threshold`` or ``exit``, and ``exit_policy``, as in
        :meth:`generate`; a rule is required): logits ``[len(tokens), vocab_size]``
        (np.float32), each position's from its exit iteration, and those iterations
        (np.int32, 1-based). ``tokens[:prompt_len]`` run as a generation call's prompt and every
        later token as a generated one (its own step at the rule's policy), so scoring a greedy
        generation's prompt and tokens gives, from row ``prompt_len - 1`` on, its tokens as the
        argmax and its exit iterations. ``prompt_len`` None: ``len(tokens)``, all a prompt."""
        arr = _tokens(tokens)
        p = _c.GenerateParams()
        _check(_dll.tl_generate_default_params(ctypes.byref(p)), "score_exit")
        p.loops = _loops(loops)
        _set_exit(p, exit_threshold, exit, exit_policy)
        n_prompt = arr.size if prompt_len is None else _int(prompt_len, "prompt_len", 0, 2**64 - 1)
        out = np.empty((max(arr.size, 1), self._vocab("score_exit")), dtype=np.float32)
        steps = np.empty(max(arr.size, 1), dtype=np.int32)
        n = ctypes.c_size_t(0)
        self._looped(
            "score_exit", _ptr(arr), arr.size, n_prompt, ctypes.byref(p), _ptr(out, _F32P),
            out.size, ctypes.byref(n), _ptr(steps),
        )
        return out[: arr.size], steps[: arr.size]

    @_loops_also_as("n_loops")
    def logprobs(
        self, tokens: Tokens, loops: Optional[int] = None, decode_path: bool = False
    ) -> np.ndarray:
        """``log p(tokens[i+1] | tokens[:i+1])`` for every i < len(tokens) - 1 (np.float32).

        ``decode_path=True`` feeds each token as its own one-row decode step, as generation
        does (``tl_logprobs_decode``), instead of the tokens as one step."""
        arr = _tokens(tokens)
        out = np.empty(max(arr.size - 1, 1), dtype=np.float32)
        n = ctypes.c_size_t(0)
        self._run(
            "logprobs", "logprobs_decode" if decode_path else "logprobs", _ptr(arr), arr.size,
            _loops(loops), _ptr(out, _F32P), out.size, ctypes.byref(n),
        )
        return out[: n.value]

    @_loops_also_as("n_loops")
    def score_text(self, text: str, loops: Optional[int] = None) -> np.ndarray:
        """``log p(token[i+1] | tokens[:i+1])`` (np.float32) for the tokens of ``text`` under
        the model's tokenizer, with its special tokens (a BOS makes the first text token scored
        too): one value per token after the first."""
        args = (_utf8(text, "text"), _loops(loops))
        n_out = self._required("score_text", *args)
        out = np.empty(max(n_out, 1), dtype=np.float32)
        n = ctypes.c_size_t(0)
        self._looped("score_text", *args, _ptr(out, _F32P), out.size, ctypes.byref(n))
        return out[: n.value]

    # ---- looped-model calls (tl_* on a model, tl_session_* on a session) -----------------

    def _looped(self, method: str, *args, bound: Optional["_Bound"] = None) -> None:
        """Run the C function of ``method``: ``tl_<name>`` on a model, ``tl_session_<name>`` on a
        session."""
        self._call(method, self._prefix + _C_NAMES.get(method, method), *args, bound=bound)

    def _required(self, method: str, *args) -> int:
        """The output length a buffer call needs (a size query: NULL buffer, capacity 0);
        invalid arguments raise here, before any buffer is allocated."""
        n = ctypes.c_size_t(0)
        h = self._handle(method)
        ptr = h.acquire(method)
        try:
            fn = getattr(_dll, self._prefix + _C_NAMES.get(method, method))
            status = fn(ptr, *args, None, 0, ctypes.byref(n))
            if status != _c.TL_ERR_BUFFER_TOO_SMALL:
                _check(status, method, self._what)
        finally:
            h.release()
        return n.value

    @_loops_also_as("n_loops")
    def score_logit_lens(self, tokens: Tokens, loops: Optional[int] = None) -> np.ndarray:
        """The logit lens: logits ``[loops, vocab_size]`` (np.float32) at the last position of
        ``tokens``, read out after each loop iteration; row ``L - 1`` equals
        ``score_last(tokens, loops=L)``."""
        arr = _tokens(tokens)
        args = (_ptr(arr), arr.size, _loops(loops))
        vocab = self._vocab("score_logit_lens")
        out = np.empty((self._required("score_logit_lens", *args) // vocab, vocab), np.float32)
        n = ctypes.c_size_t(0)
        self._looped(
            "score_logit_lens", *args, _ptr(out, _F32P), out.size, ctypes.byref(n),
        )
        return out

    @_loops_also_as("n_loops")
    def score_trajectory(self, tokens: Tokens, loops: Optional[int] = None) -> List[Dict[str, Any]]:
        """The last position's path through the loop iterations: one dict per iteration with
        ``hidden_norm``, ``rel_change``, ``kl_prev`` (nats), ``entropy`` (bits), ``argmax``."""
        arr = _tokens(tokens)
        args = (_ptr(arr), arr.size, _loops(loops))
        n_loops = self._required("score_trajectory", *args)
        out = (_c.TrajectoryPoint * n_loops)()
        n = ctypes.c_size_t(0)
        self._looped("score_trajectory", *args, out, n_loops, ctypes.byref(n))
        keys = ("hidden_norm", "rel_change", "kl_prev", "entropy", "argmax")
        return [{k: getattr(point, k) for k in keys} for point in out[: n.value]]

    @_loops_also_as("n_loops", "verify_loops")
    def generate_speculative(
        self,
        tokens: Tokens,
        draft_loops: int,
        draft_len: int = 4,
        reuse: bool = True,
        max_tokens: int = 128,
        loops: Optional[int] = None,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: Optional[int] = None,
        stop: Optional[Iterable[int]] = None,
        ctx_tier: Optional[Union["CtxTier", Dict[str, Any]]] = None,
        beta_monitor: BetaMonitor = None,
        exit_threshold: Optional[float] = None,
        exit: Optional[str] = None,
        exit_policy: Optional[str] = None,
    ) -> np.ndarray:
        """Self-speculative generation: ``draft_len`` tokens at a time drafted at
        ``draft_loops`` iterations, verified at ``loops`` (the model default when None). Greedy
        output equals :meth:`generate` at ``loops``; sampled output has its distribution.
        ``reuse=False`` recomputes every block in the verify pass (the baseline,
        :meth:`generate_speculative_no_cache`). Acceptance counts (and with ``beta_monitor``
        the BETA-MON summary, agreement included): :meth:`last_generate_stats`. Adaptive exit
        as in :meth:`generate`, with the exit gate at ``exit_policy`` "reference" only: each
        verify row is its token's output at its exit iteration (the verify pass then runs every
        iteration, whatever ``reuse`` says), and the tokens and exits are :meth:`generate`'s."""
        call = _Call(
            tokens, max_tokens, loops, temperature, top_k, top_p, seed, stop,
            ctx_tier=ctx_tier, beta_monitor=beta_monitor,
            exit_threshold=exit_threshold, exit=exit, exit_policy=exit_policy,
        )
        return self._speculative("generate_speculative", call, draft_loops, draft_len, reuse)

    @_loops_also_as("n_loops", "verify_loops")
    def generate_speculative_no_cache(
        self,
        tokens: Tokens,
        draft_loops: int,
        draft_len: int = 4,
        max_tokens: int = 128,
        loops: Optional[int] = None,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: Optional[int] = None,
        stop: Optional[Iterable[int]] = None,
        ctx_tier: Optional[Union["CtxTier", Dict[str, Any]]] = None,
        beta_monitor: BetaMonitor = None,
        exit_threshold: Optional[float] = None,
        exit: Optional[str] = None,
        exit_policy: Optional[str] = None,
    ) -> np.ndarray:
        """The reference pages' name for :meth:`generate_speculative` with ``reuse=False``
        (the same arguments but ``reuse``): the verify pass recomputes every block application
        instead of continuing from the draft's KV and hidden state. The same tokens, slower;
        the baseline that draft reuse is measured against."""
        call = _Call(
            tokens, max_tokens, loops, temperature, top_k, top_p, seed, stop,
            ctx_tier=ctx_tier, beta_monitor=beta_monitor,
            exit_threshold=exit_threshold, exit=exit, exit_policy=exit_policy,
        )
        method = "generate_speculative_no_cache"
        return self._speculative(method, call, draft_loops, draft_len, reuse=False)

    def _speculative(
        self, method: str, call: _Call, draft_loops: int, draft_len: int, reuse: bool
    ) -> np.ndarray:
        """``tl_generate_speculative`` for ``method``."""
        spec = _c.SpeculativeParams()
        _check(_dll.tl_speculative_default_params(ctypes.byref(spec)), method)
        spec.draft_loops = _int(draft_loops, "draft_loops", 0, _U32_MAX)
        spec.draft_len = _int(draft_len, "draft_len", 0, _U32_MAX)
        spec.reuse = bool(reuse)
        out = np.empty(max(call.params.max_tokens, 1), dtype=np.int32)
        n = ctypes.c_size_t(0)
        self._looped(
            method, *call.args(), ctypes.byref(spec), _ptr(out), out.size, ctypes.byref(n),
        )
        return out[: n.value].copy()

    @_loops_also_as("n_loops")
    def build_prefix_cache(self, tokens: Tokens, loops: Optional[int] = None) -> "PrefixCache":
        """Run ``tokens`` at ``loops`` and keep their KV entries: ``generate(prompt,
        prefix_cache=cache)`` at the same loops then gives the tokens of generating from
        ``tokens + prompt``, on any session of this model. Closed with its model."""
        arr = _tokens(tokens)
        out = ctypes.c_void_p()
        self._looped("build_prefix_cache", _ptr(arr), arr.size, _loops(loops), ctypes.byref(out))
        return PrefixCache(out.value)

    @_loops_also_as("n_loops")
    def build_resume_handle(self, tokens: Tokens, loops: Optional[int] = None) -> "ResumeHandle":
        """Run the prompt ``tokens`` at ``loops`` and keep what :meth:`resume_generate` needs to
        generate after it at any loop count. Closed with its model."""
        arr = _tokens(tokens)
        out = ctypes.c_void_p()
        self._looped("build_resume_handle", _ptr(arr), arr.size, _loops(loops), ctypes.byref(out))
        return ResumeHandle(out.value)

    @_loops_also_as("n_loops")
    def resume_generate(
        self,
        handle: "ResumeHandle",
        max_tokens: int = 128,
        loops: Optional[int] = None,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: Optional[int] = None,
        stop: Optional[Iterable[int]] = None,
        ctx_tier: Optional[Union["CtxTier", Dict[str, Any]]] = None,
        beta_monitor: BetaMonitor = None,
    ) -> np.ndarray:
        """Generate after the prompt of ``handle`` at ``loops`` (any depth): the same tokens as
        ``generate(prompt, loops=loops)``, reusing the iterations the handle already ran."""
        if not isinstance(handle, ResumeHandle):
            raise TypeError(f"handle must be a ResumeHandle, got {type(handle).__name__}")
        call = _Call(
            (), max_tokens, loops, temperature, top_k, top_p, seed, stop,
            ctx_tier=ctx_tier, beta_monitor=beta_monitor,
        )
        out = np.empty(max(call.params.max_tokens, 1), dtype=np.int32)
        n = ctypes.c_size_t(0)
        self._looped(
            "resume_generate", handle._pointer("resume_generate"), ctypes.byref(call.params),
            _ptr(out), out.size, ctypes.byref(n), bound=handle,
        )
        return out[: n.value].copy()

    def last_generate_stats(self) -> Dict[str, Any]:
        """What the last successful generation call here did: ``tokens``, ``prefill_ms``,
        ``decode_ms``, and for speculative calls ``drafted``, ``accepted``,
        ``acceptance_rate`` and ``agreement`` (draft / verify argmax agreement), for calls with
        an exit rule ``exit_tokens`` (the tokens returned with an exit iteration: all of them)
        and ``exit_mean_steps`` (their mean exit iteration, 1-based); zeros before the first
        call. ``beta_mon``: None, or for a monitored call its BETA-MON summary, a dict
        with ``n_tokens``, ``entropy_mean_bits``, ``entropy_std_bits``, ``entropy_min_bits``,
        ``entropy_max_bits``, ``low_rate``, ``high_rate``, ``agreement_rate`` (None unless
        speculative), the thresholds ``low_entropy_bits``, ``high_entropy_bits``,
        ``agreement_floor``, and ``agreement_below_floor``."""
        stats = _c.GenerateStats()
        stats.struct_size = ctypes.sizeof(_c.GenerateStats)
        self._looped("last_generate_stats", ctypes.byref(stats))
        names = [name for name, _ in _c.GenerateStats._fields_ if name != "struct_size"]
        out: Dict[str, Any] = {
            k: getattr(stats, k) for k in names if not k.startswith(("ctx_", "beta_mon"))
        }
        tier = {k[len("ctx_tier_"):]: getattr(stats, k) for k in names if k.startswith("ctx_")}
        final = tier.pop("final")
        if final:
            tier["tier"] = "SHORT" if final == 1 else "LONG"
        out["ctx_tier"] = tier if final else None
        out["beta_mon"] = _beta_mon(stats) if stats.beta_mon else None
        return out

    def _vocab(self, method: str) -> int:
        raise NotImplementedError


class Model(_Runner):
    """Weights of one ``.tinyloop`` file on one device, plus a default session.

    :param path: the ``.tinyloop`` file.
    :param max_seq_len: upper bound on prompt + generated tokens, at most the model's
        ``max_position``; 0 (the default) is 2048, or ``max_position`` when that is smaller
        (``config()["max_seq_len"]`` gives the value in use).
    :param prefill_chunk: when > 0, prompts longer than this are prefilled in chunks and score
        calls accept at most this many tokens; 0 sizes buffers to ``max_seq_len``.
    :param device: "auto", "cpu", "cuda" or "cuda:N"; None uses ``TINYLOOP_DEVICE``, or
        "auto" when that is unset.
    :param max_loops: the largest ``loops`` a call may ask for.
    :param kv_mode: the KV cache mode: "fp16", "fp16-h", "int8-h", "int4-h", "int8", "delta",
        "age" or "age:A:B" (ValueError for others); None uses ``TINYLOOP_KV_INT8`` /
        ``TINYLOOP_KV_DELTA``, else "fp16".
    :param log: print the library's lines on stderr (the load log, and the CTX-TIER and BETA-MON
        lines of calls that ask for them); False silences them all.
    :param fp16_body: keep an FP16 copy of the transformer blocks' quantized weights on the GPU
        for prefill GEMMs through cuBLAS (more memory, faster long prompts; weights rounded to
        f16 on that path); None follows ``TINYLOOP_EXPERIMENTAL_FP16_BODY=1``. No effect on the CPU.
    :param state_init: how a model whose loop starts from a random state (Huginn) draws it:
        "model" (its own rule, from seed 0; also None), "zeros" or "seed:N". Other models
        accept only "model" (docs/MODELS.md).
    :raises RuntimeError: (:class:`TinyLoopError`) the file is missing or invalid, or the device
        is unusable; the message names the failure point.
    :raises ValueError: ``max_seq_len < 0`` or above ``max_position`` (and other invalid
        arguments).
    """

    _prefix = "tl_"
    _fn = {
        "generate": "tl_generate",
        "generate_stream": "tl_generate_stream",
        "score_last": "tl_score_last",
        "score": "tl_score",
        "logprobs": "tl_logprobs",
        "logprobs_decode": "tl_logprobs_decode",
        "cancel": "tl_cancel",
    }

    def __init__(
        self,
        path: Union[str, "os.PathLike[str]"],
        max_seq_len: int = 0,
        prefill_chunk: int = 0,
        device: Optional[str] = None,
        max_loops: int = 64,
        kv_mode: Optional[str] = None,
        log: bool = True,
        fp16_body: Optional[bool] = None,
        state_init: Optional[str] = None,
    ):
        super().__init__()
        self._config: Optional[Dict[str, Any]] = None
        params = _c.ModelParams()
        _check(_dll.tl_model_default_params(ctypes.byref(params)), "Model")
        params.max_seq_len = _int(max_seq_len, "max_seq_len", 0, _U32_MAX)
        params.prefill_chunk = _int(prefill_chunk, "prefill_chunk", 0, _U32_MAX)
        params.max_loops = _int(max_loops, "max_loops", 1, _U32_MAX)
        params.log = bool(log)
        device_bytes = None if device is None else str(device).encode("utf-8")
        params.device = device_bytes
        kv_mode_bytes = None if kv_mode is None else str(kv_mode).encode("utf-8")
        params.kv_mode = kv_mode_bytes
        if fp16_body is not None and not isinstance(fp16_body, bool):
            raise TypeError(f"fp16_body must be a bool or None, got {type(fp16_body).__name__}")
        params.fp16_body = -1 if fp16_body is None else int(fp16_body)
        params.state_init = None if state_init is None else _utf8(state_init, "state_init")
        handle = ctypes.c_void_p()
        _check(
            _dll.tl_model_open(os.fsencode(os.fspath(path)), ctypes.byref(params),
                               ctypes.byref(handle)),
            "Model",
        )
        self.path = os.fspath(path)
        self._h = _Handle(handle.value, "model", _dll.tl_close, _dll.tl_model_free)

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<tinyloop_py.Model {self.path!r} ({state})>"

    def config(self) -> Dict[str, Any]:
        """The static architecture from the file header: ``dim, n_heads, ffn_dim, vocab_size,
        embed_factor_dim, n_pre_blocks, default_loops`` plus ``n_kv_heads, n_loop_blocks,
        n_post_blocks, norm, norm_eps, rope_theta, max_position, head``; and the options the
        model was opened with, ``max_seq_len`` (the value in use), ``prefill_chunk`` and
        ``max_loops``."""
        cfg = _c.Config()
        cfg.struct_size = ctypes.sizeof(_c.Config)
        self._run_model("config", _dll.tl_model_config, ctypes.byref(cfg))
        keys = [
            "dim", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "embed_factor_dim",
            "n_pre_blocks", "n_loop_blocks", "n_post_blocks", "default_loops", "norm_eps",
            "rope_theta", "max_position", "max_seq_len", "prefill_chunk", "max_loops",
        ]
        out: Dict[str, Any] = {k: getattr(cfg, k) for k in keys}
        out["norm"] = cfg.norm.decode()
        out["head"] = cfg.head.decode()
        self._config = out
        return dict(out)

    def vram_usage_mb(self) -> float:
        """Device memory held by the weights and every live session, in MB (10^6 bytes)."""
        mb = ctypes.c_double(0.0)
        self._run_model("vram_usage_mb", _dll.tl_vram_usage_mb, ctypes.byref(mb))
        return float(mb.value)

    @property
    def device(self) -> str:
        """The device the weights live on, in words."""
        return self._text("device", _dll.tl_model_device)

    @property
    def kv_mode(self) -> str:
        """The KV cache mode of this model's sessions (as opened, or chosen by the
        environment)."""
        return self._text("kv_mode", _dll.tl_model_kv_mode)

    def _text(self, method: str, fn) -> str:
        n = ctypes.c_size_t(0)
        buf = ctypes.create_string_buffer(256)
        self._run_model(method, fn, buf, ctypes.sizeof(buf), ctypes.byref(n))
        return buf.value.decode("utf-8", "replace")

    def tokenize(self, text: str, add_special_tokens: bool = True) -> np.ndarray:
        """The token ids (np.int32) of ``text`` under the model's tokenizer; with
        ``add_special_tokens``, those the tokenizer adds around a text (its BOS, ...). Special
        tokens written in the text ("<|im_start|>") are recognized either way."""
        args = (_utf8(text, "text"), bool(add_special_tokens))
        n = ctypes.c_size_t(0)
        out = np.empty(len(args[0]) + 8, dtype=np.int32)
        status = self._call_model("tokenize", _dll.tl_tokenize, *args, _ptr(out), out.size,
                                  ctypes.byref(n))
        if status == _c.TL_ERR_BUFFER_TOO_SMALL:
            out = np.empty(n.value, dtype=np.int32)
            self._run_model("tokenize", _dll.tl_tokenize, *args, _ptr(out), out.size,
                            ctypes.byref(n))
        return out[: n.value].copy()

    def detokenize(self, tokens: Tokens, skip_special_tokens: bool = False) -> str:
        """The text of ``tokens`` under the model's tokenizer (special tokens left out with
        ``skip_special_tokens``); bytes that do not form UTF-8 become U+FFFD."""
        arr = _tokens(tokens)
        return self._model_str(
            "detokenize", _dll.tl_detokenize, _ptr(arr), arr.size, bool(skip_special_tokens)
        )

    def special_token(self, text: str) -> int:
        """The id of the special token written ``text`` (e.g. "<|im_end|>");
        :class:`InvalidArgumentError` names an unknown one."""
        out = ctypes.c_int32(0)
        self._run_model("special_token", _dll.tl_special_token, _utf8(text, "text"),
                        ctypes.byref(out))
        return int(out.value)

    def apply_chat_template(
        self, messages: Iterable[Dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """``messages`` (dicts with "role" and "content") rendered by the model's chat
        template; with ``add_generation_prompt``, followed by the start of the assistant's
        reply. Generate from it with ``generate(text=..., add_special_tokens=False)``."""
        encoded = []
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or set(message) != {"role", "content"}:
                raise TypeError(
                    f"messages[{i}] must be a dict with exactly 'role' and 'content', got {message!r}"
                )
            encoded.append(
                (_utf8(message["role"], f"messages[{i}]['role']"),
                 _utf8(message["content"], f"messages[{i}]['content']"))
            )
        array = (_c.ChatMessage * max(len(encoded), 1))(*[_c.ChatMessage(r, c) for r, c in encoded])
        return self._model_str(
            "apply_chat_template", _dll.tl_apply_chat_template, array, len(encoded),
            bool(add_generation_prompt),
        )

    def _call_model(self, method: str, fn, *args) -> int:
        """Call ``fn`` on the model handle; returns the status (TL_ERR_BUFFER_TOO_SMALL is not
        raised, other failures are)."""
        h = self._handle(method)
        ptr = h.acquire(method)
        try:
            status = fn(ptr, *args)
            if status != _c.TL_ERR_BUFFER_TOO_SMALL:
                _check(status, method)
            return status
        finally:
            h.release()

    def _model_str(self, method: str, fn, *args) -> str:
        """The NUL-terminated UTF-8 text a model function writes to (out, cap, len): a size
        query, then the call."""
        n = ctypes.c_size_t(0)
        self._call_model(method, fn, *args, None, 0, ctypes.byref(n))
        buf = ctypes.create_string_buffer(n.value)
        self._run_model(method, fn, *args, buf, n.value, ctypes.byref(n))
        return buf.raw[: n.value - 1].decode("utf-8")

    def new_session(self) -> "Session":
        """A new session (own buffers and KV cache) over this model's weights; use one per
        thread for concurrent generation. It keeps the weights alive until it is closed."""
        out = ctypes.c_void_p()
        self._run_model("new_session", _dll.tl_session_new, ctypes.byref(out))
        return Session(out.value, self)

    def _run_model(self, method: str, fn, *args) -> None:
        h = self._handle(method)
        ptr = h.acquire(method)
        try:
            _check(fn(ptr, *args), method)
        finally:
            h.release()

    def _vocab(self, method: str) -> int:
        if self._config is None:
            if self.closed:
                raise _closed(method, "model")
            self.config()
        assert self._config is not None
        return int(self._config["vocab_size"])


class Session(_Runner):
    """One sequence's buffers and KV cache over a :class:`Model`'s shared weights. Use from one
    thread at a time (a concurrent call raises :class:`BusyError`)."""

    _what = "session"
    _prefix = "tl_session_"
    _fn = {
        "generate": "tl_session_generate",
        "generate_stream": "tl_session_generate_stream",
        "score_last": "tl_session_score_last",
        "score": "tl_session_score",
        "logprobs": "tl_session_logprobs",
        "logprobs_decode": "tl_session_logprobs_decode",
        "cancel": "tl_session_cancel",
    }

    def __init__(self, ptr: int, model: Model):
        super().__init__()
        self._vocab_size = model._vocab("new_session")
        self._h = _Handle(ptr, "session", _dll.tl_session_cancel, _dll.tl_session_free)

    def _vocab(self, method: str) -> int:
        return self._vocab_size


class _Bound(_Closing):
    """A prefix cache or resume handle: bound to the model it was built on (closing the model
    releases it), freed by :meth:`close`, the context manager, or garbage collection."""

    _noun = ""
    _free = None
    _memory = None

    def __init__(self, ptr: int):
        self._ptr: Optional[int] = ptr

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran (closing its model is only noticed by the next call)."""
        return self._ptr is None

    def _pointer(self, method: str) -> int:
        if self._ptr is None:
            raise self._released(method)
        return self._ptr

    def _released(self, method: str) -> ClosedError:
        return ClosedError(
            f"{method}() called with a {self._noun} that was closed, or whose model was "
            f"closed; build a new one",
            _c.TL_ERR_CLOSED,
        )

    def memory_mb(self) -> float:
        """Device memory it holds, in MB (10^6 bytes); part of the model's vram_usage_mb()."""
        mb = ctypes.c_double(0.0)
        status = type(self)._memory(self._pointer("memory_mb"), ctypes.byref(mb))
        if status == _c.TL_ERR_CLOSED:
            raise self._released("memory_mb")
        _check(status, "memory_mb")
        return float(mb.value)

    def close(self) -> None:
        """Release it now (idempotent). A call using it in another thread finishes normally."""
        ptr, self._ptr = self._ptr, None
        if ptr is not None:
            type(self)._free(ptr)


class PrefixCache(_Bound):
    """The KV entries of a prefix, from :meth:`Model.build_prefix_cache`; pass it as
    ``generate(..., prefix_cache=cache)``. Several sessions may use one cache at once."""

    _noun = "prefix cache"
    _free = _dll.tl_prefix_cache_free
    _memory = _dll.tl_prefix_cache_memory_mb


class ResumeHandle(_Bound):
    """A prompt run at some loop count, from :meth:`Model.build_resume_handle`; resume it at
    any depth with :meth:`Model.resume_generate`."""

    _noun = "resume handle"
    _free = _dll.tl_resume_handle_free
    _memory = _dll.tl_resume_handle_memory_mb


class Request:
    """A request submitted to an :class:`Engine`. Iterate it (``for token in request``, or
    ``async for token in request`` from asyncio) for its tokens as they are generated; once
    the iteration ends, :attr:`stats` says what it did. Iteration raises
    :class:`CancelledError` when the request was cancelled (:meth:`cancel`, or the engine was
    closed) and the failure that stopped it otherwise. One consumer at a time."""

    def __init__(self, engine: "Engine", request_id: int):
        self._engine = engine
        #: The request's id in its engine.
        self.id = request_id
        #: After the last token: ``prompt_tokens``, ``cached_tokens`` (prompt tokens taken from
        #: the cached pages of an earlier request with the same prefix), ``tokens``, ``finish``
        #: ("length" or "stop"), ``queue_ms``, ``first_token_ms`` and ``total_ms``.
        self.stats: Optional[Dict[str, Any]] = None

    def _next(self) -> Optional[int]:
        """The next token, or None once the request has finished (waits for the engine)."""
        if self.stats is not None:
            return None
        if self._engine.closed:
            raise CancelledError(
                f"request {self.id} was cancelled: its engine was closed", _c.TL_ERR_CANCELLED
            )
        event = _c.EngineEvent()
        self._engine._call("Request", "tl_engine_next", ctypes.c_uint64(self.id), -1,
                           ctypes.byref(event))
        if event.kind == _c.EVENT_TOKEN:
            return int(event.token)
        s = event.stats
        self.stats = {
            "prompt_tokens": s.prompt_tokens,
            "cached_tokens": s.cached_tokens,
            "tokens": s.tokens,
            "finish": _c.FINISH_NAMES.get(s.finish, "unknown"),
            "queue_ms": s.queue_ms,
            "first_token_ms": s.first_token_ms,
            "total_ms": s.total_ms,
        }
        return None

    def __iter__(self) -> Iterator[int]:
        while True:
            token = self._next()
            if token is None:
                return
            yield token

    async def __aiter__(self):
        import asyncio

        loop = asyncio.get_running_loop()
        while True:
            # The wait runs on a worker thread (without the GIL), not on the event loop.
            token = await loop.run_in_executor(None, self._next)
            if token is None:
                return
            yield token

    def tokens(self) -> np.ndarray:
        """Wait for every token; returns them as np.int32."""
        return np.array(list(self), dtype=np.int32)

    def cancel(self) -> None:
        """Cancel the request: its iteration then raises :class:`CancelledError`. A request
        that has ended raises ValueError."""
        self._engine._call("cancel", "tl_engine_cancel", ctypes.c_uint64(self.id))


class Engine(_Owner):
    """Many concurrent requests over one :class:`Model`, batched at every step (continuous
    batching, docs/ABI.md "Engines"): each request's tokens are those ``Model.generate`` gives
    it alone. :meth:`submit` may be called from any thread; the engine runs on a thread of its
    own. CPU models only, KV modes fp16, int8 and delta.

    :param model: the model; the engine keeps its weights alive until it is closed.
    :param max_step_rows: rows one step runs at most (decode rows and prompt chunks together).
    :param max_running: requests that run at once; more wait in the queue.
    :param page_size: positions per KV page.
    :param pool_positions: positions of the KV pool (rounded up to whole pages); 0: 8 ×
        ``max_seq_len``.
    :param max_queued: requests waiting at most; a submit beyond it raises :class:`BusyError`.
    """

    _what = "engine"

    def __init__(
        self,
        model: Model,
        max_step_rows: int = 256,
        max_running: int = 64,
        page_size: int = 16,
        pool_positions: int = 0,
        max_queued: int = 4096,
    ):
        self._h: Optional[_Handle] = None
        params = _c.EngineParams()
        _check(_dll.tl_engine_default_params(ctypes.byref(params)), "Engine")
        params.max_step_rows = _int(max_step_rows, "max_step_rows", 0, _U32_MAX)
        params.max_running = _int(max_running, "max_running", 0, _U32_MAX)
        params.page_size = _int(page_size, "page_size", 0, _U32_MAX)
        params.pool_positions = _int(pool_positions, "pool_positions", 0, 2**64 - 1)
        params.max_queued = _int(max_queued, "max_queued", 0, _U32_MAX)
        handle = ctypes.c_void_p()
        model_handle = model._handle("Engine")
        ptr = model_handle.acquire("Engine")
        try:
            _check(_dll.tl_engine_new(ptr, ctypes.byref(params), ctypes.byref(handle)), "Engine")
        finally:
            model_handle.release()
        self._h = _Handle(handle.value, "engine", _dll.tl_engine_free, lambda ptr: None)

    def _call(self, method: str, fn_name: str, *args) -> None:
        if self._h is None:
            raise _closed(method, self._what)
        ptr = self._h.acquire(method)
        try:
            _check(getattr(_dll, fn_name)(ptr, *args), method, self._what)
        finally:
            self._h.release()

    def submit(
        self,
        tokens: Tokens,
        max_tokens: int = 128,
        loops: Optional[int] = None,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: Optional[int] = None,
        stop: Optional[Iterable[int]] = None,
    ) -> Request:
        """Queue a request with the arguments of :meth:`Model.generate` (token prompts; stop
        tokens); returns it at once. Iterate the :class:`Request` for its tokens."""
        call = _Call(tokens, max_tokens, loops, temperature, top_k, top_p, seed, stop)
        call.check_tokens(tokens)
        request_id = ctypes.c_uint64()
        self._call("submit", "tl_engine_submit", *call.args(), ctypes.byref(request_id))
        return Request(self, request_id.value)

    def stats(self) -> Dict[str, int]:
        """``queued``, ``running``, ``pool_pages``, ``pages_used``, ``cached_pages``,
        ``page_size``, ``steps``, ``rows``, ``tokens`` and ``preemptions`` now."""
        out = _c.EngineStats()
        self._call("stats", "tl_engine_get_stats", ctypes.byref(out))
        return {name: int(getattr(out, name)) for name, _ in _c.EngineStats._fields_}

    def close(self) -> None:
        """Stop the engine: queued and running requests end with :class:`CancelledError`.
        Idempotent."""
        super().close()


def load(path: Union[str, "os.PathLike[str]"], **kwargs: Any) -> Model:
    """Alias of :class:`Model` (``load(path, max_seq_len=...)``)."""
    return Model(path, **kwargs)
