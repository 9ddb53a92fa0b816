//! Text in, text out at the C ABI: tokenizing, detokenizing, chat templates, special-token
//! lookup, and generation and scoring that take and give UTF-8 text through the model's
//! tokenizer. Generation and scoring are written once over a [`Target`], with their two entry
//! points side by side; the others only read the model and never wait for a running call.

use std::ffi::{c_char, c_void};

use super::calls::{c_tokens, fill};
use super::looped::params_without_prefix;
use super::model::{model_of, tl_model};
use super::params::{
    check_buffer, loops_arg, read_versioned, speculation, tl_speculative_params, tokens_arg,
    write_buffer,
};
use super::session::tl_session;
use super::target::Target;
use super::{
    boundary, c_str, non_null, tl_generate_params, tl_status, write_out, Failure, FfiResult,
};
use crate::{ChatMessage, GeneratedText, Model, Session, TextParams};

/// How a text call turns its prompt into tokens and the generated tokens into text. Fill with
/// `tl_text_default_params`, then change fields.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct tl_text_params {
    /// `sizeof(tl_text_params)`; set by `tl_text_default_params`. Smaller values are rejected;
    /// larger values are accepted and the extra bytes ignored.
    pub struct_size: usize,
    /// Stop strings (NUL-terminated UTF-8, none empty): generation ends once the generated text
    /// contains one, also when it spans several tokens, and the text returned ends before it.
    /// May be NULL when `n_stop` is 0. Only read during the call.
    pub stop: *const *const c_char,
    /// Number of entries in `stop`. Default 0.
    pub n_stop: usize,
    /// Add the tokenizer's special tokens (its BOS, ...) to the prompt. Default true; a prompt
    /// made by `tl_apply_chat_template` has them already (pass false).
    pub add_special_tokens: bool,
    /// Leave special tokens out of the generated text. Default true.
    pub skip_special_tokens: bool,
}

/// One message of a conversation for `tl_apply_chat_template`: NUL-terminated UTF-8 strings.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct tl_chat_message {
    /// "system", "user", "assistant", or another role the model's template knows.
    pub role: *const c_char,
    pub content: *const c_char,
}

/// Called for each piece of generated text with the `user_data` given to the call: `piece`
/// points to `len` bytes of UTF-8 (whole characters; the text may contain NUL bytes) followed
/// by a NUL, valid only during the callback. Return true to continue, false to stop generation
/// (the call then returns TL_OK).
pub type tl_text_callback =
    Option<unsafe extern "C" fn(piece: *const c_char, len: usize, user_data: *mut c_void) -> bool>;

fn default_text_params() -> tl_text_params {
    let d = TextParams::default();
    tl_text_params {
        struct_size: std::mem::size_of::<tl_text_params>(),
        stop: std::ptr::null(),
        n_stop: 0,
        add_special_tokens: d.add_special_tokens,
        skip_special_tokens: d.skip_special_tokens,
    }
}

/// Fill `*params` with the defaults of this library version (including `struct_size`): no stop
/// strings, special tokens added to the prompt and skipped in the output.
///
/// Ownership: the caller owns `*params` and the stop strings it may point to later.
/// Threads: any thread.
///
/// # Safety
/// `params` must be NULL or valid for a write of `tl_text_params`.
#[no_mangle]
pub unsafe extern "C" fn tl_text_default_params(params: *mut tl_text_params) -> tl_status {
    boundary("tl_text_default_params", || {
        non_null(params, "params")?;
        // SAFETY: non-NULL and writable by the caller's contract.
        unsafe { write_out(params, default_text_params()) };
        Ok(())
    })
}

/// Convert text params (NULL = defaults) to [`TextParams`].
///
/// # Safety
/// `params` must be NULL or point to a `tl_text_params` of at least its `struct_size` bytes,
/// whose `stop` holds `n_stop` NUL-terminated strings.
unsafe fn text_params(params: *const tl_text_params) -> FfiResult<TextParams> {
    let p = if params.is_null() {
        default_text_params()
    } else {
        // SAFETY: non-NULL; the caller's contract covers its struct_size bytes.
        unsafe { read_versioned(params, default_text_params(), &[], "tl_text_params") }?
    };
    if p.n_stop > 0 {
        non_null(p.stop, "tl_text_params.stop")?;
    }
    let stop = (0..p.n_stop)
        .map(|i| {
            // SAFETY: `stop` holds `n_stop` string pointers by the caller's contract.
            let ptr = unsafe { *p.stop.add(i) };
            // SAFETY: NULL or NUL-terminated by the caller's contract.
            unsafe { c_str(ptr, &format!("tl_text_params.stop[{i}]")) }.map(str::to_string)
        })
        .collect::<FfiResult<Vec<String>>>()?;
    Ok(TextParams {
        stop,
        add_special_tokens: p.add_special_tokens,
        skip_special_tokens: p.skip_special_tokens,
    })
}

