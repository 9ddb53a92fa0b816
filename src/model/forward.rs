//! The forward pass, written once over the [`Backend`] op set.
//!
//! One step feeds `rows` tokens at positions `start_pos..start_pos + rows` through every block
//! application (pre blocks, the loop body L times, post blocks). Each application reads and
//! writes its own KV slot, keyed by (stage, block, iteration) ([`KvLayout`]), so the state after
//! loop iteration i never depends on the total L.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::backend::{Backend, Choice, Chosen, NormLayer, PooledRows, Residual, StepInput};
use crate::ctx_tier::{Tier, TierTracker};
use crate::error::{Error, Result};
use crate::kv::{Application, KvCache, KvLayout, KvSlot};
use crate::model::architecture::{LoopInput, LoopNorm, LoopState};
use crate::model::body::{LoopBody, Made};
use crate::model::config::ModelConfig;
use crate::model::layout::Stage;
use crate::model::state_init::StateInit;
use crate::model::weights::{Block, Head, Norm, Weights};

/// Logit rows computed per head call; bounds the logits buffer at `LOGIT_ROWS × vocab`.
pub const LOGIT_ROWS: usize = 16;

/// Which block applications a step runs, in order: the embedding and pre blocks (`start`; when
/// false the residual stream is already in place), loop iterations `first..=last` (1-based; none
/// when `first > last`), and the post blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    pub start: bool,
    pub first: usize,
    pub last: usize,
    pub post: bool,
}

impl Span {
    /// The whole network at `loops` iterations.
    pub fn all(loops: usize) -> Span {
        Span {
            start: true,
            first: 1,
            last: loops,
            post: true,
        }
    }

    /// Loop iterations `first..=last` alone.
    pub fn iterations(first: usize, last: usize) -> Span {
        Span {
            start: false,
            first,
            last,
            post: false,
        }
    }

    /// The post blocks alone.
    pub fn post() -> Span {
        Span {
            start: false,
            first: 1,
            last: 0,
            post: true,
        }
    }

    /// The block applications of this span, in order.
    pub fn applications(self, config: &ModelConfig) -> impl Iterator<Item = Application> + '_ {
        let k = config.n_loop_blocks;
        let body =
            (self.first..=self.last).flat_map(move |iteration| iteration_blocks(k, iteration));
        let pre = if self.start { config.n_pre_blocks } else { 0 };
        let post = if self.post { config.n_post_blocks } else { 0 };
        stage_blocks(Stage::Pre, pre)
            .chain(body)
            .chain(stage_blocks(Stage::Post, post))
    }
}

/// The applications of the `n` blocks of the pre or post stage.
fn stage_blocks(stage: Stage, n: usize) -> impl Iterator<Item = Application> {
    (0..n).map(move |block| Application {
        stage,
        block,
        iteration: 0,
    })
}

/// The applications of the `k` loop blocks in loop iteration `iteration`.
fn iteration_blocks(k: usize, iteration: usize) -> impl Iterator<Item = Application> {
    (0..k).map(move |block| Application {
        stage: Stage::Loop,
        block,
        iteration,
    })
}

/// The block applications of `loops` iterations, in order.
pub fn schedule(config: &ModelConfig, loops: usize) -> impl Iterator<Item = Application> + '_ {
    Span::all(loops).applications(config)
}

/// Rows of [`Buffers::hidden`]: the most positions one speculative round saves.
pub const HIDDEN_ROWS: usize = LOGIT_ROWS;

/// Per-session runtime buffers, allocated once for `max_rows` rows per step, and the KV cache.
pub struct Buffers<B: Backend> {
    pub max_rows: usize,
    x: B::Float,
    h: B::Half,
    qkv: B::Float,
    att: B::Half,
    gate: B::Float,
    up: B::Float,
    act: B::Half,
    factor: B::Float,
    factor_half: B::Half,
    /// `logit_rows × vocab` logits.
    pub logits: B::Float,
    /// Rows one head call computes: LOGIT_ROWS, or more for an engine ([`Buffers::grow_logits`]).
    pub logit_rows: usize,
    /// Residual streams saved by decode steps ([`Decode::hidden_row`]): `HIDDEN_ROWS × dim`.
    pub hidden: B::Float,
    /// With a loop adapter, the loop input of those rows beside them.
    hidden_input: B::Float,
    /// A sublayer's output before its norm (sandwich layouts), `max_rows × dim`.
    delta: B::Float,
    /// The stream's second buffer (sandwich layouts): an op that adds a pending sublayer output
    /// writes the stream here, and the two swap ([`Pending`]).
    x_next: B::Float,
    /// The loop input `adapter.input · e` of each row (loop adapter), `max_rows × dim`.
    loop_input: B::Float,
    /// The initial loop state of each staged row (random loop state), `max_rows × dim`.
    initial_state: B::Float,
    /// How the initial loop state is drawn.
    pub state_init: StateInit,
    step: B::Step,
    /// Slots are added as calls need them (more loop iterations), keeping what they hold.
    pub kv: KvCache<B::KvStorage>,
    /// The loop body the session runs, its tier, and the session's tier policy (CTX-TIER).
    pub body: Arc<LoopBody<B>>,
    body_tier: Tier,
    pub tier: TierTracker,
    /// Bytes held by the buffers above, KV cache excluded.
    pub bytes: usize,
}

