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

/// One line of the library's log on stderr, written only when `$on`: the model's `log` option
/// ([`ModelOptions::log`]) governs the load log and every CTX-TIER and BETA-MON line alike.
macro_rules! log_line {
    ($on:expr, $($arg:tt)*) => {
        if $on {
            eprintln!($($arg)*);
        }
    };
}

mod alloc;
pub mod backend;
pub mod batch;
pub mod convert;
pub mod ctx_tier;
mod device;
pub mod env;
pub mod error;
pub mod ffi;
pub mod format;
pub mod generate;
mod handle;
pub mod kv;
pub mod model;
mod session;
mod shared;
pub mod telemetry;
mod text;
pub mod tokenizer;

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use backend::cpu::CpuBackend;
use backend::cuda::fp16_body;
use backend::Backend;
use kv::KvLayout;
use model::forward::Buffers;
use model::weights::Weights;
use shared::{CudaSession, Loaded, OnDevice, SessionState, Shared};

/// Packaging: precompile the CUDA kernels for an architecture into a folder (`tinyloop kernels`).
pub use backend::cuda::kernels::ship as ship_kernels;
pub use batch::{
    Engine, EngineOptions, EngineStats, Event, Finish, RequestStats, Submitted, STEP_MS_BOUNDS,
};
pub use ctx_tier::{CtxTier, CtxTierStats, Tier};
pub use device::Device;
pub use error::{Error, Result};
pub use format::ModelFile;
pub use generate::criteria::Criterion;
pub use generate::exit::{Exit, ExitPolicy, ExitRule};
pub use generate::lens::TrajectoryPoint;
pub use generate::sampling::SamplingParams;
pub use generate::speculative::{Speculation, MAX_DRAFT_LEN};
pub use generate::GenerateStats;
pub use handle::{PrefixCache, ResumeHandle};
pub use kv::{AgeTiers, KvMode};
pub use model::architecture::{Architecture, BlockNorms, LoopInput, LoopNorm, LoopState};
pub use model::config::{HeadKind, ModelConfig, NormKind, DEFAULT_MAX_SEQ_LEN};
pub use model::state_init::StateInit;
pub use session::{CancelHandle, Session};
pub use telemetry::beta_monitor::{BetaMonEnv, BetaMonSummary, BetaMonitor};
pub use text::{GeneratedText, ScoredText, TextParams};
pub use tokenizer::{ChatMessage, Tokenizer};

/// Options fixed when a model is opened.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelOptions {
    /// Upper bound on prompt + generated tokens of one sequence, at most the model's
    /// `max_position`. 0 (the default) opens the model for
    /// [`ModelConfig::default_max_seq_len`]: 2048, or `max_position` when that is smaller.
    /// [`Model::options`] reports the value in use.
    pub max_seq_len: usize,
    /// When > 0, step buffers hold this many rows and longer prompts are prefilled in chunks;
    /// score calls then accept at most this many tokens. 0 sizes buffers to `max_seq_len`.
    pub prefill_chunk: usize,
    /// `None` uses `TINYLOOP_DEVICE`, or `auto` when that is unset.
    pub device: Option<Device>,
    /// Largest loop count a call may ask for (bounds the KV cache).
    pub max_loops: usize,
    /// What the KV cache stores; `None` uses the environment's default ([`KvMode::from_env`]).
    pub kv_mode: Option<KvMode>,
    /// Print the library's lines on stderr: the load log, and the CTX-TIER and BETA-MON lines of
    /// calls that ask for them. `false`: the library writes nothing on stderr (the statistics
    /// and the JSON files of CTX-TIER and BETA-MON are unaffected).
    pub log: bool,
    /// Keep an FP16 copy of the transformer blocks' quantized weights on the GPU for prefill GEMMs
    /// through cuBLAS (more memory, faster long prompts; weights rounded to f16 on that path,
    /// docs/FORMAT.md "The FP16 body cache"). `None` uses `TINYLOOP_EXPERIMENTAL_FP16_BODY=1`.
    /// Has no effect on the CPU.
    pub fp16_body: Option<bool>,
    /// How a loop that starts from a random state (Huginn) draws it: the model's own rule from
    /// seed 0, zeros, or a seed ([`StateInit`]). Other models accept only the default.
    pub state_init: StateInit,
}

