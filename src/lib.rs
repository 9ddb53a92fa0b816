//! TinyLoop: inference for looped (weight-shared) transformers with INT4 / INT2 weights.
//!
//! ```no_run
//! use tinyloop::{GenerateParams, Model, ModelOptions};
//! let model = Model::open("models/demo.tinyloop", &ModelOptions::default())?;
//! let mut session = model.new_session()?;
//! let tokens = session.generate(b"ROMEO:".map(u32::from).as_slice(), &GenerateParams::default())?;
//! # Ok::<(), tinyloop::Error>(())
//! ```
//!
//! A [`Model`] holds immutable weights on one device and may be shared across threads (it is
//! `Clone`; clones share the weights). A [`Session`] holds the runtime buffers and KV cache of one
//! sequence; it is used by one thread at a time, and many sessions share one model's weights.

mod alloc;
pub mod backend;
pub mod convert;
mod device;
pub mod error;
pub mod ffi;
pub mod format;
pub mod generate;
pub mod model;

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use backend::cpu::CpuBackend;
use backend::cuda::CudaBackend;
use backend::Backend;
use generate::GenerateRequest;
use model::forward::Buffers;
use model::weights::Weights;

pub use device::Device;
pub use error::{Error, Result};
pub use format::ModelFile;
pub use generate::sampling::SamplingParams;
pub use model::config::{HeadKind, ModelConfig, NormKind};

/// Options fixed when a model is opened.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelOptions {
    /// Upper bound on prompt + generated tokens of one sequence. Must be > 0.
    pub max_seq_len: usize,
    /// When > 0, step buffers hold this many rows and longer prompts are prefilled in chunks;
    /// score calls then accept at most this many tokens. 0 sizes buffers to `max_seq_len`.
    pub prefill_chunk: usize,
    /// `None` uses `TINYLOOP_DEVICE`, or `auto` when that is unset.
    pub device: Option<Device>,
    /// Largest loop count a call may ask for (bounds the KV cache).
    pub max_loops: usize,
    /// Print the load log on stderr.
    pub log: bool,
}

impl Default for ModelOptions {
    fn default() -> Self {
        ModelOptions {
            max_seq_len: 2048,
            prefill_chunk: 0,
            device: None,
            max_loops: 64,
            log: true,
        }
    }
}

/// Parameters of a generation call.
#[derive(Clone, Debug, PartialEq)]
pub struct GenerateParams {
    /// Tokens to generate (≥ 1).
    pub max_tokens: usize,
    /// Loop iterations; `None` uses the model's `default_loops`.
    pub loops: Option<usize>,
    pub sampling: SamplingParams,
    /// Generation ends when one of these is produced; it is not returned.
    pub stop_tokens: Vec<u32>,
}

impl Default for GenerateParams {
    fn default() -> Self {
        GenerateParams {
            max_tokens: 128,
            loops: None,
            sampling: SamplingParams::default(),
            stop_tokens: Vec::new(),
        }
    }
}

/// Facts about a loaded model.
#[derive(Clone, Debug)]
pub struct ModelInfo {
    /// The device the weights live on, in words.
    pub device: String,
    pub tensors: usize,
    pub file_bytes: usize,
    pub weight_bytes: usize,
    pub load_ms: f64,
    /// CUDA only: how this open obtained the kernels ("disk cache hit (3.1 ms)", "compiled by
    /// NVRTC 13.0 for sm_90 in 9000 ms, cached in ...", "already loaded in this process").
    pub kernels: Option<String>,
    /// CUDA only: milliseconds this open spent compiling or loading kernels (part of `load_ms`).
    pub kernel_ms: f64,
    pub metadata: serde_json::Map<String, serde_json::Value>,
}

struct Loaded<B: Backend> {
    backend: B,
    weights: Weights<B>,
}

enum Engine {
    Cpu(Loaded<CpuBackend>),
    Cuda(Loaded<CudaBackend>),
}

enum SessionState {
    Cpu(Buffers<CpuBackend>),
    Cuda(CudaSession),
}

/// A CUDA session: its buffers and its own backend instance (stream, attention scratch) over the
/// model's shared weights. Buffers drop first, then the stream.
struct CudaSession {
    buffers: Buffers<CudaBackend>,
    backend: CudaBackend,
}