/// `a · b` elements, or an error naming what would not fit.
fn elements(a: usize, b: usize, what: &str) -> Result<usize> {
    a.checked_mul(b)
        .ok_or_else(|| Error::invalid(format!("{what}: {a} × {b} elements overflow")))
}

impl<B: Backend> Buffers<B> {
    /// Buffers for steps of up to `max_rows` rows, running the loop body `body` (the SHORT
    /// tier's), drawing initial loop states as `state_init` says.
    pub fn new(
        backend: &B,
        config: &ModelConfig,
        max_rows: usize,
        kv: KvLayout,
        body: Arc<LoopBody<B>>,
        state_init: StateInit,
    ) -> Result<Self> {
        let arch = &config.architecture;
        state_init.check(arch)?;
        let (d, f, r) = (config.dim, config.ffn_dim, config.embed_factor_dim);
        let wide = d.max(r);
        let rows = |width: usize| elements(width, max_rows, "step buffers");
        let float_len = [rows(d)?, rows(config.qkv_dim())?, rows(f)?, rows(f)?];
        let half_len = [rows(wide)?, rows(d)?, rows(f)?];
        let logits_len = elements(LOGIT_ROWS, config.vocab_size, "logits")?;
        let factor_len = LOGIT_ROWS * r.max(1);
        // Buffers of the architecture's optional parts hold one value when it lacks them.
        let rows_if = |needed: bool| if needed { rows(d) } else { Ok(1) };
        let adapter = arch.loop_input == LoopInput::Adapter;
        let sandwich = arch.block_norms.has_out_norms();
        let optional_len = [
            if adapter { HIDDEN_ROWS * d } else { 1 },
            rows_if(sandwich)?,
            rows_if(sandwich)?,
            rows_if(adapter)?,
            rows_if(arch.loop_state == LoopState::Random)?,
        ];
        let bytes = 4
            * (float_len.iter().sum::<usize>()
                + logits_len
                + factor_len
                + HIDDEN_ROWS * d
                + optional_len.iter().sum::<usize>())
            + 2 * (half_len.iter().sum::<usize>() + factor_len);
        let [hidden_input, delta, x_next, loop_input, initial_state] =
            optional_len.map(|len| backend.alloc_float(len));
        Ok(Buffers {
            max_rows,
            x: backend.alloc_float(float_len[0])?,
            qkv: backend.alloc_float(float_len[1])?,
            gate: backend.alloc_float(float_len[2])?,
            up: backend.alloc_float(float_len[3])?,
            h: backend.alloc_half(half_len[0])?,
            att: backend.alloc_half(half_len[1])?,
            act: backend.alloc_half(half_len[2])?,
            factor: backend.alloc_float(factor_len)?,
            factor_half: backend.alloc_half(factor_len)?,
            logits: backend.alloc_float(logits_len)?,
            logit_rows: LOGIT_ROWS,
            hidden: backend.alloc_float(HIDDEN_ROWS * d)?,
            hidden_input: hidden_input?,
            delta: delta?,
            x_next: x_next?,
            loop_input: loop_input?,
            initial_state: initial_state?,
            state_init,
            step: backend.alloc_step(max_rows)?,
            kv: KvCache {
                storage: backend.alloc_kv(kv.bytes(0))?,
                layout: kv,
                slots: 0,
                bounds: Default::default(),
                depths: Default::default(),
            },
            body,
            body_tier: Tier::Short,
            tier: TierTracker::default(),
            bytes,
        })
    }

    /// The step block (inputs and the backend's per-step scratch).
    pub fn step(&self) -> &B::Step {
        &self.step
    }

    /// The residual stream, `max_rows × dim` f32.
    pub fn residual(&self) -> &B::Float {
        &self.x
    }

    /// Width of the residual stream (the model dimension).
    pub fn width(&self) -> usize {
        self.kv.layout.dim
    }

    /// Drop the captured decode graphs (they keep the buffers' and the depth mask's addresses).
    pub fn reset_graphs(&mut self, backend: &B) {
        backend.graph_reset(&mut self.step);
    }

    /// Let one head call compute the logits of up to `rows` rows (at most `max_rows`): an
    /// engine takes those of all its decode rows at once, reading the head once per step.
    pub fn grow_logits(&mut self, backend: &B, config: &ModelConfig, rows: usize) -> Result<()> {
        let rows = rows.min(self.max_rows);
        if rows <= self.logit_rows {
            return Ok(());
        }
        let r = config.embed_factor_dim.max(1);
        let (logits_len, factor_len) = (elements(rows, config.vocab_size, "logits")?, rows * r);
        let (old_logits, old_factor) = (self.logit_rows * config.vocab_size, self.logit_rows * r);
        self.logits = backend.alloc_float(logits_len)?;
        self.factor = backend.alloc_float(factor_len)?;
        self.factor_half = backend.alloc_half(factor_len)?;
        self.bytes += 4 * (logits_len - old_logits) + 6 * (factor_len - old_factor);
        self.logit_rows = rows;
        backend.graph_reset(&mut self.step); // graphs keep the old buffers' addresses
        Ok(())
    }

