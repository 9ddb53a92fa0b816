//! Handles that outlive a call: a prefix cache (the KV entries of a prefix at one loop count)
//! and a resume handle (a prompt run at one loop count, resumable at any). Each belongs to one
//! model and serves any number of its sessions at once (read-only; a session copies what it
//! needs into its own cache). Its bytes count in the model's memory while it lives.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::backend::cpu::CpuBackend;
use crate::backend::cuda::CudaBackend;
use crate::generate::handles;
use crate::shared::{PerDevice, Shared};

pub(crate) type PrefixInner =
    PerDevice<handles::PrefixCache<CpuBackend>, handles::PrefixCache<CudaBackend>>;
pub(crate) type ResumeInner =
    PerDevice<handles::ResumeHandle<CpuBackend>, handles::ResumeHandle<CudaBackend>>;

impl From<handles::PrefixCache<CpuBackend>> for PrefixInner {
    fn from(cache: handles::PrefixCache<CpuBackend>) -> Self {
        PerDevice::Cpu(cache)
    }
}

impl From<handles::PrefixCache<CudaBackend>> for PrefixInner {
    fn from(cache: handles::PrefixCache<CudaBackend>) -> Self {
        PerDevice::Cuda(cache)
    }
}

impl From<handles::ResumeHandle<CpuBackend>> for ResumeInner {
    fn from(handle: handles::ResumeHandle<CpuBackend>) -> Self {
        PerDevice::Cpu(handle)
    }
}

impl From<handles::ResumeHandle<CudaBackend>> for ResumeInner {
    fn from(handle: handles::ResumeHandle<CudaBackend>) -> Self {
        PerDevice::Cuda(handle)
    }
}

/// Bytes a handle holds, counted in its model's memory from creation to drop.
struct Counted {
    shared: Arc<Shared>,
    bytes: usize,
}

impl Counted {
    fn new(shared: Arc<Shared>, bytes: usize) -> Counted {
        shared.session_bytes.fetch_add(bytes, Ordering::Relaxed);
        Counted { shared, bytes }
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.shared
            .session_bytes
            .fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

/// The KV entries of a prefix at one loop count, for
/// [`crate::Session::generate_with_prefix`] on any session of its model.
pub struct PrefixCache {
    pub(crate) shared: Arc<Shared>,
    pub(crate) inner: PrefixInner,
    tokens: Vec<u32>,
    counted: Counted,
}

impl PrefixCache {
    pub(crate) fn new(shared: Arc<Shared>, inner: PrefixInner, tokens: Vec<u32>) -> PrefixCache {
        let bytes = match &inner {
            PerDevice::Cpu(c) => c.entries.bytes(),
            PerDevice::Cuda(c) => c.entries.bytes(),
        };
        PrefixCache {
            counted: Counted::new(shared.clone(), bytes),
            shared,
            inner,
            tokens,
        }
    }

    /// The prefix.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// The loop count it was built at (generation with it uses the same).
    pub fn loops(&self) -> usize {
        match &self.inner {
            PerDevice::Cpu(c) => c.loops,
            PerDevice::Cuda(c) => c.loops,
        }
    }

    /// Bytes of device memory it holds.
    pub fn memory_bytes(&self) -> usize {
        self.counted.bytes
    }
}

/// A prompt run at one loop count, for [`crate::Session::resume_generate`] at any loop count on
/// any session of its model.
pub struct ResumeHandle {
    pub(crate) shared: Arc<Shared>,
    pub(crate) inner: ResumeInner,
    counted: Counted,
}

impl ResumeHandle {
    pub(crate) fn new(shared: Arc<Shared>, inner: ResumeInner) -> ResumeHandle {
        let dim = shared.config().dim;
        let bytes = match &inner {
            PerDevice::Cpu(h) => h.bytes(dim),
            PerDevice::Cuda(h) => h.bytes(dim),
        };
        ResumeHandle {
            counted: Counted::new(shared.clone(), bytes),
            shared,
            inner,
        }
    }

    /// The prompt it ran.
    pub fn prompt(&self) -> &[u32] {
        match &self.inner {
            PerDevice::Cpu(h) => &h.prompt,
            PerDevice::Cuda(h) => &h.prompt,
        }
    }

    /// The loop count it ran at.
    pub fn loops(&self) -> usize {
        match &self.inner {
            PerDevice::Cpu(h) => h.loops,
            PerDevice::Cuda(h) => h.loops,
        }
    }

    /// Bytes of device memory it holds.
    pub fn memory_bytes(&self) -> usize {
        self.counted.bytes
    }
}
