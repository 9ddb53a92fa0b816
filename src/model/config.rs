//! Static architecture of a looped transformer, as stored in the `.tinyloop` header.

use serde::{Deserialize, Serialize};

use super::architecture::Architecture;
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
    /// The per-family choices (version 2); absent in version-1 files, which have the default.
    #[serde(default, skip_serializing_if = "Architecture::is_default")]
    pub architecture: Architecture,
}

/// The longest sequence (prompt + generated tokens) a model is opened for when the caller names
/// no `max_seq_len`, unless the model's `max_position` is shorter
/// ([`ModelConfig::default_max_seq_len`]).
pub const DEFAULT_MAX_SEQ_LEN: usize = 2048;

/// Upper bounds on config values (docs/FORMAT.md "Limits"). They lie far above any model this
/// runtime targets and keep every size derived from a config far below 2^63 (on 64-bit targets),
/// so that no product of header values overflows and nothing is built from an unchecked count.
pub mod limits {
    /// `dim`, `embed_factor_dim`.
    pub const MAX_DIM: usize = 1 << 16;
    pub const MAX_HEADS: usize = 1 << 12;
    pub const MAX_FFN_DIM: usize = 1 << 18;
    pub const MAX_VOCAB: usize = 1 << 24;
    /// `n_pre_blocks`, `n_loop_blocks`, `n_post_blocks` (each).
    pub const MAX_BLOCKS: usize = 1 << 10;
    pub const MAX_DEFAULT_LOOPS: usize = 1 << 10;
    pub const MAX_POSITION: usize = 1 << 24;
}

impl ModelConfig {
    /// `dim / n_heads`. This and the other derived sizes below are valid (and cannot overflow)
    /// once [`ModelConfig::validate`] has passed.
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
    /// Cannot overflow for `loops` up to a `max_loops` that [`ModelConfig::check_session`] accepted.
    pub fn applications(&self, loops: usize) -> usize {
        self.n_pre_blocks + self.n_loop_blocks * loops + self.n_post_blocks
    }

    /// Range checks of every field, then the relations between them.
    pub fn validate(&self) -> Result<()> {
        use limits::*;
        let fail = |what: String| Err(Error::format(format!("config: {what}")));
        for (name, value, min, max) in [
            ("dim", self.dim, 1, MAX_DIM),
            ("n_heads", self.n_heads, 1, MAX_HEADS),
            ("n_kv_heads", self.n_kv_heads, 1, MAX_HEADS),
            ("ffn_dim", self.ffn_dim, 1, MAX_FFN_DIM),
            ("vocab_size", self.vocab_size, 1, MAX_VOCAB),
            ("embed_factor_dim", self.embed_factor_dim, 0, MAX_DIM),
            ("n_pre_blocks", self.n_pre_blocks, 0, MAX_BLOCKS),
            ("n_loop_blocks", self.n_loop_blocks, 1, MAX_BLOCKS),
            ("n_post_blocks", self.n_post_blocks, 0, MAX_BLOCKS),
            ("default_loops", self.default_loops, 1, MAX_DEFAULT_LOOPS),
            ("max_position", self.max_position, 1, MAX_POSITION),
        ] {
            if value < min {
                return fail(format!("{name} must be > 0"));
            }
            if value > max {
                return fail(format!("{name} {value} exceeds the limit {max}"));
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
        // Norms add ε in f32, so it must be a positive f32 (a zero ε divides 0 by 0).
        let eps = self.norm_eps as f32;
        if !(eps > 0.0 && eps.is_finite()) {
            return fail(format!(
                "norm_eps {:e} must be positive and representable as f32",
                self.norm_eps
            ));
        }
        self.architecture
            .validate(self.n_post_blocks)
            .map_err(|e| Error::format(format!("config: architecture: {e}")))?;
        // Below 1 the RoPE frequencies θ^(−2i/head_dim) grow instead of shrinking, and at tiny θ
        // the angles overflow.
        if !(self.rope_theta >= 1.0 && self.rope_theta.is_finite()) {
            return fail(format!("rope_theta {:e} must be ≥ 1", self.rope_theta));
        }
        Ok(())
    }

    /// The `max_seq_len` of a model opened without one: [`DEFAULT_MAX_SEQ_LEN`], or
    /// `max_position` when that is smaller.
    pub fn default_max_seq_len(&self) -> usize {
        DEFAULT_MAX_SEQ_LEN.min(self.max_position)
    }

    /// Check the options a model is opened with against this (validated) config: sequences fit
    /// the model's positions, the default loop count is allowed, and every size a session derives
    /// from them (KV cache, step buffers, RoPE table) is computable without overflow.
    pub fn check_session(&self, max_seq_len: usize, max_loops: usize) -> Result<()> {
        if max_seq_len > self.max_position {
            return Err(Error::invalid(format!(
                "max_seq_len {max_seq_len} exceeds the model's max_position {}",
                self.max_position
            )));
        }
        if self.default_loops > max_loops {
            return Err(Error::invalid(format!(
                "the model's default_loops {} exceeds max_loops {max_loops}",
                self.default_loops
            )));
        }
        // Step buffers and the RoPE table multiply max_seq_len (≤ max_position) by widths within
        // the limits, far below 2^63. The KV cache also scales with max_loops, which the caller
        // chooses: K and V for every application at max_loops, at up to 8 bytes per value.
        let kv_bytes = self
            .n_loop_blocks
            .checked_mul(max_loops)
            .and_then(|n| n.checked_add(self.n_pre_blocks + self.n_post_blocks))
            .and_then(|slots| slots.checked_mul(max_seq_len))
            .and_then(|n| n.checked_mul(self.kv_dim()))
            .and_then(|n| n.checked_mul(2 * 8))
            .filter(|&bytes| bytes <= isize::MAX as usize);
        if kv_bytes.is_none() {
            return Err(Error::invalid(format!(
                "a KV cache for max_loops {max_loops} and max_seq_len {max_seq_len} would exceed \
                 the address space; lower max_loops"
            )));
        }
        Ok(())
    }
}
