//! The OpenAI request bodies the server takes, checked field by field, and its error bodies.
//!
//! Fields: `prompt` (a string, or an array of token ids) or `messages` (`role` and `content`
//! strings), `max_tokens` (also `max_completion_tokens`; default 16 for completions, as OpenAI's,
//! and for chat whatever fits in `max_seq_len`), `temperature` (default 1, as OpenAI's; 0 is
//! greedy), `top_p`, `seed`, `stop` (a string or up to 4 strings), `stream`, `n` (1 only),
//! `return_token_ids` (each choice also carries the ids of its tokens), and TinyLoop's `loops`
//! and `top_k`. Other fields (`model`, `user`, ...) are accepted and ignored.
//!
//! A model without a tokenizer takes token-id prompts only, with no `messages` and no `stop`
//! strings; its choices carry empty text and always their token ids.

use serde_json::{json, Map, Value};
use tinyloop::tokenizer::ChatMessage;
use tinyloop::{Error, GenerateParams, Model, SamplingParams, Tokenizer};

/// Which endpoint a request came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Completion,
    Chat,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::Completion => "completions",
            Kind::Chat => "chat_completions",
        }
    }

    pub fn id_prefix(self) -> &'static str {
        match self {
            Kind::Completion => "cmpl",
            Kind::Chat => "chatcmpl",
        }
    }

    pub fn object(self) -> &'static str {
        match self {
            Kind::Completion => "text_completion",
            Kind::Chat => "chat.completion",
        }
    }

    pub fn chunk_object(self) -> &'static str {
        match self {
            Kind::Completion => "text_completion",
            Kind::Chat => "chat.completion.chunk",
        }
    }
}

/// A failed request: its HTTP status and message.
#[derive(Debug)]
pub struct ApiError {
    pub status: u16,
    pub message: String,
}

impl ApiError {
    fn invalid(message: impl Into<String>) -> ApiError {
        ApiError {
            status: 400,
            message: message.into(),
        }
    }

    /// The OpenAI error body.
    pub fn body(&self) -> Value {
        let kind = if self.status < 500 {
            "invalid_request_error"
        } else {
            "server_error"
        };
        json!({"error": {"message": self.message, "type": kind, "param": null, "code": null}})
    }
}

impl From<Error> for ApiError {
    fn from(e: Error) -> ApiError {
        let status = match e {
            Error::InvalidArgument(_) => 400,
            // The queue is full: the client may retry.
            Error::Busy => 429,
            Error::Closed(_) | Error::Cancelled => 503,
            _ => 500,
        };
        ApiError {
            status,
            message: e.to_string(),
        }
    }
}

/// A request ready for the engine.
pub struct Job {
    pub prompt: Vec<u32>,
    pub params: GenerateParams,
    pub stop: Vec<String>,
    pub stream: bool,
    /// Whether each choice carries the ids of its tokens (asked for, or the model has no
    /// tokenizer to give text).
    pub token_ids: bool,
}

impl Job {
    pub fn parse(model: &Model, kind: Kind, body: &Value) -> Result<Job, ApiError> {
        let body = body
            .as_object()
            .ok_or_else(|| ApiError::invalid("the request body must be a JSON object"))?;
        let tokenizer = model.tokenizer().ok();
        let prompt = match kind {
            Kind::Completion => completion_prompt(model, body)?,
            Kind::Chat => chat_prompt(model, body)?,
        };
        let stop = stop_strings(body)?;
        if !stop.is_empty() && tokenizer.is_none() {
            return Err(ApiError::invalid(
                "stop is given, but the model has no tokenizer to find stop strings in its text",
            ));
        }
        if let Some(n) = uint(body, "n")? {
            if n != 1 {
                return Err(ApiError::invalid(format!("n is {n}: only n = 1 is served")));
            }
        }
        let room = model.options().max_seq_len.saturating_sub(prompt.len());
        let max_tokens = match (
            uint(body, "max_tokens")?,
            uint(body, "max_completion_tokens")?,
        ) {
            (Some(n), _) | (None, Some(n)) => n as usize,
            (None, None) if kind == Kind::Completion => 16,
            (None, None) => room.max(1),
        };
        let temperature = number(body, "temperature")?.unwrap_or(1.0) as f32;
        let sampling = SamplingParams {
            temperature,
            top_k: uint(body, "top_k")?.unwrap_or(0) as usize,
            top_p: number(body, "top_p")?.unwrap_or(1.0) as f32,
            seed: match uint(body, "seed")? {
                Some(seed) => seed,
                None => random_seed(),
            },
        };
        let loops = uint(body, "loops")?.map(|l| l as usize);
        let params = GenerateParams {
            max_tokens,
            loops,
            sampling,
            stop_tokens: tokenizer.map_or_else(Vec::new, |t| t.eos_tokens().to_vec()),
            ..GenerateParams::default()
        };
        Ok(Job {
            prompt,
            params,
            stop,
            stream: boolean(body, "stream")?.unwrap_or(false),
            token_ids: boolean(body, "return_token_ids")?.unwrap_or(false) || tokenizer.is_none(),
        })
    }
}