/// Write `text`'s bytes and a terminating NUL to `(out, cap, len)`: `*len` is the byte length
/// plus one. Unlike the names of `tl_model_device`, the text is kept whole: a NUL byte inside
/// it (a model may generate byte 0) stays, so `*len - 1` is its length.
///
/// # Safety
/// `out` must be valid for `cap` bytes; `len` for one write.
unsafe fn write_text(text: &str, out: *mut c_char, cap: usize, len: *mut usize) -> FfiResult {
    let mut bytes: Vec<c_char> = text.bytes().map(|b| b as c_char).collect();
    bytes.push(0);
    // SAFETY: caller's contract on out / cap / len.
    unsafe {
        check_buffer(out, cap, len, bytes.len())?;
        write_buffer(out, &bytes, len);
    }
    Ok(())
}

/// The token ids of the UTF-8 string `text` under the model's tokenizer, into `out[0..*len]`;
/// with `add_special_tokens`, the special tokens the tokenizer adds around a sequence (its BOS,
/// ...). Special tokens written in the text (e.g. "<|im_start|>") are recognized either way.
/// The length is known only once the text is tokenized, so a short `cap` (a size query: `out`
/// NULL, `cap` 0) costs one tokenization: `TL_ERR_BUFFER_TOO_SMALL` with the count in `*len`.
/// No tokens (an empty text without special tokens) is TL_OK with `*len` 0, whatever `out`.
///
/// Failures: `TL_ERR_INVALID_ARGUMENT` (NULL, text not valid UTF-8, a model without a
/// tokenizer), `TL_ERR_CLOSED`.
///
/// Ownership: the caller owns all buffers. Threads: any thread, concurrently with other calls
/// on the model (it never waits for a running call).
///
/// # Safety
/// `text` NULL or NUL-terminated; `out` valid for `cap` writes; `len` for one write.
#[no_mangle]
pub unsafe extern "C" fn tl_tokenize(
    model: *const tl_model,
    text: *const c_char,
    add_special_tokens: bool,
    out: *mut i32,
    cap: usize,
    len: *mut usize,
) -> tl_status {
    boundary("tl_tokenize", || {
        let m = model_of(model, "tl_tokenize")?;
        // SAFETY: the caller's contract.
        let text = unsafe { c_str(text, "text") }?;
        let tokens = c_tokens(m.tokenize(text, add_special_tokens)?);
        // No tokens (an empty text) need no buffer: `out` may then be NULL.
        if tokens.is_empty() {
            non_null(len, "len")?;
            // SAFETY: non-NULL and writable by the caller's contract.
            unsafe { write_out(len, 0) };
            return Ok(());
        }
        // SAFETY: as above.
        unsafe {
            check_buffer(out, cap, len, tokens.len())?;
            write_buffer(out, &tokens, len);
        }
        Ok(())
    })
}

/// The text of `tokens[0..n_tokens]` (each in 0..vocab_size; none is an empty text) as
/// NUL-terminated UTF-8 in `out`; `*len` is its byte length plus one (the NUL). With
/// `skip_special_tokens`, special tokens are left out. Bytes that do not form UTF-8 (a
/// character cut off) become U+FFFD. A short `cap` is `TL_ERR_BUFFER_TOO_SMALL` with the
/// required size in `*len`.
///
/// Failures: `TL_ERR_INVALID_ARGUMENT` (NULL, a token outside the vocabulary, a model without
/// a tokenizer), `TL_ERR_CLOSED`.
///
/// Ownership: the caller owns all buffers. Threads: any thread, concurrently with other calls.
///
/// # Safety
/// `tokens` valid for `n_tokens` reads; `out` for `cap` bytes; `len` for one write.
#[no_mangle]
pub unsafe extern "C" fn tl_detokenize(
    model: *const tl_model,
    tokens: *const i32,
    n_tokens: usize,
    skip_special_tokens: bool,
    out: *mut c_char,
    cap: usize,
    len: *mut usize,
) -> tl_status {
    boundary("tl_detokenize", || {
        let m = model_of(model, "tl_detokenize")?;
        // SAFETY: the caller's contract.
        let tokens = unsafe { tokens_arg(tokens, n_tokens, "tokens") }?;
        let text = m.detokenize(&tokens, skip_special_tokens)?;
        // SAFETY: as above.
        unsafe { write_text(&text, out, cap, len) }
    })
}