    /// Make sure the KV cache has at least `slots` slots; growing it keeps every entry.
    pub fn reserve_kv(&mut self, backend: &B, slots: usize) -> Result<()> {
        let kv = &mut self.kv;
        if kv.slots >= slots {
            return Ok(());
        }
        backend.graph_reset(&mut self.step); // captured graphs point at the old storage
        let mut storage = backend.alloc_kv(kv.layout.bytes(slots))?;
        let kept = kv.layout.scratch_offset(kv.slots);
        backend.copy_kv(&kv.storage, 0, &mut storage, 0, kept)?;
        kv.storage = storage;
        kv.slots = slots;
        Ok(())
    }
}

/// Run one step through every block application; afterwards the residual stream of each row is
/// in the buffers, ready for [`logits`]. `cancel` is checked before each block application.
pub fn forward<B: Backend>(
    backend: &B,
    w: &Weights<B>,
    buf: &mut Buffers<B>,
    input: StepInput,
    loops: usize,
    cancel: &AtomicBool,
) -> Result<()> {
    let rows = input.tokens.len();
    stage(backend, w, buf, input, loops)?;
    run(backend, w, buf, rows, Span::all(loops), Some(cancel))
}

/// The rows of the next step over `remaining` tokens from position `start`: as many as the buffers
/// hold, cut where the CTX-TIER tier or the age-tier bounds change, so that every row of the step
/// computes what it would compute fed alone (the tiers are functions of positions, not of how a
/// sequence is cut into steps).
pub fn step_rows<B: Backend>(buf: &Buffers<B>, start: usize, remaining: usize) -> usize {
    let rows = remaining.min(buf.max_rows);
    let (_, same_tier) = buf.tier.ahead(start, rows);
    same_tier.min(buf.kv.uniform_rows(start, rows))
}

/// Validate a step of up to `loops` iterations, observe its sequence length (CTX-TIER: the loop
/// body may change precision), make room in the KV cache (and move entries that changed age
/// tier), mark its positions reached in the depth mask, and stage its tokens, position and tier
/// bounds. Then [`run`] its spans.
pub fn stage<B: Backend>(
    backend: &B,
    w: &Weights<B>,
    buf: &mut Buffers<B>,
    input: StepInput,
    loops: usize,
) -> Result<()> {
    let rows = input.tokens.len();
    if rows == 0 || rows > buf.max_rows {
        return Err(Error::invalid(format!(
            "step of {rows} rows (buffers hold 1..={})",
            buf.max_rows
        )));
    }
    let end = input.start_pos + rows;
    if end > buf.kv.layout.capacity {
        return Err(Error::invalid(format!(
            "sequence of {end} tokens exceeds max_seq_len {}",
            buf.kv.layout.capacity
        )));
    }
    let tier = buf.tier.observe(end);
    follow_tier(backend, w, buf, tier)?;
    buf.reserve_kv(backend, buf.kv.layout.slots(loops))?;
    buf.begin_depths(backend, input.start_pos, rows)?;
    for mv in buf.kv.advance_tiers(input.start_pos, end) {
        backend.kv_move(&mut buf.kv, &mv);
    }
    write_initial_states(backend, w, buf, input.start_pos..end)?;
    backend.set_step(&mut buf.step, input, buf.kv.bounds)
}

/// With a random loop state, draw the initial state of each staged row at its position.
fn write_initial_states<B: Backend>(
    backend: &B,
    w: &Weights<B>,
    buf: &mut Buffers<B>,
    positions: impl ExactSizeIterator<Item = usize>,
) -> Result<()> {
    let arch = &w.config.architecture;
    if arch.loop_state != LoopState::Random {
        return Ok(());
    }
    let dim = w.config.dim;
    let mut states = crate::alloc::zeroed::<f32>(positions.len() * dim, "initial loop states")?;
    for (position, state) in positions.zip(states.chunks_exact_mut(dim)) {
        buf.state_init.fill(arch, position, 1, dim, state);
    }
    backend.write_float(&mut buf.initial_state, &states)
}

/// Stage a step over a KV pool ([`crate::kv::pool`]): row r is `tokens[r]` at position
/// `places.rows[r].position` of its own sequence, and runs `loops[r]` loop iterations (rows
/// deepest first). The cache is the pool's; the caller keeps every row's page table large
/// enough and its positions below the model's `max_seq_len`. Then [`run_rows`] with
/// [`Rows::Deepest`]. Returns the backend's key of the places ([`Backend::set_places`]).
pub fn stage_pooled<B: Backend>(
    backend: &B,
    w: &Weights<B>,
    buf: &mut Buffers<B>,
    tokens: &[u32],
    places: PooledRows,
    loops: &[usize],
) -> Result<u64> {
    let rows = tokens.len();
    if rows == 0 || rows > buf.max_rows || places.rows.len() != rows || loops.len() != rows {
        return Err(Error::invalid(format!(
            "pooled step of {rows} rows with {} places and {} loop counts (buffers hold \
             1..={} rows)",
            places.rows.len(),
            loops.len(),
            buf.max_rows
        )));
    }
    if !loops.is_sorted_by(|a, b| a >= b) || loops[rows - 1] == 0 {
        return Err(Error::invalid(
            "pooled step rows must come deepest first, each with at least one loop iteration",
        ));
    }
    buf.reserve_kv(backend, buf.kv.layout.slots(loops[0]))?;
    write_initial_states(backend, w, buf, places.rows.iter().map(|r| r.position))?;
    let input = StepInput {
        tokens,
        start_pos: 0,
        choice: Choice::Greedy,
    };
    backend.set_step(&mut buf.step, input, buf.kv.bounds)?;
    backend.set_places(&mut buf.step, places)
}

