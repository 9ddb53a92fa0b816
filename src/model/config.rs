//! Static architecture of a looped transformer, as stored in the `.tinyloop` header.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NormKind {
    RmsNorm,
    LayerNorm,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HeadKind {
    /// A separate `head` tensor `[vocab, dim]`.
    Untied,
    /// Logits use the embedding table (through `embed_proj` when the embedding is factorized).
    Tied,
}

/// The architecture. Field names are the keys of `config()` and of the file header.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    pub dim: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub ffn_dim: usize,
    pub vocab_size: usize,
    /// Rank r of a factorized embedding `E[vocab, r] · P[r, dim]`; 0 means full rank.
    pub embed_factor_dim: usize,
    pub n_pre_blocks: usize,
    pub n_loop_blocks: usize,
    pub n_post_blocks: usize,
    pub default_loops: usize,
    pub norm: NormKind,
    pub norm_eps: f64,
    pub rope_theta: f64,
    pub max_position: usize,
    pub head: HeadKind,
}

impl ModelConfig {
    pub fn head_dim(&self) -> usize {
        self.dim / self.n_heads
    }

    /// Width of the fused QKV projection: Q for every head, K and V for every KV head.
    pub fn qkv_dim(&self) -> usize {
        (self.n_heads + 2 * self.n_kv_heads) * self.head_dim()
    }

    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim()
    }

    /// Block applications (and so KV cache slots) for one sequence at `loops` iterations.
    pub fn applications(&self, loops: usize) -> usize {
        self.n_pre_blocks + self.n_loop_blocks * loops + self.n_post_blocks
    }

    pub fn validate(&self) -> Result<()> {
        let fail = |what: String| Err(Error::format(format!("config: {what}")));
        for (name, value) in [
            ("dim", self.dim),
            ("n_heads", self.n_heads),
            ("n_kv_heads", self.n_kv_heads),
            ("ffn_dim", self.ffn_dim),
            ("vocab_size", self.vocab_size),
            ("n_loop_blocks", self.n_loop_blocks),
            ("default_loops", self.default_loops),
            ("max_position", self.max_position),
        ] {
            if value == 0 {
                return fail(format!("{name} must be > 0"));
            }
        }
        if !self.dim.is_multiple_of(self.n_heads) {
            return fail(format!(
                "dim {} is not divisible by n_heads {}",
                self.dim, self.n_heads
            ));
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return fail(format!(
                "n_heads {} is not divisible by n_kv_heads {}",
                self.n_heads, self.n_kv_heads
            ));
        }
        if !self.head_dim().is_multiple_of(2) {
            return fail(format!(
                "head_dim {} must be even for RoPE",
                self.head_dim()
            ));
        }
        if self.vocab_size > i32::MAX as usize {
            return fail(format!("vocab_size {} exceeds i32", self.vocab_size));
        }
        if !(self.norm_eps > 0.0 && self.norm_eps.is_finite()) {
            return fail(format!("norm_eps {} must be positive", self.norm_eps));
        }
        if !(self.rope_theta > 0.0 && self.rope_theta.is_finite()) {
            return fail(format!("rope_theta {} must be positive", self.rope_theta));
        }
        Ok(())
    }
}
