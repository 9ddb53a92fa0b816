//! Prefix caches and resume handles: the KV entries of a sequence (and, for resuming at another
//! depth, its residual streams after every loop iteration) kept outside any session, read-only,
//! so that later calls of any session of the model start from them instead of recomputing.
//!
//! Entries live in a [`KvLayout`] of exactly the sequence's length; a session copies the slots
//! it needs into its own cache (one copy per slot and region). Age mode is refused: its entries
//! move between tiers as the sequence grows, so a copy would not stay what it was.

use std::sync::atomic::AtomicBool;

use super::exit::{Decision, ResolvedExit};
use super::sampling::Rng;
use super::{decode, first_token, next_choice, prefill, GenerateRequest, GenerateStats, Output};
use crate::backend::{Backend, StepInput};
use crate::error::{Error, Result};
use crate::kv::{KvLayout, KvMode};
use crate::model::forward::{restore_rows, run, save_rows, stage, Buffers, Span};
use crate::model::weights::Weights;

/// KV entries of positions `0..positions` for slots `0..slots`, in a layout of that length.
pub struct Entries<S> {
    layout: KvLayout,
    slots: usize,
    storage: S,
}

impl<S> Entries<S> {
    /// Bytes of device memory held.
    pub fn bytes(&self) -> usize {
        self.layout.scratch_offset(self.slots)
    }

    pub fn positions(&self) -> usize {
        self.layout.capacity
    }
}

/// Copy the entries of `slots` at positions `0..positions` between two layouts of one mode.
fn copy_entries<B: Backend>(
    backend: &B,
    from: (&KvLayout, &B::KvStorage),
    to: (&KvLayout, &mut B::KvStorage),
    slots: impl Iterator<Item = usize>,
    positions: usize,
) -> Result<()> {
    let (from_layout, from_storage) = from;
    let (to_layout, to_storage) = to;
    let tier = &from_layout.tiers[0];
    for slot in slots {
        for tensor in 0..from_layout.tensors() {
            let regions = [
                (
                    from_layout.codes_at(0, tensor, slot, 0),
                    to_layout.codes_at(0, tensor, slot, 0),
                    tier.row_bytes,
                ),
                (
                    from_layout.scales_at(0, tensor, slot, 0),
                    to_layout.scales_at(0, tensor, slot, 0),
                    tier.scale_row_bytes,
                ),
            ];
            for (src, dst, row) in regions {
                backend.copy_kv(from_storage, src, to_storage, dst, positions * row)?;
            }
        }
    }
    Ok(())
}

fn refuse_age(layout: &KvLayout, what: &str) -> Result<()> {
    if matches!(layout.mode, KvMode::Age(_)) {
        return Err(Error::invalid(format!(
            "{what} needs a KV mode whose entries stay where they are; age mode moves them \
             between tiers as the sequence grows (use delta)"
        )));
    }
    Ok(())
}

/// Copy slots `0..slots` of the session's first `positions` positions out of its cache.
fn take_entries<B: Backend>(
    backend: &B,
    buf: &Buffers<B>,
    slots: usize,
    positions: usize,
) -> Result<Entries<B::KvStorage>> {
    let kv = &buf.kv;
    let layout = kv.layout.with_capacity(positions);
    let mut storage = backend.alloc_kv(layout.scratch_offset(slots))?;
    copy_entries(
        backend,
        (&kv.layout, &kv.storage),
        (&layout, &mut storage),
        0..slots,
        positions,
    )?;
    // Other sessions read the entries on their own streams.
    backend.synchronize()?;
    Ok(Entries {
        layout,
        slots,
        storage,
    })
}

/// Put the entries of `slots` back into the session's cache: a sequence whose positions reached
/// every depth.
fn give_entries<B: Backend>(
    backend: &B,
    buf: &mut Buffers<B>,
    entries: &Entries<B::KvStorage>,
    slots: impl Iterator<Item = usize>,
) -> Result<()> {
    buf.clear_depths(backend);
    let kv = &mut buf.kv;
    copy_entries(
        backend,
        (&entries.layout, &entries.storage),
        (&kv.layout, &mut kv.storage),
        slots,
        entries.positions(),
    )
}

/// The KV entries of a prefix at a loop count.
pub struct PrefixCache<B: Backend> {
    pub loops: usize,
    pub entries: Entries<B::KvStorage>,
}

impl<B: Backend> PrefixCache<B> {
    /// Prefill `prefix` at `loops` in `buf` and keep its entries.
    pub fn build(
        backend: &B,
        w: &Weights<B>,
        buf: &mut Buffers<B>,
        prefix: &[u32],
        loops: usize,
        cancel: &AtomicBool,
    ) -> Result<PrefixCache<B>> {
        refuse_age(&buf.kv.layout, "a prefix cache")?;
        prefill(
            backend,
            w,
            buf,
            prefix,
            0,
            loops,
            Default::default(),
            cancel,
        )?;
        let slots = buf.kv.layout.slots(loops);
        let entries = take_entries(backend, buf, slots, prefix.len())?;
        Ok(PrefixCache { loops, entries })
    }

