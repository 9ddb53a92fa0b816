//! The looped-model calls on the CPU backend (the reference): logit lens, trajectory,
//! self-speculative decoding, prefix caches and resume handles. Each equality is exact here: the
//! CPU computes every row of a step independently and in a fixed order, so the same block
//! applications give the same bits however the work is split into steps. tests/cuda_parity.rs
//! checks the CUDA backend.

mod common;

use common::{open_cpu, synth_file, tokens};
use tinyloop::generate::sampling::argmax;
use tinyloop::{Error, GenerateParams, Model, ModelOptions, SamplingParams, Speculation};

fn greedy(max_tokens: usize, loops: usize) -> GenerateParams {
    GenerateParams {
        max_tokens,
        loops: Some(loops),
        ..GenerateParams::default()
    }
}

fn spec(draft_loops: usize, draft_len: usize, reuse: bool) -> Speculation {
    Speculation {
        draft_loops,
        draft_len,
        reuse,
    }
}

const PRESETS: [&str; 3] = ["tiny", "tiny-gqa", "tiny-tied"];

#[test]
fn logit_lens_rows_are_score_last_at_each_depth() {
    for preset in PRESETS {
        let model = open_cpu(&synth_file(preset, 3, 4));
        let mut s = model.new_session().unwrap();
        let vocab = model.config().vocab_size;
        let prompt = tokens(17, vocab, 2);
        let lens = s.score_logit_lens(&prompt, Some(6)).unwrap();
        assert_eq!(lens.len(), 6 * vocab);
        for l in 1..=6 {
            let last = s.score_last(&prompt, Some(l)).unwrap();
            assert_eq!(
                &lens[(l - 1) * vocab..l * vocab],
                &last[..],
                "{preset} row {l}"
            );
        }
        let shorter = s.score_logit_lens(&prompt, Some(3)).unwrap();
        assert_eq!(
            &lens[..3 * vocab],
            &shorter[..],
            "{preset}: rows at 3 are a prefix"
        );
    }
}

#[test]
fn trajectory_matches_the_lens_it_reads() {
    for preset in PRESETS {
        let model = open_cpu(&synth_file(preset, 5, 4));
        let mut s = model.new_session().unwrap();
        let vocab = model.config().vocab_size;
        let prompt = tokens(11, vocab, 8);
        let lens = s.score_logit_lens(&prompt, Some(5)).unwrap();
        let path = s.score_trajectory(&prompt, Some(5)).unwrap();
        assert_eq!(path.len(), 5);
        let softmax = |row: &[f32]| {
            let max = row.iter().copied().fold(f32::MIN, f32::max) as f64;
            let e: Vec<f64> = row.iter().map(|&v| (v as f64 - max).exp()).collect();
            let t: f64 = e.iter().sum();
            e.into_iter().map(|v| v / t).collect::<Vec<f64>>()
        };
        let mut previous: Option<Vec<f64>> = None;
        for (i, point) in path.iter().enumerate() {
            let row = &lens[i * vocab..(i + 1) * vocab];
            let p = softmax(row);
            let entropy: f64 = -p
                .iter()
                .map(|&x| if x > 0.0 { x * x.log2() } else { 0.0 })
                .sum::<f64>();
            let kl = previous.as_ref().map_or(0.0, |q| {
                p.iter().zip(q).map(|(a, b)| a * (a / b).ln()).sum()
            });
            // f64 recomputations of the same sums: agreement to 1e-9 relative.
            assert!(
                (point.entropy - entropy).abs() <= 1e-9 * entropy.max(1.0),
                "{preset} {i}"
            );
            assert!(
                (point.kl_prev - kl).abs() <= 1e-9 * kl.max(1.0),
                "{preset} {i}"
            );
            assert_eq!(point.argmax, argmax(row), "{preset} {i}");
            assert!(point.hidden_norm.is_finite() && point.hidden_norm > 0.0);
            assert!(point.rel_change.is_finite() && point.rel_change > 0.0);
            previous = Some(p);
        }
        assert_eq!(path[0].kl_prev, 0.0);
        let shorter = s.score_trajectory(&prompt, Some(2)).unwrap();
        assert_eq!(
            &path[..2],
            &shorter[..],
            "{preset}: the first iterations do not depend on L"
        );
    }
}

