//! The op set the forward pass needs. The forward pass (model/forward.rs) is written once over
//! this trait; `cpu` is the reference implementation, `cuda` the fast path.
//!
//! Numerics contract, shared by every backend (docs/NUMERICS.md specifies each operation):
//! * the residual stream, linear outputs, attention scores and logits are f32;
//! * linear inputs are f16: the outputs of norms, attention and SwiGLU are rounded to f16;
//! * linear weights are dequantized as `scale · q + zero` in f32 and accumulated in f32;
//! * K and V are cached as the KV mode says (f16, or quantized by `kv::codec` from f32 values)
//!   and Q is rounded to f16 before the dot products;
//! * RoPE uses the host-computed table of [`rope_table`].

pub mod cpu;
pub mod cuda;

use half::f16;

use crate::error::Result;
use crate::format::DType;
use crate::generate::sampling::{self, SamplingParams};
use crate::kv::{KvCache, KvSlot, TierBounds, TierMove};
use crate::model::architecture::BlockNorms;
use crate::model::config::NormKind;
use crate::model::quant::QuantizedMatrix;

/// A linear weight `[rows, cols]` as stored in the file (docs/FORMAT.md encodings), before upload.
#[derive(Clone, Copy, Debug)]
pub struct HostLinear<'a> {
    pub rows: usize,
    pub cols: usize,
    pub dtype: DType,
    /// Quantization group size (equal to `cols` for f16).
    pub group_size: usize,
    /// The tensor's bytes: f16 values, or codes + scales + zeros.
    pub bytes: &'a [u8],
}

impl HostLinear<'_> {
    pub fn to_quantized(&self) -> Result<QuantizedMatrix> {
        QuantizedMatrix::from_bytes(
            self.dtype,
            self.rows,
            self.cols,
            self.group_size,
            self.bytes,
        )
    }
}

/// A linear weight's bytes in host memory, in the file's encoding (a device copy brought back).
#[derive(Clone, Debug)]
pub struct OwnedLinear {
    pub rows: usize,
    pub cols: usize,
    pub dtype: DType,
    pub group_size: usize,
    pub bytes: Vec<u8>,
}

impl OwnedLinear {
    pub fn as_host(&self) -> HostLinear<'_> {
        HostLinear {
            rows: self.rows,
            cols: self.cols,
            dtype: self.dtype,
            group_size: self.group_size,
            bytes: &self.bytes,
        }
    }
}

/// Position-dependent inputs of one forward step: token ids, the position of the first row, and
/// how [`Backend::choose`] picks a token from this step's logits.
#[derive(Clone, Copy, Debug)]
pub struct StepInput<'a> {
    pub tokens: &'a [u32],
    pub start_pos: usize,
    pub choice: Choice,
}

/// Where the rows of a step over a KV pool ([`crate::kv::pool`]) sit: each row is one position of
/// its own sequence, whose entries live in the pool's pages.
#[derive(Clone, Copy, Debug)]
pub struct PooledRows<'a> {
    /// Positions per page.
    pub page_size: usize,
    pub rows: &'a [PooledRow<'a>],
}

/// One row of a pooled step: its position in its sequence, and the sequence's page table (the
/// entry of position t is at pool index `table[t / page_size] · page_size + t mod page_size`).
#[derive(Clone, Copy, Debug)]
pub struct PooledRow<'a> {
    pub position: usize,
    pub table: &'a [u32],
}

/// The pool index of position `t` of a sequence with page table `table`.
pub fn pool_index(table: &[u32], page_size: usize, t: usize) -> usize {
    table[t / page_size] as usize * page_size + t % page_size
}

/// How the next token is chosen from a row of logits.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum Choice {
    /// The largest logit (lowest index on ties).
    #[default]
    Greedy,
    /// [`sampling::sample`] with these parameters and this 53-bit uniform draw.
    Sample { params: SamplingParams, draw: u64 },
}

impl Choice {
    pub fn is_sample(&self) -> bool {
        matches!(self, Choice::Sample { .. })
    }
}

