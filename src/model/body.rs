//! The loop body's linear weights at one precision, and the model's store of the precisions its
//! sessions run (CTX-TIER, src/ctx_tier.rs).
//!
//! Every session holds an `Arc` of the body of its tier. The store keeps the body as loaded (the
//! SHORT tier) and hands it out; the first session to reach the LONG tier re-quantizes it to INT2
//! on the device, and later ones share that re-pack until no session holds it (then it is freed).
//! The loaded body's device memory is released once no session holds it while a re-pack is in
//! use; its bytes are then copied to the host first (device → host), so that the next session or
//! call at the SHORT tier gets exactly the loaded weights back without reading the file again.
//! Host memory is spent only while the device copy is gone.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Instant;

use crate::backend::{Backend, OwnedLinear};
use crate::ctx_tier::Tier;
use crate::error::{Error, Result};
use crate::format::DType;

/// The five linear weights of one block.
pub struct BlockLinears<B: Backend> {
    pub attn_qkv: B::Linear,
    pub attn_out: B::Linear,
    pub mlp_gate: B::Linear,
    pub mlp_up: B::Linear,
    pub mlp_down: B::Linear,
}

impl<B: Backend> BlockLinears<B> {
    /// The weights in `BLOCK_LINEARS` order.
    pub fn all(&self) -> [&B::Linear; 5] {
        [
            &self.attn_qkv,
            &self.attn_out,
            &self.mlp_gate,
            &self.mlp_up,
            &self.mlp_down,
        ]
    }

    /// Build from five weights in `BLOCK_LINEARS` order.
    pub fn from_array([attn_qkv, attn_out, mlp_gate, mlp_up, mlp_down]: [B::Linear; 5]) -> Self {
        BlockLinears {
            attn_qkv,
            attn_out,
            mlp_gate,
            mlp_up,
            mlp_down,
        }
    }

    fn try_map(&self, f: impl FnMut(&B::Linear) -> Result<B::Linear>) -> Result<Self> {
        Ok(BlockLinears::from_array(all_ok(self.all().map(f))?))
    }
}

/// The five values, or the first error.
fn all_ok<T>([a, b, c, d, e]: [Result<T>; 5]) -> Result<[T; 5]> {
    Ok([a?, b?, c?, d?, e?])
}

/// The linear weights of the loop blocks at one precision. Its device bytes count in the model's
/// memory while it lives.
pub struct LoopBody<B: Backend> {
    pub blocks: Vec<BlockLinears<B>>,
    /// The encoding of every weight, when they share one.
    pub dtype: Option<DType>,
    bytes: usize,
    live: Arc<AtomicUsize>,
}

impl<B: Backend> LoopBody<B> {
    fn new(backend: &B, blocks: Vec<BlockLinears<B>>, live: &Arc<AtomicUsize>) -> Result<Self> {
        let mut bytes = 0;
        let mut dtypes = Vec::new();
        for w in blocks.iter().flat_map(|b| b.all()) {
            backend.prepare_block_weight(w, true)?;
            bytes += backend.linear_bytes(w);
            dtypes.push(backend.linear_dtype(w));
        }
        let dtype = dtypes
            .first()
            .copied()
            .filter(|d| dtypes.iter().all(|x| x == d));
        live.fetch_add(bytes, Ordering::Relaxed);
        Ok(LoopBody {
            blocks,
            dtype,
            bytes,
            live: live.clone(),
        })
    }

    /// Device bytes of the weights.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Number of weights.
    pub fn len(&self) -> usize {
        5 * self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }
}

impl<B: Backend> Drop for LoopBody<B> {
    fn drop(&mut self) {
        self.live.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

/// What [`BodyStore::acquire`] had to make.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Made {
    /// Nothing: a session already held that body.
    Nothing,
    /// The loaded body was re-quantized (`weights` of them) in `ms` milliseconds.
    Repacked { weights: usize, ms: f64 },
    /// The loaded body was uploaded again from its host copy.
    Restored { weights: usize, ms: f64 },
}

/// The loop bodies of one model, shared by its sessions.
pub struct BodyStore<B: Backend> {
    variants: Mutex<Variants<B>>,
    /// Device bytes of the live bodies.
    live: Arc<AtomicUsize>,
}

struct Variants<B: Backend> {
    /// The body as loaded, while it is on the device.
    loaded: Option<Arc<LoopBody<B>>>,
    /// The loaded body's bytes while it is not.
    host: Option<Vec<[OwnedLinear; 5]>>,
    /// The LONG tier's re-pack, while a session holds it.
    repacked: Weak<LoopBody<B>>,
}

impl<B: Backend> BodyStore<B> {
    /// A store holding the loaded body.
    pub fn new(backend: &B, blocks: Vec<BlockLinears<B>>) -> Result<Self> {
        let live = Arc::new(AtomicUsize::new(0));
        let loaded = Arc::new(LoopBody::new(backend, blocks, &live)?);
        Ok(BodyStore {
            variants: Mutex::new(Variants {
                loaded: Some(loaded),
                host: None,
                repacked: Weak::new(),
            }),
            live,
        })
    }

