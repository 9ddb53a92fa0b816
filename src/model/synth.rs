//! Deterministic random-weight models for tests and benchmarks (`tinyloop synth`).

use half::f16;
use rayon::prelude::*;

use super::architecture::{Architecture, BlockNorms, LoopInput, LoopNorm, LoopState};
use super::config::{HeadKind, ModelConfig, NormKind};
use super::layout::{expected_tensors, TensorRole};
use super::quant::{group_size_for, quantize_rtn, LinearData};
use crate::error::{Error, Result};
use crate::format::{DType, FileWriter};
use crate::generate::sampling::Rng;

/// Names accepted by [`preset`].
pub const PRESETS: [&str; 10] = [
    "tiny",
    "small",
    "tl-407m",
    "tiny-gqa",
    "tiny-tied",
    "tiny-sandwich",
    "tiny-recurrent",
    "ouro-1.4b",
    "ouro-1.4b-own",
    "huginn-3.5b",
];

/// The architecture of a named preset.
///
/// * `tiny`: byte vocab, D 64, 4 heads, F 256, 2 pre + 1 loop, L 4, 2048 positions (as all the
///   presets below but `tl-407m`).
/// * `small`: byte vocab, D 512, 8 heads, F 2048, 2 pre + 1 loop, L 4.
/// * `tl-407m`: D 2048, 16 heads, F 8192, vocab 50304, 2 pre + 1 loop, L 8, 32768 positions.
/// * `tiny-gqa`: GQA (4 heads, 2 KV heads), LayerNorm, factorized embedding with tied head,
///   1 pre + 2 loop + 1 post blocks, L 3.
/// * `tiny-tied`: no pre blocks, tied full-rank head, L 2.
/// * `tiny-sandwich`: Ouro's architecture (sandwich norms, the final norm after every iteration
///   feeding the next, an exit gate), no pre blocks, 2 loop blocks, L 4.
/// * `tiny-recurrent`: Huginn's architecture (norms after the residual add, a QKV bias, a scaled
///   embedding, a loop adapter over a random initial state, the final norm after the loop),
///   2 pre + 2 loop + 2 post blocks, tied head, L 4.
/// * `ouro-1.4b`: Ouro-1.4B's shape: D 2048, 16 heads, F 5632, vocab 49152, 24 loop blocks, L 4.
/// * `ouro-1.4b-own`: the same shape in TinyLoop's own architecture (pre-norm blocks), the
///   baseline that shows what Ouro's block structure costs.
/// * `huginn-3.5b`: Huginn-0125's shape: D 5280, 55 heads, F 17920, vocab 65536, 2 pre + 4 loop
///   + 2 post blocks, L 32.
pub fn preset(name: &str) -> Result<ModelConfig> {
    let base = ModelConfig {
        dim: 64,
        n_heads: 4,
        n_kv_heads: 4,
        ffn_dim: 256,
        vocab_size: 256,
        embed_factor_dim: 0,
        n_pre_blocks: 2,
        n_loop_blocks: 1,
        n_post_blocks: 0,
        default_loops: 4,
        norm: NormKind::RmsNorm,
        norm_eps: 1e-5,
        rope_theta: 10000.0,
        max_position: 2048,
        head: HeadKind::Untied,
        architecture: Default::default(),
    };
    Ok(match name {
        "tiny" => base,
        "small" => ModelConfig {
            dim: 512,
            n_heads: 8,
            n_kv_heads: 8,
            ffn_dim: 2048,
            ..base
        },
        "tl-407m" => ModelConfig {
            dim: 2048,
            n_heads: 16,
            n_kv_heads: 16,
            ffn_dim: 8192,
            vocab_size: 50304,
            default_loops: 8,
            max_position: 32768,
            ..base
        },
        "tiny-gqa" => ModelConfig {
            n_kv_heads: 2,
            ffn_dim: 128,
            embed_factor_dim: 32,
            n_pre_blocks: 1,
            n_loop_blocks: 2,
            n_post_blocks: 1,
            default_loops: 3,
            norm: NormKind::LayerNorm,
            head: HeadKind::Tied,
            ..base
        },
        "tiny-tied" => ModelConfig {
            n_pre_blocks: 0,
            default_loops: 2,
            head: HeadKind::Tied,
            ..base
        },
        "tiny-sandwich" => ModelConfig {
            ffn_dim: 128,
            n_kv_heads: 2,
            n_pre_blocks: 0,
            n_loop_blocks: 2,
            architecture: ouro_architecture(),
            ..base
        },
        "tiny-recurrent" => ModelConfig {
            ffn_dim: 128,
            n_loop_blocks: 2,
            n_post_blocks: 2,
            head: HeadKind::Tied,
            architecture: huginn_architecture(64),
            ..base
        },
        "ouro-1.4b" => ModelConfig {
            dim: 2048,
            n_heads: 16,
            n_kv_heads: 16,
            ffn_dim: 5632,
            vocab_size: 49152,
            n_pre_blocks: 0,
            n_loop_blocks: 24,
            norm_eps: 1e-6,
            rope_theta: 1e6,
            max_position: 65536,
            architecture: ouro_architecture(),
            ..base
        },
        "ouro-1.4b-own" => ModelConfig {
            architecture: Architecture::default(),
            ..preset("ouro-1.4b")?
        },
        "huginn-3.5b" => ModelConfig {
            dim: 5280,
            n_heads: 55,
            n_kv_heads: 55,
            ffn_dim: 17920,
            vocab_size: 65536,
            n_loop_blocks: 4,
            n_post_blocks: 2,
            default_loops: 32,
            norm_eps: 1e-6,
            rope_theta: 50000.0,
            max_position: 4096,
            head: HeadKind::Tied,
            architecture: huginn_architecture(5280),
            ..base
        },
        other => {
            return Err(Error::invalid(format!(
                "unknown preset {other:?} (known: {})",
                PRESETS.join(", ")
            )))
        }
    })
}

