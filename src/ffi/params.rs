//! Parameter and config structs of the C ABI, their defaults, and their conversion to the Rust
//! option types.

use std::ffi::c_char;

use super::bound::tl_prefix_cache;
use super::ctx_tier::{ctx_tier_arg, tl_ctx_tier_params};
use super::{c_str, tl_status, Failure, FfiResult, TL_LOOPS_DEFAULT};
use crate::generate::exit::check_threshold;
use crate::{
    BetaMonSummary, BetaMonitor, Device, Exit, ExitPolicy, ExitRule, GenerateParams, GenerateStats,
    KvMode, ModelOptions, SamplingParams, Speculation, StateInit, Tier, TrajectoryPoint,
};

/// Options for `tl_model_open`. Fill with `tl_model_default_params`, then change fields.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct tl_model_params {
    /// `sizeof(tl_model_params)`; set by `tl_model_default_params`. The size of this struct in
    /// an earlier version of this header is accepted too (the fields added since take their
    /// defaults); other smaller values are rejected (`TL_ERR_INVALID_ARGUMENT`); larger values
    /// are accepted and the extra bytes ignored.
    pub struct_size: usize,
    /// Upper bound on prompt + generated tokens of one sequence, at most the model's
    /// max_position. 0 (default) opens the model for 2048 tokens, or for max_position when that
    /// is smaller; `tl_model_config` reports the value in use.
    pub max_seq_len: u32,
    /// When > 0, step buffers hold this many rows, longer prompts are prefilled in chunks, and
    /// score calls accept at most this many tokens. 0 (default) sizes buffers to max_seq_len.
    pub prefill_chunk: u32,
    /// "auto", "cpu", "cuda" or "cuda:N"; NULL (default) uses the TINYLOOP_DEVICE environment
    /// variable, or "auto" when it is unset. Only read during `tl_model_open`.
    pub device: *const c_char,
    /// Largest loop count a call may ask for (bounds the KV cache). Must be > 0. Default 64.
    pub max_loops: u32,
    /// Print the library's lines on stderr: the load log, and the CTX-TIER and BETA-MON lines of
    /// calls that ask for them. false: the library writes nothing on stderr. Default true.
    pub log: bool,
    /// KV cache mode: "fp16", "fp16-h", "int8-h", "int4-h", "int8", "delta", "age" or
    /// "age:A:B" (docs/ABI.md "KV cache modes"). NULL (default) uses the environment
    /// (TINYLOOP_KV_INT8=1 → "int8", TINYLOOP_KV_DELTA=1 → "delta"), else "fp16". Only read
    /// during `tl_model_open`.
    pub kv_mode: *const c_char,
    /// FP16 body cache: 1 keeps an FP16 copy of the transformer blocks' quantized weights on the
    /// GPU for prefill GEMMs through cuBLAS (more memory; weights rounded to f16 on that path,
    /// docs/FORMAT.md "The FP16 body cache"), 0 does not, -1 (default) follows
    /// TINYLOOP_EXPERIMENTAL_FP16_BODY=1. No effect on the CPU. Other values are rejected.
    pub fp16_body: i32,
    /// How a model whose loop starts from a random state (Huginn) draws it: "model" (its own
    /// rule, from seed 0), "zeros" or "seed:N". NULL (default) is "model"; other models accept
    /// only "model". Only read during `tl_model_open`.
    pub state_init: *const c_char,
}

