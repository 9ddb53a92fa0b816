//! The runtime's forward pass against the independent f64 reference in tests/common/reference.rs,
//! on every architecture variant, every weight encoding and loops ∈ {1, 3, 8}.

mod common;

use common::reference::Reference;
use common::{cpu_options, synth_file, tokens};
use tinyloop::{LoopState, Model, ModelOptions, StateInit};

/// Relative L2 error of the logits allowed between the runtime (f32 accumulation) and the
/// reference (f64 accumulation, same f16 rounding points).
///
/// Why 2e-3: positions where no f16 rounding decision differs agree to ~1e-7 (f32 accumulation
/// over K ≤ 256 terms). Where the f32 and f64 values straddle an f16 rounding boundary, one
/// activation differs by one f16 ulp (2^-11 ≈ 4.9e-4 relative), which moves that position's
/// logits by ~1e-4. With ~10^4 roundings per position a few such flips are expected per sequence;
/// the worst measured over this suite is 6.0e-4 (print it with `-- --nocapture`). 2e-3 leaves
/// headroom for that, while a wrong op, index or scale moves the logits by O(1).
const TOLERANCE: f64 = 2e-3;

fn relative_error(actual: &[f32], expected: &[Vec<f64>]) -> f64 {
    let flat: Vec<f64> = expected.iter().flatten().copied().collect();
    assert_eq!(actual.len(), flat.len());
    let diff: f64 = actual
        .iter()
        .zip(&flat)
        .map(|(&a, &b)| (a as f64 - b).powi(2))
        .sum();
    let norm: f64 = flat.iter().map(|b| b * b).sum();
    (diff / norm).sqrt()
}

fn check(preset: &str, bits: u32) {
    let path = synth_file(preset, 11, bits);
    let reference = Reference::load(&std::fs::read(&path).unwrap());
    let config = tinyloop::model::synth::preset(preset).unwrap();
    // The reference starts a random loop state from zeros.
    let state_init = match config.architecture.loop_state {
        LoopState::Random => StateInit::Zeros,
        LoopState::Carry => StateInit::Model,
    };
    let options = ModelOptions {
        state_init,
        ..cpu_options()
    };
    let model = Model::open(&path, &options).unwrap();
    let mut session = model.new_session().unwrap();
    let input = tokens(9, model.config().vocab_size, bits);
    let mut worst = 0f64;
    for loops in [1, 3, 8] {
        let actual = session.score(&input, Some(loops)).unwrap();
        let err = relative_error(&actual, &reference.logits(&input, loops));
        worst = worst.max(err);
        println!("  {preset} {bits} loops {loops}: {err:.2e}");
        assert!(
            err < TOLERANCE,
            "{preset} int{bits} loops {loops}: relative error {err:.2e}"
        );
    }
    println!("{preset} bits {bits}: worst relative error {worst:.2e}");
}

#[test]
fn tiny_matches_reference() {
    for bits in [4, 2, 16] {
        check("tiny", bits);
    }
}

#[test]
fn gqa_layernorm_two_loop_blocks_post_block_factorized_tied_matches_reference() {
    for bits in [4, 2, 16] {
        check("tiny-gqa", bits);
    }
}

#[test]
fn tied_head_without_pre_blocks_matches_reference() {
    for bits in [4, 2, 16] {
        check("tiny-tied", bits);
    }
}

#[test]
fn sandwich_norms_loop_norm_and_exit_gate_match_reference() {
    for bits in [4, 2, 16] {
        check("tiny-sandwich", bits);
    }
}

#[test]
fn norms_after_the_residual_qkv_bias_scaled_embedding_and_loop_adapter_match_reference() {
    for bits in [4, 2, 16] {
        check("tiny-recurrent", bits);
    }
}
