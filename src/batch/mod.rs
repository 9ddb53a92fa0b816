//! Continuous batching: one [`Engine`] serves many concurrent requests of one model.
//!
//! Requests are submitted from any thread and run on the engine's own thread, which steps all
//! running sequences together: each step takes one decode row of every sequence that is
//! generating and fills the rest of its row budget with prompt chunks ([`schedule`]), so a
//! request's prompt is prefilled while others decode. The KV entries of every sequence live in
//! one pool of fixed-size pages ([`crate::kv::pool`]); a request is admitted, oldest first, when
//! the pages of its prompt are free, and takes a page for its generated tokens whenever it needs
//! one. When none is left the newest running requests give theirs up (preemption): such a
//! request runs again, before any new one, with its prompt and the tokens it had generated as
//! its prompt, and continues with the tokens it would have given. Pages of prompt prefixes are
//! shared: a request whose prompt starts with
//! the tokens of an earlier request's full pages, at the same loops, takes those pages and
//! starts after them.
//!
//! Rows of one step may ask for different loop counts: rows run deepest first, and loop
//! iteration i runs only the rows that reach it. On the CPU every row computes exactly what it
//! computes alone, so a request's tokens never depend on what else runs with it: greedy output
//! equals [`crate::Session::generate`] token for token.

mod schedule;
mod worker;

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Instant;

use crate::error::{Error, Result};
use crate::generate::GenerateRequest;
use crate::kv::KvMode;
use crate::shared::Shared;
use crate::{GenerateParams, Model};

/// How an engine is sized, fixed when it is created.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineOptions {
    /// Rows one step runs at most (decode rows and prompt chunks together): the token budget of
    /// a step. At least 1.
    pub max_step_rows: usize,
    /// Requests that run at once; more wait in the queue. At least 1.
    pub max_running: usize,
    /// Positions per KV page. At least 1.
    pub page_size: usize,
    /// Positions of the KV pool, rounded up to whole pages; 0: 8 × the model's `max_seq_len`.
    pub pool_positions: usize,
    /// Requests waiting to run at most; a submit beyond it is refused. At least 1.
    pub max_queued: usize,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            max_step_rows: 256,
            max_running: 64,
            page_size: 16,
            pool_positions: 0,
            max_queued: 4096,
        }
    }
}

/// Why a request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// It produced `max_tokens` tokens (or filled the model's `max_seq_len`).
    Length,
    /// It produced one of its stop tokens (not returned).
    Stop,
}

/// What happened to a request, one event at a time, in order: its tokens, then exactly one
/// `Done` or `Failed`.
#[derive(Debug)]
pub enum Event {
    Token(u32),
    Done(RequestStats),
    /// The request ended without finishing: [`Error::Cancelled`] when it was cancelled (or the
    /// engine was dropped), or the error that stopped it.
    Failed(Error),
}

/// What one request did.
#[derive(Clone, Debug, PartialEq)]
pub struct RequestStats {
    pub prompt_tokens: usize,
    /// Prompt tokens whose KV entries came from cached pages of an earlier request with the
    /// same prefix at the same loops (they were not computed again).
    pub cached_tokens: usize,
    /// Tokens returned.
    pub tokens: usize,
    pub finish: Finish,
    /// From submission to its admission (its pages reserved, its prompt's first step planned).
    pub queue_ms: f64,
    /// From submission to its first token.
    pub first_token_ms: f64,
    /// From submission to its end.
    pub total_ms: f64,
}

/// Upper bounds (milliseconds) of the step-time histogram of [`EngineStats::step_ms_buckets`].
pub const STEP_MS_BOUNDS: [f64; 12] = [
    1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2500.0, 10000.0,
];

/// What an engine holds now.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EngineStats {
    /// Requests waiting to be admitted.
    pub queued: usize,
    /// Requests running (prefilling or generating).
    pub running: usize,
    pub pool_pages: usize,
    /// Pages held by running requests.
    pub pages_used: usize,
    /// Pages nobody holds that keep a prompt prefix for later requests (evicted, least
    /// recently used first, when memory is needed).
    pub cached_pages: usize,
    pub page_size: usize,
    /// Steps run, and the rows and generated tokens they carried, since the engine started.
    pub steps: u64,
    pub rows: u64,
    pub tokens: u64,
    /// Times a running request gave its pages up to older ones (it then runs its prompt and
    /// the tokens it had generated again, and continues with the tokens it would have given).
    pub preemptions: u64,
    /// Steps that took at most each bound of [`STEP_MS_BOUNDS`] (cumulative counts; `steps`
    /// counts every step), and the milliseconds of all steps.
    pub step_ms_buckets: [u64; STEP_MS_BOUNDS.len()],
    pub step_ms_sum: f64,
}