struct Shared {
    engine: Engine,
    options: ModelOptions,
    info: ModelInfo,
    /// Bytes held by live sessions (buffers and KV caches).
    session_bytes: AtomicUsize,
}

/// Run `$body` with the backend, weights and buffers of a session, whatever the device.
macro_rules! with_backend {
    ($session:expr, |$backend:ident, $weights:ident, $buffers:ident| $body:expr) => {
        match (&$session.shared.engine, &mut $session.state) {
            (Engine::Cpu(loaded), SessionState::Cpu($buffers)) => {
                let ($backend, $weights) = (&loaded.backend, &loaded.weights);
                $body
            }
            (Engine::Cuda(loaded), SessionState::Cuda(session)) => {
                let ($backend, $weights, $buffers) =
                    (&session.backend, &loaded.weights, &mut session.buffers);
                $body
            }
            _ => unreachable!("a session always matches its model's device"),
        }
    };
}

/// Immutable weights on one device. Cheap to clone; clones share the weights.
#[derive(Clone)]
pub struct Model {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("device", &self.shared.info.device)
            .field("config", self.config())
            .finish()
    }
}

impl Model {
    /// Open and validate a `.tinyloop` file, then upload its weights to the chosen device.
    pub fn open(path: impl AsRef<Path>, options: &ModelOptions) -> Result<Model> {
        let start = Instant::now();
        if options.max_seq_len == 0 {
            return Err(Error::invalid("max_seq_len must be > 0"));
        }
        if options.max_loops == 0 {
            return Err(Error::invalid("max_loops must be > 0"));
        }
        // Device initialization (driver, context, kernels) overlaps reading and checking the file.
        let (file, choice) = std::thread::scope(|scope| {
            let device = scope.spawn(|| Device::resolve(options.device).and_then(device::select));
            let file = ModelFile::open(path.as_ref());
            let choice = device
                .join()
                .unwrap_or_else(|_| Err(Error::Device("device initialization panicked".into())));
            (file, choice)
        });
        let (file, choice) = (file?, choice?);
        file.config
            .check_session(options.max_seq_len, options.max_loops)?;
        let mut notes = Vec::new();
        let (mut kernels, mut kernel_ms) = (None, 0.0);
        let (engine, device_name, weight_bytes) = match choice {
            device::Selected::Cpu { note } => {
                notes.extend(note);
                let backend = CpuBackend;
                let weights = Weights::load(&backend, &file, options.max_seq_len)?;
                let bytes = weights.bytes;
                (
                    Engine::Cpu(Loaded { backend, weights }),
                    backend.describe(),
                    bytes,
                )
            }
            device::Selected::Cuda(backend) => {
                let backend = *backend;
                let upload = Instant::now();
                let weights = Weights::load(&backend, &file, options.max_seq_len)?;
                let fit = backend.finish_load(&weights)?;
                let upload_ms = upload.elapsed().as_secs_f64() * 1e3;
                let (note, ms) = backend.kernel_load();
                notes.push(format!("kernels: {note}"));
                notes.push(format!(
                    "weights uploaded in {upload_ms:.1} ms ({:.1} GB/s); {fit}",
                    weights.bytes as f64 / upload_ms / 1e6
                ));
                (kernels, kernel_ms) = (Some(note.to_string()), ms);
                let bytes = weights.bytes;
                let name = backend.describe();
                (Engine::Cuda(Loaded { backend, weights }), name, bytes)
            }
        };
        let info = ModelInfo {
            device: device_name,
            tensors: file.tensor_entries().count(),
            file_bytes: file.file_len(),
            weight_bytes,
            load_ms: start.elapsed().as_secs_f64() * 1e3,
            kernels,
            kernel_ms,
            metadata: file.metadata.clone(),
        };
        if options.log {
            eprintln!(
                "[tinyloop] loaded {} on {}: {} tensors, weights {:.1} MB, {:.1} ms",
                path.as_ref().display(),
                info.device,
                info.tensors,
                info.weight_bytes as f64 / 1e6,
                info.load_ms
            );
            for note in &notes {
                eprintln!("[tinyloop]   {note}");
            }
        }
        Ok(Model {
            shared: Arc::new(Shared {
                engine,
                options: options.clone(),
                info,
                session_bytes: AtomicUsize::new(0),
            }),
        })
    }