/// Greedy speculative output equals plain greedy output at the verify loops, for every draft
/// depth and length, with and without reuse of the draft's state, and across the ends of a call
/// (max_tokens, a stop token, the end of max_seq_len).
#[test]
fn greedy_speculation_equals_plain_generation() {
    for preset in PRESETS {
        let model = open_cpu(&synth_file(preset, 2, 4));
        let vocab = model.config().vocab_size;
        let mut s = model.new_session().unwrap();
        let prompt = tokens(9, vocab, 4);
        for verify in [3, 6] {
            let plain = s.generate(&prompt, &greedy(40, verify)).unwrap();
            for draft_loops in [1, verify - 1] {
                for draft_len in [1, 3, 8] {
                    for reuse in [true, false] {
                        let sp = spec(draft_loops, draft_len, reuse);
                        let out = s
                            .generate_speculative(&prompt, &greedy(40, verify), &sp, &mut |_| true)
                            .unwrap();
                        assert_eq!(out, plain, "{preset} verify {verify} {sp:?}");
                        let stats = s.last_generate_stats();
                        assert_eq!(stats.tokens, out.len());
                        assert!(stats.accepted <= stats.drafted && stats.agreed <= stats.drafted);
                        assert!(stats.drafted > 0, "{preset}: {stats:?}");
                    }
                }
            }
            // A stop token that plain generation produces ends both at the same place.
            let stop = plain[12];
            let params = GenerateParams {
                stop_tokens: vec![stop],
                ..greedy(40, verify)
            };
            let a = s.generate(&prompt, &params).unwrap();
            let b = s
                .generate_speculative(&prompt, &params, &spec(1, 4, true), &mut |_| true)
                .unwrap();
            assert_eq!(a, b, "{preset}: stop token");
        }
    }
    // Up to the last position of max_seq_len.
    let path = synth_file("tiny", 2, 4);
    let options = ModelOptions {
        max_seq_len: 30,
        ..common::cpu_options()
    };
    let model = Model::open(&path, &options).unwrap();
    let mut s = model.new_session().unwrap();
    let prompt = tokens(5, 256, 1);
    let plain = s.generate(&prompt, &greedy(25, 4)).unwrap();
    let out = s
        .generate_speculative(&prompt, &greedy(25, 4), &spec(2, 8, true), &mut |_| true)
        .unwrap();
    assert_eq!(out, plain);
}

/// Sampled speculation draws from the verify distribution: the joint distribution of the first
/// two tokens over many seeds matches plain sampling. With top-k 3 there are 9 outcomes; at 4000
/// draws each the total-variation distance between two samples of one distribution has a
/// standard deviation of about 0.015, so 0.08 (over 5 standard deviations) separates sampling
/// noise from a wrong rule (drafting from q unchanged gives distances of 0.2 and more here).
#[test]
fn sampled_speculation_has_the_plain_distribution() {
    let model = open_cpu(&synth_file("tiny", 9, 4));
    let mut s = model.new_session().unwrap();
    let prompt = tokens(6, 256, 3);
    let draws = 4000;
    let mut joint = |speculative: bool| {
        let mut counts = std::collections::HashMap::<(u32, u32), usize>::new();
        for seed in 0..draws {
            let params = GenerateParams {
                max_tokens: 2,
                loops: Some(4),
                sampling: SamplingParams {
                    temperature: 1.5,
                    top_k: 3,
                    top_p: 1.0,
                    seed,
                },
                ..GenerateParams::default()
            };
            let out = if speculative {
                s.generate_speculative(&prompt, &params, &spec(1, 2, true), &mut |_| true)
                    .unwrap()
            } else {
                s.generate(&prompt, &params).unwrap()
            };
            *counts.entry((out[0], out[1])).or_default() += 1;
        }
        counts
    };
    let (plain, speculative) = (joint(false), joint(true));
    let keys: std::collections::HashSet<_> = plain.keys().chain(speculative.keys()).collect();
    let tv: f64 = keys
        .iter()
        .map(|k| {
            let a = *plain.get(k).unwrap_or(&0) as f64 / draws as f64;
            let b = *speculative.get(k).unwrap_or(&0) as f64 / draws as f64;
            (a - b).abs()
        })
        .sum::<f64>()
        / 2.0;
    assert!(tv <= 0.08, "total variation {tv}");
}