/// A step over a KV pool whose rows all decode (each the next token of its sequence): stage it
/// ([`stage_pooled`]), run it, and leave the argmax of every row's logits in the step (read them
/// with [`chosen_rows`]). The ops after staging depend only on the rows' loop counts and the
/// backend's key of the places, so a backend with graphs captures them once per `key`, which the
/// caller makes distinct for each distinct (loop counts, places key) pair it passes as `shape`.
#[allow(clippy::too_many_arguments)]
pub fn pooled_decode_step<B: Backend>(
    backend: &B,
    w: &Weights<B>,
    buf: &mut Buffers<B>,
    tokens: &[u32],
    places: PooledRows,
    loops: &[usize],
    key: impl FnOnce(u64) -> u64,
) -> Result<()> {
    let rows = tokens.len();
    if rows > buf.logit_rows {
        return Err(Error::invalid(format!(
            "a pooled decode step of {rows} rows needs logits for {rows} rows (buffers hold {})",
            buf.logit_rows
        )));
    }
    let key = key(stage_pooled(backend, w, buf, tokens, places, loops)?);
    let capturable = buf.kv.layout.mode.graph_capturable();
    if capturable && backend.graph_replay(&mut buf.step, key)? {
        return Ok(());
    }
    let capturing = capturable && backend.graph_begin(&mut buf.step, key)?;
    run_rows(
        backend,
        w,
        buf,
        Rows::Deepest(loops),
        Span::all(loops[0]),
        None,
    )?;
    final_norm(backend, w, buf, rows);
    logits(backend, w, buf, 0, rows);
    backend.argmax_rows(&buf.logits, rows, w.config.vocab_size, &mut buf.step);
    if capturing {
        backend.graph_end(&mut buf.step, key)?;
    }
    Ok(())
}

/// The argmax of each of logits rows `0..rows` left by the last [`pooled_decode_step`] (waits
/// for the device).
pub fn chosen_rows<B: Backend>(backend: &B, buf: &Buffers<B>, rows: usize) -> Result<Vec<u32>> {
    backend.chosen_tokens(&buf.step, rows)
}

/// Make the session's loop body the one of `tier`: take it from the model (made if no session
/// holds it), let go of the old one, and free what no session needs any more. Captured graphs
/// point at the old weights, so they are dropped.
fn follow_tier<B: Backend>(
    backend: &B,
    w: &Weights<B>,
    buf: &mut Buffers<B>,
    tier: Tier,
) -> Result<()> {
    if tier == buf.body_tier {
        return Ok(());
    }
    // Work issued with the old body must be complete before its memory may be released.
    backend.synchronize()?;
    let before = w.body.live_bytes() as i64;
    let (body, made) = w.body.acquire(backend, tier)?;
    (buf.body, buf.body_tier) = (body, tier);
    w.body.release_unused(backend, None)?;
    backend.graph_reset(&mut buf.step);
    let freed = before - w.body.live_bytes() as i64;
    let (weights, ms) = match made {
        Made::Nothing => (0, 0.0),
        Made::Repacked { weights, ms } | Made::Restored { weights, ms } => (weights, ms),
    };
    buf.tier.applied(tier, weights, ms, freed);
    Ok(())
}

/// The block applications of `span` for the `rows` staged rows (the embedding first when the
/// span starts), with what the architecture does between them: the loop's start (its input and
/// initial state) before iteration 1, the loop input before every iteration, the loop norm after
/// every iteration or before the post blocks. With `cancel`, stops between block applications
/// once it is set.
pub fn run<B: Backend>(
    backend: &B,
    w: &Weights<B>,
    buf: &mut Buffers<B>,
    rows: usize,
    span: Span,
    cancel: Option<&AtomicBool>,
) -> Result<()> {
    run_rows(backend, w, buf, Rows::All(rows), span, cancel)
}

/// The staged rows a span runs: all of them, or rows of different loop counts, deepest first
/// (`loops[r]` for row r, non-increasing), of which loop iteration i runs those that reach i.
/// The pre and post blocks run every row either way.
#[derive(Clone, Copy, Debug)]
pub enum Rows<'a> {
    All(usize),
    Deepest(&'a [usize]),
}

impl Rows<'_> {
    fn all(self) -> usize {
        match self {
            Rows::All(rows) => rows,
            Rows::Deepest(loops) => loops.len(),
        }
    }

    /// The rows of loop iteration `iteration`: a prefix of the step's rows.
    fn reaching(self, iteration: usize) -> usize {
        match self {
            Rows::All(rows) => rows,
            Rows::Deepest(loops) => loops.partition_point(|&l| l >= iteration),
        }
    }
}