    pub fn config(&self) -> &ModelConfig {
        match &self.shared.engine {
            Engine::Cpu(l) => &l.weights.config,
            Engine::Cuda(l) => &l.weights.config,
        }
    }

    pub fn info(&self) -> &ModelInfo {
        &self.shared.info
    }

    pub fn options(&self) -> &ModelOptions {
        &self.shared.options
    }

    /// Device memory held by the weights and every live session of this model, in bytes.
    pub fn memory_bytes(&self) -> usize {
        self.shared.info.weight_bytes + self.shared.session_bytes.load(Ordering::Relaxed)
    }

    /// A new session with its own buffers and KV cache, sharing this model's weights.
    pub fn new_session(&self) -> Result<Session> {
        let opts = &self.shared.options;
        let rows = if opts.prefill_chunk > 0 {
            opts.prefill_chunk.min(opts.max_seq_len)
        } else {
            opts.max_seq_len
        };
        let state = match &self.shared.engine {
            Engine::Cpu(l) => SessionState::Cpu(Buffers::new(
                &l.backend,
                &l.weights.config,
                rows,
                opts.max_seq_len,
            )?),
            Engine::Cuda(l) => {
                let config = &l.weights.config;
                let backend = l.backend.session(config)?;
                let buffers = Buffers::new(&backend, config, rows, opts.max_seq_len)?;
                if opts.log {
                    let kv = config.applications(config.default_loops)
                        * opts.max_seq_len
                        * config.kv_dim()
                        * 4;
                    eprintln!(
                        "[tinyloop] session on {}: buffers {:.1} MB for {rows} rows, KV cache \
                         {:.1} MB at L={} (allocated at first use)",
                        backend.describe(),
                        (buffers.bytes + backend.own_bytes()) as f64 / 1e6,
                        kv as f64 / 1e6,
                        config.default_loops
                    );
                }
                SessionState::Cuda(CudaSession { buffers, backend })
            }
        };
        let mut session = Session {
            shared: self.shared.clone(),
            state,
            cancel: Arc::new(AtomicBool::new(false)),
            accounted_bytes: 0,
        };
        session.account();
        Ok(session)
    }
}

/// Cancels the call in flight on one session; `Send + Sync`, usable from any thread.
#[derive(Clone, Debug)]
pub struct CancelHandle(Arc<AtomicBool>);

impl CancelHandle {
    /// Stop the session's running generation at the next token (it returns [`Error::Cancelled`]).
    /// Has no effect on calls that start later.
    pub fn cancel(&self) {
        self.0.store(true, Ordering::Release);
    }
}

/// Runtime buffers and KV cache of one sequence over a shared [`Model`].
pub struct Session {
    shared: Arc<Shared>,
    state: SessionState,
    cancel: Arc<AtomicBool>,
    accounted_bytes: usize,
}

impl Session {
    pub fn config(&self) -> &ModelConfig {
        match &self.shared.engine {
            Engine::Cpu(l) => &l.weights.config,
            Engine::Cuda(l) => &l.weights.config,
        }
    }

    pub fn cancel_handle(&self) -> CancelHandle {
        CancelHandle(self.cancel.clone())
    }

    /// Generate tokens after `prompt`; returns only the new tokens.
    pub fn generate(&mut self, prompt: &[u32], params: &GenerateParams) -> Result<Vec<u32>> {
        self.generate_stream(prompt, params, &mut |_| true)
    }

    /// Like [`Session::generate`], calling `on_token` with each new token as soon as it exists;
    /// returning false from it ends generation (not an error).
    pub fn generate_stream(
        &mut self,
        prompt: &[u32],
        params: &GenerateParams,
        on_token: &mut dyn FnMut(u32) -> bool,
    ) -> Result<Vec<u32>> {
        // A cancel only concerns the call in flight; clear any earlier one before anything else.
        self.cancel.store(false, Ordering::Release);
        let loops = self.check_tokens(prompt, params.loops)?;
        params.sampling.validate()?;
        if params.max_tokens == 0 {
            return Err(Error::invalid("max_tokens must be >= 1"));
        }
        let max_seq = self.shared.options.max_seq_len;
        if prompt.len() + params.max_tokens > max_seq {
            return Err(Error::invalid(format!(
                "prompt of {} tokens + max_tokens {} exceeds max_seq_len {max_seq}",
                prompt.len(),
                params.max_tokens
            )));
        }
        for &t in &params.stop_tokens {
            self.check_token(t, "stop token")?;
        }
        let req = GenerateRequest {
            max_tokens: params.max_tokens,
            loops,
            sampling: params.sampling,
            stop_tokens: params.stop_tokens.clone(),
        };
        let cancel = self.cancel.clone();
        let result = with_backend!(self, |b, w, buf| generate::generate(
            b, w, buf, prompt, &req, &cancel, on_token
        ));
        self.account();
        result
    }