/// The id of the special token written `text` (e.g. "<|im_end|>") into `*out_token`.
///
/// Failures: `TL_ERR_INVALID_ARGUMENT` (NULL, not UTF-8, not a special token of the model's
/// tokenizer: the message lists some that are; a byte-level model has none), `TL_ERR_CLOSED`.
///
/// Ownership: none retained. Threads: any thread, concurrently with other calls.
///
/// # Safety
/// `text` NULL or NUL-terminated; `out_token` NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn tl_special_token(
    model: *const tl_model,
    text: *const c_char,
    out_token: *mut i32,
) -> tl_status {
    boundary("tl_special_token", || {
        let m = model_of(model, "tl_special_token")?;
        // SAFETY: the caller's contract.
        let text = unsafe { c_str(text, "text") }?;
        non_null(out_token, "out_token")?;
        let id = m.tokenizer()?.special_token(text)?;
        // SAFETY: checked non-NULL; writable by the caller's contract. Ids are < vocab_size
        // <= i32::MAX (checked at load).
        unsafe { write_out(out_token, id as i32) };
        Ok(())
    })
}

/// `messages[0..n_messages]` rendered by the model's chat template (tokenizer_config's
/// `chat_template`, Jinja) as NUL-terminated UTF-8 in `out`; with `add_generation_prompt`,
/// followed by what starts the assistant's reply. `*len` and short buffers as in
/// `tl_detokenize`. Tokenize the result with `add_special_tokens` false: the template writes
/// them.
///
/// Failures: `TL_ERR_INVALID_ARGUMENT` (NULL, not UTF-8, a byte-level model or one whose
/// tokenizer has no chat template, a template that refuses the conversation: its message),
/// `TL_ERR_CLOSED`.
///
/// Ownership: the caller owns all buffers. Threads: any thread, concurrently with other calls.
///
/// # Safety
/// `messages` valid for `n_messages` reads, each string NULL or NUL-terminated; `out` valid
/// for `cap` bytes; `len` for one write.
#[no_mangle]
pub unsafe extern "C" fn tl_apply_chat_template(
    model: *const tl_model,
    messages: *const tl_chat_message,
    n_messages: usize,
    add_generation_prompt: bool,
    out: *mut c_char,
    cap: usize,
    len: *mut usize,
) -> tl_status {
    boundary("tl_apply_chat_template", || {
        let m = model_of(model, "tl_apply_chat_template")?;
        if n_messages > 0 {
            non_null(messages, "messages")?;
        }
        let messages = (0..n_messages)
            .map(|i| {
                // SAFETY: valid for n_messages reads by the caller's contract.
                let message = unsafe { *messages.add(i) };
                // SAFETY: NULL or NUL-terminated by the caller's contract.
                let role = unsafe { c_str(message.role, &format!("messages[{i}].role")) }?;
                // SAFETY: as above.
                let content = unsafe { c_str(message.content, &format!("messages[{i}].content")) }?;
                Ok(ChatMessage::new(role, content))
            })
            .collect::<FfiResult<Vec<_>>>()?;
        let text = m.apply_chat_template(&messages, add_generation_prompt)?;
        // SAFETY: the caller's contract.
        unsafe { write_text(&text, out, cap, len) }
    })
}

/// The bytes a text generation call may need in `out`: `max_tokens` tokens at the most bytes
/// one token can add to a text, and the NUL.
fn text_capacity(model: &Model, max_tokens: usize) -> FfiResult<usize> {
    model
        .tokenizer()?
        .max_token_bytes()
        .checked_mul(max_tokens)
        .and_then(|n| n.checked_add(1))
        .ok_or_else(|| Failure::invalid("max_tokens is too large for a text buffer"))
}

/// How a text generation call runs: plainly or self-speculatively.
#[derive(Clone, Copy)]
enum Run {
    Plain,
    Speculative(*const tl_speculative_params),
}