/// Options of one generation call. Fill with `tl_generate_default_params`, then change fields.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct tl_generate_params {
    /// `sizeof(tl_generate_params)`; set by `tl_generate_default_params`. The size of this
    /// struct in an earlier version of this header is accepted too (the fields added since take
    /// their defaults); other smaller values are rejected; larger values are accepted and the
    /// extra bytes ignored.
    pub struct_size: usize,
    /// Tokens to generate at most, >= 1 (fewer when the sequence reaches max_seq_len first).
    /// Default 128. The output buffer must hold this many.
    pub max_tokens: u32,
    /// Loop iterations, 1..=max_loops, or TL_LOOPS_DEFAULT (-1, the default) for the model's
    /// default_loops. 0 and other negative values are rejected.
    pub loops: i32,
    /// 0 (default) selects greedy decoding; otherwise a finite value > 0.
    pub temperature: f32,
    /// Keep only the k most likely tokens (and any tied with the k-th); 0 (default) keeps all.
    pub top_k: u32,
    /// Nucleus sampling threshold in (0, 1]: keep the fewest most likely tokens whose
    /// probability reaches it (ties at the cut kept); 1 (default) keeps all.
    pub top_p: f32,
    /// Seed of the sampler; the same seed and inputs give the same tokens, and the CPU and the
    /// GPU sample the same token from the same logits. Default 0.
    pub seed: u64,
    /// Generation ends when one of these tokens is produced; it is not returned. May be NULL
    /// when `n_stop_tokens` is 0. Only read during the call.
    pub stop_tokens: *const i32,
    /// Number of entries in `stop_tokens`. Default 0.
    pub n_stop_tokens: usize,
    /// Generate after the prefix held by this cache (from `tl_prefix_cache_new` on the same
    /// model, built at the same loops): the same tokens as generating from the prefix followed
    /// by the prompt. NULL (default): no prefix. Read by `tl_generate`, `tl_generate_stream`
    /// and their session forms; the other generation functions and `tl_score_exit` reject a
    /// non-NULL value.
    pub prefix_cache: *const tl_prefix_cache,
    /// CTX-TIER policy of the call (`tl_ctx_tier_params`, only read during the call). NULL
    /// (default): the `TINYLOOP_CTX_TIER*` environment's policy when the model was opened, or
    /// no tiers.
    pub ctx_tier: *const tl_ctx_tier_params,
    /// BETA-MON this call with the three thresholds below (docs/ABI.md "BETA-MON"): its summary
    /// is then in `tl_generate_stats`. false (default): the call is monitored only when the
    /// environment says so (TINYLOOP_BETA_MONITOR=1, with the TINYLOOP_BETA_MON_* thresholds).
    pub beta_monitor: bool,
    /// With `beta_monitor`: entropies below this many bits count in `beta_mon_low_rate`.
    /// Finite, >= 0 and <= `beta_mon_high_entropy_bits`. Default 0.5.
    pub beta_mon_low_entropy_bits: f64,
    /// With `beta_monitor`: entropies above this many bits count in `beta_mon_high_rate`.
    /// Finite and >= 0. Default 6.0.
    pub beta_mon_high_entropy_bits: f64,
    /// With `beta_monitor`, speculative calls: a draft/verify agreement below this share, in
    /// [0, 1], sets `beta_mon_agreement_below_floor`. Default 0.95.
    pub beta_mon_agreement_floor: f64,
    /// Adaptive exit with the model's exit gate at this cumulative exit probability, in [0, 1]
    /// (docs/ABI.md "Adaptive exit"); shorthand for `exit` "gate:T". Negative (default -1): no
    /// threshold. Read by `tl_generate`, `tl_generate_stream`, `tl_score_exit` and their
    /// session forms, and with the gate by `tl_generate_speculative` (policy "reference") and
    /// after a prefix cache.
    pub exit_threshold: f64,
    /// Adaptive exit rule: "gate" (the model's own threshold) or "gate:T", or one of Huginn's
    /// criteria "entropy-diff", "latent-diff", "cosine", "kl", "minp-kl" (each with an optional
    /// ":T") or "argmax-stability" / "argmax" (optional ":N") (docs/ABI.md "Adaptive exit").
    /// NULL (default): none. Setting both this and `exit_threshold` is rejected.
    pub exit: *const c_char,
    /// With an exit rule: "reference" (NULL, the default: as the model's own code computes;
    /// with the gate every iteration runs and the output is the exit iteration's, with a
    /// criterion a call stops at its exit and deeper iterations of later tokens leave it out) or
    /// "skip" (generated tokens, and with a criterion every call, stop at their exit iteration
    /// and copy its KV entries into the skipped slots; KV modes fp16, fp16-h, int8-h, int4-h and
    /// int8).
    pub exit_policy: *const c_char,
}

/// How `tl_generate_speculative` drafts. Fill with `tl_speculative_default_params`, then set
/// `draft_loops`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct tl_speculative_params {
    /// `sizeof(tl_speculative_params)`; set by `tl_speculative_default_params`. Smaller values
    /// are rejected; larger values are accepted and the extra bytes ignored.
    pub struct_size: usize,
    /// Loop iterations of the draft steps, 1..verify_loops-1 (the verify loops are
    /// `tl_generate_params.loops`). No default: 0, which is rejected, until set.
    pub draft_loops: u32,
    /// Tokens drafted per round, 1..=TL_MAX_DRAFT_LEN. Default 4.
    pub draft_len: u32,
    /// Verify from the draft's KV entries and hidden state (true, the default), or recompute
    /// every block application in the verify pass (false: the baseline without reuse). The
    /// tokens are the same either way.
    pub reuse: bool,
}