impl Default for ModelOptions {
    fn default() -> Self {
        ModelOptions {
            max_seq_len: 0,
            prefill_chunk: 0,
            device: None,
            max_loops: 64,
            kv_mode: None,
            log: true,
            fp16_body: None,
            state_init: StateInit::Model,
        }
    }
}

/// Parameters of a generation call.
#[derive(Clone, Debug, PartialEq)]
pub struct GenerateParams {
    /// Tokens to generate at most (≥ 1): generation also stops when the sequence reaches the
    /// model's `max_seq_len`.
    pub max_tokens: usize,
    /// Loop iterations; `None` uses the model's `default_loops`.
    pub loops: Option<usize>,
    pub sampling: SamplingParams,
    /// Generation ends when one of these is produced; it is not returned.
    pub stop_tokens: Vec<u32>,
    /// CTX-TIER policy of the call; `None` uses the environment's (`TINYLOOP_CTX_TIER*`, read
    /// when the model was opened), or runs without tiers when that is off.
    pub ctx_tier: Option<CtxTier>,
    /// BETA-MON this call with these thresholds (summary in `GenerateStats::beta_mon`); `None`
    /// monitors it only when `TINYLOOP_BETA_MONITOR=1`.
    pub beta_monitor: Option<BetaMonitor>,
    /// Adaptive exit: the rule that picks each token's loop iteration, and its policy
    /// ([`Exit`]; the exit iterations in `GenerateStats::exit_steps`). `None`: every token takes
    /// the last iteration.
    pub exit: Option<Exit>,
}