#[test]
fn prefix_cache_equals_generating_from_the_whole_text() {
    for preset in PRESETS {
        for mode in ["fp16", "fp16-h", "int8", "delta"] {
            let options = ModelOptions {
                kv_mode: Some(mode.parse().unwrap()),
                ..common::cpu_options()
            };
            let model = Model::open(synth_file(preset, 4, 4), &options).unwrap();
            let vocab = model.config().vocab_size;
            let (prefix, prompt) = (tokens(23, vocab, 1), tokens(5, vocab, 2));
            let mut whole = prefix.clone();
            whole.extend(&prompt);
            let mut s = model.new_session().unwrap();
            // The session's cache has its slots for 3 loops first, so that only the handle adds.
            let expected = s.generate(&whole, &greedy(12, 3)).unwrap();
            let before = model.memory_bytes();
            let cache = s.build_prefix_cache(&prefix, Some(3)).unwrap();
            assert_eq!(model.memory_bytes(), before + cache.memory_bytes());
            let with_prefix = s
                .generate_with_prefix(&cache, &prompt, &greedy(12, 3), &mut |_| true)
                .unwrap();
            assert_eq!(with_prefix, expected, "{preset} {mode}");
            // Several sessions use one cache at once.
            std::thread::scope(|scope| {
                let runs: Vec<_> = (0..2)
                    .map(|_| {
                        let (model, cache, prompt) = (&model, &cache, &prompt);
                        scope.spawn(move || {
                            let mut t = model.new_session().unwrap();
                            t.generate_with_prefix(cache, prompt, &greedy(12, 3), &mut |_| true)
                                .unwrap()
                        })
                    })
                    .collect();
                for run in runs {
                    assert_eq!(run.join().unwrap(), expected, "{preset} {mode}: threads");
                }
            });
            drop(cache);
            assert_eq!(
                model.memory_bytes(),
                before,
                "{preset} {mode}: bytes released"
            );
        }
    }
}

#[test]
fn resume_equals_a_fresh_generation_at_any_depth() {
    for preset in PRESETS {
        let model = open_cpu(&synth_file(preset, 6, 4));
        let vocab = model.config().vocab_size;
        let prompt = tokens(14, vocab, 5);
        let mut s = model.new_session().unwrap();
        let handle = s.build_resume_handle(&prompt, Some(4)).unwrap();
        assert_eq!(handle.loops(), 4);
        for l2 in [1, 2, 4, 6] {
            let fresh = s.generate(&prompt, &greedy(16, l2)).unwrap();
            let resumed = s
                .resume_generate(&handle, &greedy(16, l2), &mut |_| true)
                .unwrap();
            assert_eq!(resumed, fresh, "{preset} resume at {l2} from 4");
        }
    }
}

#[test]
fn bad_looped_inputs_are_clear_errors() {
    let model = open_cpu(&synth_file("tiny", 1, 4));
    let mut s = model.new_session().unwrap();
    let prompt = tokens(4, 256, 1);
    let expect = |r: tinyloop::Result<Vec<u32>>, needle: &str| match r {
        Err(Error::InvalidArgument(msg)) => assert!(msg.contains(needle), "{msg}"),
        other => panic!("expected InvalidArgument naming {needle}, got {other:?}"),
    };
    let mut run =
        |sp: Speculation| s.generate_speculative(&prompt, &greedy(4, 4), &sp, &mut |_| true);
    expect(run(spec(4, 2, true)), "draft_loops");
    expect(run(spec(5, 2, true)), "draft_loops");
    expect(run(spec(0, 2, true)), "draft_loops");
    expect(run(spec(2, 0, true)), "draft_len");
    expect(run(spec(2, 16, true)), "draft_len");

    let other = open_cpu(&synth_file("tiny", 2, 4));
    let cache = other
        .new_session()
        .unwrap()
        .build_prefix_cache(&prompt, Some(2))
        .unwrap();
    expect(
        s.generate_with_prefix(&cache, &prompt, &greedy(4, 2), &mut |_| true),
        "belongs to another model",
    );
    let own = s.build_prefix_cache(&prompt, Some(2)).unwrap();
    expect(
        s.generate_with_prefix(&own, &prompt, &greedy(4, 3), &mut |_| true),
        "built at loops 2",
    );
    let handle = s.build_resume_handle(&prompt, Some(2)).unwrap();
    expect(
        s.resume_generate(&handle, &greedy(4, 65), &mut |_| true),
        "loops must be in 1..=64",
    );
    let age = Model::open(
        synth_file("tiny", 1, 4),
        &ModelOptions {
            kv_mode: Some("age".parse().unwrap()),
            ..common::cpu_options()
        },
    )
    .unwrap();
    match age.new_session().unwrap().build_prefix_cache(&prompt, None) {
        Err(Error::InvalidArgument(msg)) => assert!(msg.contains("age mode"), "{msg}"),
        other => panic!("expected InvalidArgument, got {:?}", other.map(|c| c.len())),
    }
}