/// One loop iteration of the last position, as `tl_score_trajectory` reports it.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct tl_trajectory_point {
    /// L2 norm of the residual stream after the iteration.
    pub hidden_norm: f64,
    /// ||h_i - h_{i-1}|| / ||h_{i-1}|| (h_0: the stream entering the loop).
    pub rel_change: f64,
    /// KL(p_i || p_{i-1}) in nats between the next-token distributions read out after this
    /// iteration and the one before; 0 for the first.
    pub kl_prev: f64,
    /// Entropy of p_i in bits.
    pub entropy: f64,
    /// The most likely token of p_i.
    pub argmax: i32,
}

/// What the last successful generation call on a model's default session or a session did,
/// filled by `tl_last_generate_stats`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct tl_generate_stats {
    /// Set to `sizeof(tl_generate_stats)` by the caller before `tl_last_generate_stats`. Fields
    /// may be added at the end in later versions; the size of this struct in any earlier
    /// version of this header stays accepted (the library then writes only those fields).
    pub struct_size: usize,
    /// Tokens returned.
    pub tokens: usize,
    /// Milliseconds from the call's start to the first token (prefill, or restoring a handle).
    pub prefill_ms: f64,
    /// Milliseconds from the first token to the end.
    pub decode_ms: f64,
    /// Speculative calls: tokens drafted.
    pub drafted: usize,
    /// Speculative calls: drafted tokens the verify pass accepted.
    pub accepted: usize,
    /// `accepted / drafted` (0 without drafts).
    pub acceptance_rate: f64,
    /// The share of drafted positions where the draft's argmax equals the verify pass's (0
    /// without drafts).
    pub agreement: f64,
    /// CTX-TIER (all 0 when the call had no tier policy): steps observed, steps run at each
    /// tier, transitions, the last observed sequence length.
    pub ctx_tier_observations: usize,
    pub ctx_tier_short_steps: usize,
    pub ctx_tier_long_steps: usize,
    pub ctx_tier_transitions: usize,
    pub ctx_tier_last_seq_len: usize,
    /// Milliseconds from the first observation to the end of the call, and spent making loop
    /// bodies (re-pack to INT2, upload of INT4 again) at transitions.
    pub ctx_tier_elapsed_ms: f64,
    pub ctx_tier_apply_ms: f64,
    /// Net device bytes the call's transitions freed (negative: allocated).
    pub ctx_tier_freed_bytes: i64,
    /// The session's tier at the end of the call: 0 no policy, 1 SHORT, 2 LONG.
    pub ctx_tier_final: i32,
    /// The call was BETA-MONitored (docs/ABI.md "BETA-MON"); the `beta_mon_` fields are 0
    /// otherwise.
    pub beta_mon: bool,
    /// Returned tokens, each with the entropy of the distribution it was chosen from.
    pub beta_mon_n_tokens: usize,
    /// Mean, population standard deviation, min and max of those entropies, in bits (all 0
    /// when no token was returned).
    pub beta_mon_entropy_mean_bits: f64,
    pub beta_mon_entropy_std_bits: f64,
    pub beta_mon_entropy_min_bits: f64,
    pub beta_mon_entropy_max_bits: f64,
    /// Share of the tokens below `beta_mon_low_entropy_bits`, and above
    /// `beta_mon_high_entropy_bits`.
    pub beta_mon_low_rate: f64,
    pub beta_mon_high_rate: f64,
    /// The thresholds the call was monitored with.
    pub beta_mon_low_entropy_bits: f64,
    pub beta_mon_high_entropy_bits: f64,
    pub beta_mon_agreement_floor: f64,
    /// Speculative calls: `agreement` fell below `beta_mon_agreement_floor`.
    pub beta_mon_agreement_below_floor: bool,
    /// Calls with an exit rule: the tokens returned with an exit iteration (all of them), and the
    /// mean of those iterations (1-based; 0 without an exit rule).
    pub exit_tokens: usize,
    pub exit_mean_steps: f64,
}

/// Static architecture of a model, filled by `tl_model_config`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct tl_config {
    /// Set to `sizeof(tl_config)` by the caller before `tl_model_config`; smaller values
    /// are rejected. The library writes only the fields it knows.
    pub struct_size: usize,
    pub dim: u32,
    pub n_heads: u32,
    pub n_kv_heads: u32,
    pub ffn_dim: u32,
    pub vocab_size: u32,
    /// Rank of a factorized embedding; 0 means full rank.
    pub embed_factor_dim: u32,
    pub n_pre_blocks: u32,
    pub n_loop_blocks: u32,
    pub n_post_blocks: u32,
    pub default_loops: u32,
    /// "rmsnorm" or "layernorm" (static storage; never free).
    pub norm: *const c_char,
    pub norm_eps: f64,
    pub rope_theta: f64,
    pub max_position: u32,
    /// "untied" or "tied" (static storage; never free).
    pub head: *const c_char,
    /// The options the model was opened with (`max_seq_len` as resolved: never 0).
    pub max_seq_len: u32,
    pub prefill_chunk: u32,
    pub max_loops: u32,
}