/// A submitted request: its id (for [`Engine::cancel`]) and its events.
#[derive(Debug)]
pub struct Submitted {
    pub id: u64,
    pub events: Receiver<Event>,
}

impl Submitted {
    /// Wait for every event and return the tokens and statistics, or the error that ended it.
    pub fn wait(self) -> Result<(Vec<u32>, RequestStats)> {
        let mut tokens = Vec::new();
        for event in self.events {
            match event {
                Event::Token(t) => tokens.push(t),
                Event::Done(stats) => return Ok((tokens, stats)),
                Event::Failed(e) => return Err(e),
            }
        }
        Err(Error::Device(
            "the engine stopped without ending the request".into(),
        ))
    }
}

/// A request between [`Engine::submit`] and its admission.
pub(crate) struct Queued {
    pub id: u64,
    pub prompt: Vec<u32>,
    pub request: GenerateRequest,
    pub submitted: Instant,
    pub cancel: Arc<AtomicBool>,
    pub events: mpsc::Sender<Event>,
}

/// What submitters and the engine's thread share.
pub(crate) struct Inbox {
    state: Mutex<State>,
    wake: Condvar,
}

pub(crate) struct State {
    pub queue: VecDeque<Queued>,
    /// Cancellation flags of every request not yet ended, by id.
    pub live: HashMap<u64, Arc<AtomicBool>>,
    pub next_id: u64,
    pub shutdown: bool,
    pub stats: EngineStats,
}

impl Inbox {
    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        // A panic of the engine's thread is reported to its requests; the state stays usable.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Wait until there is news (a submission, a cancellation, shutdown).
    pub(crate) fn wait<'a>(&self, guard: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        self.wake.wait(guard).unwrap_or_else(|p| p.into_inner())
    }
}

/// Many concurrent requests over one model, batched at every step. Dropping the engine cancels
/// the requests still queued or running (each gets [`Event::Failed`] with
/// [`Error::Cancelled`]) and waits for its thread.
pub struct Engine {
    inbox: Arc<Inbox>,
    shared: Arc<Shared>,
    options: EngineOptions,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("options", &self.options)
            .field("stats", &self.stats())
            .finish()
    }
}

impl Engine {
    /// An engine over `model`, with its step buffers and KV pool allocated and its thread
    /// started. The model's KV mode must be `fp16`, `int8` or `delta`.
    pub fn new(model: &Model, options: &EngineOptions) -> Result<Engine> {
        let shared = model.shared.clone();
        check_options(options)?;
        let mode = shared.kv_layout.mode;
        if !matches!(mode, KvMode::Fp16 | KvMode::Int8 | KvMode::Delta) {
            return Err(Error::invalid(format!(
                "the engine's KV pool holds K and V by position: KV mode {mode} is not \
                 supported (use fp16, int8 or delta)"
            )));
        }
        let mut options = options.clone();
        if options.pool_positions == 0 {
            options.pool_positions = 8 * shared.options.max_seq_len;
        }
        let pages = options.pool_positions.div_ceil(options.page_size);
        options.pool_positions = pages * options.page_size;
        let inbox = Arc::new(Inbox {
            state: Mutex::new(State {
                queue: VecDeque::new(),
                live: HashMap::new(),
                next_id: 0,
                shutdown: false,
                stats: EngineStats {
                    pool_pages: pages,
                    page_size: options.page_size,
                    ..EngineStats::default()
                },
            }),
            wake: Condvar::new(),
        });
        let thread = worker::start(shared.clone(), inbox.clone(), options.clone())?;
        Ok(Engine {
            inbox,
            shared,
            options,
            thread: Mutex::new(Some(thread)),
        })
    }