impl Run {
    /// # Safety
    /// `spec` as documented on `tl_generate_text_speculative`.
    unsafe fn generate(
        self,
        s: &mut Session,
        prompt: &str,
        params: &TextCall,
        on_text: &mut dyn FnMut(&str) -> bool,
    ) -> FfiResult<GeneratedText> {
        let (params, text) = (&params.generate, &params.text);
        Ok(match self {
            Run::Plain => s.generate_text_stream(prompt, params, text, on_text)?,
            Run::Speculative(spec) => {
                // SAFETY: the caller's contract.
                let spec = unsafe { speculation(spec) }?;
                s.generate_text_speculative(prompt, params, &spec, text, on_text)?
            }
        })
    }
}

/// The converted parameters of a text generation call.
struct TextCall {
    generate: crate::GenerateParams,
    text: TextParams,
}

/// # Safety
/// `prompt`, `params` and `text` as documented on `tl_generate_text`.
unsafe fn text_call_args<'a>(
    prompt: *const c_char,
    params: *const tl_generate_params,
    text: *const tl_text_params,
    func: &str,
) -> FfiResult<(&'a str, TextCall)> {
    // SAFETY: the caller's contract, forwarded.
    let prompt = unsafe { c_str(prompt, "prompt") }?;
    // SAFETY: as above.
    let generate = unsafe { params_without_prefix(params, func) }?;
    // SAFETY: as above.
    let text = unsafe { text_params(text) }?;
    Ok((prompt, TextCall { generate, text }))
}

/// Generate after the UTF-8 `prompt`, tokenized by the model's tokenizer, on the model's
/// default session; the generated text goes to `out` as NUL-terminated UTF-8 (`*len`: its byte
/// length plus one). Generation ends after `params->max_tokens` tokens, at max_seq_len, at the
/// tokenizer's end-of-sequence tokens (generation_config's `eos_token_id`; added to
/// `params->stop_tokens`), or at a stop string of `text`. `cap` must be at least max_tokens
/// times the most bytes one token can add to a text, plus one (3 * max_tokens + 1 for a
/// byte-level model): else `TL_ERR_BUFFER_TOO_SMALL` with that size in `*len`, before any
/// work (`out` NULL, `cap` 0 is a size query). `params`, `text` NULL: the defaults.
///
/// Failures: as `tl_generate`, and `TL_ERR_INVALID_ARGUMENT` for a prompt that is not UTF-8,
/// a model without a tokenizer, an empty stop string, or a `params->prefix_cache`.
///
/// Ownership: the caller owns all buffers; nothing is retained after the call.
/// Threads: any thread; one call at a time per model (use sessions for concurrency).
///
/// # Safety
/// `prompt` NULL or NUL-terminated; `params` NULL or from `tl_generate_default_params`;
/// `text` NULL or from `tl_text_default_params`; `out` valid for `cap` bytes; `len` for one
/// write.
#[no_mangle]
pub unsafe extern "C" fn tl_generate_text(
    model: *const tl_model,
    prompt: *const c_char,
    params: *const tl_generate_params,
    text: *const tl_text_params,
    out: *mut c_char,
    cap: usize,
    len: *mut usize,
) -> tl_status {
    let target = Target::Model(model);
    let func = "tl_generate_text";
    // SAFETY: the caller's contract, forwarded.
    unsafe {
        generate_text(
            target,
            func,
            Run::Plain,
            prompt,
            params,
            text,
            out,
            cap,
            len,
        )
    }
}

/// `tl_generate_text` on a session.
///
/// Ownership: the caller owns all buffers. Threads: any thread; one call at a time per session.
///
/// # Safety
/// Pointers other than `session` as `tl_generate_text`.
#[no_mangle]
pub unsafe extern "C" fn tl_session_generate_text(
    session: *const tl_session,
    prompt: *const c_char,
    params: *const tl_generate_params,
    text: *const tl_text_params,
    out: *mut c_char,
    cap: usize,
    len: *mut usize,
) -> tl_status {
    let target = Target::Session(session);
    let func = "tl_session_generate_text";
    // SAFETY: the caller's contract, forwarded.
    unsafe {
        generate_text(
            target,
            func,
            Run::Plain,
            prompt,
            params,
            text,
            out,
            cap,
            len,
        )
    }
}

