//! The forward pass, written once over the [`Backend`] op set.
//!
//! One step feeds `rows` tokens at positions `start_pos..start_pos + rows` through every block
//! application (pre blocks, the loop body L times, post blocks). Application `a` owns KV slot `a`,
//! so the state after loop iteration i never depends on the total L.

use crate::backend::{AttentionShape, Backend, NormLayer, StepInput};
use crate::error::{Error, Result};
use crate::model::config::ModelConfig;
use crate::model::weights::{BlockWeights, Head, Norm, Weights};

/// Logit rows computed per head call; bounds the logits buffer at `LOGIT_ROWS × vocab`.
pub const LOGIT_ROWS: usize = 16;

/// The order of block applications for `loops` iterations: indices into `Weights::blocks`.
pub fn schedule(config: &ModelConfig, loops: usize) -> impl Iterator<Item = usize> + '_ {
    let (n_pre, k) = (config.n_pre_blocks, config.n_loop_blocks);
    let pre = 0..n_pre;
    let body = (0..loops).flat_map(move |_| n_pre..n_pre + k);
    let post = n_pre + k..n_pre + k + config.n_post_blocks;
    pre.chain(body).chain(post)
}

/// Per-session runtime buffers, allocated once for `max_rows` rows per step.
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
    pub logits: B::Float,
    step: B::Step,
    kv: Option<B::KvCache>,
    kv_slots: usize,
    kv_capacity: usize,
    /// Bytes held by the buffers above, KV cache excluded.
    pub bytes: usize,
}

impl<B: Backend> Buffers<B> {
    pub fn new(backend: &B, config: &ModelConfig, max_rows: usize, max_seq: usize) -> Result<Self> {
        let (d, f, r) = (config.dim, config.ffn_dim, config.embed_factor_dim);
        let wide = d.max(r);
        let float_len = [d, config.qkv_dim(), f, f].map(|w| w * max_rows);
        let half_len = [wide, d, f].map(|w| w * max_rows);
        let logits_len = LOGIT_ROWS * config.vocab_size;
        let factor_len = LOGIT_ROWS * r.max(1);
        let bytes = 4 * (float_len.iter().sum::<usize>() + logits_len + factor_len)
            + 2 * (half_len.iter().sum::<usize>() + factor_len);
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
            step: backend.alloc_step(max_rows)?,
            kv: None,
            kv_slots: 0,
            kv_capacity: max_seq,
            bytes,
        })
    }

    /// Make sure the KV cache has `slots` slots; grows (and clears) it when it has fewer.
    pub fn reserve_kv(&mut self, backend: &B, config: &ModelConfig, slots: usize) -> Result<()> {
        if self.kv.is_none() || self.kv_slots < slots {
            backend.graph_reset(&mut self.step); // captured graphs point at the old cache
            self.kv = None; // release the old cache before allocating the larger one
            self.kv = Some(backend.alloc_kv(slots, self.kv_capacity, config.kv_dim())?);
            self.kv_slots = slots;
        }
        Ok(())
    }

    pub fn kv_bytes(&self, backend: &B) -> usize {
        self.kv.as_ref().map_or(0, |kv| backend.kv_bytes(kv))
    }
}

/// Run one step through every block application; afterwards the residual stream of each row is
/// in the buffers, ready for [`logits`].
pub fn forward<B: Backend>(
    backend: &B,
    w: &Weights<B>,
    buf: &mut Buffers<B>,
    input: StepInput,
    loops: usize,
) -> Result<()> {
    let rows = input.tokens.len();
    stage(backend, w, buf, input, loops)?;
    step_ops(backend, w, buf, rows, loops);
    Ok(())
}

/// Validate a step, make room in the KV cache, and stage its tokens and position.
fn stage<B: Backend>(
    backend: &B,
    w: &Weights<B>,
    buf: &mut Buffers<B>,
    input: StepInput,
    loops: usize,
) -> Result<()> {
    let config = &w.config;
    let rows = input.tokens.len();
    if rows == 0 || rows > buf.max_rows {
        return Err(Error::invalid(format!(
            "step of {rows} rows (buffers hold 1..={})",
            buf.max_rows
        )));
    }
    if input.start_pos + rows > buf.kv_capacity {
        return Err(Error::invalid(format!(
            "sequence of {} tokens exceeds max_seq_len {}",
            input.start_pos + rows,
            buf.kv_capacity
        )));
    }
    buf.reserve_kv(backend, config, config.applications(loops))?;
    backend.set_step(&mut buf.step, input)
}

