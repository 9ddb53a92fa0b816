//! `tinyloop MODEL serve`: an HTTP server over one engine, speaking the OpenAI API that users'
//! clients speak (`/v1/completions`, `/v1/chat/completions`, with server-sent events when
//! `stream` is set; `/v1/models`), plus `/health` and Prometheus `/metrics`. On SIGINT or
//! SIGTERM it stops accepting connections and returns once the requests in flight have ended.

mod api;
mod metrics;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::extract::{Json, State};
use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde_json::{json, Value};
use tinyloop::tokenizer::StopStrings;
use tinyloop::{Engine, EngineOptions, Error, Event, Finish, Model, Result, Submitted};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use api::{ApiError, Job, Kind};
use metrics::Metrics;

/// What every handler shares.
struct Server {
    model: Model,
    engine: Engine,
    /// The model's id in `/v1/models` and in responses.
    name: String,
    next_id: AtomicU64,
    metrics: Metrics,
}

/// Serve `model` through an engine of `options` on `addr` until SIGINT or SIGTERM.
pub fn run(model: Model, name: String, options: &EngineOptions, addr: SocketAddr) -> Result<()> {
    let engine = Engine::new(&model, options)?;
    let server = Arc::new(Server {
        model,
        engine,
        name,
        next_id: AtomicU64::new(0),
        metrics: Metrics::default(),
    });
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("tinyloop-http")
        .build()
        .map_err(|e| Error::Device(format!("cannot start the HTTP runtime: {e}")))?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|e| Error::InvalidArgument(format!("cannot listen on {addr}: {e}")))?;
        let bound = listener
            .local_addr()
            .map_err(|e| Error::Device(format!("no local address: {e}")))?;
        eprintln!("[tinyloop] serving {} on http://{bound}", server.name);
        let app = Router::new()
            .route("/health", get(|| async { "ok" }))
            .route("/metrics", get(metrics))
            .route("/v1/models", get(models))
            .route("/v1/completions", post(completions))
            .route("/v1/chat/completions", post(chat_completions))
            .with_state(server.clone());
        axum::serve(listener, app)
            .with_graceful_shutdown(shutdown_signal())
            .await
            .map_err(|e| Error::Device(format!("the HTTP server failed: {e}")))?;
        eprintln!("[tinyloop] stopped: every request in flight has ended");
        Ok(())
    })
}