/// `tl_generate_text` drafting `spec->draft_len` tokens at a time at `spec->draft_loops` and
/// verifying them at `params->loops` (as `tl_generate_speculative`): greedy output equals
/// `tl_generate_text`'s. Statistics: `tl_last_generate_stats`.
///
/// Ownership: the caller owns all buffers. Threads: any thread; one call at a time per model.
///
/// # Safety
/// As `tl_generate_text`; `spec` NULL or from `tl_speculative_default_params`.
#[no_mangle]
pub unsafe extern "C" fn tl_generate_text_speculative(
    model: *const tl_model,
    prompt: *const c_char,
    params: *const tl_generate_params,
    spec: *const tl_speculative_params,
    text: *const tl_text_params,
    out: *mut c_char,
    cap: usize,
    len: *mut usize,
) -> tl_status {
    let target = Target::Model(model);
    let (func, run) = ("tl_generate_text_speculative", Run::Speculative(spec));
    // SAFETY: the caller's contract, forwarded.
    unsafe { generate_text(target, func, run, prompt, params, text, out, cap, len) }
}

/// `tl_generate_text_speculative` on a session.
///
/// Ownership: the caller owns all buffers. Threads: any thread; one call at a time per session.
///
/// # Safety
/// As `tl_generate_text_speculative`.
#[no_mangle]
pub unsafe extern "C" fn tl_session_generate_text_speculative(
    session: *const tl_session,
    prompt: *const c_char,
    params: *const tl_generate_params,
    spec: *const tl_speculative_params,
    text: *const tl_text_params,
    out: *mut c_char,
    cap: usize,
    len: *mut usize,
) -> tl_status {
    let target = Target::Session(session);
    let (func, run) = (
        "tl_session_generate_text_speculative",
        Run::Speculative(spec),
    );
    // SAFETY: the caller's contract, forwarded.
    unsafe { generate_text(target, func, run, prompt, params, text, out, cap, len) }
}

/// # Safety
/// Pointer arguments as documented on `tl_generate_text`.
#[allow(clippy::too_many_arguments)]
unsafe fn generate_text(
    target: Target,
    func: &'static str,
    run: Run,
    prompt: *const c_char,
    params: *const tl_generate_params,
    text: *const tl_text_params,
    out: *mut c_char,
    cap: usize,
    len: *mut usize,
) -> tl_status {
    boundary(func, || {
        target.run(func, |s| {
            // SAFETY: the caller's contract, forwarded.
            let (prompt, args) = unsafe { text_call_args(prompt, params, text, func) }?;
            let required = text_capacity(&s.model(), args.generate.max_tokens)?;
            // SAFETY: as above.
            unsafe {
                fill(out, cap, len, required, || {
                    let generated = run.generate(s, prompt, &args, &mut |_| true)?;
                    let mut bytes: Vec<c_char> =
                        generated.text.bytes().map(|b| b as c_char).collect();
                    bytes.push(0);
                    Ok(bytes)
                })
            }
        })
    })
}

/// Like `tl_generate_text`, but calls `callback(piece, len, user_data)` on the calling thread
/// with each piece of generated text as soon as it is known: whole UTF-8 characters, never part
/// of a stop string (text that may begin one is held until it is known not to). Returning false
/// stops generation early (TL_OK). Pieces already delivered stay delivered when the call later
/// fails. The callback may call `tl_cancel`; any other call on this model from inside it
/// returns `TL_ERR_BUSY`.
///
/// Ownership: `user_data` is passed through untouched; `piece` belongs to the library.
/// Threads: as `tl_generate_text`.
///
/// # Safety
/// As `tl_generate_text`; `callback` must be safe to call with `user_data` during the call.
#[no_mangle]
pub unsafe extern "C" fn tl_generate_text_stream(
    model: *const tl_model,
    prompt: *const c_char,
    params: *const tl_generate_params,
    text: *const tl_text_params,
    callback: tl_text_callback,
    user_data: *mut c_void,
) -> tl_status {
    let target = Target::Model(model);
    let func = "tl_generate_text_stream";
    // SAFETY: the caller's contract, forwarded.
    unsafe { generate_text_stream(target, func, prompt, params, text, callback, user_data) }
}

/// `tl_generate_text_stream` on a session; the callback may call `tl_session_cancel`.
///
/// Ownership: `user_data` is passed through. Threads: any thread; one call at a time per
/// session.
///
/// # Safety
/// Arguments other than `session` as `tl_generate_text_stream`.
#[no_mangle]
pub unsafe extern "C" fn tl_session_generate_text_stream(
    session: *const tl_session,
    prompt: *const c_char,
    params: *const tl_generate_params,
    text: *const tl_text_params,
    callback: tl_text_callback,
    user_data: *mut c_void,
) -> tl_status {
    let target = Target::Session(session);
    let func = "tl_session_generate_text_stream";
    // SAFETY: the caller's contract, forwarded.
    unsafe { generate_text_stream(target, func, prompt, params, text, callback, user_data) }
}