/// [`run`] over [`Rows`].
pub fn run_rows<B: Backend>(
    backend: &B,
    w: &Weights<B>,
    buf: &mut Buffers<B>,
    rows: Rows,
    span: Span,
    cancel: Option<&AtomicBool>,
) -> Result<()> {
    let config = &w.config;
    let arch = &config.architecture;
    let body = buf.body.clone();
    let mut pending = None;
    let apply = |buf: &mut Buffers<B>, rows: usize, app: Application, pending: &mut _| {
        if cancel.is_some_and(|c| c.load(Ordering::Acquire)) {
            return Err(Error::Cancelled);
        }
        apply_block(backend, w, &body, buf, rows, app, pending);
        Ok(())
    };
    let all = rows.all();
    if span.start {
        embed(backend, w, buf, all);
        for app in stage_blocks(Stage::Pre, config.n_pre_blocks) {
            apply(buf, all, app, &mut pending)?;
        }
    }
    for iteration in span.first..=span.last {
        let n = rows.reaching(iteration);
        if n == 0 {
            break;
        }
        if iteration == 1 {
            settle(backend, config, buf, all, pending.take());
            begin_loop(backend, w, buf, all);
        }
        if let Some(adapter) = &w.adapter {
            // x = adapter.state · x + adapter.input · e, the second term computed at the start.
            settle(backend, config, buf, n, pending.take());
            let d = config.dim;
            backend.to_half(&buf.x, n * d, &mut buf.h);
            backend.copy_rows(&buf.loop_input, 0, &mut buf.x, 0, n, d);
            backend.linear(&buf.h, 0, n, &adapter.state, &mut buf.x, true);
        }
        for app in iteration_blocks(config.n_loop_blocks, iteration) {
            apply(buf, n, app, &mut pending)?;
        }
        if arch.loop_norm == LoopNorm::EachIteration {
            norm_state(backend, w, buf, n, pending.take());
        }
        if rows.reaching(iteration + 1) < n {
            // Rows that stop here leave with their last sublayer's output added.
            settle(backend, config, buf, n, pending.take());
        }
    }
    if span.post {
        if arch.loop_norm == LoopNorm::AfterLoop {
            norm_state(backend, w, buf, all, pending.take());
        }
        for app in stage_blocks(Stage::Post, config.n_post_blocks) {
            apply(buf, all, app, &mut pending)?;
        }
    }
    settle(backend, config, buf, all, pending.take());
    Ok(())
}

/// The output norm of a sandwich sublayer whose output (in [`Buffers::delta`]) is not yet added
/// to the residual stream: the next op that reads the stream adds it. A block whose attention
/// product adds the previous block's output writes the stream to [`Buffers::x_next`] and its
/// MLP product does the same with the attention's output, so each block swaps the two buffers
/// twice or not at all, and the stream is in [`Buffers::x`] between blocks (as captured graphs
/// and readers of the stream expect).
type Pending<'a, B> = Option<NormLayer<'a, <B as Backend>::Vector>>;

/// Block application `app` for the `rows` staged rows.
fn apply_block<'a, B: Backend>(
    backend: &B,
    w: &'a Weights<B>,
    body: &'a LoopBody<B>,
    buf: &mut Buffers<B>,
    rows: usize,
    app: Application,
    pending: &mut Pending<'a, B>,
) {
    let at = buf.kv.layout.at(app);
    let block = w.block(app, body);
    block_forward(backend, &w.config, block, &w.rope, buf, rows, at, pending);
}

/// Add the pending sublayer output, if any, to the stream in place.
fn settle<B: Backend>(
    backend: &B,
    config: &ModelConfig,
    buf: &mut Buffers<B>,
    rows: usize,
    pending: Pending<'_, B>,
) {
    if let Some(norm) = pending {
        let layout = config.architecture.block_norms;
        let residual = Residual {
            norm,
            delta: &buf.delta,
            layout,
        };
        backend.residual_norm(&residual, rows, &mut buf.x);
    }
}

/// The embedding of the staged tokens into the residual stream, scaled as the architecture says.
fn embed<B: Backend>(backend: &B, w: &Weights<B>, buf: &mut Buffers<B>, rows: usize) {
    match &w.embed_proj {
        None => backend.embed(&w.embed, &buf.step, &mut buf.x),
        Some(proj) => {
            backend.embed_half(&w.embed, &buf.step, &mut buf.h);
            backend.linear(&buf.h, 0, rows, proj, &mut buf.x, false);
        }
    }
    let scale = w.config.architecture.embed_scale;
    if scale != 1.0 {
        backend.scale(&mut buf.x, rows * w.config.dim, scale as f32);
    }
}

/// Before loop iteration 1, with the residual stream holding the pre blocks' output `e`: compute
/// the loop input from `e` (loop adapter) and replace the stream by the initial state (random
/// loop state). A loop that carries its state starts from `e` itself.
fn begin_loop<B: Backend>(backend: &B, w: &Weights<B>, buf: &mut Buffers<B>, rows: usize) {
    let d = w.config.dim;
    if let Some(adapter) = &w.adapter {
        backend.to_half(&buf.x, rows * d, &mut buf.h);
        backend.linear(&buf.h, 0, rows, &adapter.input, &mut buf.loop_input, false);
    }
    if w.config.architecture.loop_state == LoopState::Random {
        backend.copy_rows(&buf.initial_state, 0, &mut buf.x, 0, rows, d);
    }
}