pub(crate) fn saturate(v: usize) -> u32 {
    u32::try_from(v).unwrap_or(u32::MAX)
}

fn default_model_params() -> tl_model_params {
    let d = ModelOptions::default();
    tl_model_params {
        struct_size: std::mem::size_of::<tl_model_params>(),
        max_seq_len: saturate(d.max_seq_len),
        prefill_chunk: saturate(d.prefill_chunk),
        device: std::ptr::null(),
        max_loops: saturate(d.max_loops),
        log: d.log,
        kv_mode: std::ptr::null(),
        fp16_body: -1,
        state_init: std::ptr::null(),
    }
}

fn default_generate_params() -> tl_generate_params {
    let d = GenerateParams::default();
    let beta = BetaMonitor::default();
    tl_generate_params {
        struct_size: std::mem::size_of::<tl_generate_params>(),
        max_tokens: saturate(d.max_tokens),
        loops: TL_LOOPS_DEFAULT,
        temperature: d.sampling.temperature,
        top_k: saturate(d.sampling.top_k),
        top_p: d.sampling.top_p,
        seed: d.sampling.seed,
        stop_tokens: std::ptr::null(),
        n_stop_tokens: 0,
        prefix_cache: std::ptr::null(),
        ctx_tier: std::ptr::null(),
        beta_monitor: false,
        beta_mon_low_entropy_bits: beta.low_entropy_bits,
        beta_mon_high_entropy_bits: beta.high_entropy_bits,
        beta_mon_agreement_floor: beta.agreement_floor,
        exit_threshold: -1.0,
        exit: std::ptr::null(),
        exit_policy: std::ptr::null(),
    }
}

fn default_speculative_params() -> tl_speculative_params {
    tl_speculative_params {
        struct_size: std::mem::size_of::<tl_speculative_params>(),
        draft_loops: 0,
        draft_len: 4,
        reuse: true,
    }
}

fn check_size(found: usize, needed: usize, what: &str) -> FfiResult {
    if found < needed {
        return Err(Failure::invalid(format!(
            "{what}.struct_size is {found}, need at least {needed}: initialize it with \
             {what}'s default_params function"
        )));
    }
    Ok(())
}

/// A params struct from the caller: this version's struct, or one of an earlier version of the
/// header (its `struct_size` one of `earlier`), whose missing fields take their defaults.
///
/// # Safety
/// `params` must be non-NULL and valid for reads of its `struct_size` bytes; `T` must start
/// with the `usize` `struct_size`.
pub(crate) unsafe fn read_versioned<T: Copy>(
    params: *const T,
    defaults: T,
    earlier: &[usize],
    what: &str,
) -> FfiResult<T> {
    // SAFETY: struct_size is the first field of every version; the caller's contract.
    let size = unsafe { (params as *const usize).read() };
    let ours = std::mem::size_of::<T>();
    if size < ours && !earlier.contains(&size) {
        check_size(size, ours, what)?;
    }
    let mut out = defaults;
    // SAFETY: `size.min(ours)` bytes are readable at `params` (caller's contract) and writable in
    // `out`; every earlier size ends at a field boundary, so no field is copied in part.
    unsafe {
        std::ptr::copy_nonoverlapping(
            params as *const u8,
            &mut out as *mut T as *mut u8,
            size.min(ours),
        )
    };
    Ok(out)
}

/// A loop count argument: TL_LOOPS_DEFAULT means the model default; 0 and other negative values
/// are passed on or rejected so that the message names the valid range.
pub(crate) fn loops_arg(loops: i32) -> FfiResult<Option<usize>> {
    match loops {
        TL_LOOPS_DEFAULT => Ok(None),
        l if l < 0 => Err(Failure::invalid(format!(
            "loops must be >= 1 or TL_LOOPS_DEFAULT (-1), got {l}"
        ))),
        l => Ok(Some(l as usize)),
    }
}