/// # Safety
/// Pointer arguments as documented on `tl_generate_text_stream`.
unsafe fn generate_text_stream(
    target: Target,
    func: &'static str,
    prompt: *const c_char,
    params: *const tl_generate_params,
    text: *const tl_text_params,
    callback: tl_text_callback,
    user_data: *mut c_void,
) -> tl_status {
    boundary(func, || {
        target.run(func, |s| {
            // SAFETY: the caller's contract, forwarded.
            let (prompt, args) = unsafe { text_call_args(prompt, params, text, func) }?;
            let callback = callback.ok_or_else(|| Failure::invalid("callback is NULL"))?;
            let mut piece = Vec::new();
            let mut on_text = |text: &str| {
                piece.clear();
                piece.extend_from_slice(text.as_bytes());
                piece.push(0);
                // SAFETY: the caller guarantees the callback may be called with user_data;
                // `piece` holds text.len() bytes and a NUL for the duration of the call.
                unsafe { callback(piece.as_ptr() as *const c_char, text.len(), user_data) }
            };
            // SAFETY: as above.
            unsafe { Run::Plain.generate(s, prompt, &args, &mut on_text) }?;
            Ok(())
        })
    })
}

/// `log p(token[i+1] | tokens[0..=i])` for the tokens of the UTF-8 `text` (tokenized with the
/// tokenizer's special tokens, so a BOS makes the first text token scored too) at `loops`
/// iterations (TL_LOOPS_DEFAULT: default_loops), on the model's default session, into
/// `out[0..*len]`: one value per token after the first. The count is known once the text is
/// tokenized (no network pass): a short `cap` (or a size query) is `TL_ERR_BUFFER_TOO_SMALL`
/// with it in `*len`. With prefill_chunk > 0 the text must be at most that many tokens.
///
/// Failures: as `tl_logprobs`, and `TL_ERR_INVALID_ARGUMENT` for a text that is not UTF-8 or
/// is fewer than 2 tokens, or a model without a tokenizer.
///
/// Ownership: the caller owns all buffers. Threads: any thread; one call at a time per model.
///
/// # Safety
/// `text` NULL or NUL-terminated; `out` valid for `cap` writes; `len` for one write.
#[no_mangle]
pub unsafe extern "C" fn tl_score_text(
    model: *const tl_model,
    text: *const c_char,
    loops: i32,
    out: *mut f32,
    cap: usize,
    len: *mut usize,
) -> tl_status {
    let target = Target::Model(model);
    // SAFETY: the caller's contract, forwarded.
    unsafe { score_text(target, "tl_score_text", text, loops, out, cap, len) }
}

/// `tl_score_text` on a session.
///
/// Ownership: the caller owns all buffers. Threads: any thread; one call at a time per session.
///
/// # Safety
/// As `tl_score_text`.
#[no_mangle]
pub unsafe extern "C" fn tl_session_score_text(
    session: *const tl_session,
    text: *const c_char,
    loops: i32,
    out: *mut f32,
    cap: usize,
    len: *mut usize,
) -> tl_status {
    let target = Target::Session(session);
    // SAFETY: the caller's contract, forwarded.
    unsafe { score_text(target, "tl_session_score_text", text, loops, out, cap, len) }
}

/// # Safety
/// Pointer arguments as documented on `tl_score_text`.
unsafe fn score_text(
    target: Target,
    func: &'static str,
    text: *const c_char,
    loops: i32,
    out: *mut f32,
    cap: usize,
    len: *mut usize,
) -> tl_status {
    boundary(func, || {
        target.run(func, |s| {
            // SAFETY: the caller's contract.
            let text = unsafe { c_str(text, "text") }?;
            let loops = loops_arg(loops)?;
            let tokens = s.model().tokenize(text, true)?;
            if tokens.len() < 2 {
                return Err(Failure::invalid(format!(
                    "the text is {} token(s); scoring needs at least 2",
                    tokens.len()
                )));
            }
            // SAFETY: as above.
            unsafe {
                fill(out, cap, len, tokens.len() - 1, || {
                    Ok(s.logprobs(&tokens, loops)?)
                })
            }
        })
    })
}