    /// Tokens of the prefix.
    pub fn len(&self) -> usize {
        self.entries.positions()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The exit rules a prefix cache takes: the gate, whose prompt positions run every iteration as
/// the prefix's did. A criterion makes the prompt's calls exit, which the prefix never did.
pub fn check_exit(exit: &ResolvedExit) -> Result<()> {
    match exit.decision {
        Decision::Gate(_) => Ok(()),
        Decision::Criterion(..) => Err(Error::invalid(
            "a prefix cache takes the exit gate, not a criterion: a criterion stops the \
             prompt's calls at their exit, and the prefix ran every iteration",
        )),
    }
}

/// [`super::generate`] after the prefix of `cache`: the same tokens as generating from the prefix
/// followed by `prompt`.
#[allow(clippy::too_many_arguments)]
pub fn generate_after<B: Backend>(
    backend: &B,
    w: &Weights<B>,
    buf: &mut Buffers<B>,
    cache: &PrefixCache<B>,
    prompt: &[u32],
    req: &GenerateRequest,
    cancel: &AtomicBool,
    on_token: &mut dyn FnMut(u32) -> bool,
) -> Result<(Vec<u32>, GenerateStats)> {
    if req.loops != cache.loops {
        return Err(Error::invalid(format!(
            "the prefix cache was built at loops {}; generate with it at the same loops, not {}",
            cache.loops, req.loops
        )));
    }
    buf.tier.replay_short(cache.len())?;
    let mut rng = Rng::new(req.sampling.seed);
    let mut out = Output::new(req, cancel, on_token);
    buf.reserve_kv(backend, buf.kv.layout.slots(req.loops))?;
    give_entries(backend, buf, &cache.entries, 0..cache.entries.slots)?;
    let start = cache.len();
    let choice = next_choice(&req.sampling, &mut rng);
    if let Some(rule) = req.exit {
        // The gate's (the only rule a prefix takes): prompt positions run every iteration, as
        // the prefix's did.
        super::exit::generate(
            backend, w, buf, prompt, start, rule, &mut out, choice, &mut rng,
        )?;
        return Ok(out.finish());
    }
    let last = prefill(backend, w, buf, prompt, start, req.loops, choice, cancel)?;
    let first = first_token(backend, w, buf, last, out.measures())?;
    decode(
        backend,
        w,
        buf,
        &mut out,
        first,
        start + prompt.len(),
        &mut rng,
    )?;
    Ok(out.finish())
}

/// A prompt run at one loop count, kept so that generation can start from it at another: its KV
/// entries and its residual streams after every loop iteration.
pub struct ResumeHandle<B: Backend> {
    pub prompt: Vec<u32>,
    pub loops: usize,
    pub entries: Entries<B::KvStorage>,
    /// `loops × prompt.len()` rows of `dim`: the residual streams after iteration 1, 2, …
    pub hidden: B::Float,
}

impl<B: Backend> ResumeHandle<B> {
    /// Run `prompt` (one step: at most the buffers' rows) at `loops` and keep what a resume needs.
    pub fn build(
        backend: &B,
        w: &Weights<B>,
        buf: &mut Buffers<B>,
        prompt: &[u32],
        loops: usize,
        cancel: &AtomicBool,
    ) -> Result<ResumeHandle<B>> {
        refuse_age(&buf.kv.layout, "a resume handle")?;
        let n = prompt.len();
        stage(backend, w, buf, super::whole(prompt), loops)?;
        let mut hidden = backend.alloc_float(loops * n * w.config.dim)?;
        let pre = Span {
            start: true,
            first: 1,
            last: 0,
            post: false,
        };
        run(backend, w, buf, n, pre, Some(cancel))?;
        for i in 1..=loops {
            run(backend, w, buf, n, Span::iterations(i, i), Some(cancel))?;
            save_rows(backend, buf, 0, &mut hidden, (i - 1) * n, n);
        }
        let slots = buf.kv.layout.slots(loops);
        let entries = take_entries(backend, buf, slots, n)?;
        Ok(ResumeHandle {
            prompt: prompt.to_vec(),
            loops,
            entries,
            hidden,
        })
    }

    /// Bytes of device memory held.
    pub fn bytes(&self, dim: usize) -> usize {
        self.entries.bytes() + self.loops * self.prompt.len() * dim * 4
    }
}

/// Generate after the handle's prompt at `req.loops`: the same tokens as a fresh generation from
/// that prompt at `req.loops`. Keeps the pre blocks and iterations up to the smaller of the two
/// loop counts; computes only the rest.
pub fn resume<B: Backend>(
    backend: &B,
    w: &Weights<B>,
    buf: &mut Buffers<B>,
    handle: &ResumeHandle<B>,
    req: &GenerateRequest,
    cancel: &AtomicBool,
    on_token: &mut dyn FnMut(u32) -> bool,
) -> Result<(Vec<u32>, GenerateStats)> {
    let n = handle.prompt.len();
    buf.tier.replay_short(n)?;
    let kept = handle.loops.min(req.loops);
    let mut rng = Rng::new(req.sampling.seed);
    let mut out = Output::new(req, cancel, on_token);
    let input = StepInput {
        tokens: &handle.prompt,
        start_pos: 0,
        choice: next_choice(&req.sampling, &mut rng),
    };
    stage(backend, w, buf, input, req.loops)?;
    let kept_span = Span {
        start: true,
        first: 1,
        last: kept,
        post: false,
    };
    let layout = buf.kv.layout.clone();
    let slots = kept_span
        .applications(&w.config)
        .map(|app| layout.slot(app));
    give_entries(backend, buf, &handle.entries, slots)?;
    restore_rows(backend, buf, &handle.hidden, (kept - 1) * n, 0, n);
    let rest = Span {
        start: false,
        first: kept + 1,
        last: req.loops,
        post: true,
    };
    run(backend, w, buf, n, rest, Some(cancel))?;
    let first = first_token(backend, w, buf, n - 1, out.measures())?;
    decode(backend, w, buf, &mut out, first, n, &mut rng)?;
    Ok(out.finish())
}