/// Token ids from C: non-negative `int32_t`. An empty sequence is returned as empty (the
/// engine rejects it where it matters).
///
/// # Safety
/// `ptr` must be NULL or valid for reads of `n` values.
pub(crate) unsafe fn tokens_arg(ptr: *const i32, n: usize, what: &str) -> FfiResult<Vec<u32>> {
    if n == 0 {
        return Ok(Vec::new());
    }
    if ptr.is_null() {
        return Err(Failure::invalid(format!("{what} is NULL")));
    }
    // No allocation holds more bytes than isize::MAX: such an `n` is not a length at all.
    if n > isize::MAX as usize / std::mem::size_of::<i32>() {
        return Err(Failure::invalid(format!(
            "{what}: a length of {n} values exceeds the address space"
        )));
    }
    // SAFETY: non-NULL and valid for n reads by the caller's contract; n is a possible length.
    let raw = unsafe { std::slice::from_raw_parts(ptr, n) };
    raw.iter()
        .enumerate()
        .map(|(i, &t)| {
            u32::try_from(t).map_err(|_| Failure::invalid(format!("{what}[{i}] is negative ({t})")))
        })
        .collect()
}

/// The prompt of a call: non-empty, non-negative.
///
/// # Safety
/// As [`tokens_arg`].
pub(crate) unsafe fn prompt_arg(ptr: *const i32, n: usize) -> FfiResult<Vec<u32>> {
    if n == 0 {
        return Err(Failure::invalid("empty token sequence (n_tokens is 0)"));
    }
    // SAFETY: forwarded contract.
    unsafe { tokens_arg(ptr, n, "tokens") }
}

/// Convert model params (NULL = defaults) to [`ModelOptions`].
///
/// # Safety
/// `params` must be NULL or point to a `tl_model_params` of at least its `struct_size` bytes
/// whose `device`, `kv_mode` and `state_init` are NULL or NUL-terminated strings.
pub(crate) unsafe fn model_options(params: *const tl_model_params) -> FfiResult<ModelOptions> {
    let p = if params.is_null() {
        default_model_params()
    } else {
        // SAFETY: non-NULL; the caller's contract covers its struct_size bytes. Version 1 of the
        // header ended before `kv_mode`, version 2 before `fp16_body`, version 3 before
        // `state_init`.
        let sizes = [
            std::mem::offset_of!(tl_model_params, kv_mode),
            std::mem::offset_of!(tl_model_params, fp16_body),
            std::mem::offset_of!(tl_model_params, state_init),
        ];
        unsafe { read_versioned(params, default_model_params(), &sizes, "tl_model_params") }?
    };
    let fp16_body = match p.fp16_body {
        -1 => None,
        0 => Some(false),
        1 => Some(true),
        v => {
            return Err(Failure::invalid(format!(
                "tl_model_params.fp16_body must be -1 (environment), 0 or 1, got {v}"
            )))
        }
    };
    let device = if p.device.is_null() {
        None
    } else {
        // SAFETY: non-NULL and NUL-terminated by the caller's contract.
        let name = unsafe { c_str(p.device, "tl_model_params.device") }?;
        Some(name.parse::<Device>()?)
    };
    let kv_mode = if p.kv_mode.is_null() {
        None
    } else {
        // SAFETY: non-NULL and NUL-terminated by the caller's contract.
        let name = unsafe { c_str(p.kv_mode, "tl_model_params.kv_mode") }?;
        Some(name.parse::<KvMode>()?)
    };
    let state_init = if p.state_init.is_null() {
        StateInit::Model
    } else {
        // SAFETY: non-NULL and NUL-terminated by the caller's contract.
        let name = unsafe { c_str(p.state_init, "tl_model_params.state_init") }?;
        name.parse::<StateInit>()?
    };
    Ok(ModelOptions {
        max_seq_len: p.max_seq_len as usize,
        prefill_chunk: p.prefill_chunk as usize,
        device,
        max_loops: p.max_loops as usize,
        kv_mode,
        log: p.log,
        fp16_body,
        state_init,
    })
}

