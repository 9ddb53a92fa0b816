//! The KV cache modes on the CPU backend (the reference): exact equalities where the modes are
//! exact, envelopes where they quantize, age tiers moving entries, and memory accounting.
//! The CUDA backend is checked against these numerics in tests/cuda_parity.rs.

mod common;

use common::{prefill_and_decode, rel_l2, synth_file, tokens};
use tinyloop::backend::cpu::{read_kv_entry, CpuBackend};
use tinyloop::backend::{Backend, Choice, StepInput};
use tinyloop::kv::{Application, KvLayout, KvMode, TierBounds, AGE_BLOCK};
use tinyloop::model::forward::Buffers;
use tinyloop::model::layout::Stage;
use tinyloop::model::weights::Weights;
use tinyloop::{Error, GenerateParams, Model, ModelFile, ModelOptions};

const MODES: [&str; 7] = [
    "fp16",
    "fp16-h",
    "int8-h",
    "int4-h",
    "int8",
    "delta",
    "age:64:128",
];

fn open_in(path: &std::path::Path, mode: &str, max_seq_len: usize) -> Model {
    let options = ModelOptions {
        kv_mode: Some(mode.parse().unwrap()),
        max_seq_len,
        ..common::cpu_options()
    };
    Model::open(path, &options).unwrap()
}

fn greedy(max_tokens: usize, loops: usize) -> GenerateParams {
    GenerateParams {
        max_tokens,
        loops: Some(loops),
        ..GenerateParams::default()
    }
}

/// Recomputing K and V from the cached h with the QKV weight's K and V rows is the same dot
/// product, in the same order, as the QKV projection itself, so fp16-h reproduces fp16 exactly.
#[test]
fn fp16_h_gives_exactly_the_fp16_logits() {
    for preset in ["tiny", "tiny-gqa", "tiny-tied"] {
        let path = synth_file(preset, 3, 4);
        let (fp16, by_h) = (open_in(&path, "fp16", 64), open_in(&path, "fp16-h", 64));
        let prompt = tokens(21, fp16.config().vocab_size, 5);
        for loops in [1, 3] {
            let a = fp16.new_session().unwrap().score(&prompt, Some(loops));
            let b = by_h.new_session().unwrap().score(&prompt, Some(loops));
            assert_eq!(a.unwrap(), b.unwrap(), "{preset} loops {loops}");
            let a = fp16
                .new_session()
                .unwrap()
                .generate(&prompt, &greedy(12, loops));
            let b = by_h
                .new_session()
                .unwrap()
                .generate(&prompt, &greedy(12, loops));
            assert_eq!(a.unwrap(), b.unwrap(), "{preset} loops {loops}");
        }
    }
}

/// Every step reads every position's K and V from the cache, its own rows included, and each
/// row's computation does not depend on the rows beside it; steps are cut where the age-tier
/// bounds change, so every entry is written and moved between tiers as one-token steps would do
/// it. So chunking the prompt changes nothing, in every mode (`age:64:128` moves entries at
/// sequence lengths 128 and 192 of the 200-token prompt).
#[test]
fn chunked_prefill_matches_single_shot_in_every_mode() {
    let path = synth_file("tiny-gqa", 2, 4);
    let file = ModelFile::open(&path).unwrap();
    let config = file.config.clone();
    let weights = Weights::load(&CpuBackend, &file, 256).unwrap();
    let prompt = tokens(200, config.vocab_size, 9);
    let loops = 3;
    let run = |mode: &str, chunk| {
        let layout = KvLayout::new(&config, mode.parse().unwrap(), 256).unwrap();
        prefill_and_decode(&CpuBackend, &weights, layout, chunk, &prompt, loops, 6)
    };
    for mode in MODES {
        let (single, single_tokens) = run(mode, 0);
        for chunk in [1, 7, 48] {
            if mode.ends_with("-h") && chunk == 1 {
                continue; // recomputing every position per one-row step: slow, and covered by 7
            }
            let (chunked, chunked_tokens) = run(mode, chunk);
            assert_eq!(chunked_tokens, single_tokens, "{mode} chunk {chunk}");
            assert!(chunked == single, "{mode} chunk {chunk}: logits differ");
        }
    }
}

/// A decode step computes its row exactly as a prefill computes that row (the cache holds the
/// same entries), so in every mode the logits of each decode step equal the row of a one-shot
/// `score` over the same tokens (score steps are cut at age-tier changes like every other).
#[test]
fn decode_steps_equal_full_recompute_in_every_mode() {
    let path = synth_file("tiny-gqa", 4, 4);
    for mode in MODES {
        let model = open_in(&path, mode, 64);
        let vocab = model.config().vocab_size;
        let mut s = model.new_session().unwrap();
        let prompt = tokens(6, vocab, 3);
        let generated = s.generate(&prompt, &greedy(8, 2)).unwrap();
        let mut all = prompt.clone();
        all.extend(&generated);
        let logits = s.score(&all, Some(2)).unwrap();
        for (i, &t) in generated.iter().enumerate() {
            let row = &logits[(prompt.len() - 1 + i) * vocab..][..vocab];
            assert_eq!(
                tinyloop::generate::sampling::argmax(row),
                t,
                "{mode} step {i}"
            );
        }
    }
}