/// Resolves on SIGINT or SIGTERM.
async fn shutdown_signal() {
    let interrupt = tokio::signal::ctrl_c();
    let mut terminate =
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    let term = async {
        match terminate.as_mut() {
            Some(signal) => {
                signal.recv().await;
            }
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        _ = interrupt => {}
        _ = term => {}
    }
    eprintln!("[tinyloop] shutting down: draining the requests in flight");
}

async fn models(State(s): State<Arc<Server>>) -> Json<Value> {
    Json(json!({
        "object": "list",
        "data": [{"id": s.name, "object": "model", "created": unix_time(), "owned_by": "tinyloop"}],
    }))
}

async fn metrics(State(s): State<Arc<Server>>) -> impl IntoResponse {
    let body = s.metrics.render(&s.engine.stats());
    ([("content-type", "text/plain; version=0.0.4")], body)
}

async fn completions(State(s): State<Arc<Server>>, body: Json<Value>) -> Response {
    respond(s, Kind::Completion, body.0).await
}

async fn chat_completions(State(s): State<Arc<Server>>, body: Json<Value>) -> Response {
    respond(s, Kind::Chat, body.0).await
}

async fn respond(s: Arc<Server>, kind: Kind, body: Value) -> Response {
    let job = match Job::parse(&s.model, kind, &body) {
        Ok(job) => job,
        Err(e) => return s.metrics.failed(kind, e),
    };
    let started = Instant::now();
    let id = format!(
        "{}-{}",
        kind.id_prefix(),
        s.next_id.fetch_add(1, Ordering::Relaxed)
    );
    let mut steps = match start(&s, &job) {
        Ok(steps) => steps,
        Err(e) => return s.metrics.failed(kind, ApiError::from(e)),
    };
    let reply = Reply {
        id,
        kind,
        model: s.name.clone(),
        created: unix_time(),
        token_ids: job.token_ids,
    };
    if job.stream {
        let (tx, rx) = mpsc::channel::<std::result::Result<SseEvent, Infallible>>(64);
        tokio::spawn(async move {
            let send = |v: Value| tx.send(Ok(SseEvent::default().data(v.to_string())));
            if kind == Kind::Chat {
                let _ = send(reply.chunk(Some("assistant"), &Piece::default(), None)).await;
            }
            let mut first = true;
            let outcome = loop {
                match next(&mut steps).await {
                    Step::Piece(piece) => {
                        if first {
                            s.metrics.first_token(started);
                            first = false;
                        }
                        if send(reply.chunk(None, &piece, None)).await.is_err() {
                            // The client went away: dropping `steps` cancels the request.
                            return;
                        }
                    }
                    Step::End(end) => break end,
                }
            };
            match outcome {
                Ok(end) => {
                    s.metrics.finished(kind, started, &end);
                    let _ = send(reply.chunk(None, &Piece::default(), Some(end.finish))).await;
                    let _ = tx.send(Ok(SseEvent::default().data("[DONE]"))).await;
                }
                Err(e) => {
                    let e = ApiError::from(e);
                    s.metrics.count(kind, e.status);
                    let _ = send(e.body()).await;
                }
            }
        });
        return Sse::new(ReceiverStream::new(rx)).into_response();
    }
    let mut whole = Piece::default();
    let mut first = true;
    let end = loop {
        match next(&mut steps).await {
            Step::Piece(piece) => {
                if first {
                    s.metrics.first_token(started);
                    first = false;
                }
                whole.text.push_str(&piece.text);
                whole.tokens.extend(piece.tokens);
            }
            Step::End(end) => break end,
        }
    };
    match end {
        Ok(end) => {
            s.metrics.finished(kind, started, &end);
            Json(reply.complete(&whole, &end)).into_response()
        }
        Err(e) => s.metrics.failed(kind, ApiError::from(e)),
    }
}

fn unix_time() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// How a generation ended.
pub struct End {
    pub finish: &'static str,
    pub prompt_tokens: usize,
    /// Prompt tokens taken from cached pages (known when the engine finished the request, not
    /// when a stop string ended it).
    pub cached_tokens: Option<usize>,
    pub completion_tokens: usize,
}

/// What a running request hands the handler: pieces, then its end.
enum Step {
    Piece(Piece),
    End(Result<End>),
}

/// The next piece of a generation: text of whole characters (before any stop string) and, when
/// the request returns token ids, the tokens generated since the previous piece (whose text may
/// still be held back, as part of a character or of what may be a stop string).
#[derive(Default)]
struct Piece {
    text: String,
    tokens: Vec<u32>,
}

/// Submit `job` to the engine; its pieces arrive on the returned channel. The engine's events
/// come on a blocking channel, so a blocking task turns them into text (the model's streaming
/// detokenizer, then the stop strings). Dropping the receiver ends the request: the task's next
/// send fails, it drops the engine's receiver, and the engine cancels the request.
fn start(s: &Arc<Server>, job: &Job) -> Result<mpsc::Receiver<Step>> {
    let submitted = s.engine.submit(&job.prompt, &job.params)?;
    let stops = StopStrings::new(job.stop.clone())?;
    let (tx, rx) = mpsc::channel(256);
    let server = s.clone();
    let prompt_tokens = job.prompt.len();
    let token_ids = job.token_ids;
    tokio::task::spawn_blocking(move || {
        let pieces = Pieces {
            tx: &tx,
            token_ids,
            held: Vec::new(),
        };
        let end = pump(&server, submitted, stops, prompt_tokens, pieces);
        let _ = tx.blocking_send(Step::End(end));
    });
    Ok(rx)
}

/// Sends a request's pieces: text whenever there is some, and with token ids every token.
struct Pieces<'a> {
    tx: &'a mpsc::Sender<Step>,
    token_ids: bool,
    /// Tokens not sent yet.
    held: Vec<u32>,
}