/// `x = final_norm(x)` in f32: the loop norm, of the stream with the pending sublayer output
/// added if there is one.
fn norm_state<B: Backend>(
    backend: &B,
    w: &Weights<B>,
    buf: &mut Buffers<B>,
    rows: usize,
    pending: Pending<'_, B>,
) {
    let norm = norm_layer(&w.config, &w.final_norm);
    match pending {
        None => backend.norm_state(&norm, &mut buf.x, rows),
        Some(out_norm) => {
            let residual = Residual {
                norm: out_norm,
                delta: &buf.delta,
                layout: w.config.architecture.block_norms,
            };
            backend.residual_norm_state(&residual, &norm, &mut buf.x, rows);
        }
    }
}

/// Whether [`Span::post`] changes the residual stream (post blocks or a loop norm before them):
/// readers of the stream after an iteration then run it on a copy.
pub fn post_changes_state(config: &ModelConfig) -> bool {
    config.n_post_blocks > 0 || config.architecture.loop_norm == LoopNorm::AfterLoop
}

/// Copy `rows` rows of the residual stream, from row `from`, to row `to_row` of another buffer.
pub fn save_rows<B: Backend>(
    backend: &B,
    buf: &Buffers<B>,
    from: usize,
    to: &mut B::Float,
    to_row: usize,
    rows: usize,
) {
    backend.copy_rows(&buf.x, from, to, to_row, rows, buf.width());
}

/// Put `rows` saved rows of residual stream back, from row `from` of `saved` to row `to`.
pub fn restore_rows<B: Backend>(
    backend: &B,
    buf: &mut Buffers<B>,
    saved: &B::Float,
    from: usize,
    to: usize,
    rows: usize,
) {
    let width = buf.width();
    backend.copy_rows(saved, from, &mut buf.x, to, rows, width);
}

/// What a decode step does after the loop iterations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Decode {
    pub loops: usize,
    /// Save the residual stream after the last loop iteration into this row of
    /// [`Buffers::hidden`] (for a verify step that continues from it).
    pub hidden_row: Option<usize>,
    /// Run the post blocks and the head and choose the next token (false: stop after saving).
    pub head: bool,
    /// With the head: also measure the entropy of the logits (BETA-MON).
    pub entropy: bool,
}

impl Decode {
    /// A plain decode step at `loops` iterations.
    pub fn plain(loops: usize) -> Decode {
        Decode {
            loops,
            hidden_row: None,
            head: true,
            entropy: false,
        }
    }

    /// This step, measuring the entropy of its logits when `entropy`.
    pub fn measured(self, entropy: bool) -> Decode {
        Decode { entropy, ..self }
    }

    /// Distinct for every distinct sequence of ops (the key of a captured graph).
    fn key(&self, sample: bool) -> u64 {
        let row = self.hidden_row.map_or(0, |r| r as u64 + 1);
        (self.loops as u64) << 9
            | (self.entropy as u64) << 8
            | row << 2
            | (self.head as u64) << 1
            | sample as u64
    }
}

/// The steps of one call of `rows` rows, from creation until dropped, when the call before it
/// resumes ([`Backend::set_call_rows`]): every loop that cuts a prompt into steps holds one, and
/// so does the head's read-out of some rows of a step.
pub struct CallRows<'a, B: Backend> {
    backend: &'a B,
    outer: usize,
}

impl<'a, B: Backend> CallRows<'a, B> {
    pub fn new(backend: &'a B, rows: usize) -> Self {
        let outer = backend.set_call_rows(rows);
        CallRows { backend, outer }
    }
}

impl<B: Backend> Drop for CallRows<'_, B> {
    fn drop(&mut self) {
        self.backend.set_call_rows(self.outer);
    }
}

/// One decode step: feed `input` (one token); with `decode.head`, leave its logits in
/// `buf.logits` row 0 and choose the next token as `input.choice` says (read it with
/// [`chosen_token`]).
///
/// After `set_step`, the ops depend only on `decode` and on whether the choice samples (kernels
/// read the token, position and sampling parameters staged in device memory), so a backend with
/// graphs captures them once per such key and replays.
pub fn decode_step<B: Backend>(
    backend: &B,
    w: &Weights<B>,
    buf: &mut Buffers<B>,
    input: StepInput,
    decode: Decode,
) -> Result<()> {
    debug_assert_eq!(input.tokens.len(), 1);
    // Validation, KV reservation, tier moves and staging happen outside any graph.
    let key = decode.key(input.choice.is_sample());
    stage(backend, w, buf, input, decode.loops)?;
    let capturable = buf.kv.layout.mode.graph_capturable();
    if capturable && backend.graph_replay(&mut buf.step, key)? {
        return Ok(());
    }
    let capturing = capturable && backend.graph_begin(&mut buf.step, key)?;
    let body = Span {
        post: false,
        ..Span::all(decode.loops)
    };
    run(backend, w, buf, 1, body, None)?;
    if let Some(row) = decode.hidden_row {
        let width = buf.width();
        backend.copy_rows(&buf.x, 0, &mut buf.hidden, row, 1, width);
        if w.adapter.is_some() {
            backend.copy_rows(&buf.loop_input, 0, &mut buf.hidden_input, row, 1, width);
        }
    }
    if decode.head {
        run(backend, w, buf, 1, Span::post(), None)?;
        final_norm(backend, w, buf, 1);
        logits(backend, w, buf, 0, 1);
        choose(backend, w, buf);
        if decode.entropy {
            measure(backend, w, buf, 1);
        }
    }
    if capturing {
        backend.graph_end(&mut buf.step, key)?;
    }
    Ok(())
}

