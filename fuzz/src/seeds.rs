//! Seed inputs: synthetic models of the `tinyloop synth` presets and of smaller configurations
//! (every weight encoding, group sizes down to the smallest allowed, every architecture option),
//! and safetensors checkpoints of one small configuration in F32, F16 and BF16.

use std::collections::HashMap;

use safetensors::tensor::TensorView;
use safetensors::Dtype;
use tinyloop::model::layout::expected_tensors;
use tinyloop::model::synth::{preset, random_model};
use tinyloop::{
    Architecture, BlockNorms, HeadKind, LoopInput, LoopNorm, LoopState, ModelConfig, NormKind,
};

use crate::rng::Rng;

/// A small configuration with every optional part: GQA, LayerNorm, a factorized tied embedding,
/// pre, loop and post blocks.
pub fn small_config() -> ModelConfig {
    ModelConfig {
        dim: 16,
        n_heads: 4,
        n_kv_heads: 2,
        ffn_dim: 24,
        vocab_size: 32,
        embed_factor_dim: 8,
        n_pre_blocks: 1,
        n_loop_blocks: 1,
        n_post_blocks: 1,
        default_loops: 2,
        norm: NormKind::LayerNorm,
        norm_eps: 1e-5,
        rope_theta: 10000.0,
        max_position: 64,
        head: HeadKind::Tied,
        architecture: Architecture::default(),
    }
}

/// The smallest plain configuration: RMSNorm, MHA, untied head, no pre or post blocks.
fn plain_config() -> ModelConfig {
    ModelConfig {
        dim: 8,
        n_heads: 2,
        n_kv_heads: 2,
        ffn_dim: 8,
        vocab_size: 16,
        embed_factor_dim: 0,
        n_pre_blocks: 0,
        n_loop_blocks: 2,
        n_post_blocks: 0,
        default_loops: 3,
        norm: NormKind::RmsNorm,
        norm_eps: 1e-6,
        rope_theta: 500.0,
        max_position: 32,
        head: HeadKind::Untied,
        architecture: Architecture::default(),
    }
}

/// `.tinyloop` seeds.
pub fn tinyloop_files() -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for name in [
        "tiny",
        "tiny-gqa",
        "tiny-tied",
        "tiny-sandwich",
        "tiny-recurrent",
    ] {
        let config = preset(name).expect("preset exists");
        for bits in [4, 2] {
            out.push(model(&config, bits, 32));
        }
    }
    for config in [small_config(), plain_config()] {
        out.push(model(&config, 16, 0));
        for (bits, group) in [(4, 2), (4, 8), (2, 4), (2, 8), (4, 0)] {
            out.push(model(&config, bits, group));
        }
    }
    out
}

fn model(config: &ModelConfig, bits: u32, group: usize) -> Vec<u8> {
    random_model(config, 7, bits, group)
        .expect("seed configurations are valid")
        .to_bytes()
}

/// A model of a random small configuration (`None` when the drawn group size does not fit it).
pub fn random_tinyloop(rng: &mut Rng) -> Option<Vec<u8>> {
    let n_heads = 1 + rng.below(4);
    let n_kv_heads = *rng.pick(
        &(1..=n_heads)
            .filter(|&k| n_heads.is_multiple_of(k))
            .collect::<Vec<_>>(),
    );
    let config = ModelConfig {
        dim: n_heads * 2 * (1 + rng.below(4)),
        n_heads,
        n_kv_heads,
        ffn_dim: 1 + rng.below(40),
        vocab_size: 1 + rng.below(48),
        embed_factor_dim: *rng.pick(&[0, 0, 1, 2, 5, 8]),
        n_pre_blocks: rng.below(3),
        n_loop_blocks: 1 + rng.below(2),
        n_post_blocks: rng.below(2),
        default_loops: 1 + rng.below(4),
        norm: *rng.pick(&[NormKind::RmsNorm, NormKind::LayerNorm]),
        norm_eps: *rng.pick(&[1e-5, 1e-6, 1e-30, 0.5]),
        rope_theta: *rng.pick(&[10000.0, 1e6, 1.0, 1.5]),
        max_position: *rng.pick(&[16, 17, 64]),
        head: *rng.pick(&[HeadKind::Tied, HeadKind::Untied]),
        architecture: random_architecture(rng),
    };
    let bits = *rng.pick(&[16, 4, 2]);
    let group = *rng.pick(&[0, 2, 4, 8, 16, 32]);
    let seed = rng.next_u64();
    Some(random_model(&config, seed, bits, group).ok()?.to_bytes())
}

/// Any combination of the architecture's choices; `random_model` refuses the invalid ones (the
/// caller then draws again), so the models hold every valid combination.
fn random_architecture(rng: &mut Rng) -> Architecture {
    let loop_state = *rng.pick(&[LoopState::Carry, LoopState::Random]);
    Architecture {
        block_norms: *rng.pick(&[
            BlockNorms::Pre,
            BlockNorms::Sandwich,
            BlockNorms::SandwichResidual,
        ]),
        qkv_bias: rng.below(2) == 1,
        embed_scale: *rng.pick(&[1.0, 8.0, 0.5, 0.0]),
        loop_input: *rng.pick(&[LoopInput::None, LoopInput::Adapter]),
        loop_state,
        state_std: match loop_state {
            LoopState::Carry => *rng.pick(&[0.0, 0.0, 1.0]),
            LoopState::Random => *rng.pick(&[0.5, 2.0, 0.0]),
        },
        loop_norm: *rng.pick(&[LoopNorm::None, LoopNorm::EachIteration, LoopNorm::AfterLoop]),
        head_norm: rng.below(4) != 0,
        exit_gate: rng.below(2) == 1,
        exit_threshold: *rng.pick(&[None, Some(0.5), Some(1.0), Some(1.5)]),
    }
}

/// Safetensors seeds for [`small_config`], one per stored dtype.
pub fn safetensors_files() -> Vec<Vec<u8>> {
    let config = small_config();
    let mut rng = Rng::new(11);
    let tensors: Vec<(String, Vec<usize>, Vec<f32>)> = expected_tensors(&config)
        .into_iter()
        .map(|spec| {
            let shape: Vec<usize> = spec.shape.iter().map(|&d| d as usize).collect();
            let n = shape.iter().product();
            let values = (0..n)
                .map(|_| (rng.below(2001) as f32 - 1000.0) / 1000.0)
                .collect();
            (spec.name, shape, values)
        })
        .collect();
    type Encode = fn(f32) -> Vec<u8>;
    let encodings: [(Dtype, Encode); 3] = [
        (Dtype::F32, |v| v.to_le_bytes().to_vec()),
        (Dtype::F16, |v| {
            half::f16::from_f32(v).to_le_bytes().to_vec()
        }),
        (Dtype::BF16, |v| {
            half::bf16::from_f32(v).to_le_bytes().to_vec()
        }),
    ];
    encodings
        .iter()
        .map(|(dtype, encode)| {
            let data: HashMap<&str, Vec<u8>> = tensors
                .iter()
                .map(|(name, _, values)| {
                    (
                        name.as_str(),
                        values.iter().flat_map(|&v| encode(v)).collect(),
                    )
                })
                .collect();
            let views = tensors.iter().map(|(name, shape, _)| {
                let view = TensorView::new(*dtype, shape.clone(), &data[name.as_str()])
                    .expect("shape matches data");
                (name.as_str(), view)
            });
            safetensors::serialize(views, None).expect("checkpoint serializes")
        })
        .collect()
}