impl Pieces<'_> {
    fn token(&mut self, token: u32) {
        if self.token_ids {
            self.held.push(token);
        }
    }

    fn send(&mut self, text: String) -> Result<()> {
        if text.is_empty() && self.held.is_empty() {
            return Ok(());
        }
        let tokens = std::mem::take(&mut self.held);
        self.tx
            .blocking_send(Step::Piece(Piece { text, tokens }))
            .map_err(|_| Error::Cancelled)
    }
}

fn pump(
    s: &Server,
    submitted: Submitted,
    mut stops: StopStrings,
    prompt_tokens: usize,
    mut pieces: Pieces,
) -> Result<End> {
    // A model without a tokenizer serves token ids only (Job::parse checked the request).
    let mut text = s.model.tokenizer().ok().map(|t| t.stream(true));
    let id = submitted.id;
    let mut tokens = 0;
    for event in submitted.events {
        match event {
            Event::Token(token) => {
                tokens += 1;
                pieces.token(token);
                let piece = text.as_mut().map(|t| t.push(token)).transpose()?;
                let (out, stopped) = stops.push(&piece.unwrap_or_default());
                pieces.send(out)?;
                if stopped {
                    // Tokens the engine produced past the stop string are not returned.
                    let _ = s.engine.cancel(id);
                    return Ok(End {
                        finish: "stop",
                        prompt_tokens,
                        cached_tokens: None,
                        completion_tokens: tokens,
                    });
                }
            }
            Event::Done(stats) => {
                let rest = text.as_mut().map(|t| t.finish()).transpose()?;
                let (mut out, stopped) = stops.push(&rest.unwrap_or_default());
                if !stopped {
                    out.push_str(&stops.finish());
                }
                pieces.send(out)?;
                let stop = stopped || stats.finish == Finish::Stop;
                return Ok(End {
                    finish: if stop { "stop" } else { "length" },
                    prompt_tokens,
                    cached_tokens: Some(stats.cached_tokens),
                    completion_tokens: stats.tokens,
                });
            }
            Event::Failed(e) => return Err(e),
        }
    }
    Err(Error::Device(
        "the engine ended the request without finishing it".into(),
    ))
}

/// The next step of a generation (an end with an error if its task is gone).
async fn next(rx: &mut mpsc::Receiver<Step>) -> Step {
    rx.recv().await.unwrap_or_else(|| {
        Step::End(Err(Error::Device(
            "the request's generation task ended early".into(),
        )))
    })
}

/// The fixed fields of one response.
struct Reply {
    id: String,
    kind: Kind,
    model: String,
    created: u64,
    /// Whether each choice carries `token_ids`.
    token_ids: bool,
}

impl Reply {
    /// A server-sent chunk: a piece, the chat's opening role, or (with `finish`) the end.
    fn chunk(&self, role: Option<&str>, piece: &Piece, finish: Option<&str>) -> Value {
        let text = &piece.text;
        let mut choice = match self.kind {
            Kind::Completion => {
                json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish})
            }
            Kind::Chat => {
                let mut delta = json!({});
                if let Some(role) = role {
                    delta["role"] = json!(role);
                }
                if !text.is_empty() || role.is_some() {
                    delta["content"] = json!(text);
                }
                json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish})
            }
        };
        if self.token_ids {
            choice["token_ids"] = json!(piece.tokens);
        }
        json!({
            "id": self.id,
            "object": self.kind.chunk_object(),
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        })
    }

    /// The whole response of a request that was not streamed.
    fn complete(&self, whole: &Piece, end: &End) -> Value {
        let text = &whole.text;
        let mut choice = match self.kind {
            Kind::Completion => json!({
                "index": 0, "text": text, "logprobs": null, "finish_reason": end.finish,
            }),
            Kind::Chat => json!({
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": null,
                "finish_reason": end.finish,
            }),
        };
        if self.token_ids {
            choice["token_ids"] = json!(whole.tokens);
        }
        json!({
            "id": self.id,
            "object": self.kind.object(),
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": {
                "prompt_tokens": end.prompt_tokens,
                "prompt_tokens_details": {"cached_tokens": end.cached_tokens},
                "completion_tokens": end.completion_tokens,
                "total_tokens": end.prompt_tokens + end.completion_tokens,
            },
        })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::BAD_REQUEST);
        (status, Json(self.body())).into_response()
    }
}