/// A verify step of self-speculative decoding: the staged `rows` positions continue from the
/// residual streams that draft steps saved in [`Buffers::hidden`] after iteration
/// `draft_loops`, through iterations `draft_loops + 1..=loops` and the post blocks (the KV of
/// the pre blocks and of iterations up to `draft_loops` is the draft's); logits of every row in
/// `buf.logits`. Without `reuse`, the rows run through the whole network instead.
pub fn verify_step<B: Backend>(
    backend: &B,
    w: &Weights<B>,
    buf: &mut Buffers<B>,
    input: StepInput,
    draft_loops: usize,
    loops: usize,
    reuse: bool,
) -> Result<()> {
    let rows = input.tokens.len();
    if rows > HIDDEN_ROWS {
        return Err(Error::invalid(format!(
            "a verify step of {rows} rows (at most {HIDDEN_ROWS})"
        )));
    }
    stage(backend, w, buf, input, loops)?;
    let span = if reuse {
        let width = buf.width();
        backend.copy_rows(&buf.hidden, 0, &mut buf.x, 0, rows, width);
        if w.adapter.is_some() {
            backend.copy_rows(&buf.hidden_input, 0, &mut buf.loop_input, 0, rows, width);
        }
        Span {
            start: false,
            first: draft_loops + 1,
            last: loops,
            post: true,
        }
    } else {
        Span::all(loops)
    };
    run(backend, w, buf, rows, span, None)?;
    final_norm(backend, w, buf, rows);
    logits(backend, w, buf, 0, rows);
    Ok(())
}

/// Choose the next token from logits row 0 as the last staged step's choice says.
pub fn choose<B: Backend>(backend: &B, w: &Weights<B>, buf: &mut Buffers<B>) {
    backend.choose(&buf.logits, w.config.vocab_size, &mut buf.step);
}

/// The argmax of each of logits rows `0..rows` (waits for the device).
pub fn argmax_rows<B: Backend>(
    backend: &B,
    w: &Weights<B>,
    buf: &mut Buffers<B>,
    rows: usize,
) -> Result<Vec<u32>> {
    backend.argmax_rows(&buf.logits, rows, w.config.vocab_size, &mut buf.step);
    backend.chosen_tokens(&buf.step, rows)
}

/// The token chosen by the last [`decode_step`] or [`choose`] (waits for the device).
pub fn chosen_token<B: Backend>(backend: &B, buf: &Buffers<B>) -> Result<u32> {
    backend.chosen_token(&buf.step)
}

/// Measure the entropy of each of logits rows `0..rows` (BETA-MON); read them with [`chosen`]
/// (row 0) or [`entropies`].
pub fn measure<B: Backend>(backend: &B, w: &Weights<B>, buf: &mut Buffers<B>, rows: usize) {
    backend.entropy_rows(&buf.logits, rows, w.config.vocab_size, &mut buf.step);
}

/// The token chosen by the last [`decode_step`] or [`choose`], with the entropy of its logits
/// when `entropy` (the step measured it); one read from the device either way.
pub fn chosen<B: Backend>(backend: &B, buf: &Buffers<B>, entropy: bool) -> Result<Chosen> {
    if entropy {
        let (token, bits) = backend.chosen_measured(&buf.step)?;
        Ok(Chosen {
            token,
            entropy_bits: Some(bits),
        })
    } else {
        Ok(Chosen {
            token: backend.chosen_token(&buf.step)?,
            entropy_bits: None,
        })
    }
}

/// The entropies of the last [`measure`] (waits for the device).
pub fn entropies<B: Backend>(backend: &B, buf: &Buffers<B>, rows: usize) -> Result<Vec<f32>> {
    backend.entropies(&buf.step, rows)
}