/// A token chosen from a row of logits and, when it was measured (BETA-MON), the entropy in bits
/// of that row's distribution.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Chosen {
    pub token: u32,
    pub entropy_bits: Option<f32>,
}

/// A norm layer as the ops take it.
#[derive(Clone, Copy, Debug)]
pub struct NormLayer<'a, V> {
    pub kind: NormKind,
    pub eps: f32,
    pub weight: &'a V,
    pub bias: Option<&'a V>,
}

/// A sandwich sublayer's output `delta` not yet added to the residual stream: the stream is
/// `x + norm(delta)` ([`BlockNorms::Sandwich`]) or `norm(x + delta)`
/// ([`BlockNorms::SandwichResidual`]), in f32.
pub struct Residual<'a, V, F> {
    pub norm: NormLayer<'a, V>,
    pub delta: &'a F,
    pub layout: BlockNorms,
}

/// A device and the kernels that run on it.
///
/// Buffer types own device memory. Every op enqueues work; only the `read_*` methods and
/// [`Backend::chosen_token`] wait for results. `rows` arguments never exceed the row capacity the
/// buffer was allocated with (the forward pass guarantees this).
pub trait Backend: Send + Sync + Sized + 'static {
    /// f32 rows (residual stream, linear outputs, logits).
    type Float: Send;
    /// f16 rows (inputs of linear layers).
    type Half: Send;
    /// An uploaded linear weight (f16, int4 or int2).
    type Linear: Send + Sync;
    /// An uploaded f16 parameter vector (norm weight or bias).
    type Vector: Send + Sync;
    /// Per-session position inputs (token ids, start position) on the device.
    type Step: Send;
    /// The bytes of a KV cache ([`KvLayout`]): slots, then the reconstruction scratch.
    type KvStorage: Send;

    fn describe(&self) -> String;

    fn upload_linear(&self, weight: &HostLinear) -> Result<Self::Linear>;
    fn upload_vector(&self, values: &[f16]) -> Result<Self::Vector>;

    fn alloc_float(&self, len: usize) -> Result<Self::Float>;
    fn alloc_half(&self, len: usize) -> Result<Self::Half>;
    fn alloc_step(&self, max_rows: usize) -> Result<Self::Step>;
    /// Zeroed KV storage of `bytes` bytes (a cache's [`KvLayout::bytes`], or a handle's slots).
    fn alloc_kv(&self, bytes: usize) -> Result<Self::KvStorage>;
    /// Copy `bytes` bytes between KV storages (growing a cache; prefix and resume handles), in
    /// stream order.
    fn copy_kv(
        &self,
        from: &Self::KvStorage,
        from_offset: usize,
        to: &mut Self::KvStorage,
        to_offset: usize,
        bytes: usize,
    ) -> Result<()>;

    /// Copy host `bytes` to `offset` of a KV storage, in stream order (the depth mask of
    /// [`crate::kv::Depths`], which attention reads from the storage it is kept in).
    fn kv_write(&self, storage: &mut Self::KvStorage, offset: usize, bytes: &[u8]) -> Result<()>;

    /// Copy `rows` rows of `width` values from row `from_row` of `from` to row `to_row` of `to`
    /// (saving and restoring residual streams).
    #[allow(clippy::too_many_arguments)]
    fn copy_rows(
        &self,
        from: &Self::Float,
        from_row: usize,
        to: &mut Self::Float,
        to_row: usize,
        rows: usize,
        width: usize,
    );

    /// Bytes of device memory a buffer or weight occupies (for `vram_usage_mb`).
    fn linear_bytes(&self, w: &Self::Linear) -> usize;
    /// The encoding of an uploaded weight.
    fn linear_dtype(&self, w: &Self::Linear) -> DType;

    /// A quantized weight re-quantized to `dtype` at the same group size, equal bit for bit to
    /// [`QuantizedMatrix::requantize`] (CTX-TIER's re-pack of the loop body), in stream order.
    fn requantize_linear(&self, w: &Self::Linear, dtype: DType) -> Result<Self::Linear>;
    /// A weight's bytes on the host, in the file's encoding (waits for the device).
    fn download_linear(&self, w: &Self::Linear) -> Result<OwnedLinear>;
    /// Prepare a linear weight of a transformer block as it is made (loaded, or for the loop
    /// body also re-packed or uploaded again): the CUDA backend with the FP16 body cache gives it
    /// its FP16 copy, and keeps a weight of the loop body (`looped`: every iteration reads it
    /// again) resident in its cache. Nothing by default.
    fn prepare_block_weight(&self, _w: &Self::Linear, _looped: bool) -> Result<()> {
        Ok(())
    }
    fn kv_bytes(&self, kv: &Self::KvStorage) -> usize;

    /// The rows of the call whose steps follow (a prompt that `prefill_chunk` or a tier change
    /// cuts into steps; 0: none); returns the value it replaces, set again when the call ends
    /// ([`crate::model::forward::CallRows`]). A backend whose kernels depend on a step's row
    /// count picks each of these steps' kernels as for one step of all the call's rows, so a
    /// row's results do not depend on where its call was cut. Nothing by default.
    fn set_call_rows(&self, _rows: usize) -> usize {
        0
    }

    /// Stage the token ids, start position and choice of the next step, and the KV cache's
    /// age-tier bounds for it.
    fn set_step(&self, step: &mut Self::Step, input: StepInput, tiers: TierBounds) -> Result<()>;

    /// Stage where the rows of the step just staged by [`Backend::set_step`] live in a KV pool
    /// (without this, row r is position `start_pos + r` of the cache's one sequence). Returns a
    /// key of what in the places changes the ops this backend issues for the step (the part of
    /// a captured graph's key that the places decide; 0 when nothing does). Backends that cannot
    /// address a pool refuse.
    fn set_places(&self, _step: &mut Self::Step, _places: PooledRows) -> Result<u64> {
        Err(crate::error::Error::invalid(format!(
            "{} does not run steps over a KV pool (continuous batching); use the CPU",
            self.describe()
        )))
    }

    /// `out[r] = table[token_r]` for the staged tokens, as f32.
    fn embed(&self, table: &Self::Linear, step: &Self::Step, out: &mut Self::Float);
    /// Same as [`Backend::embed`] into an f16 buffer (input of a factorized embedding projection).
    fn embed_half(&self, table: &Self::Linear, step: &Self::Step, out: &mut Self::Half);

    /// Normalize `rows` rows of `x` (width = weight length) and round to f16.
    fn norm(
        &self,
        norm: &NormLayer<Self::Vector>,
        x: &Self::Float,
        rows: usize,
        out: &mut Self::Half,
    );

    /// `x = norm(x)` for `rows` rows, in f32 (the loop norm).
    fn norm_state(&self, norm: &NormLayer<Self::Vector>, x: &mut Self::Float, rows: usize);

    /// Add a sandwich sublayer's pending output to `rows` rows of the stream `x`, in place.
    fn residual_norm(
        &self,
        residual: &Residual<Self::Vector, Self::Float>,
        rows: usize,
        x: &mut Self::Float,
    );

    /// [`Backend::residual_norm`] and then [`Backend::norm_state`] of the same rows: the loop norm
    /// of a stream whose last sublayer output is pending.
    fn residual_norm_state(
        &self,
        residual: &Residual<Self::Vector, Self::Float>,
        norm: &NormLayer<Self::Vector>,
        x: &mut Self::Float,
        rows: usize,
    ) {
        self.residual_norm(residual, rows, x);
        self.norm_state(norm, x, rows);
    }

    /// [`Backend::residual_norm`] out of place: `next` = the stream `x` with the output added.
    fn residual_norm_into(
        &self,
        residual: &Residual<Self::Vector, Self::Float>,
        x: &Self::Float,
        rows: usize,
        next: &mut Self::Float,
    );

    /// `x[r] += bias` for `rows` rows of width `bias.len()`.
    fn add_bias(&self, x: &mut Self::Float, rows: usize, bias: &Self::Vector);

    /// Copy byte ranges `(from, to, len)` of the cache's storage onto others of the same storage
    /// (non-overlapping; [`KvLayout::entry_copies`]).
    fn kv_copy_within(
        &self,
        kv: &mut KvCache<Self::KvStorage>,
        ranges: &[(usize, usize, usize)],
    ) -> Result<()>;

    /// `x[i] *= factor` for the first `len` values.
    fn scale(&self, x: &mut Self::Float, len: usize, factor: f32);

    /// `out[r] (+)= x[first_row + r] · wᵀ` for `r < rows`; accumulate adds into `out`.
    fn linear(
        &self,
        x: &Self::Half,
        first_row: usize,
        rows: usize,
        w: &Self::Linear,
        out: &mut Self::Float,
        accumulate: bool,
    );

    /// `out = f16(silu(x · gateᵀ) * (x · upᵀ))`; `gate_buf` / `up_buf` are f32 scratch.
    #[allow(clippy::too_many_arguments)]
    fn mlp_gate_up(
        &self,
        x: &Self::Half,
        rows: usize,
        gate: &Self::Linear,
        up: &Self::Linear,
        gate_buf: &mut Self::Float,
        up_buf: &mut Self::Float,
        out: &mut Self::Half,
    );

    /// `out = norm(x) · wᵀ` for `rows` rows. The default normalizes into `h` and calls
    /// [`Backend::linear`]; a backend may fuse the two, leaving `h` unspecified.
    fn norm_linear(
        &self,
        norm: &NormLayer<Self::Vector>,
        x: &Self::Float,
        rows: usize,
        w: &Self::Linear,
        h: &mut Self::Half,
        out: &mut Self::Float,
    ) {
        self.norm(norm, x, rows, h);
        self.linear(h, 0, rows, w, out, false);
    }

    /// [`Backend::mlp_gate_up`] of `norm(x)`. The default normalizes into `h`; a backend may
    /// fuse the norm into the product, leaving `h` unspecified.
    #[allow(clippy::too_many_arguments)]
    fn norm_mlp_gate_up(
        &self,
        norm: &NormLayer<Self::Vector>,
        x: &Self::Float,
        rows: usize,
        gate: &Self::Linear,
        up: &Self::Linear,
        h: &mut Self::Half,
        scratch: (&mut Self::Float, &mut Self::Float),
        out: &mut Self::Half,
    ) {
        self.norm(norm, x, rows, h);
        self.mlp_gate_up(h, rows, gate, up, scratch.0, scratch.1, out);
    }

    /// [`Backend::norm_linear`] of the stream `x` with a pending sublayer output added; the
    /// stream with it added is left in `next`. The default settles it first
    /// ([`Backend::residual_norm_into`]); a backend may fuse the three.
    #[allow(clippy::too_many_arguments)]
    fn residual_norm_linear(
        &self,
        residual: &Residual<Self::Vector, Self::Float>,
        x: &Self::Float,
        rows: usize,
        next: &mut Self::Float,
        norm: &NormLayer<Self::Vector>,
        w: &Self::Linear,
        h: &mut Self::Half,
        out: &mut Self::Float,
    ) {
        self.residual_norm_into(residual, x, rows, next);
        self.norm_linear(norm, next, rows, w, h, out);
    }

    /// [`Backend::norm_mlp_gate_up`] of the stream `x` with a pending sublayer output added; the
    /// stream with it added is left in `next`, as in [`Backend::residual_norm_linear`].
    #[allow(clippy::too_many_arguments)]
    fn residual_norm_mlp_gate_up(
        &self,
        residual: &Residual<Self::Vector, Self::Float>,
        x: &Self::Float,
        rows: usize,
        next: &mut Self::Float,
        norm: &NormLayer<Self::Vector>,
        gate: &Self::Linear,
        up: &Self::Linear,
        h: &mut Self::Half,
        scratch: (&mut Self::Float, &mut Self::Float),
        out: &mut Self::Half,
    ) {
        self.residual_norm_into(residual, x, rows, next);
        self.norm_mlp_gate_up(norm, next, rows, gate, up, h, scratch, out);
    }

    /// Rotate the Q (and, unless the mode caches h, K) parts of `qkv` for the `rows` staged
    /// rows at their positions, and store their entries in slot `at.own()` of the cache: K and V
    /// from `qkv`, or `h` (the normed attention input) in the h modes. Delta modes store the
    /// difference to the chain's earlier iterations.
    #[allow(clippy::too_many_arguments)]
    fn kv_store(
        &self,
        qkv: &mut Self::Float,
        h: &Self::Half,
        step: &Self::Step,
        rows: usize,
        rope: &Self::Float,
        kv: &mut KvCache<Self::KvStorage>,
        at: KvSlot,
    );

    /// Causal attention of the staged rows' (rotated) queries over positions `0..=pos` of the
    /// cache entries at `at`; output rounded to f16, `rows × n_heads·head_dim`. Positions the
    /// cache's depth mask ([`crate::kv::Depths::mask`]) says did not reach `at`'s iteration are
    /// left out. The h modes first recompute K and V of those positions with the K and V rows
    /// of `qkv_weight` (into the cache's scratch).
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        qkv: &Self::Float,
        step: &Self::Step,
        rows: usize,
        kv: &mut KvCache<Self::KvStorage>,
        at: KvSlot,
        qkv_weight: &Self::Linear,
        rope: &Self::Float,
        out: &mut Self::Half,
    );

    /// [`Backend::kv_store`], then [`Backend::attention`]; a backend may fuse the two (then
    /// `qkv` is left unspecified).
    #[allow(clippy::too_many_arguments)]
    fn rope_attention(
        &self,
        qkv: &mut Self::Float,
        h: &Self::Half,
        step: &Self::Step,
        rows: usize,
        rope: &Self::Float,
        kv: &mut KvCache<Self::KvStorage>,
        at: KvSlot,
        qkv_weight: &Self::Linear,
        out: &mut Self::Half,
    ) {
        self.kv_store(qkv, h, step, rows, rope, kv, at);
        self.attention(qkv, step, rows, kv, at, qkv_weight, rope, out);
    }

    /// Re-quantize the entries of positions `mv.first..mv.end` of every slot from tier `mv.from`
    /// to tier `mv.to` (AGE-KV), chains together so that deltas stay exact against the new
    /// encoding.
    fn kv_move(&self, kv: &mut KvCache<Self::KvStorage>, mv: &TierMove);

    /// Round the first `len` values to f16.
    fn to_half(&self, x: &Self::Float, len: usize, out: &mut Self::Half);

    /// Wait until the work issued so far has finished (before other streams read its results).
    fn synchronize(&self) -> Result<()>;

    /// Copy `out.len()` values starting at `offset` into `out` on the host (waits for the
    /// device).
    fn read_float_into(&self, x: &Self::Float, offset: usize, out: &mut [f32]) -> Result<()>;

    /// Copy `len` values starting at `offset` to the host (waits for the device).
    fn read_float(&self, x: &Self::Float, offset: usize, len: usize) -> Result<Vec<f32>> {
        let mut out = vec![0f32; len];
        self.read_float_into(x, offset, &mut out)?;
        Ok(out)
    }

    /// Upload host values into a float buffer (used for constant tables).
    fn write_float(&self, x: &mut Self::Float, values: &[f32]) -> Result<()>;

    /// Choose a token from the first `len` logits of `logits` as the last staged step's
    /// [`Choice`] says, into the step (so that it can be part of a captured graph); read it with
    /// [`Backend::chosen_token`].
    fn choose(&self, logits: &Self::Float, len: usize, step: &mut Self::Step);

    /// The token of the last [`Backend::choose`] (waits for the device).
    fn chosen_token(&self, step: &Self::Step) -> Result<u32>;

    /// The argmax of each of the first `rows` rows of `len` logits, into the step (at most the
    /// step's row capacity); read them with [`Backend::chosen_tokens`].
    fn argmax_rows(&self, logits: &Self::Float, rows: usize, len: usize, step: &mut Self::Step);

    /// The tokens of the last [`Backend::argmax_rows`] (waits for the device).
    fn chosen_tokens(&self, step: &Self::Step, rows: usize) -> Result<Vec<u32>>;

    /// The entropy in bits of softmax at temperature 1 of each of the first `rows` rows of `len`
    /// logits, into the step (at most `LOGIT_ROWS` rows; BETA-MON); read row 0 with
    /// [`Backend::chosen_measured`], all of them with [`Backend::entropies`].
    fn entropy_rows(&self, logits: &Self::Float, rows: usize, len: usize, step: &mut Self::Step);

    /// The token of the last [`Backend::choose`] and the entropy of row 0 of the last
    /// [`Backend::entropy_rows`], read together (waits for the device).
    fn chosen_measured(&self, step: &Self::Step) -> Result<(u32, f32)>;

    /// The entropies of the last [`Backend::entropy_rows`] (waits for the device).
    fn entropies(&self, step: &Self::Step, rows: usize) -> Result<Vec<f32>>;

    // Decode graphs (model/forward.rs `decode_step`). The defaults capture nothing, so a backend
    // without graphs runs the same ops eagerly.

    /// Launch the graph captured for `key` in this step's session; false when there is none
    /// (the caller then issues the ops itself).
    fn graph_replay(&self, _step: &mut Self::Step, _key: u64) -> Result<bool> {
        Ok(false)
    }

    /// Start capturing the ops that follow into a graph for `key`; false when this backend does
    /// not capture (the ops then run as they are issued).
    fn graph_begin(&self, _step: &mut Self::Step, _key: u64) -> Result<bool> {
        Ok(false)
    }

    /// Finish the capture begun by [`Backend::graph_begin`], keep the graph for `key`, and launch
    /// it once (captured work does not run while it is captured).
    fn graph_end(&self, _step: &mut Self::Step, _key: u64) -> Result<()> {
        Ok(())
    }

    /// Drop this step's graphs (a buffer they use was reallocated).
    fn graph_reset(&self, _step: &mut Self::Step) {}
}

