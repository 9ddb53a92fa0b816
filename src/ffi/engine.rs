//! `tl_engine`: continuous batching over a model (docs/ABI.md "Engines"). Requests are
//! submitted from any thread, and their tokens are taken one event at a time with
//! `tl_engine_next`.

use std::collections::HashMap;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex, TryLockError};
use std::time::Duration;

use super::handles::{Kind, Lookup, Table};
use super::model::model_of;
use super::params::{generate_params, prompt_arg, read_versioned};
use super::{
    boundary, boundary_void, non_null, tl_generate_params, tl_model, tl_status, write_out, Failure,
};
use crate::{Engine, EngineOptions, EngineStats, Event, Finish, RequestStats};

/// An engine: one model serving many concurrent requests, batched at every step. Opaque;
/// created by `tl_engine_new`, freed by `tl_engine_free`. A handle is a value the library looks
/// up, not an address.
pub struct tl_engine {
    _opaque: [u8; 0],
}

static ENGINES: Table<OpenEngine, tl_engine> = Table::new(Kind::Engine);

/// An engine and the event queues of its requests that have not ended yet (for the caller).
struct OpenEngine {
    engine: Engine,
    requests: Mutex<HashMap<u64, Arc<Mutex<Receiver<Event>>>>>,
}

/// How an engine is sized. Fill with `tl_engine_default_params`, then change fields.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct tl_engine_params {
    /// `sizeof(tl_engine_params)`; set by `tl_engine_default_params`. Smaller values are
    /// rejected; larger values are accepted and the extra bytes ignored.
    pub struct_size: usize,
    /// Rows one step runs at most (decode rows and prompt chunks together), >= 1. Default 256.
    pub max_step_rows: u32,
    /// Requests that run at once, >= 1; more wait in the queue. Default 64.
    pub max_running: u32,
    /// Positions per KV page, >= 1. Default 16.
    pub page_size: u32,
    /// Requests waiting at most, >= 1; `tl_engine_submit` beyond it is `TL_ERR_BUSY`.
    /// Default 4096.
    pub max_queued: u32,
    /// Positions of the KV pool (rounded up to whole pages); 0 (default): 8 × max_seq_len.
    pub pool_positions: u64,
}

/// Why a request ended.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum tl_finish {
    /// It produced `max_tokens` tokens (or filled max_seq_len).
    TL_FINISH_LENGTH = 0,
    /// It produced one of its stop tokens (not returned).
    TL_FINISH_STOP = 1,
}

/// What one request did (in its `TL_EVENT_DONE` event).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct tl_request_stats {
    pub prompt_tokens: u32,
    /// Prompt tokens whose KV entries came from cached pages of an earlier request with the
    /// same prefix at the same loops (not computed again).
    pub cached_tokens: u32,
    /// Tokens returned.
    pub tokens: u32,
    pub finish: tl_finish,
    /// From submission to admission (its KV pages reserved).
    pub queue_ms: f64,
    /// From submission to its first token.
    pub first_token_ms: f64,
    /// From submission to its end.
    pub total_ms: f64,
}

/// The kind of a `tl_engine_event`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum tl_event_kind {
    /// No event within the timeout; the request is still running.
    TL_EVENT_NONE = 0,
    /// `token` holds the request's next token.
    TL_EVENT_TOKEN = 1,
    /// The request finished; `stats` holds what it did. Its id is no longer valid.
    TL_EVENT_DONE = 2,
}

/// One event of a request, from `tl_engine_next`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct tl_engine_event {
    pub kind: tl_event_kind,
    /// `TL_EVENT_TOKEN`: the token; -1 otherwise.
    pub token: i32,
    /// `TL_EVENT_DONE`: the request's statistics; zero otherwise.
    pub stats: tl_request_stats,
}

/// What an engine holds now (`tl_engine_get_stats`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct tl_engine_stats {
    /// Requests waiting to be admitted.
    pub queued: u64,
    /// Requests running (prefilling or generating).
    pub running: u64,
    pub pool_pages: u64,
    /// Pages held by running requests.
    pub pages_used: u64,
    /// Pages nobody holds that keep a prompt prefix cached for later requests.
    pub cached_pages: u64,
    pub page_size: u64,
    /// Steps run since the engine started, and the rows and generated tokens they carried.
    pub steps: u64,
    pub rows: u64,
    pub tokens: u64,
    /// Times a running request gave its KV pages up to older ones (it runs again and gives
    /// the same tokens).
    pub preemptions: u64,
}