/// Convert generate params (NULL = defaults) to [`GenerateParams`] and the prefix cache handle
/// they name (NULL for none; resolved by the caller).
///
/// # Safety
/// `params` must be NULL or point to a `tl_generate_params` of at least its `struct_size`
/// bytes, whose `stop_tokens` is valid for `n_stop_tokens` reads.
pub(crate) unsafe fn generate_params(
    params: *const tl_generate_params,
) -> FfiResult<(GenerateParams, *const tl_prefix_cache)> {
    // SAFETY: the caller's contract, forwarded.
    let p = unsafe { read_generate_params(params) }?;
    // SAFETY: the caller's contract covers stop_tokens / n_stop_tokens.
    let stop_tokens = unsafe {
        tokens_arg(
            p.stop_tokens,
            p.n_stop_tokens,
            "tl_generate_params.stop_tokens",
        )
    }?;
    // Checked here, before any output buffer is sized from it.
    if p.max_tokens == 0 {
        return Err(Failure::invalid("max_tokens must be >= 1"));
    }
    let params = GenerateParams {
        max_tokens: p.max_tokens as usize,
        loops: loops_arg(p.loops)?,
        sampling: SamplingParams {
            temperature: p.temperature,
            top_k: p.top_k as usize,
            top_p: p.top_p,
            seed: p.seed,
        },
        stop_tokens,
        // SAFETY: the caller's contract covers the policy it points to.
        ctx_tier: unsafe { ctx_tier_arg(p.ctx_tier) }?,
        // Validated by the call, which names the field.
        beta_monitor: p.beta_monitor.then_some(BetaMonitor {
            low_entropy_bits: p.beta_mon_low_entropy_bits,
            high_entropy_bits: p.beta_mon_high_entropy_bits,
            agreement_floor: p.beta_mon_agreement_floor,
        }),
        // SAFETY: the caller's contract covers the two strings.
        exit: unsafe { exit_arg(p.exit_threshold, p.exit, p.exit_policy) }?,
    };
    Ok((params, p.prefix_cache))
}

/// A caller's `tl_generate_params` (NULL = defaults), of this header's version or an earlier one.
///
/// # Safety
/// `params` must be NULL or point to a `tl_generate_params` of at least its `struct_size` bytes.
unsafe fn read_generate_params(params: *const tl_generate_params) -> FfiResult<tl_generate_params> {
    if params.is_null() {
        return Ok(default_generate_params());
    }
    // Version 1 of the header ended before `prefix_cache`, version 2 before `ctx_tier`, version
    // 3 before `exit_threshold`.
    let sizes = [
        std::mem::offset_of!(tl_generate_params, prefix_cache),
        std::mem::offset_of!(tl_generate_params, ctx_tier),
        std::mem::offset_of!(tl_generate_params, exit_threshold),
    ];
    // SAFETY: non-NULL; the caller's contract covers its struct_size bytes.
    unsafe {
        read_versioned(
            params,
            default_generate_params(),
            &sizes,
            "tl_generate_params",
        )
    }
}

/// The loops and the exit rule of a score call with an exit (`tl_score_exit`), which requires
/// a rule and takes no prefix cache; the other fields are not read.
///
/// # Safety
/// `params` must be NULL or point to a `tl_generate_params` of at least its `struct_size`
/// bytes, whose `exit` and `exit_policy` are NULL or NUL-terminated strings.
pub(crate) unsafe fn score_exit_params(
    params: *const tl_generate_params,
) -> FfiResult<(Option<usize>, Exit)> {
    if params.is_null() {
        return Err(Failure::invalid(
            "params is NULL, so there is no exit rule: set exit_threshold or exit",
        ));
    }
    // SAFETY: the caller's contract, forwarded.
    let p = unsafe { read_generate_params(params) }?;
    if !p.prefix_cache.is_null() {
        return Err(Failure::invalid(
            "tl_generate_params.prefix_cache is set: score calls take no prefix cache",
        ));
    }
    // SAFETY: the caller's contract covers the two strings.
    let exit = unsafe { exit_arg(p.exit_threshold, p.exit, p.exit_policy) }?.ok_or_else(|| {
        Failure::invalid("tl_generate_params has no exit rule: set exit_threshold or exit")
    })?;
    Ok((loops_arg(p.loops)?, exit))
}

/// The exit rule of `tl_generate_params`: a threshold or a rule string (not both), and a policy.
///
/// # Safety
/// `rule` and `policy` must be NULL or NUL-terminated strings.
pub(crate) unsafe fn exit_arg(
    threshold: f64,
    rule: *const c_char,
    policy: *const c_char,
) -> FfiResult<Option<Exit>> {
    let rule = match (threshold < 0.0, rule.is_null()) {
        (true, true) => None,
        (false, true) => {
            check_threshold(threshold)?;
            Some(ExitRule::Gate {
                threshold: Some(threshold),
            })
        }
        // SAFETY: non-NULL and NUL-terminated by the caller's contract.
        (true, false) => Some(unsafe { c_str(rule, "tl_generate_params.exit") }?.parse()?),
        (false, false) => {
            return Err(Failure::invalid(
                "tl_generate_params: set exit_threshold or exit, not both",
            ))
        }
    };
    let policy = if policy.is_null() {
        ExitPolicy::Reference
    } else {
        // SAFETY: non-NULL and NUL-terminated by the caller's contract.
        unsafe { c_str(policy, "tl_generate_params.exit_policy") }?.parse()?
    };
    match rule {
        Some(rule) => Ok(Some(Exit { rule, policy })),
        None if policy == ExitPolicy::Reference => Ok(None),
        None => Err(Failure::invalid(
            "tl_generate_params.exit_policy is set without an exit rule",
        )),
    }
}