/// `prompt`: text through the tokenizer (with its special tokens), or token ids.
fn completion_prompt(model: &Model, body: &Map<String, Value>) -> Result<Vec<u32>, ApiError> {
    let encode = |text: &str| model.tokenize(text, true).map_err(ApiError::from);
    match body.get("prompt") {
        Some(Value::String(text)) => encode(text),
        Some(Value::Array(items)) if items.iter().all(Value::is_u64) => {
            let vocab = model.config().vocab_size as u64;
            items
                .iter()
                .enumerate()
                .map(|(i, v)| match v.as_u64() {
                    Some(t) if t < vocab => Ok(t as u32),
                    _ => Err(ApiError::invalid(format!(
                        "prompt[{i}] is {v}: token ids are below vocab_size {vocab}"
                    ))),
                })
                .collect()
        }
        Some(Value::Array(items)) if items.len() == 1 && items[0].is_string() => {
            encode(items[0].as_str().unwrap_or_default())
        }
        Some(_) => Err(ApiError::invalid(
            "prompt must be a string, a one-string array or an array of token ids",
        )),
        None => Err(ApiError::invalid("prompt is missing")),
    }
}

/// `messages` through the model's chat template; a byte-level model, which has none, takes
/// them as a transcript (`role: content` lines, then `assistant:`).
fn chat_prompt(model: &Model, body: &Map<String, Value>) -> Result<Vec<u32>, ApiError> {
    let tokenizer = model.tokenizer().map_err(|_| {
        ApiError::invalid(
            "chat completions need a tokenizer and the model has none: send token ids to \
             /v1/completions",
        )
    })?;
    let messages = body
        .get("messages")
        .and_then(Value::as_array)
        .ok_or_else(|| ApiError::invalid("messages must be an array of messages"))?;
    if messages.is_empty() {
        return Err(ApiError::invalid("messages is empty"));
    }
    let mut chat = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        let field = |name: &str| {
            m.get(name)
                .and_then(Value::as_str)
                .ok_or_else(|| ApiError::invalid(format!("messages[{i}].{name} must be a string")))
        };
        chat.push(ChatMessage::new(field("role")?, field("content")?));
    }
    let text = match tokenizer {
        Tokenizer::Bytes => {
            let mut t: String = chat
                .iter()
                .map(|m| format!("{}: {}\n", m.role, m.content))
                .collect();
            t.push_str("assistant:");
            t
        }
        Tokenizer::HuggingFace(_) => model
            .apply_chat_template(&chat, true)
            .map_err(ApiError::from)?,
    };
    // A rendered template carries its special tokens already.
    tokenizer.encode(&text, false).map_err(ApiError::from)
}

fn stop_strings(body: &Map<String, Value>) -> Result<Vec<String>, ApiError> {
    let stops = match body.get("stop") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| v.as_str().map(str::to_string))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| ApiError::invalid("stop must be a string or an array of strings"))?,
        Some(_) => {
            return Err(ApiError::invalid(
                "stop must be a string or an array of strings",
            ))
        }
    };
    if stops.len() > 4 {
        return Err(ApiError::invalid(format!(
            "stop has {} strings: at most 4",
            stops.len()
        )));
    }
    Ok(stops)
}

fn uint(body: &Map<String, Value>, name: &str) -> Result<Option<u64>, ApiError> {
    match body.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_u64().map(Some).ok_or_else(|| {
            ApiError::invalid(format!("{name} is {v}: it must be a whole number >= 0"))
        }),
    }
}

fn number(body: &Map<String, Value>, name: &str) -> Result<Option<f64>, ApiError> {
    match body.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .map(Some)
            .ok_or_else(|| ApiError::invalid(format!("{name} is {v}: it must be a number"))),
    }
}

fn boolean(body: &Map<String, Value>, name: &str) -> Result<Option<bool>, ApiError> {
    match body.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_bool()
            .map(Some)
            .ok_or_else(|| ApiError::invalid(format!("{name} is {v}: it must be true or false"))),
    }
}

/// A seed for a sampled request that names none.
fn random_seed() -> u64 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(std::time::SystemTime::now())
}
