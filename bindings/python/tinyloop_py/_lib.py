"""Loading libtinyloop and declaring its C ABI (include/tinyloop.h) for ctypes."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from pathlib import Path
from typing import List, Optional

#: The C ABI version these declarations describe (TL_ABI_VERSION in include/tinyloop.h).
ABI_VERSION = 1
#: TL_LOOPS_DEFAULT: a loops value selecting the model's default_loops.
LOOPS_DEFAULT = -1
#: TL_MAX_DRAFT_LEN: the largest draft_len of speculative generation.
MAX_DRAFT_LEN = 15

STATUS_NAMES = {
    0: "TL_OK",
    1: "TL_ERR_INVALID_ARGUMENT",
    2: "TL_ERR_IO",
    3: "TL_ERR_FORMAT",
    4: "TL_ERR_OUT_OF_MEMORY",
    5: "TL_ERR_DEVICE",
    6: "TL_ERR_CLOSED",
    7: "TL_ERR_BUSY",
    8: "TL_ERR_CANCELLED",
    9: "TL_ERR_PANIC",
    10: "TL_ERR_BUFFER_TOO_SMALL",
}
TL_OK = 0
TL_ERR_INVALID_ARGUMENT = 1
TL_ERR_CLOSED = 6
TL_ERR_BUSY = 7
TL_ERR_CANCELLED = 8
TL_ERR_BUFFER_TOO_SMALL = 10

if sys.platform == "darwin":
    LIB_NAMES = ["libtinyloop.dylib"]
elif sys.platform == "win32":
    LIB_NAMES = ["tinyloop.dll"]
else:
    LIB_NAMES = ["libtinyloop.so"]


class ModelParams(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("max_seq_len", ctypes.c_uint32),
        ("prefill_chunk", ctypes.c_uint32),
        ("device", ctypes.c_char_p),
        ("max_loops", ctypes.c_uint32),
        ("log", ctypes.c_bool),
        ("kv_mode", ctypes.c_char_p),
        ("fp16_body", ctypes.c_int32),
        ("state_init", ctypes.c_char_p),
    ]


class GenerateParams(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("max_tokens", ctypes.c_uint32),
        ("loops", ctypes.c_int32),
        ("temperature", ctypes.c_float),
        ("top_k", ctypes.c_uint32),
        ("top_p", ctypes.c_float),
        ("seed", ctypes.c_uint64),
        ("stop_tokens", ctypes.POINTER(ctypes.c_int32)),
        ("n_stop_tokens", ctypes.c_size_t),
        ("prefix_cache", ctypes.c_void_p),
        ("ctx_tier", ctypes.c_void_p),
        ("beta_monitor", ctypes.c_bool),
        ("beta_mon_low_entropy_bits", ctypes.c_double),
        ("beta_mon_high_entropy_bits", ctypes.c_double),
        ("beta_mon_agreement_floor", ctypes.c_double),
        ("exit_threshold", ctypes.c_double),
        ("exit", ctypes.c_char_p),
        ("exit_policy", ctypes.c_char_p),
    ]


class CtxTierParams(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("short_t", ctypes.c_uint32),
        ("long_t", ctypes.c_uint32),
        ("long_bits", ctypes.c_uint32),
        ("verbose", ctypes.c_bool),
        ("file", ctypes.c_char_p),
    ]


class SpeculativeParams(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("draft_loops", ctypes.c_uint32),
        ("draft_len", ctypes.c_uint32),
        ("reuse", ctypes.c_bool),
    ]


class TrajectoryPoint(ctypes.Structure):
    _fields_ = [
        ("hidden_norm", ctypes.c_double),
        ("rel_change", ctypes.c_double),
        ("kl_prev", ctypes.c_double),
        ("entropy", ctypes.c_double),
        ("argmax", ctypes.c_int32),
    ]


class GenerateStats(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("tokens", ctypes.c_size_t),
        ("prefill_ms", ctypes.c_double),
        ("decode_ms", ctypes.c_double),
        ("drafted", ctypes.c_size_t),
        ("accepted", ctypes.c_size_t),
        ("acceptance_rate", ctypes.c_double),
        ("agreement", ctypes.c_double),
        ("ctx_tier_observations", ctypes.c_size_t),
        ("ctx_tier_short_steps", ctypes.c_size_t),
        ("ctx_tier_long_steps", ctypes.c_size_t),
        ("ctx_tier_transitions", ctypes.c_size_t),
        ("ctx_tier_last_seq_len", ctypes.c_size_t),
        ("ctx_tier_elapsed_ms", ctypes.c_double),
        ("ctx_tier_apply_ms", ctypes.c_double),
        ("ctx_tier_freed_bytes", ctypes.c_int64),
        ("ctx_tier_final", ctypes.c_int32),
        ("beta_mon", ctypes.c_bool),
        ("beta_mon_n_tokens", ctypes.c_size_t),
        ("beta_mon_entropy_mean_bits", ctypes.c_double),
        ("beta_mon_entropy_std_bits", ctypes.c_double),
        ("beta_mon_entropy_min_bits", ctypes.c_double),
        ("beta_mon_entropy_max_bits", ctypes.c_double),
        ("beta_mon_low_rate", ctypes.c_double),
        ("beta_mon_high_rate", ctypes.c_double),
        ("beta_mon_low_entropy_bits", ctypes.c_double),
        ("beta_mon_high_entropy_bits", ctypes.c_double),
        ("beta_mon_agreement_floor", ctypes.c_double),
        ("beta_mon_agreement_below_floor", ctypes.c_bool),
        ("exit_tokens", ctypes.c_size_t),
        ("exit_mean_steps", ctypes.c_double),
    ]


class Config(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("dim", ctypes.c_uint32),
        ("n_heads", ctypes.c_uint32),
        ("n_kv_heads", ctypes.c_uint32),
        ("ffn_dim", ctypes.c_uint32),
        ("vocab_size", ctypes.c_uint32),
        ("embed_factor_dim", ctypes.c_uint32),
        ("n_pre_blocks", ctypes.c_uint32),
        ("n_loop_blocks", ctypes.c_uint32),
        ("n_post_blocks", ctypes.c_uint32),
        ("default_loops", ctypes.c_uint32),
        ("norm", ctypes.c_char_p),
        ("norm_eps", ctypes.c_double),
        ("rope_theta", ctypes.c_double),
        ("max_position", ctypes.c_uint32),
        ("head", ctypes.c_char_p),
        ("max_seq_len", ctypes.c_uint32),
        ("prefill_chunk", ctypes.c_uint32),
        ("max_loops", ctypes.c_uint32),
    ]


class TextParams(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("stop", ctypes.POINTER(ctypes.c_char_p)),
        ("n_stop", ctypes.c_size_t),
        ("add_special_tokens", ctypes.c_bool),
        ("skip_special_tokens", ctypes.c_bool),
    ]


class ChatMessage(ctypes.Structure):
    _fields_ = [("role", ctypes.c_char_p), ("content", ctypes.c_char_p)]


class EngineParams(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("max_step_rows", ctypes.c_uint32),
        ("max_running", ctypes.c_uint32),
        ("page_size", ctypes.c_uint32),
        ("max_queued", ctypes.c_uint32),
        ("pool_positions", ctypes.c_uint64),
    ]


class RequestStats(ctypes.Structure):
    _fields_ = [
        ("prompt_tokens", ctypes.c_uint32),
        ("cached_tokens", ctypes.c_uint32),
        ("tokens", ctypes.c_uint32),
        ("finish", ctypes.c_int),
        ("queue_ms", ctypes.c_double),
        ("first_token_ms", ctypes.c_double),
        ("total_ms", ctypes.c_double),
    ]


#: tl_event_kind
EVENT_NONE, EVENT_TOKEN, EVENT_DONE = 0, 1, 2
#: tl_finish
FINISH_NAMES = {0: "length", 1: "stop"}


class EngineEvent(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_int),
        ("token", ctypes.c_int32),
        ("stats", RequestStats),
    ]


class EngineStats(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_uint64)
        for name in (
            "queued", "running", "pool_pages", "pages_used", "cached_pages", "page_size", "steps",
            "rows", "tokens", "preemptions",
        )
    ]


#: tl_token_callback: bool (*)(int32_t token, void *user_data)
TOKEN_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_int32, ctypes.c_void_p)
#: tl_text_callback: bool (*)(const char *piece, size_t len, void *user_data)
TEXT_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)

_status = ctypes.c_int
_p = ctypes.c_void_p
_i32p = ctypes.POINTER(ctypes.c_int32)
_f32p = ctypes.POINTER(ctypes.c_float)
_sizep = ctypes.POINTER(ctypes.c_size_t)
_size = ctypes.c_size_t

_genp = ctypes.POINTER(GenerateParams)
_specp = ctypes.POINTER(SpeculativeParams)
_pointp = ctypes.POINTER(TrajectoryPoint)
_statsp = ctypes.POINTER(GenerateStats)
_dblp = ctypes.POINTER(ctypes.c_double)
_textp = ctypes.POINTER(TextParams)
_charp = ctypes.c_char_p

_SIGNATURES = {
    "tl_abi_version": (ctypes.c_uint32, []),
    "tl_status_string": (ctypes.c_char_p, [ctypes.c_int32]),
    "tl_last_error_message": (ctypes.c_char_p, []),
    "tl_model_default_params": (_status, [ctypes.POINTER(ModelParams)]),
    "tl_generate_default_params": (_status, [ctypes.POINTER(GenerateParams)]),
    "tl_model_open": (_status, [ctypes.c_char_p, ctypes.POINTER(ModelParams), ctypes.POINTER(_p)]),
    "tl_close": (_status, [_p]),
    "tl_model_free": (None, [_p]),
    "tl_cancel": (_status, [_p]),
    "tl_model_config": (_status, [_p, ctypes.POINTER(Config)]),
    "tl_vram_usage_mb": (_status, [_p, ctypes.POINTER(ctypes.c_double)]),
    "tl_model_device": (_status, [_p, ctypes.c_char_p, _size, _sizep]),
    "tl_model_kv_mode": (_status, [_p, ctypes.c_char_p, _size, _sizep]),
    "tl_generate": (
        _status,
        [_p, _i32p, _size, ctypes.POINTER(GenerateParams), _i32p, _size, _sizep],
    ),
    "tl_generate_stream": (
        _status,
        [_p, _i32p, _size, ctypes.POINTER(GenerateParams), TOKEN_CALLBACK, _p],
    ),
    "tl_score_last": (_status, [_p, _i32p, _size, ctypes.c_int32, _f32p, _size, _sizep]),
    "tl_score": (_status, [_p, _i32p, _size, ctypes.c_int32, _f32p, _size, _sizep]),
    "tl_logprobs": (_status, [_p, _i32p, _size, ctypes.c_int32, _f32p, _size, _sizep]),
    "tl_logprobs_decode": (_status, [_p, _i32p, _size, ctypes.c_int32, _f32p, _size, _sizep]),
    "tl_session_new": (_status, [_p, ctypes.POINTER(_p)]),
    "tl_session_free": (None, [_p]),
    "tl_session_cancel": (_status, [_p]),
    "tl_session_generate": (
        _status,
        [_p, _i32p, _size, ctypes.POINTER(GenerateParams), _i32p, _size, _sizep],
    ),
    "tl_session_generate_stream": (
        _status,
        [_p, _i32p, _size, ctypes.POINTER(GenerateParams), TOKEN_CALLBACK, _p],
    ),
    "tl_session_score_last": (_status, [_p, _i32p, _size, ctypes.c_int32, _f32p, _size, _sizep]),
    "tl_session_score": (_status, [_p, _i32p, _size, ctypes.c_int32, _f32p, _size, _sizep]),
    "tl_session_logprobs": (_status, [_p, _i32p, _size, ctypes.c_int32, _f32p, _size, _sizep]),
    "tl_session_logprobs_decode": (
        _status, [_p, _i32p, _size, ctypes.c_int32, _f32p, _size, _sizep]
    ),
    "tl_speculative_default_params": (_status, [_specp]),
    "tl_ctx_tier_default_params": (_status, [ctypes.POINTER(CtxTierParams)]),
    "tl_prefix_cache_free": (None, [_p]),
    "tl_prefix_cache_memory_mb": (_status, [_p, _dblp]),
    "tl_resume_handle_free": (None, [_p]),
    "tl_resume_handle_memory_mb": (_status, [_p, _dblp]),
    "tl_text_default_params": (_status, [_textp]),
    "tl_tokenize": (_status, [_p, _charp, ctypes.c_bool, _i32p, _size, _sizep]),
    "tl_detokenize": (_status, [_p, _i32p, _size, ctypes.c_bool, _p, _size, _sizep]),
    "tl_special_token": (_status, [_p, _charp, _i32p]),
    "tl_apply_chat_template": (
        _status, [_p, ctypes.POINTER(ChatMessage), _size, ctypes.c_bool, _p, _size, _sizep]
    ),
    "tl_engine_default_params": (_status, [ctypes.POINTER(EngineParams)]),
    "tl_engine_new": (_status, [_p, ctypes.POINTER(EngineParams), ctypes.POINTER(_p)]),
    "tl_engine_submit": (
        _status, [_p, _i32p, _size, ctypes.POINTER(GenerateParams), ctypes.POINTER(ctypes.c_uint64)]
    ),
    "tl_engine_next": (
        _status, [_p, ctypes.c_uint64, ctypes.c_int32, ctypes.POINTER(EngineEvent)]
    ),
    "tl_engine_cancel": (_status, [_p, ctypes.c_uint64]),
    "tl_engine_get_stats": (_status, [_p, ctypes.POINTER(EngineStats)]),
    "tl_engine_free": (None, [_p]),
}

# The text calls, each in a model form (tl_*) and a session form (tl_session_*).
_TEXT = {
    "generate_text": (_status, [_charp, _genp, _textp, _p, _size, _sizep]),
    "generate_text_stream": (_status, [_charp, _genp, _textp, TEXT_CALLBACK, _p]),
    "score_text": (_status, [_charp, ctypes.c_int32, _f32p, _size, _sizep]),
}
for _name, (_restype, _args) in _TEXT.items():
    _SIGNATURES["tl_" + _name] = (_restype, [_p, *_args])
    _SIGNATURES["tl_session_" + _name] = (_restype, [_p, *_args])

# The looped-model calls, each in a model form (tl_*) and a session form (tl_session_*) with the
# same arguments after the handle.
_LOOPED = {
    "score_logit_lens": (_status, [_i32p, _size, ctypes.c_int32, _f32p, _size, _sizep]),
    "score_trajectory": (_status, [_i32p, _size, ctypes.c_int32, _pointp, _size, _sizep]),
    "score_exit": (_status, [_i32p, _size, _size, _genp, _f32p, _size, _sizep, _i32p]),
    "generate_speculative": (_status, [_i32p, _size, _genp, _specp, _i32p, _size, _sizep]),
    "prefix_cache_new": (_status, [_i32p, _size, ctypes.c_int32, ctypes.POINTER(_p)]),
    "resume_handle_new": (_status, [_i32p, _size, ctypes.c_int32, ctypes.POINTER(_p)]),
    "resume_generate": (_status, [_p, _genp, _i32p, _size, _sizep]),
    "last_generate_stats": (_status, [_statsp]),
}
for _name, (_restype, _args) in _LOOPED.items():
    _SIGNATURES["tl_" + _name] = (_restype, [_p, *_args])
    _SIGNATURES["tl_session_" + _name] = (_restype, [_p, *_args])


def candidate_paths(env: Optional[dict] = None, cwd: Optional[Path] = None) -> List[Path]:
    """Where the library is looked for, in order (see the package README)."""
    env = os.environ if env is None else env
    cwd = Path.cwd() if cwd is None else cwd
    found: List[Path] = []
    explicit = env.get("TINYLOOP_LIB")
    if explicit:
        p = Path(explicit)
        found.extend([p / n for n in LIB_NAMES] if p.is_dir() else [p])
    package_dir = Path(__file__).resolve().parent
    found.extend(package_dir / n for n in LIB_NAMES)
    for start in (cwd.resolve(), package_dir):
        for folder in [start, *start.parents]:
            for profile in ("release", "debug"):
                found.extend(folder / "target" / profile / n for n in LIB_NAMES)
    return found


def load_library() -> ctypes.CDLL:
    """Load libtinyloop, declare its functions, and check the ABI version."""
    explicit = os.environ.get("TINYLOOP_LIB")
    lib = None
    if explicit:
        # An explicit choice is never second-guessed: it loads or the import fails.
        path = candidate_paths()[0]
        if not path.is_file():
            raise ImportError(f"tinyloop_py: TINYLOOP_LIB={explicit}: no library file at {path}")
        lib = ctypes.CDLL(str(path))
    else:
        errors = []
        for path in candidate_paths():
            if path.is_file():
                try:
                    lib = ctypes.CDLL(str(path))
                    break
                except OSError as e:  # e.g. another architecture; try the next candidate
                    errors.append(f"{path}: {e}")
        if lib is None:
            system = ctypes.util.find_library("tinyloop")
            if system:
                lib = ctypes.CDLL(system)
        if lib is None:
            raise ImportError(
                "tinyloop_py: cannot find libtinyloop; build it with `cargo build --release` "
                "or set TINYLOOP_LIB to its path" + "".join("\n  " + e for e in errors)
            )
    lib.tl_abi_version.restype = ctypes.c_uint32
    lib.tl_abi_version.argtypes = []
    version = lib.tl_abi_version()
    if version != ABI_VERSION:
        raise ImportError(
            f"tinyloop_py: {lib._name} implements C ABI version {version}, this binding needs "
            f"{ABI_VERSION}; rebuild the library or reinstall the binding"
        )
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes
    return lib