/// Ouro's choices: sandwich norms, the final norm after every iteration (no second one before
/// the head), an exit gate.
fn ouro_architecture() -> Architecture {
    Architecture {
        block_norms: BlockNorms::Sandwich,
        loop_norm: LoopNorm::EachIteration,
        head_norm: false,
        exit_gate: true,
        ..Architecture::default()
    }
}

/// Huginn's choices for model width `dim`: norms after the residual add, a QKV bias, the
/// embedding scaled by √dim, an adapter over a random initial state of standard deviation
/// √(2 / 5·dim) · √dim, the final norm after the loop and again before the head.
fn huginn_architecture(dim: usize) -> Architecture {
    let d = dim as f64;
    Architecture {
        block_norms: BlockNorms::SandwichResidual,
        qkv_bias: true,
        embed_scale: d.sqrt(),
        loop_input: LoopInput::Adapter,
        loop_state: LoopState::Random,
        state_std: (2.0 / (5.0 * d)).sqrt() * d.sqrt(),
        loop_norm: LoopNorm::AfterLoop,
        ..Architecture::default()
    }
}

/// Random weights for `config`: block linears stored at `bits` (16, 4 or 2) with `group_size`
/// (0 = per row), everything else f16. The same arguments always give the same bytes.
pub fn random_model(
    config: &ModelConfig,
    seed: u64,
    bits: u32,
    group_size: usize,
) -> Result<FileWriter> {
    config.validate()?;
    let dtype = DType::from_bits(bits)?;
    let specs = expected_tensors(config);
    if dtype.is_quantized() {
        for spec in specs.iter().filter(|s| s.is_quantizable()) {
            group_size_for(&spec.name, dtype, spec.shape[1] as usize, group_size)?;
        }
    }
    // Each tensor draws from its own generator, so tensors can be built in parallel.
    let tensors: Vec<(usize, LinearData)> = specs
        .par_iter()
        .enumerate()
        .map(|(i, spec)| {
            let mut rng = Rng::new(seed ^ (i as u64 + 1).wrapping_mul(0xA24B_AED4_963E_E407));
            let values = random_values(&spec.name, &spec.shape, spec.role, &mut rng)?;
            let data = if spec.is_quantizable() && dtype.is_quantized() {
                let (rows, cols) = (spec.shape[0] as usize, spec.shape[1] as usize);
                LinearData::Quantized(quantize_rtn(&values, rows, cols, dtype, group_size)?)
            } else {
                LinearData::F16(values.iter().map(|&v| f16::from_f32(v)).collect())
            };
            Ok((i, data))
        })
        .collect::<Result<_>>()?;

    let mut writer = FileWriter::new(config.clone());
    writer.set_metadata("tokenizer", serde_json::json!(tokenizer_name(config)));
    writer.set_metadata(
        "source",
        serde_json::json!(format!("synthetic random weights, seed {seed}")),
    );
    for (i, data) in &tensors {
        let spec = &specs[*i];
        let shape: Vec<usize> = spec.shape.iter().map(|&d| d as usize).collect();
        match (spec.role, data) {
            (TensorRole::Linear, data) => writer.add_linear(&spec.name, shape[0], shape[1], data),
            (_, LinearData::F16(values)) => writer.add_f16(&spec.name, &shape, values),
            (_, LinearData::Quantized(_)) => unreachable!("only linears are quantized"),
        }
    }
    Ok(writer)
}

fn tokenizer_name(config: &ModelConfig) -> &'static str {
    if config.vocab_size == 256 {
        "bytes"
    } else {
        "none"
    }
}

fn random_values(name: &str, shape: &[u64], role: TensorRole, rng: &mut Rng) -> Result<Vec<f32>> {
    // The config passed validation, so the product fits; the allocation may still fail.
    let len = shape.iter().product::<u64>() as usize;
    let mut values = crate::alloc::with_capacity(len, &format!("tensor {name}"))?;
    let mut normal = || {
        // Box–Muller; one value per draw keeps the stream simple.
        let u1 = rng.next_f64().max(f64::MIN_POSITIVE);
        let u2 = rng.next_f64();
        ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
    };
    let (offset, gain) = match role {
        TensorRole::Vector if name.ends_with(".bias") => (0.0, 0.05),
        TensorRole::Vector => (1.0, 0.1),
        TensorRole::Table => (0.0, 1.0),
        TensorRole::Linear => {
            // Variance 1/fan_in keeps activations O(1); residual branches get half that gain.
            let fan_in = shape[1] as f32;
            let residual = name.ends_with("attn_out") || name.ends_with("mlp_down");
            (0.0, if residual { 0.5 } else { 1.0 } / fan_in.sqrt())
        }
    };
    values.extend((0..len).map(|_| offset + gain * normal()));
    Ok(values)
}