/// The ops of a staged step: embedding, then every block application.
fn step_ops<B: Backend>(
    backend: &B,
    w: &Weights<B>,
    buf: &mut Buffers<B>,
    rows: usize,
    loops: usize,
) {
    match &w.embed_proj {
        None => backend.embed(&w.embed, &buf.step, &mut buf.x),
        Some(proj) => {
            backend.embed_half(&w.embed, &buf.step, &mut buf.h);
            backend.linear(&buf.h, 0, rows, proj, &mut buf.x, false);
        }
    }
    for (slot, block) in schedule(&w.config, loops).enumerate() {
        block_forward(
            backend,
            &w.config,
            &w.blocks[block],
            &w.rope,
            buf,
            rows,
            slot,
        );
    }
}

/// One decode step: feed `input` (one token), leave its logits in `buf.logits` row 0 and
/// choose the next token as `input.choice` says (read it with [`chosen_token`]).
///
/// After `set_step`, the ops depend only on `loops` and on whether the choice samples (kernels
/// read the token, position and sampling parameters staged in device memory), so a backend with
/// graphs captures them once per such key and replays.
pub fn decode_step<B: Backend>(
    backend: &B,
    w: &Weights<B>,
    buf: &mut Buffers<B>,
    input: StepInput,
    loops: usize,
) -> Result<()> {
    debug_assert_eq!(input.tokens.len(), 1);
    // Validation, KV reservation and staging happen outside any graph.
    let key = (loops as u64) << 1 | input.choice.is_sample() as u64;
    stage(backend, w, buf, input, loops)?;
    if backend.graph_replay(&mut buf.step, key)? {
        return Ok(());
    }
    let capturing = backend.graph_begin(&mut buf.step, key)?;
    step_ops(backend, w, buf, 1, loops);
    final_norm(backend, w, buf, 1);
    logits(backend, w, buf, 0, 1);
    choose(backend, w, buf);
    if capturing {
        backend.graph_end(&mut buf.step, key)?;
    }
    Ok(())
}

/// Choose the next token from logits row 0 as the last staged step's choice says.
pub fn choose<B: Backend>(backend: &B, w: &Weights<B>, buf: &mut Buffers<B>) {
    backend.choose(&buf.logits, w.config.vocab_size, &mut buf.step);
}

/// The token chosen by the last [`decode_step`] or [`choose`] (waits for the device).
pub fn chosen_token<B: Backend>(backend: &B, buf: &Buffers<B>) -> Result<u32> {
    backend.chosen_token(&buf.step)
}

fn block_forward<B: Backend>(
    backend: &B,
    config: &ModelConfig,
    block: &BlockWeights<B>,
    rope: &B::Float,
    buf: &mut Buffers<B>,
    rows: usize,
    slot: usize,
) {
    let heads = AttentionShape {
        n_heads: config.n_heads,
        n_kv_heads: config.n_kv_heads,
        head_dim: config.head_dim(),
    };
    let kv = buf.kv.as_mut().expect("KV cache reserved before the step");

    // Attention: x += attn_out · attention(rope(qkv · norm(x)))
    let attn_norm = norm_layer(config, &block.attn_norm);
    backend.norm_linear(
        &attn_norm,
        &buf.x,
        rows,
        &block.attn_qkv,
        &mut buf.h,
        &mut buf.qkv,
    );
    backend.rope_attention(
        &mut buf.qkv,
        &buf.step,
        rows,
        heads,
        rope,
        kv,
        slot,
        &mut buf.att,
    );
    backend.linear(&buf.att, 0, rows, &block.attn_out, &mut buf.x, true);

    // MLP: x += mlp_down · (silu(mlp_gate · norm(x)) * (mlp_up · norm(x)))
    let mlp_norm = norm_layer(config, &block.mlp_norm);
    backend.norm_mlp_gate_up(
        &mlp_norm,
        &buf.x,
        rows,
        &block.mlp_gate,
        &block.mlp_up,
        &mut buf.h,
        (&mut buf.gate, &mut buf.up),
        &mut buf.act,
    );
    backend.linear(&buf.act, 0, rows, &block.mlp_down, &mut buf.x, true);
}

fn norm_layer<'a, B: Backend>(config: &ModelConfig, n: &'a Norm<B>) -> NormLayer<'a, B::Vector> {
    NormLayer {
        kind: config.norm,
        eps: config.norm_eps as f32,
        weight: &n.weight,
        bias: n.bias.as_ref(),
    }
}

/// Apply the final norm to the step's `rows` rows.
pub fn final_norm<B: Backend>(backend: &B, w: &Weights<B>, buf: &mut Buffers<B>, rows: usize) {
    let norm = norm_layer(&w.config, &w.final_norm);
    backend.norm(&norm, &buf.x, rows, &mut buf.h);
}

/// Logits of rows `first_row..first_row + n` (n ≤ LOGIT_ROWS) of the final-normed step into
/// `buf.logits` rows `0..n`. Call [`final_norm`] first.
pub fn logits<B: Backend>(
    backend: &B,
    w: &Weights<B>,
    buf: &mut Buffers<B>,
    first_row: usize,
    n: usize,
) {
    debug_assert!(n <= LOGIT_ROWS);
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