/// Convert speculative params (NULL = defaults) to a [`Speculation`]; the engine checks the
/// values against the verify loops.
///
/// # Safety
/// `params` must be NULL or point to a `tl_speculative_params` of at least its `struct_size`
/// bytes.
pub(crate) unsafe fn speculation(params: *const tl_speculative_params) -> FfiResult<Speculation> {
    let p = if params.is_null() {
        default_speculative_params()
    } else {
        // SAFETY: non-NULL; the caller's contract covers its struct_size bytes.
        unsafe {
            read_versioned(
                params,
                default_speculative_params(),
                &[],
                "tl_speculative_params",
            )
        }?
    };
    Ok(Speculation {
        draft_loops: p.draft_loops as usize,
        draft_len: p.draft_len as usize,
        reuse: p.reuse,
    })
}

impl From<&TrajectoryPoint> for tl_trajectory_point {
    fn from(p: &TrajectoryPoint) -> Self {
        tl_trajectory_point {
            hidden_norm: p.hidden_norm,
            rel_change: p.rel_change,
            kl_prev: p.kl_prev,
            entropy: p.entropy,
            // Tokens are < vocab_size <= i32::MAX (checked at load).
            argmax: p.argmax as i32,
        }
    }
}

impl tl_generate_stats {
    pub(crate) fn new(s: &GenerateStats) -> Self {
        let t = s.ctx_tier.unwrap_or_default();
        tl_generate_stats {
            struct_size: std::mem::size_of::<tl_generate_stats>(),
            tokens: s.tokens,
            prefill_ms: s.prefill_ms,
            decode_ms: s.decode_ms,
            drafted: s.drafted,
            accepted: s.accepted,
            acceptance_rate: s.acceptance_rate(),
            agreement: s.agreement(),
            ctx_tier_observations: t.observations,
            ctx_tier_short_steps: t.short_steps,
            ctx_tier_long_steps: t.long_steps,
            ctx_tier_transitions: t.transitions,
            ctx_tier_last_seq_len: t.last_seq_len,
            ctx_tier_elapsed_ms: t.elapsed_ms,
            ctx_tier_apply_ms: t.apply_ms,
            ctx_tier_freed_bytes: t.freed_bytes,
            ctx_tier_final: match s.ctx_tier.map(|t| t.tier) {
                None => 0,
                Some(Tier::Short) => 1,
                Some(Tier::Long) => 2,
            },
            exit_tokens: s.exit_steps.len(),
            exit_mean_steps: s.mean_exit_steps(),
            ..Self::beta_mon(s.beta_mon.as_ref())
        }
    }

    /// The `beta_mon` fields (the others zero).
    fn beta_mon(summary: Option<&BetaMonSummary>) -> Self {
        let zero = tl_generate_stats::default();
        let Some(b) = summary else {
            return zero;
        };
        tl_generate_stats {
            beta_mon: true,
            beta_mon_n_tokens: b.n_tokens,
            beta_mon_entropy_mean_bits: b.entropy_mean_bits,
            beta_mon_entropy_std_bits: b.entropy_std_bits,
            beta_mon_entropy_min_bits: b.entropy_min_bits,
            beta_mon_entropy_max_bits: b.entropy_max_bits,
            beta_mon_low_rate: b.low_rate,
            beta_mon_high_rate: b.high_rate,
            beta_mon_low_entropy_bits: b.thresholds.low_entropy_bits,
            beta_mon_high_entropy_bits: b.thresholds.high_entropy_bits,
            beta_mon_agreement_floor: b.thresholds.agreement_floor,
            beta_mon_agreement_below_floor: b.agreement_below_floor(),
            ..zero
        }
    }

    /// Sizes of earlier versions of this struct: version 1 ended before the CTX-TIER fields,
    /// version 2 before the exit fields.
    pub(crate) fn earlier_sizes() -> [usize; 2] {
        [
            std::mem::offset_of!(tl_generate_stats, ctx_tier_observations),
            std::mem::offset_of!(tl_generate_stats, exit_tokens),
        ]
    }
}