    /// Device bytes of the bodies alive now.
    pub fn live_bytes(&self) -> usize {
        self.live.load(Ordering::Relaxed)
    }

    fn lock(&self) -> MutexGuard<'_, Variants<B>> {
        // The variants stay consistent at every await-free step, so a poisoned lock is usable.
        self.variants.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The loaded body when it is on the device (inspection, calibration).
    pub fn loaded(&self) -> Option<Arc<LoopBody<B>>> {
        self.lock().loaded.clone()
    }

    /// The encoding of the loaded body, when its weights share one.
    pub fn loaded_dtype(&self) -> Option<DType> {
        let v = self.lock();
        match (&v.loaded, &v.host) {
            (Some(body), _) => body.dtype,
            (None, Some(host)) => Some(host[0][0].dtype),
            (None, None) => None,
        }
    }

    /// The body a session at `tier` runs, made when no session holds it: the loaded body
    /// (uploaded again from its host copy when it was released) or its INT2 re-pack.
    pub fn acquire(&self, backend: &B, tier: Tier) -> Result<(Arc<LoopBody<B>>, Made)> {
        let mut v = self.lock();
        let (loaded, restored) = self.loaded_body(backend, &mut v)?;
        if tier == Tier::Short {
            return Ok((loaded, restored));
        }
        if let Some(body) = v.repacked.upgrade() {
            return Ok((body, restored));
        }
        let start = Instant::now();
        let blocks = loaded
            .blocks
            .iter()
            .map(|b| b.try_map(|w| backend.requantize_linear(w, DType::Int2)))
            .collect::<Result<Vec<_>>>()?;
        // The re-pack is shared with other sessions' streams: it must be complete first.
        backend.synchronize()?;
        let body = Arc::new(LoopBody::new(backend, blocks, &self.live)?);
        v.repacked = Arc::downgrade(&body);
        let made = Made::Repacked {
            weights: body.len(),
            ms: start.elapsed().as_secs_f64() * 1e3,
        };
        Ok((body, made))
    }

    fn loaded_body(&self, backend: &B, v: &mut Variants<B>) -> Result<(Arc<LoopBody<B>>, Made)> {
        if let Some(body) = &v.loaded {
            return Ok((body.clone(), Made::Nothing));
        }
        let host = v.host.as_ref().ok_or_else(|| {
            Error::Device("the loop body is neither on the device nor on the host".into())
        })?;
        let start = Instant::now();
        let blocks = host
            .iter()
            .map(|ws| {
                let uploaded = ws.each_ref().map(|w| backend.upload_linear(&w.as_host()));
                Ok(BlockLinears::from_array(all_ok(uploaded)?))
            })
            .collect::<Result<Vec<_>>>()?;
        backend.synchronize()?;
        let body = Arc::new(LoopBody::new(backend, blocks, &self.live)?);
        v.loaded = Some(body.clone());
        v.host = None;
        let made = Made::Restored {
            weights: body.len(),
            ms: start.elapsed().as_secs_f64() * 1e3,
        };
        Ok((body, made))
    }

    /// Free the loaded body's device memory when no session holds it and a re-pack is in use
    /// (its bytes go to the host first). Call after a session let go of its body, or with
    /// `leaving`, the body of a session about to be dropped; the caller's work on it must be
    /// complete. Returns the bytes freed (once the leaving session is gone).
    pub fn release_unused(&self, backend: &B, leaving: Option<&Arc<LoopBody<B>>>) -> Result<usize> {
        let mut v = self.lock();
        let unused = v.loaded.as_ref().is_some_and(|body| {
            let held_by_leaving = leaving.is_some_and(|l| Arc::ptr_eq(l, body)) as usize;
            Arc::strong_count(body) == 1 + held_by_leaving
        });
        if !unused || v.repacked.strong_count() == 0 {
            return Ok(0);
        }
        let body = v.loaded.take().expect("checked above");
        let host = body
            .blocks
            .iter()
            .map(|b| all_ok(b.all().map(|w| backend.download_linear(w))))
            .collect::<Result<Vec<_>>>();
        match host {
            Ok(host) => {
                v.host = Some(host);
                let bytes = body.bytes();
                drop(body);
                Ok(bytes)
            }
            Err(e) => {
                // Keep the device copy: nothing may be lost.
                v.loaded = Some(body);
                Err(e)
            }
        }
    }
}