    /// Logits `[n, vocab]` (row-major) for every position of `tokens`.
    pub fn score(&mut self, tokens: &[u32], loops: Option<usize>) -> Result<Vec<f32>> {
        let loops = self.check_score(tokens, loops)?;
        let result = with_backend!(self, |b, w, buf| generate::score(b, w, buf, tokens, loops));
        self.account();
        result
    }

    /// `log p(tokens[i + 1] | tokens[..=i])`, `n − 1` values. Needs at least two tokens.
    pub fn logprobs(&mut self, tokens: &[u32], loops: Option<usize>) -> Result<Vec<f32>> {
        if tokens.len() < 2 {
            return Err(Error::invalid("logprobs needs at least 2 tokens"));
        }
        let logits = self.score(tokens, loops)?;
        let vocab = self.config().vocab_size;
        Ok(generate::logprobs_from_logits(&logits, tokens, vocab))
    }

    /// Logits `[vocab]` at the last position of `tokens`.
    pub fn score_last(&mut self, tokens: &[u32], loops: Option<usize>) -> Result<Vec<f32>> {
        let loops = self.check_score(tokens, loops)?;
        let result = with_backend!(self, |b, w, buf| generate::score_last(
            b, w, buf, tokens, loops
        ));
        self.account();
        result
    }

    /// Bytes of device memory this session holds (buffers and KV cache).
    pub fn memory_bytes(&self) -> usize {
        match &self.state {
            SessionState::Cpu(buf) => buf.bytes + buf.kv_bytes(&CpuBackend),
            SessionState::Cuda(s) => {
                s.buffers.bytes + s.buffers.kv_bytes(&s.backend) + s.backend.own_bytes()
            }
        }
    }

    /// Keep the model-wide count of session bytes current.
    fn account(&mut self) {
        let now = self.memory_bytes();
        let counter = &self.shared.session_bytes;
        counter.fetch_add(now, Ordering::Relaxed);
        counter.fetch_sub(self.accounted_bytes, Ordering::Relaxed);
        self.accounted_bytes = now;
    }

    fn check_token(&self, token: u32, what: &str) -> Result<()> {
        let vocab = self.config().vocab_size;
        if token as usize >= vocab {
            return Err(Error::invalid(format!(
                "{what} {token} is out of range for vocab_size {vocab}"
            )));
        }
        Ok(())
    }

    /// Validate a token sequence and resolve the loop count.
    fn check_tokens(&self, tokens: &[u32], loops: Option<usize>) -> Result<usize> {
        if tokens.is_empty() {
            return Err(Error::invalid("empty token sequence"));
        }
        let max_seq = self.shared.options.max_seq_len;
        if tokens.len() > max_seq {
            return Err(Error::invalid(format!(
                "{} tokens exceed max_seq_len {max_seq}",
                tokens.len()
            )));
        }
        for (i, &t) in tokens.iter().enumerate() {
            self.check_token(t, &format!("token {i}:"))?;
        }
        let loops = loops.unwrap_or(self.config().default_loops);
        let max_loops = self.shared.options.max_loops;
        if loops == 0 || loops > max_loops {
            return Err(Error::invalid(format!(
                "loops must be in 1..={max_loops}, got {loops}"
            )));
        }
        Ok(loops)
    }

    fn check_score(&self, tokens: &[u32], loops: Option<usize>) -> Result<usize> {
        let loops = self.check_tokens(tokens, loops)?;
        let chunk = self.shared.options.prefill_chunk;
        if chunk > 0 && tokens.len() > chunk {
            return Err(Error::invalid(format!(
                "score APIs need seq_len <= prefill_chunk ({} > {chunk}): shorten the input or \
                 open the model with prefill_chunk=0",
                tokens.len()
            )));
        }
        Ok(loops)
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        self.shared
            .session_bytes
            .fetch_sub(self.accounted_bytes, Ordering::Relaxed);
    }
}