/// Write an out-struct whose caller set its `struct_size`: this version's size or larger (the
/// extra bytes untouched), or the size of an earlier version (only that version's fields are
/// written); `struct_size` itself is left as the caller set it.
///
/// # Safety
/// `out` must be non-NULL and valid for reads of its first field and writes of its
/// `struct_size` bytes; `T` must start with the `usize` `struct_size`.
pub(crate) unsafe fn write_versioned<T: Copy>(
    out: *mut T,
    value: T,
    earlier: &[usize],
    what: &str,
) -> FfiResult {
    // SAFETY: struct_size is the first field of every version; the caller's contract.
    let size = unsafe { (out as *const usize).read() };
    let ours = std::mem::size_of::<T>();
    if size < ours && !earlier.contains(&size) {
        check_size(size, ours, what)?;
    }
    let skip = std::mem::size_of::<usize>();
    // SAFETY: `size.min(ours)` bytes are writable at `out` (the caller's contract) and readable
    // in `value`; every earlier size ends at a field boundary, so no field is written in part.
    unsafe {
        std::ptr::copy_nonoverlapping(
            (&value as *const T as *const u8).add(skip),
            (out as *mut u8).add(skip),
            size.min(ours) - skip,
        )
    };
    Ok(())
}

/// Fill `*params` with the defaults of this library version (including `struct_size`).
///
/// Ownership: the caller owns `*params`; `device` is set to NULL. Threads: any thread.
///
/// # Safety
/// `params` must be NULL or valid for a write of `tl_model_params`.
#[no_mangle]
pub unsafe extern "C" fn tl_model_default_params(params: *mut tl_model_params) -> tl_status {
    super::boundary("tl_model_default_params", || {
        super::non_null(params, "params")?;
        // SAFETY: non-NULL and writable by the caller's contract.
        unsafe { super::write_out(params, default_model_params()) };
        Ok(())
    })
}

/// Fill `*params` with the defaults of this library version (including `struct_size`): greedy,
/// max_tokens 128, loops TL_LOOPS_DEFAULT, no stop tokens, no prefix cache.
///
/// Ownership: the caller owns `*params` and the stop-token array it may point to later.
/// Threads: any thread.
///
/// # Safety
/// `params` must be NULL or valid for a write of `tl_generate_params`.
#[no_mangle]
pub unsafe extern "C" fn tl_generate_default_params(params: *mut tl_generate_params) -> tl_status {
    super::boundary("tl_generate_default_params", || {
        super::non_null(params, "params")?;
        // SAFETY: non-NULL and writable by the caller's contract.
        unsafe { super::write_out(params, default_generate_params()) };
        Ok(())
    })
}

/// Fill `*params` with the defaults of this library version (including `struct_size`):
/// draft_len 4, reuse true, and draft_loops 0, which the caller must set.
///
/// Ownership: the caller owns `*params`. Threads: any thread.
///
/// # Safety
/// `params` must be NULL or valid for a write of `tl_speculative_params`.
#[no_mangle]
pub unsafe extern "C" fn tl_speculative_default_params(
    params: *mut tl_speculative_params,
) -> tl_status {
    super::boundary("tl_speculative_default_params", || {
        super::non_null(params, "params")?;
        // SAFETY: non-NULL and writable by the caller's contract.
        unsafe { super::write_out(params, default_speculative_params()) };
        Ok(())
    })
}

/// Check an output buffer `(out, cap, len)` against the length a call needs, before any work.
/// When it is too small, `*len = required` and the call fails with `TL_ERR_BUFFER_TOO_SMALL`
/// (`out` may then be NULL: a size query).
///
/// # Safety
/// `len` must be NULL or valid for a write.
pub(crate) unsafe fn check_buffer<T>(
    out: *mut T,
    cap: usize,
    len: *mut usize,
    required: usize,
) -> FfiResult {
    super::non_null(len, "len")?;
    if cap < required {
        // SAFETY: non-NULL and writable by the caller's contract.
        unsafe { super::write_out(len, required) };
        return Err(Failure::new(
            tl_status::TL_ERR_BUFFER_TOO_SMALL,
            format!("out holds {cap} elements, the call needs {required} (written to *len)"),
        ));
    }
    super::non_null(out, "out")
}

/// Copy `data` to a buffer already checked by [`check_buffer`] and set `*len`.
///
/// # Safety
/// `out` must be valid for `data.len()` writes and `len` for one write.
pub(crate) unsafe fn write_buffer<T: Copy>(out: *mut T, data: &[T], len: *mut usize) {
    // SAFETY: checked non-NULL with capacity >= data.len() by check_buffer; caller's contract.
    unsafe {
        std::ptr::copy_nonoverlapping(data.as_ptr(), out, data.len());
        super::write_out(len, data.len());
    }
}