/// The CTX-TIER and age tiers are functions of positions, so speculative rounds (cut at every tier
/// change) compute what one-token decode steps compute: greedy speculative output equals plain
/// greedy output in every KV mode, with a tier policy whose LONG threshold falls inside the
/// prompt, inside the generation, or nowhere. In age mode 9 + 240 tokens cross the `age:64:128`
/// bounds at sequence lengths 128 and 192 (INT8 → INT4) and 192 (INT4 → FP8 scales).
#[test]
fn greedy_speculation_equals_plain_in_every_kv_mode_and_tier() {
    let tiers = [None, Some((4, 6)), Some((4, 37))];
    let drafts = [(2, 7, true), (5, 15, false), (1, 3, true), (3, 4, false)];
    for mode in [
        "fp16",
        "fp16-h",
        "int8-h",
        "int4-h",
        "int8",
        "delta",
        "age:64:128",
    ] {
        let options = ModelOptions {
            kv_mode: Some(mode.parse().unwrap()),
            ..common::cpu_options()
        };
        let model = Model::open(synth_file("tiny", 3, 4), &options).unwrap();
        let prompt = tokens(9, model.config().vocab_size, 7);
        let max_tokens = if mode.starts_with("age") { 240 } else { 40 };
        let mut s = model.new_session().unwrap();
        for tier in tiers {
            let params = GenerateParams {
                ctx_tier: tier.map(|(short_t, long_t)| tinyloop::CtxTier {
                    short_t,
                    long_t,
                    ..Default::default()
                }),
                ..greedy(max_tokens, 6)
            };
            let plain = s.generate(&prompt, &params).unwrap();
            for (draft_loops, draft_len, reuse) in drafts {
                let sp = spec(draft_loops, draft_len, reuse);
                let out = s
                    .generate_speculative(&prompt, &params, &sp, &mut |_| true)
                    .unwrap();
                let first_diff = out.iter().zip(&plain).position(|(a, b)| a != b);
                assert_eq!(
                    out, plain,
                    "{mode} tier {tier:?} {sp:?}: first difference at {first_diff:?}"
                );
            }
        }
    }
}

/// A prefix cache must leave room for a prompt, and a resume handle for a generated token: a
/// handle that fills max_seq_len is refused when it is built, not by every later use.
#[test]
fn handles_leave_room_in_max_seq_len() {
    let options = ModelOptions {
        max_seq_len: 16,
        ..common::cpu_options()
    };
    let model = Model::open(synth_file("tiny", 1, 4), &options).unwrap();
    let mut s = model.new_session().unwrap();
    let full = tokens(16, 256, 3);
    match s.build_resume_handle(&full, Some(2)) {
        Err(Error::InvalidArgument(msg)) => assert_eq!(
            msg,
            "a prompt of 16 tokens leaves no room for a generated token in max_seq_len 16"
        ),
        other => panic!(
            "expected InvalidArgument, got {:?}",
            other.map(|h| h.loops())
        ),
    }
    match s.build_prefix_cache(&full, Some(2)) {
        Err(Error::InvalidArgument(msg)) => assert_eq!(
            msg,
            "a prefix of 16 tokens leaves no room for a prompt in max_seq_len 16"
        ),
        other => panic!("expected InvalidArgument, got {:?}", other.map(|c| c.len())),
    }
    // One position left: the handle generates exactly one token, that of a fresh generation.
    let prompt = &full[..15];
    let handle = s.build_resume_handle(prompt, Some(2)).unwrap();
    let fresh = s.generate(prompt, &greedy(1, 3)).unwrap();
    let resumed = s
        .resume_generate(&handle, &greedy(1, 3), &mut |_| true)
        .unwrap();
    assert_eq!((resumed.len(), &resumed), (1, &fresh));
}