fn default_engine_params() -> tl_engine_params {
    let d = EngineOptions::default();
    tl_engine_params {
        struct_size: std::mem::size_of::<tl_engine_params>(),
        max_step_rows: d.max_step_rows as u32,
        max_running: d.max_running as u32,
        page_size: d.page_size as u32,
        max_queued: d.max_queued as u32,
        pool_positions: d.pool_positions as u64,
    }
}

/// Fill `*params` with the defaults of this library version (including `struct_size`): 256
/// rows per step, 64 running requests, pages of 16 positions, a pool of 8 × max_seq_len
/// positions, 4096 queued requests.
///
/// Ownership: the caller owns `*params`. Threads: any thread.
///
/// # Safety
/// `params` must be NULL or valid for a write of `tl_engine_params`.
#[no_mangle]
pub unsafe extern "C" fn tl_engine_default_params(params: *mut tl_engine_params) -> tl_status {
    boundary("tl_engine_default_params", || {
        non_null(params, "params")?;
        // SAFETY: non-NULL and writable by the caller's contract.
        unsafe { write_out(params, default_engine_params()) };
        Ok(())
    })
}

/// Create an engine over `model`: its step buffers and KV pool are allocated and its thread
/// started. `params` may be NULL (defaults). The model's KV mode must be fp16, int8 or delta,
/// and the model must run on the CPU (`TL_ERR_INVALID_ARGUMENT` otherwise). The engine keeps
/// the weights alive: it works on after `tl_close(model)` until it is freed.
///
/// Ownership: the caller owns `*out_engine` and frees it with `tl_engine_free`. Threads: any
/// thread.
///
/// # Safety
/// `params` must be NULL or point to a `tl_engine_params` of at least its `struct_size` bytes;
/// `out_engine` must be valid for a write.
#[no_mangle]
pub unsafe extern "C" fn tl_engine_new(
    model: *const tl_model,
    params: *const tl_engine_params,
    out_engine: *mut *mut tl_engine,
) -> tl_status {
    boundary("tl_engine_new", || {
        let model = model_of(model, "tl_engine_new")?;
        non_null(out_engine, "out_engine")?;
        let p = if params.is_null() {
            default_engine_params()
        } else {
            // SAFETY: non-NULL; the caller's contract covers its struct_size bytes.
            unsafe { read_versioned(params, default_engine_params(), &[], "tl_engine_params") }?
        };
        let pool_positions = usize::try_from(p.pool_positions).map_err(|_| {
            Failure::invalid(format!(
                "tl_engine_params.pool_positions {} does not fit in memory",
                p.pool_positions
            ))
        })?;
        let options = EngineOptions {
            max_step_rows: p.max_step_rows as usize,
            max_running: p.max_running as usize,
            page_size: p.page_size as usize,
            pool_positions,
            max_queued: p.max_queued as usize,
        };
        let engine = Engine::new(&model, &options)?;
        let handle = ENGINES.insert(OpenEngine {
            engine,
            requests: Mutex::new(HashMap::new()),
        })?;
        // SAFETY: non-NULL and writable by the caller's contract.
        unsafe { write_out(out_engine, handle) };
        Ok(())
    })
}