    /// The options in use (`pool_positions` resolved and rounded up to whole pages).
    pub fn options(&self) -> &EngineOptions {
        &self.options
    }

    /// Queue a request: `prompt` with the generation parameters of [`crate::Session::generate`]
    /// (checked the same way, and refused here if they ask for CTX-TIER, BETA-MON or an exit
    /// rule, which the engine does not run). Any thread may call it.
    pub fn submit(&self, prompt: &[u32], params: &GenerateParams) -> Result<Submitted> {
        let request = self.shared.request(prompt, params, 0)?;
        let unsupported = [
            (
                "a CTX-TIER policy",
                params.ctx_tier.is_some() || self.shared.env_ctx_tier.is_some(),
            ),
            ("BETA-MON", request.monitor.is_some()),
            ("an exit rule", request.exit.is_some()),
        ];
        if let Some((what, _)) = unsupported.iter().find(|(_, asked)| *asked) {
            return Err(Error::invalid(format!(
                "the engine does not run requests with {what}; use a session"
            )));
        }
        let positions = fed_positions(prompt.len(), request.max_tokens);
        let pages = positions.div_ceil(self.options.page_size);
        let pool = self.options.pool_positions / self.options.page_size;
        if pages > pool {
            return Err(Error::invalid(format!(
                "a request of {} prompt tokens and {} new tokens needs {pages} KV pages; the \
                 engine's pool has {pool}",
                prompt.len(),
                request.max_tokens
            )));
        }
        let mut state = self.inbox.lock();
        if state.shutdown {
            return Err(Error::Closed("Engine::submit".into()));
        }
        if state.queue.len() >= self.options.max_queued {
            return Err(Error::Busy);
        }
        let (events, receiver) = mpsc::channel();
        let id = state.next_id;
        state.next_id += 1;
        let cancel = Arc::new(AtomicBool::new(false));
        state.live.insert(id, cancel.clone());
        state.queue.push_back(Queued {
            id,
            prompt: prompt.to_vec(),
            request,
            submitted: Instant::now(),
            cancel,
            events,
        });
        state.stats.queued = state.queue.len();
        drop(state);
        self.inbox.wake.notify_one();
        Ok(Submitted {
            id,
            events: receiver,
        })
    }

    /// Cancel request `id`: it ends with [`Event::Failed`] ([`Error::Cancelled`]) at the next
    /// step. An id that has ended, or that this engine never gave, is an error. Any thread.
    pub fn cancel(&self, id: u64) -> Result<()> {
        let state = self.inbox.lock();
        match state.live.get(&id) {
            Some(flag) => {
                flag.store(true, Ordering::Release);
                drop(state);
                self.inbox.wake.notify_one();
                Ok(())
            }
            None if id < state.next_id => {
                Err(Error::invalid(format!("request {id} has already ended")))
            }
            None => Err(Error::invalid(format!(
                "no request {id}: this engine has given ids 0..{}",
                state.next_id
            ))),
        }
    }

    /// Queue length, running requests, pool use and step counts now.
    pub fn stats(&self) -> EngineStats {
        self.inbox.lock().stats.clone()
    }

    /// Stop the engine: every request queued or running ends with [`Event::Failed`]
    /// ([`Error::Cancelled`]), the engine's thread is awaited and its buffers and pool are
    /// released; later submits are [`Error::Closed`]. Idempotent; dropping the engine does it.
    pub fn shutdown(&self) {
        self.inbox.lock().shutdown = true;
        self.inbox.wake.notify_all();
        let thread = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(thread) = thread {
            // The thread ends every request before it returns.
            let _ = thread.join();
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn check_options(o: &EngineOptions) -> Result<()> {
    let at_least_one = [
        ("max_step_rows", o.max_step_rows),
        ("max_running", o.max_running),
        ("page_size", o.page_size),
        ("max_queued", o.max_queued),
    ];
    if let Some((name, _)) = at_least_one.iter().find(|(_, v)| *v == 0) {
        return Err(Error::invalid(format!(
            "engine option {name} must be at least 1"
        )));
    }
    Ok(())
}

/// Positions a request writes KV entries for: its prompt and every generated token but the
/// last, which is never fed.
pub(crate) fn fed_positions(prompt: usize, max_tokens: usize) -> usize {
    prompt + max_tokens - 1
}