#[allow(clippy::too_many_arguments)]
fn block_forward<'a, B: Backend>(
    backend: &B,
    config: &ModelConfig,
    block: Block<'a, B>,
    rope: &B::Float,
    buf: &mut Buffers<B>,
    rows: usize,
    at: KvSlot,
    pending: &mut Pending<'a, B>,
) {
    let (vectors, linears) = (block.vectors, block.linears);
    let layout = config.architecture.block_norms;

    // Attention: f = attn_out · attention(rope(qkv · norm(x) + bias))
    let attn_norm = norm_layer(config, &vectors.attn_norm);
    let carried = pending.take();
    // Where the cache keeps h itself, h must exist (not be fused into the product).
    let fused = carried.is_some() && !buf.kv.layout.mode.stores_input();
    if buf.kv.layout.mode.stores_input() {
        settle(backend, config, buf, rows, carried);
        backend.norm(&attn_norm, &buf.x, rows, &mut buf.h);
        backend.linear(&buf.h, 0, rows, &linears.attn_qkv, &mut buf.qkv, false);
    } else if let Some(norm) = carried {
        let residual = Residual {
            norm,
            delta: &buf.delta,
            layout,
        };
        backend.residual_norm_linear(
            &residual,
            &buf.x,
            rows,
            &mut buf.x_next,
            &attn_norm,
            &linears.attn_qkv,
            &mut buf.h,
            &mut buf.qkv,
        );
        std::mem::swap(&mut buf.x, &mut buf.x_next);
    } else {
        backend.norm_linear(
            &attn_norm,
            &buf.x,
            rows,
            &linears.attn_qkv,
            &mut buf.h,
            &mut buf.qkv,
        );
    }
    if let Some(bias) = &vectors.qkv_bias {
        backend.add_bias(&mut buf.qkv, rows, bias);
    }
    backend.rope_attention(
        &mut buf.qkv,
        &buf.h,
        &buf.step,
        rows,
        rope,
        &mut buf.kv,
        at,
        &linears.attn_qkv,
        &mut buf.att,
    );
    match &vectors.attn_out_norm {
        None => backend.linear(&buf.att, 0, rows, &linears.attn_out, &mut buf.x, true),
        Some(out_norm) => {
            backend.linear(&buf.att, 0, rows, &linears.attn_out, &mut buf.delta, false);
            *pending = Some(norm_layer(config, out_norm));
        }
    }

    // MLP: f = mlp_down · (silu(mlp_gate · norm(x)) * (mlp_up · norm(x)))
    let mlp_norm = norm_layer(config, &vectors.mlp_norm);
    match pending.take() {
        Some(norm) if fused => {
            let residual = Residual {
                norm,
                delta: &buf.delta,
                layout,
            };
            backend.residual_norm_mlp_gate_up(
                &residual,
                &buf.x,
                rows,
                &mut buf.x_next,
                &mlp_norm,
                &linears.mlp_gate,
                &linears.mlp_up,
                &mut buf.h,
                (&mut buf.gate, &mut buf.up),
                &mut buf.act,
            );
            std::mem::swap(&mut buf.x, &mut buf.x_next);
        }
        unfused => {
            settle(backend, config, buf, rows, unfused);
            backend.norm_mlp_gate_up(
                &mlp_norm,
                &buf.x,
                rows,
                &linears.mlp_gate,
                &linears.mlp_up,
                &mut buf.h,
                (&mut buf.gate, &mut buf.up),
                &mut buf.act,
            );
        }
    }
    match &vectors.mlp_out_norm {
        None => backend.linear(&buf.act, 0, rows, &linears.mlp_down, &mut buf.x, true),
        Some(out_norm) => {
            backend.linear(&buf.act, 0, rows, &linears.mlp_down, &mut buf.delta, false);
            *pending = Some(norm_layer(config, out_norm));
        }
    }
}

fn norm_layer<'a, B: Backend>(config: &ModelConfig, n: &'a Norm<B>) -> NormLayer<'a, B::Vector> {
    NormLayer {
        kind: config.norm,
        eps: config.norm_eps as f32,
        weight: &n.weight,
        bias: n.bias.as_ref(),
    }
}

/// The head's input for the step's `rows` rows: the final norm of the state, or the state itself
/// where the loop norm already normed it (`head_norm` false), rounded to f16.
pub fn final_norm<B: Backend>(backend: &B, w: &Weights<B>, buf: &mut Buffers<B>, rows: usize) {
    if w.config.architecture.head_norm {
        let norm = norm_layer(&w.config, &w.final_norm);
        backend.norm(&norm, &buf.x, rows, &mut buf.h);
    } else {
        backend.to_half(&buf.x, rows * w.config.dim, &mut buf.h);
    }
}

/// Logits of rows `first_row..first_row + n` (n ≤ `buf.logit_rows`) of the final-normed step into
/// `buf.logits` rows `0..n`. Call [`final_norm`] first.
pub fn logits<B: Backend>(
    backend: &B,
    w: &Weights<B>,
    buf: &mut Buffers<B>,
    first_row: usize,
    n: usize,
) {
    debug_assert!(n <= buf.logit_rows);
    // The rows read out are a call of their own, whatever call their step belongs to.
    let _readout = CallRows::new(backend, n);
    match &w.head {
        Head::Untied(head) => backend.linear(&buf.h, first_row, n, head, &mut buf.logits, false),
        Head::Tied => backend.linear(&buf.h, first_row, n, &w.embed, &mut buf.logits, false),
        Head::TiedFactorized(proj_t) => {
            backend.linear(&buf.h, first_row, n, proj_t, &mut buf.factor, false);
            let len = n * w.config.embed_factor_dim;
            backend.to_half(&buf.factor, len, &mut buf.factor_half);
            backend.linear(&buf.factor_half, 0, n, &w.embed, &mut buf.logits, false);
        }
    }
}