/// The decode path (`Session::logprobs_decode`, one row per step) computes each row as a
/// one-step score does, since the cache holds the same entries whenever they were written; so
/// in every mode its logprobs equal the prefill ones bit for bit (in age mode over 200 tokens,
/// whose entries cross both tier boundaries of `age:64:128`: prefill steps are cut where the
/// bounds change, so entries move between tiers as in one-token steps).
#[test]
fn decode_path_logprobs_equal_prefill_logprobs_in_every_mode() {
    let path = synth_file("tiny-gqa", 4, 4);
    for mode in MODES {
        let n = if mode.starts_with("age") { 200 } else { 20 };
        let model = open_in(&path, mode, 256);
        let mut s = model.new_session().unwrap();
        let input = tokens(n, model.config().vocab_size, 2);
        let prefill = s.logprobs(&input, Some(3)).unwrap();
        let decode = s.logprobs_decode(&input, Some(3)).unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&decode), bits(&prefill), "{mode}");
    }
}

/// Quantized modes against fp16: logits within each mode's envelope. The envelopes are the
/// quantization error of a cached vector, derived in docs/QUALITY.md: for symmetric rounding
/// with step s = amax / qmax the error of a value is uniform in ±s/2 (rms s/√12), and for
/// near-Gaussian heads amax ≈ 3σ, so the relative error of a cached vector is about
/// 3 / (qmax √12): 0.7 % at INT8, 12 % at INT4. Attention mixes such vectors, so logits move by
/// about as much; each envelope is twice that (4 % for INT8 entries, 25 % for INT4 entries or
/// age, whose old entries are INT4).
#[test]
fn quantized_modes_stay_within_their_envelope() {
    let envelope = |mode: &str| match mode {
        "fp16" | "fp16-h" => 0.0,
        "int8" | "int8-h" | "delta" => 0.04,
        _ => 0.25,
    };
    for preset in ["tiny", "tiny-gqa"] {
        let path = synth_file(preset, 6, 4);
        let fp16 = open_in(&path, "fp16", 512);
        let vocab = fp16.config().vocab_size;
        let prompt = tokens(300, vocab, 11);
        for mode in MODES {
            let model = open_in(&path, mode, 512);
            for loops in [1, 4, 8] {
                // 300 tokens, so that age 64:128 holds entries in all three tiers.
                let a = fp16
                    .new_session()
                    .unwrap()
                    .score(&prompt, Some(loops))
                    .unwrap();
                let b = model
                    .new_session()
                    .unwrap()
                    .score(&prompt, Some(loops))
                    .unwrap();
                let e = rel_l2(&b, &a);
                eprintln!("{preset} {mode} L={loops}: logits rel L2 vs fp16 {e:.3e}");
                assert!(e <= envelope(mode), "{preset} {mode} L={loops}: {e:.3e}");
            }
        }
    }
}

