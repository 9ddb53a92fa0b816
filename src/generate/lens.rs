//! The logit lens and the trajectory of the last position through the loop iterations.
//!
//! One step runs the pre blocks, then the loop body one iteration at a time; after iteration i
//! the residual stream goes through the post blocks (on a copy, so that iteration i + 1 starts
//! from the loop's own state), the final norm and the head. Row L is therefore `score_last` at
//! L loops, and the first L′ rows at L are the rows at L′ (the state after iteration i never
//! depends on the total).

use std::sync::atomic::AtomicBool;

use super::finite;
use super::sampling::argmax;
use crate::backend::{Backend, Choice, StepInput};
use crate::error::Result;
use crate::model::forward::{
    final_norm, forward, logits, restore_rows, run, save_rows, stage, step_rows, Buffers, CallRows,
    Span,
};
use crate::model::weights::Weights;

/// Logits at the last position after each loop iteration (`[loops][vocab]`), and the residual
/// stream at the last position after the pre blocks and after each iteration
/// (`[loops + 1][dim]`).
pub fn logit_lens<B: Backend>(
    backend: &B,
    w: &Weights<B>,
    buf: &mut Buffers<B>,
    tokens: &[u32],
    loops: usize,
    cancel: &AtomicBool,
) -> Result<(Vec<f32>, Vec<Vec<f32>>)> {
    let (dim, vocab) = (w.config.dim, w.config.vocab_size);
    // Positions before the last step run whole; the last step is read out iteration by iteration.
    let _call = CallRows::new(backend, tokens.len());
    let mut start = 0;
    let rows = loop {
        let rows = step_rows(buf, start, tokens.len() - start);
        let input = StepInput {
            tokens: &tokens[start..start + rows],
            start_pos: start,
            choice: Choice::Greedy,
        };
        if start + rows == tokens.len() {
            stage(backend, w, buf, input, loops)?;
            break rows;
        }
        forward(backend, w, buf, input, loops, cancel)?;
        start += rows;
    };
    let last = rows - 1;
    let pre = Span {
        start: true,
        first: 1,
        last: 0,
        post: false,
    };
    run(backend, w, buf, rows, pre, Some(cancel))?;
    let mut hidden = vec![residual(backend, buf, last, dim)?];
    // The post blocks change the residual stream: run them on a copy of it.
    let mut saved = if w.config.n_post_blocks > 0 {
        Some(backend.alloc_float(rows * dim)?)
    } else {
        None
    };
    let mut lens = crate::alloc::with_capacity(loops.saturating_mul(vocab), "the logit lens")?;
    for i in 1..=loops {
        run(backend, w, buf, rows, Span::iterations(i, i), Some(cancel))?;
        hidden.push(residual(backend, buf, last, dim)?);
        if let Some(saved) = saved.as_mut() {
            save_rows(backend, buf, 0, saved, 0, rows);
            run(backend, w, buf, rows, Span::post(), Some(cancel))?;
        }
        final_norm(backend, w, buf, rows);
        logits(backend, w, buf, last, 1);
        lens.extend(finite(backend.read_float(&buf.logits, 0, vocab)?)?);
        if let Some(saved) = saved.as_ref() {
            restore_rows(backend, buf, saved, 0, 0, rows);
        }
    }
    Ok((lens, hidden))
}

/// The residual stream of row `row`, on the host.
fn residual<B: Backend>(backend: &B, buf: &Buffers<B>, row: usize, dim: usize) -> Result<Vec<f32>> {
    backend.read_float(buf.residual(), row * dim, dim)
}

/// One loop iteration as seen at the last position.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TrajectoryPoint {
    /// ‖h_i‖₂ of the residual stream after iteration i.
    pub hidden_norm: f64,
    /// ‖h_i − h_{i−1}‖ / ‖h_{i−1}‖ (h_0: the stream entering the loop).
    pub rel_change: f64,
    /// KL(p_i ‖ p_{i−1}) in nats of the next-token distributions read out after iterations i and
    /// i − 1; 0 for i = 1.
    pub kl_prev: f64,
    /// Entropy of p_i in bits.
    pub entropy: f64,
    /// The most likely token of p_i.
    pub argmax: u32,
}

/// The trajectory from the logit lens's rows and residual streams.
pub fn trajectory(lens: &[f32], hidden: &[Vec<f32>], vocab: usize) -> Vec<TrajectoryPoint> {
    let norm = |v: &[f32]| v.iter().map(|&x| (x as f64).powi(2)).sum::<f64>().sqrt();
    let mut previous: Option<Vec<f64>> = None;
    lens.chunks_exact(vocab)
        .enumerate()
        .map(|(i, row)| {
            let (h, before) = (&hidden[i + 1], &hidden[i]);
            let diff: Vec<f32> = h.iter().zip(before).map(|(a, b)| a - b).collect();
            let p = softmax(row);
            let entropy = -p
                .iter()
                .filter(|&&x| x > 0.0)
                .map(|&x| x * x.log2())
                .sum::<f64>();
            let kl_prev = previous.as_ref().map_or(0.0, |q| {
                p.iter()
                    .zip(q)
                    .filter(|(&a, _)| a > 0.0)
                    .map(|(&a, &b)| a * (a / b).ln())
                    .sum()
            });
            let point = TrajectoryPoint {
                hidden_norm: norm(h),
                rel_change: norm(&diff) / norm(before),
                kl_prev,
                entropy,
                argmax: argmax(row),
            };
            previous = Some(p);
            point
        })
        .collect()
}

/// softmax of one row, in f64.
fn softmax(row: &[f32]) -> Vec<f64> {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let e: Vec<f64> = row.iter().map(|&v| (v as f64 - max).exp()).collect();
    let total: f64 = e.iter().sum();
    e.into_iter().map(|v| v / total).collect()
}