/// Queue a request: `tokens` (`n_tokens` >= 1 ids) as its prompt, generated as `tl_generate`
/// would with `params` (NULL: defaults; `prefix_cache`, `ctx_tier`, `beta_monitor` and the
/// exit rules are rejected). Writes the request's id to `*out_id`; take its tokens with
/// `tl_engine_next`. `TL_ERR_BUSY` when `max_queued` requests are waiting already.
///
/// Ownership: `tokens` and `params` are only read during the call. Threads: any thread, also
/// while other threads submit or take events.
///
/// # Safety
/// `tokens` must point to `n_tokens` readable values; `params` as for `tl_generate`; `out_id`
/// must be valid for a write.
#[no_mangle]
pub unsafe extern "C" fn tl_engine_submit(
    engine: *const tl_engine,
    tokens: *const i32,
    n_tokens: usize,
    params: *const tl_generate_params,
    out_id: *mut u64,
) -> tl_status {
    boundary("tl_engine_submit", || {
        let open = ENGINES.get(engine, "tl_engine_submit")?;
        non_null(out_id, "out_id")?;
        // SAFETY: the caller's contract, forwarded.
        let prompt = unsafe { prompt_arg(tokens, n_tokens) }?;
        // SAFETY: as above.
        let (params, prefix) = unsafe { generate_params(params) }?;
        if !prefix.is_null() {
            return Err(Failure::invalid(
                "tl_generate_params.prefix_cache is not read by tl_engine_submit: set it to NULL",
            ));
        }
        let submitted = open.engine.submit(&prompt, &params)?;
        let mut requests = open.requests.lock().unwrap_or_else(|p| p.into_inner());
        requests.insert(submitted.id, Arc::new(Mutex::new(submitted.events)));
        // SAFETY: non-NULL and writable by the caller's contract.
        unsafe { write_out(out_id, submitted.id) };
        Ok(())
    })
}