impl Default for GenerateParams {
    fn default() -> Self {
        GenerateParams {
            max_tokens: 128,
            loops: None,
            sampling: SamplingParams::default(),
            stop_tokens: Vec::new(),
            ctx_tier: None,
            beta_monitor: None,
            exit: None,
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
    /// NVRTC 13.0 for sm_90a in 9000 ms, cached in ...", "already loaded in this process").
    pub kernels: Option<String>,
    /// CUDA only: milliseconds this open spent compiling or loading kernels (part of `load_ms`).
    pub kernel_ms: f64,
    pub metadata: serde_json::Map<String, serde_json::Value>,
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
        if options.max_loops == 0 {
            return Err(Error::invalid("max_loops must be > 0"));
        }
        // Device initialization (driver, context, kernels) overlaps reading and checking the file.
        let (file, choice) = std::thread::scope(|scope| {
            let device = scope.spawn(|| {
                Device::resolve(options.device, env::Vars::process()).and_then(device::select)
            });
            let file = ModelFile::open(path.as_ref());
            let choice = device
                .join()
                .unwrap_or_else(|_| Err(Error::Device("device initialization panicked".into())));
            (file, choice)
        });
        let (file, choice) = (file?, choice?);
        let tokenizer = Tokenizer::from_metadata(&file.metadata, file.config.vocab_size)?;
        let options = &ModelOptions {
            max_seq_len: match options.max_seq_len {
                0 => file.config.default_max_seq_len(),
                n => n,
            },
            ..options.clone()
        };
        file.config
            .check_session(options.max_seq_len, options.max_loops)?;
        options.state_init.check(&file.config.architecture)?;
        let kv_mode = match options.kv_mode {
            Some(mode) => mode,
            None => KvMode::from_env()?,
        };
        let kv_layout = KvLayout::new(&file.config, kv_mode, options.max_seq_len)?;
        let env_ctx_tier = CtxTier::from_env()?;
        let beta_env = BetaMonEnv::from_env()?;
        let mut notes = Vec::new();
        let fp16_body = match options.fp16_body {
            Some(on) => on,
            None => fp16_body::from_vars(env::Vars::process())?,
        };
        let (mut kernels, mut kernel_ms) = (None, 0.0);
        let (on_device, device_name, weight_bytes) = match choice {
            device::Selected::Cpu { note } => {
                notes.extend(note);
                if fp16_body {
                    notes.push("FP16 body cache: not used on the CPU".into());
                }
                let backend = CpuBackend;
                let weights = Weights::load(&backend, &file, options.max_seq_len)?;
                let bytes = weights.live_bytes();
                (
                    OnDevice::Cpu(Loaded { backend, weights }),
                    backend.describe(),
                    bytes,
                )
            }
            device::Selected::Cuda(backend) => {
                let mut backend = *backend;
                if fp16_body {
                    backend.enable_fp16_body()?;
                }
                let upload = Instant::now();
                let weights = Weights::load(&backend, &file, options.max_seq_len)?;
                let fit = backend.finish_load(&weights)?;
                if fp16_body {
                    notes.push(format!(
                        "FP16 body cache: {:.1} MB of FP16 block weights for prefill GEMMs \
                         (cuBLAS)",
                        backend.fp16_body_bytes(&weights) as f64 / 1e6
                    ));
                }
                let upload_ms = upload.elapsed().as_secs_f64() * 1e3;
                let (note, ms) = backend.kernel_load();
                notes.push(format!("kernels: {note}"));
                notes.push(format!(
                    "weights uploaded in {upload_ms:.1} ms ({:.1} GB/s); {fit}",
                    weights.live_bytes() as f64 / upload_ms / 1e6
                ));
                (kernels, kernel_ms) = (Some(note.to_string()), ms);
                let bytes = weights.live_bytes();
                let name = backend.describe();
                (OnDevice::Cuda(Loaded { backend, weights }), name, bytes)
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
        log_line!(
            options.log,
            "[tinyloop] loaded {} on {}: {} tensors, weights {:.1} MB, {:.1} ms",
            path.as_ref().display(),
            info.device,
            info.tensors,
            info.weight_bytes as f64 / 1e6,
            info.load_ms
        );
        for note in &notes {
            log_line!(options.log, "[tinyloop]   {note}");
        }
        Ok(Model {
            shared: Arc::new(Shared {
                on_device,
                options: options.clone(),
                kv_layout,
                beta_env,
                info,
                session_bytes: AtomicUsize::new(0),
                env_ctx_tier,
                tokenizer,
            }),
        })
    }

    pub fn config(&self) -> &ModelConfig {
        self.shared.config()
    }

    pub fn info(&self) -> &ModelInfo {
        &self.shared.info
    }

    pub fn options(&self) -> &ModelOptions {
        &self.shared.options
    }

    /// What the KV cache of this model's sessions stores.
    pub fn kv_mode(&self) -> KvMode {
        self.shared.kv_layout.mode
    }

    /// Device memory held by the weights (the loop bodies alive now: CTX-TIER may add an INT2
    /// re-pack and release the INT4 one), every live session and every live prefix cache and
    /// resume handle of this model, in bytes.
    pub fn memory_bytes(&self) -> usize {
        self.shared.weight_bytes() + self.shared.session_bytes.load(Ordering::Relaxed)
    }

    /// Device bytes of the weights now (`ModelInfo::weight_bytes` is the amount at load).
    pub fn weight_bytes(&self) -> usize {
        self.shared.weight_bytes()
    }

    /// A new session with its own buffers and KV cache, sharing this model's weights.
    pub fn new_session(&self) -> Result<Session> {
        let opts = &self.shared.options;
        let rows = if opts.prefill_chunk > 0 {
            opts.prefill_chunk.min(opts.max_seq_len)
        } else {
            opts.max_seq_len
        };
        let layout = self.shared.kv_layout.clone();
        let state = match &self.shared.on_device {
            OnDevice::Cpu(l) => {
                // A new session starts at the SHORT tier: it needs the loaded loop body.
                let (body, _) = l.weights.body.acquire(&l.backend, Tier::Short)?;
                SessionState::Cpu(Buffers::new(
                    &l.backend,
                    &l.weights.config,
                    rows,
                    layout,
                    body,
                    opts.state_init,
                )?)
            }
            OnDevice::Cuda(l) => {
                let config = &l.weights.config;
                let backend = l.backend.session(config)?;
                let (body, _) = l.weights.body.acquire(&backend, Tier::Short)?;
                let buffers = Buffers::new(&backend, config, rows, layout, body, opts.state_init)?;
                let layout = &buffers.kv.layout;
                let loops = config.default_loops;
                log_line!(
                    opts.log,
                    "[tinyloop] session on {}: buffers {:.1} MB for {rows} rows, KV cache ({}) \
                     {:.1} MB at L={loops} (allocated at first use)",
                    backend.describe(),
                    (buffers.bytes + backend.own_bytes()) as f64 / 1e6,
                    layout.mode,
                    layout.bytes(layout.slots(loops)) as f64 / 1e6,
                );
                SessionState::Cuda(CudaSession { buffers, backend })
            }
        };
        Ok(Session::new(self.shared.clone(), state))
    }
}