/// The token `choice` picks from a row of logits on the host (the reference every backend's
/// [`Backend::choose`] matches).
pub fn choose_on_host(logits: &[f32], choice: &Choice) -> u32 {
    match choice {
        Choice::Greedy => sampling::argmax(logits),
        Choice::Sample { params, draw } => sampling::sample(logits, params, *draw),
    }
}

/// Head geometry that attention kernels need.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionShape {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

impl AttentionShape {
    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
    pub fn qkv_dim(&self) -> usize {
        self.q_dim() + 2 * self.kv_dim()
    }
}

/// RoPE table `[positions, head_dim / 2, 2]` of (cos, sin), computed in f64 and rounded to f32,
/// with frequency `theta^(-2i / head_dim)` for pair i. Pairs rotate (x[i], x[i + head_dim/2]).
/// The size comes from the caller's `max_seq_len`, so allocation failure is an error.
pub fn rope_table(positions: usize, head_dim: usize, theta: f64) -> Result<Vec<f32>> {
    let half = head_dim / 2;
    let what = format!("the RoPE table ({positions} positions x {half} pairs)");
    let len = positions
        .checked_mul(2 * half)
        .ok_or_else(|| crate::error::Error::invalid(format!("{what} exceeds the address space")))?;
    let mut table = crate::alloc::with_capacity(len, &what)?;
    let freqs: Vec<f64> = (0..half)
        .map(|i| theta.powf(-2.0 * i as f64 / head_dim as f64))
        .collect();
    for pos in 0..positions {
        for &freq in &freqs {
            let angle = pos as f64 * freq;
            table.push(angle.cos() as f32);
            table.push(angle.sin() as f32);
        }
    }
    Ok(table)
}