/// Take the next event of request `id`, waiting up to `timeout_ms` milliseconds (0: do not
/// wait; -1: wait until there is one). TL_OK with `TL_EVENT_TOKEN` (a token), `TL_EVENT_DONE`
/// (the request finished; the id is forgotten) or `TL_EVENT_NONE` (nothing yet). A request that
/// ended without finishing returns its error instead — `TL_ERR_CANCELLED` after
/// `tl_engine_cancel` or when the engine is freed, or the failure that stopped it, with its
/// message — and its id is forgotten. An id that was forgotten or never given is
/// `TL_ERR_INVALID_ARGUMENT`; two threads waiting on one id: the second gets `TL_ERR_BUSY`.
///
/// Ownership: `*out_event` is written on TL_OK. Threads: any thread; different requests'
/// events may be taken from different threads at once.
///
/// # Safety
/// `out_event` must be valid for a write.
#[no_mangle]
pub unsafe extern "C" fn tl_engine_next(
    engine: *const tl_engine,
    id: u64,
    timeout_ms: i32,
    out_event: *mut tl_engine_event,
) -> tl_status {
    boundary("tl_engine_next", || {
        let open = ENGINES.get(engine, "tl_engine_next")?;
        non_null(out_event, "out_event")?;
        if timeout_ms < -1 {
            return Err(Failure::invalid(format!(
                "timeout_ms is {timeout_ms}: use -1 (wait), 0 (poll) or a positive number of \
                 milliseconds"
            )));
        }
        let queue = {
            let requests = open.requests.lock().unwrap_or_else(|p| p.into_inner());
            requests.get(&id).cloned().ok_or_else(|| {
                Failure::invalid(format!(
                    "no request {id} on this engine: it has ended (its last event was taken) \
                     or was never submitted"
                ))
            })?
        };
        let receiver = match queue.try_lock() {
            Ok(receiver) => receiver,
            Err(TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
            Err(TryLockError::WouldBlock) => {
                return Err(Failure::new(
                    tl_status::TL_ERR_BUSY,
                    format!("another thread is taking the events of request {id}"),
                ))
            }
        };
        let event = match timeout_ms {
            -1 => receiver.recv().ok(),
            ms => match receiver.recv_timeout(Duration::from_millis(ms as u64)) {
                Ok(event) => Some(event),
                Err(RecvTimeoutError::Timeout) => {
                    let none = event_of(tl_event_kind::TL_EVENT_NONE, -1, None);
                    // SAFETY: non-NULL and writable by the caller's contract.
                    unsafe { write_out(out_event, none) };
                    return Ok(());
                }
                Err(RecvTimeoutError::Disconnected) => None,
            },
        };
        let forget = || {
            let mut requests = open.requests.lock().unwrap_or_else(|p| p.into_inner());
            requests.remove(&id);
        };
        let out = match event {
            Some(Event::Token(token)) => {
                event_of(tl_event_kind::TL_EVENT_TOKEN, token as i32, None)
            }
            Some(Event::Done(stats)) => {
                forget();
                event_of(tl_event_kind::TL_EVENT_DONE, -1, Some(&stats))
            }
            Some(Event::Failed(e)) => {
                forget();
                return Err(Failure::from(e));
            }
            None => {
                forget();
                return Err(Failure::new(
                    tl_status::TL_ERR_DEVICE,
                    format!("request {id}: the engine stopped without ending it"),
                ));
            }
        };
        // SAFETY: non-NULL and writable by the caller's contract.
        unsafe { write_out(out_event, out) };
        Ok(())
    })
}

fn event_of(kind: tl_event_kind, token: i32, stats: Option<&RequestStats>) -> tl_engine_event {
    let stats = stats.map_or(
        tl_request_stats {
            prompt_tokens: 0,
            cached_tokens: 0,
            tokens: 0,
            finish: tl_finish::TL_FINISH_LENGTH,
            queue_ms: 0.0,
            first_token_ms: 0.0,
            total_ms: 0.0,
        },
        |s| tl_request_stats {
            prompt_tokens: s.prompt_tokens as u32,
            cached_tokens: s.cached_tokens as u32,
            tokens: s.tokens as u32,
            finish: match s.finish {
                Finish::Length => tl_finish::TL_FINISH_LENGTH,
                Finish::Stop => tl_finish::TL_FINISH_STOP,
            },
            queue_ms: s.queue_ms,
            first_token_ms: s.first_token_ms,
            total_ms: s.total_ms,
        },
    );
    tl_engine_event { kind, token, stats }
}

/// Cancel request `id`: it ends at the engine's next step, and `tl_engine_next` then returns
/// `TL_ERR_CANCELLED` for it. A request that has ended (finished, failed or cancelled already)
/// or an id this engine never gave is `TL_ERR_INVALID_ARGUMENT`.
///
/// Ownership: none. Threads: any thread, also while another thread waits in `tl_engine_next`.
#[no_mangle]
pub extern "C" fn tl_engine_cancel(engine: *const tl_engine, id: u64) -> tl_status {
    boundary("tl_engine_cancel", || {
        let open = ENGINES.get(engine, "tl_engine_cancel")?;
        Ok(open.engine.cancel(id)?)
    })
}

/// Queue length, running requests, KV pool use and step counts of an engine now.
///
/// Ownership: `*out_stats` is written on success. Threads: any thread.
///
/// # Safety
/// `out_stats` must be valid for a write.
#[no_mangle]
pub unsafe extern "C" fn tl_engine_get_stats(
    engine: *const tl_engine,
    out_stats: *mut tl_engine_stats,
) -> tl_status {
    boundary("tl_engine_get_stats", || {
        let open = ENGINES.get(engine, "tl_engine_get_stats")?;
        non_null(out_stats, "out_stats")?;
        let EngineStats {
            queued,
            running,
            pool_pages,
            pages_used,
            cached_pages,
            page_size,
            steps,
            rows,
            tokens,
            preemptions,
            ..
        } = open.engine.stats();
        let stats = tl_engine_stats {
            queued: queued as u64,
            running: running as u64,
            pool_pages: pool_pages as u64,
            pages_used: pages_used as u64,
            cached_pages: cached_pages as u64,
            page_size: page_size as u64,
            steps,
            rows,
            tokens,
            preemptions,
        };
        // SAFETY: non-NULL and writable by the caller's contract.
        unsafe { write_out(out_stats, stats) };
        Ok(())
    })
}

/// Free an engine: its queued and running requests are cancelled (a thread waiting in
/// `tl_engine_next` gets `TL_ERR_CANCELLED`), its thread is awaited, and its buffers and KV
/// pool are released. NULL and an engine already freed are accepted (no-op).
///
/// Ownership: takes back the handle from `tl_engine_new`; afterwards every call on it returns
/// `TL_ERR_CLOSED`. Threads: any thread, also while others submit or wait on it.
#[no_mangle]
pub extern "C" fn tl_engine_free(engine: *mut tl_engine) {
    boundary_void("tl_engine_free", || match ENGINES.lookup(engine) {
        Lookup::Null | Lookup::Closed => Ok(()),
        Lookup::Invalid(failure) => Err(failure),
        Lookup::Live(open) => {
            ENGINES.remove(engine);
            open.engine.shutdown();
            Ok(())
        }
    })
}