/// Age 64:128 against delta, storing the same K and V rows one position at a time through the
/// backend's ops (as decode steps do): the tier bounds move at the right positions, young entries
/// are exactly the delta mode's, older ones were re-quantized (so differ) within the INT4
/// envelope of `quantized_modes_stay_within_their_envelope`, and the young ring's slots, reused
/// by newer positions, did not corrupt the entries moved out of them.
#[test]
fn age_moves_entries_at_both_boundaries() {
    let config = tinyloop::model::synth::preset("tiny").unwrap();
    let (capacity, positions) = (320, 300);
    let heads = tinyloop::backend::AttentionShape {
        n_heads: config.n_heads,
        n_kv_heads: config.n_kv_heads,
        head_dim: config.head_dim(),
    };
    let rope = tinyloop::backend::rope_table(capacity, heads.head_dim, config.rope_theta).unwrap();
    let apps = [
        Application {
            stage: Stage::Pre,
            block: 1,
            iteration: 0,
        },
        Application {
            stage: Stage::Loop,
            block: 0,
            iteration: 1,
        },
        Application {
            stage: Stage::Loop,
            block: 0,
            iteration: 2,
        },
    ];
    let mut rng = tinyloop::generate::sampling::Rng::new(3);
    let mut rows = || -> Vec<f32> {
        (0..heads.qkv_dim())
            .map(|_| (rng.next_u64() % 2001) as f32 / 1000.0 - 1.0)
            .collect()
    };
    let inputs: Vec<Vec<Vec<f32>>> = (0..positions)
        .map(|_| apps.iter().map(|_| rows()).collect())
        .collect();
    let caches: Vec<_> = ["delta", "age:64:128"]
        .iter()
        .map(|mode| {
            let layout = KvLayout::new(&config, mode.parse().unwrap(), capacity).unwrap();
            let mut kv = tinyloop::kv::KvCache {
                storage: CpuBackend.alloc_kv(layout.bytes(layout.slots(2))).unwrap(),
                slots: layout.slots(2),
                layout,
                bounds: TierBounds::default(),
                depths: Default::default(),
            };
            let mut step = CpuBackend.alloc_step(1).unwrap();
            let h = vec![0f32; config.dim];
            for (pos, rows) in inputs.iter().enumerate() {
                for mv in kv.advance_tiers(pos, pos + 1) {
                    CpuBackend.kv_move(&mut kv, &mv);
                }
                if mode.starts_with("age") {
                    let floor = |n: usize| n / AGE_BLOCK * AGE_BLOCK;
                    let expected = TierBounds {
                        mid_end: floor((pos + 1).saturating_sub(64)),
                        old_end: floor((pos + 1).saturating_sub(128)),
                    };
                    assert_eq!(kv.bounds, expected, "at position {pos}");
                }
                let input = StepInput {
                    tokens: &[0],
                    start_pos: pos,
                    choice: Choice::Greedy,
                };
                CpuBackend.set_step(&mut step, input, kv.bounds).unwrap();
                for (app, row) in apps.iter().zip(rows) {
                    let mut qkv = row.clone();
                    let at = kv.layout.at(*app);
                    CpuBackend.kv_store(&mut qkv, &h, &step, 1, &rope, &mut kv, at);
                }
            }
            kv
        })
        .collect();
    let (delta, age) = (&caches[0], &caches[1]);
    assert_eq!(
        age.bounds,
        TierBounds {
            mid_end: 192,
            old_end: 128
        }
    );
    let hd = heads.head_dim;
    let mut by_tier = [(0f64, 0f64); 3];
    for app in apps {
        for t in 0..positions {
            let tier = age.layout.tier_of(t, &age.bounds);
            for tensor in 0..2 {
                for head in 0..heads.n_kv_heads {
                    let (mut a, mut d) = (vec![0f32; hd], vec![0f32; hd]);
                    read_kv_entry(age, tensor, age.layout.at(app), t, head, &mut a);
                    read_kv_entry(delta, tensor, delta.layout.at(app), t, head, &mut d);
                    let diff: f64 = a
                        .iter()
                        .zip(&d)
                        .map(|(x, y)| ((x - y) as f64).powi(2))
                        .sum();
                    let norm: f64 = d.iter().map(|y| (*y as f64).powi(2)).sum();
                    by_tier[tier].0 += diff;
                    by_tier[tier].1 += norm;
                }
            }
        }
    }
    let rel: Vec<f64> = by_tier.iter().map(|(d, n)| (d / n).sqrt()).collect();
    eprintln!("age vs delta entries, rel L2 by tier (INT8, INT4, INT4 + FP8 scales): {rel:.3?}");
    assert_eq!(
        rel[0], 0.0,
        "young entries are the delta mode's INT8 entries"
    );
    for tier in [1, 2] {
        assert!(
            rel[tier] > 0.0 && rel[tier] <= 0.25,
            "tier {tier}: {}",
            rel[tier]
        );
    }
}

/// The bytes a session reports are the bytes its cache holds, in every mode, and they grow with
/// the loop count as the layout says.
#[test]
fn memory_accounting_equals_the_allocations() {
    let path = synth_file("tiny-gqa", 1, 4);
    let file = ModelFile::open(&path).unwrap();
    for mode in MODES {
        let model = open_in(&path, mode, 128);
        let weights_only = model.memory_bytes();
        let mut s = model.new_session().unwrap();
        for loops in [2, 5] {
            s.generate(&tokens(4, 256, 1), &greedy(2, loops)).unwrap();
            let layout = KvLayout::new(&file.config, mode.parse().unwrap(), 128).unwrap();
            assert_eq!(s.kv_bytes(), layout.bytes(layout.slots(loops)), "{mode}");
            assert_eq!(
                model.memory_bytes(),
                weights_only + s.memory_bytes(),
                "{mode}"
            );
        }
        // The storage itself, through the forward pass's object.
        let weights = Weights::load(&CpuBackend, &file, 128).unwrap();
        let layout = KvLayout::new(&file.config, mode.parse().unwrap(), 128).unwrap();
        let mut buf = Buffers::new(
            &CpuBackend,
            &file.config,
            4,
            layout,
            weights.body.loaded().unwrap(),
            tinyloop::StateInit::Model,
        )
        .unwrap();
        buf.reserve_kv(&CpuBackend, buf.kv.layout.slots(3)).unwrap();
        assert_eq!(
            CpuBackend.kv_bytes(&buf.kv.storage),
            buf.kv.bytes(),
            "{mode}"
        );
        drop(weights);
    }
}

#[test]
fn bad_kv_modes_are_clear_errors() {
    let err = "int3".parse::<KvMode>().unwrap_err().to_string();
    assert!(
        err.contains("fp16, fp16-h, int8-h, int4-h, int8, delta, age"),
        "{err}"
    );
    let path = synth_file("tiny", 1, 4);
    let options = ModelOptions {
        kv_mode: Some(KvMode::Age(tinyloop::AgeTiers {
            int4_from: 4096,
            fp8_from: 1024,
        })),
        ..common::cpu_options()
    };
    match Model::open(&path, &options) {
        Err(Error::InvalidArgument(msg)) => assert!(msg.contains("out of order"), "{msg}"),
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
}
