//! Arithmetic of one forward pass, for reporting throughput (docs/PERF.md "Prefill against an
//! honest peer"; bench/torch_peer.py counts the same way).
//!
//! A multiply-add counts as 2 FLOPs. For `n` new tokens after `past` cached positions:
//! * every linear layer applied to a row: 2 · rows · cols (QKV, output, gate, up and down of
//!   each block application; the embedding projection of a factorized embedding);
//! * attention, per block application: query i (0-based) attends to past + i + 1 positions, and
//!   each (query, key) pair costs 2 · head_dim for Q·K and 2 · head_dim for P·V, per head:
//!   4 · n_heads · head_dim · Σᵢ (past + i + 1) = 4 · dim · (n · past + n (n + 1) / 2);
//! * the head, per row that needs logits: 2 · dim · vocab (plus the projection of a factorized
//!   tied head).
//!
//! Norms, RoPE, softmax and SwiGLU are O(n · dim) and left out, as is usual for such counts.

use super::config::{HeadKind, ModelConfig};

/// FLOPs of a forward pass over `n` tokens after `past` cached positions at `loops` iterations,
/// with logits for `head_rows` rows (1 for a prefill that samples the next token, `n` for a
/// scoring call).
pub fn forward_flops(
    config: &ModelConfig,
    n: usize,
    past: usize,
    loops: usize,
    head_rows: usize,
) -> f64 {
    let (d, f) = (config.dim as f64, config.ffn_dim as f64);
    let (n, past) = (n as f64, past as f64);
    let block_params = d * config.qkv_dim() as f64 + d * d + 3.0 * d * f;
    let linear = 2.0 * n * block_params;
    let attention = 4.0 * d * (n * past + n * (n + 1.0) / 2.0);
    let applications = config.applications(loops) as f64;
    let r = config.embed_factor_dim as f64;
    let embed = 2.0 * n * r * d;
    let vocab = config.vocab_size as f64;
    let head_per_row = match config.head {
        HeadKind::Untied => 2.0 * d * vocab,
        HeadKind::Tied if r > 0.0 => 2.0 * d * r + 2.0 * r * vocab,
        HeadKind::Tied => 2.0 * d * vocab,
    };
    applications * (linear + attention) + embed + head_rows as f64 * head_per_row
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::synth::preset;

    #[test]
    fn tl_407m_prefill_matches_the_hand_count() {
        let c = preset("tl-407m").unwrap();
        // D 2048, F 8192, MHA: 4·D² + 3·D·F = 67 108 864 weights per block.
        let block = 4.0 * 2048.0 * 2048.0 + 3.0 * 2048.0 * 8192.0;
        let n = 2048.0;
        let per_app = 2.0 * n * block + 4.0 * 2048.0 * n * (n + 1.0) / 2.0;
        let want = 10.0 * per_app + 2.0 * 2048.0 * 50304.0;
        assert_eq!(forward_flops(&c, 2048, 0, 8, 1), want);
    }

    #[test]
    fn cached_positions_add_attention_only() {
        let c = preset("tiny").unwrap();
        let extra = forward_flops(&c, 4, 10, 2, 1) - forward_flops(&c, 4, 0, 2, 1);
        let apps = c.applications(2) as f64;
        assert_eq!(extra, apps * 4.0 * c.dim as f64 * 4.0 * 10.0);
    }
}
