//! What a model, its sessions and its handles share: the backend and weights on one device, the
//! options and KV layout, the memory counter; and the per-device session state.

use std::sync::atomic::AtomicUsize;

use crate::backend::cpu::CpuBackend;
use crate::backend::cuda::CudaBackend;
use crate::backend::Backend;
use crate::ctx_tier::CtxTier;
use crate::kv::KvLayout;
use crate::model::config::ModelConfig;
use crate::model::forward::Buffers;
use crate::model::weights::Weights;
use crate::telemetry::beta_monitor::BetaMonEnv;
use crate::{ModelInfo, ModelOptions};

pub(crate) struct Loaded<B: Backend> {
    pub backend: B,
    pub weights: Weights<B>,
}

// One per model, so the difference in the variants' sizes costs nothing worth an indirection.
#[allow(clippy::large_enum_variant)]
pub(crate) enum OnDevice {
    Cpu(Loaded<CpuBackend>),
    Cuda(Loaded<CudaBackend>),
}

// One per session, so the difference in the variants' sizes costs nothing worth an indirection.
#[allow(clippy::large_enum_variant)]
pub(crate) enum SessionState {
    Cpu(Buffers<CpuBackend>),
    Cuda(CudaSession),
}

/// A CUDA session: its buffers and its own backend instance (stream, attention scratch) over the
/// model's shared weights. Buffers drop first, then the stream.
pub(crate) struct CudaSession {
    pub buffers: Buffers<CudaBackend>,
    pub backend: CudaBackend,
}

/// What a model and all its sessions and handles share.
pub(crate) struct Shared {
    pub on_device: OnDevice,
    pub options: ModelOptions,
    /// The KV cache layout of every session (mode resolved, capacity max_seq_len).
    pub kv_layout: KvLayout,
    /// The BETA-MON environment variables, read at open.
    pub beta_env: BetaMonEnv,
    pub info: ModelInfo,
    /// Bytes held by live sessions (buffers and KV caches) and handles (prefix caches, resume
    /// handles).
    pub session_bytes: AtomicUsize,
    /// The CTX-TIER policy of `TINYLOOP_CTX_TIER*` at open (generation calls without one).
    pub env_ctx_tier: Option<CtxTier>,
    /// The tokenizer the file's metadata names (`None`: the model takes token ids only).
    pub tokenizer: Option<crate::Tokenizer>,
}

impl Shared {
    pub fn config(&self) -> &ModelConfig {
        match &self.on_device {
            OnDevice::Cpu(l) => &l.weights.config,
            OnDevice::Cuda(l) => &l.weights.config,
        }
    }

    /// Device bytes of the weights now.
    pub fn weight_bytes(&self) -> usize {
        match &self.on_device {
            OnDevice::Cpu(l) => l.weights.live_bytes(),
            OnDevice::Cuda(l) => l.weights.live_bytes(),
        }
    }
}

/// Run `$body` with the backend, weights and buffers of a session, whatever the device.
macro_rules! with_backend {
    ($session:expr, |$backend:ident, $weights:ident, $buffers:ident| $body:expr) => {
        match (&$session.shared.on_device, &mut $session.state) {
            (OnDevice::Cpu(loaded), SessionState::Cpu($buffers)) => {
                let ($backend, $weights) = (&loaded.backend, &loaded.weights);
                $body
            }
            (OnDevice::Cuda(loaded), SessionState::Cuda(session)) => {
                let ($backend, $weights, $buffers) =
                    (&session.backend, &loaded.weights, &mut session.buffers);
                $body
            }
            _ => unreachable!("a session always matches its model's device"),
        }
    };
}

/// Run `$body` with the backend, weights and buffers of a session and the matching part of a
/// handle (`$held`: a [`crate::handle`] value's per-device contents), whatever the device.
macro_rules! with_handle {
    ($session:expr, $held:expr, |$backend:ident, $weights:ident, $buffers:ident, $inner:ident| $body:expr) => {
        match (&$session.shared.on_device, &mut $session.state, $held) {
            (OnDevice::Cpu(loaded), SessionState::Cpu($buffers), PerDevice::Cpu($inner)) => {
                let ($backend, $weights) = (&loaded.backend, &loaded.weights);
                $body
            }
            (OnDevice::Cuda(loaded), SessionState::Cuda(session), PerDevice::Cuda($inner)) => {
                let ($backend, $weights, $buffers) =
                    (&session.backend, &loaded.weights, &mut session.buffers);
                $body
            }
            _ => unreachable!("a handle always matches its model's device"),
        }
    };
}

pub(crate) use {with_backend, with_handle};

/// A value for the device a model runs on.
pub(crate) enum PerDevice<C, G> {
    Cpu(C),
    Cuda(G),
}
