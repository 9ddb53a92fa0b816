//! Generation and scoring behaviour through the Rust API.

mod common;

use common::{open_cpu, synth_file, synth_with_max_position, tokens};
use tinyloop::{Device, Error, GenerateParams, Model, ModelOptions, SamplingParams};

fn greedy(max_tokens: usize, loops: usize) -> GenerateParams {
    GenerateParams {
        max_tokens,
        loops: Some(loops),
        ..GenerateParams::default()
    }
}

fn sampled(seed: u64) -> GenerateParams {
    GenerateParams {
        max_tokens: 24,
        loops: Some(3),
        sampling: SamplingParams {
            temperature: 0.9,
            top_k: 40,
            top_p: 0.95,
            seed,
        },
        ..GenerateParams::default()
    }
}

#[test]
fn greedy_is_deterministic_across_calls_and_sessions() {
    let model = open_cpu(&synth_file("tiny", 1, 4));
    let prompt = tokens(7, 256, 1);
    let mut a = model.new_session().unwrap();
    let mut b = model.new_session().unwrap();
    let first = a.generate(&prompt, &greedy(32, 4)).unwrap();
    assert_eq!(first.len(), 32);
    assert_eq!(a.generate(&prompt, &greedy(32, 4)).unwrap(), first);
    assert_eq!(b.generate(&prompt, &greedy(32, 4)).unwrap(), first);
}

#[test]
fn seeded_sampling_is_reproducible_and_depends_on_the_seed() {
    let model = open_cpu(&synth_file("tiny", 1, 4));
    let prompt = tokens(5, 256, 2);
    let mut s = model.new_session().unwrap();
    let a = s.generate(&prompt, &sampled(1)).unwrap();
    assert_eq!(s.generate(&prompt, &sampled(1)).unwrap(), a);
    let others: Vec<_> = (2..6)
        .map(|seed| s.generate(&prompt, &sampled(seed)).unwrap())
        .collect();
    assert!(others.iter().any(|o| *o != a), "seed has no effect");
}

/// Decoding with the KV cache must pick the same tokens as recomputing every prefix from scratch.
#[test]
fn incremental_decode_matches_full_recompute() {
    for preset in ["tiny", "tiny-gqa"] {
        let model = open_cpu(&synth_file(preset, 4, 4));
        let mut s = model.new_session().unwrap();
        let prompt = tokens(6, 256, 3);
        let generated = s.generate(&prompt, &greedy(12, 3)).unwrap();
        let mut seq = prompt.clone();
        for &t in &generated {
            let logits = s.score_last(&seq, Some(3)).unwrap();
            assert_eq!(tinyloop::generate::sampling::argmax(&logits), t, "{preset}");
            seq.push(t);
        }
    }
}

#[test]
fn chunked_prefill_is_bit_identical_to_single_shot() {
    let path = synth_file("tiny-gqa", 2, 4);
    let prompt = tokens(37, 256, 9);
    let run = |chunk: usize| {
        let options = ModelOptions {
            prefill_chunk: chunk,
            ..common::cpu_options()
        };
        let model = Model::open(&path, &options).unwrap();
        model
            .new_session()
            .unwrap()
            .generate(&prompt, &greedy(16, 3))
            .unwrap()
    };
    let single = run(0);
    for chunk in [1, 5, 16] {
        assert_eq!(run(chunk), single, "prefill_chunk {chunk}");
    }
}

#[test]
fn score_refuses_inputs_longer_than_the_prefill_chunk() {
    let options = ModelOptions {
        prefill_chunk: 8,
        ..common::cpu_options()
    };
    let model = Model::open(synth_file("tiny", 1, 4), &options).unwrap();
    let mut s = model.new_session().unwrap();
    let err = s.score_last(&tokens(9, 256, 0), None).unwrap_err();
    assert!(err.to_string().contains("prefill_chunk=0"), "{err}");
    assert_eq!(s.score_last(&tokens(8, 256, 0), None).unwrap().len(), 256);
}

#[test]
fn logprobs_are_log_softmax_of_score() {
    let model = open_cpu(&synth_file("tiny", 1, 2));
    let mut s = model.new_session().unwrap();
    let input = tokens(6, 256, 4);
    let logprobs = s.logprobs(&input, Some(2)).unwrap();
    let logits = s.score(&input, Some(2)).unwrap();
    assert_eq!(logprobs.len(), 5);
    for (i, lp) in logprobs.iter().enumerate() {
        let row = &logits[i * 256..(i + 1) * 256];
        let total: f64 = row.iter().map(|&v| (v as f64).exp()).sum();
        let expected = row[input[i + 1] as usize] as f64 - total.ln();
        // f64 arithmetic on both sides; 1e-5 covers the f32 storage of the result.
        assert!((*lp as f64 - expected).abs() < 1e-5, "{lp} vs {expected}");
    }
    // The last position of score equals score_last.
    assert_eq!(
        &logits[5 * 256..],
        s.score_last(&input, Some(2)).unwrap().as_slice()
    );
}

/// The bit patterns of a vector of f32, so that equality means bit for bit.
fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

/// On the CPU a row's arithmetic does not depend on how many rows its step has: every linear
/// output is one dot product summed in a fixed order (backend/cpu/linear.rs), norms, RoPE and
/// SwiGLU work row by row, and attention reads every position, the row's own included, from the
/// cache. So in the fp16 KV mode logprobs fed one decode step at a time equal the one-step
/// (prefill) logprobs bit for bit, at every loop count; no tolerance is needed (the GPU, whose
/// one-row and multi-row products sum in different orders, is held to the parity tolerance in
/// tests/cuda_parity.rs instead).
#[test]
fn decode_path_logprobs_equal_prefill_logprobs_bit_for_bit() {
    for preset in ["tiny", "tiny-gqa"] {
        let model = open_cpu(&synth_file(preset, 5, 4));
        let mut s = model.new_session().unwrap();
        let input = tokens(24, model.config().vocab_size, 8);
        for loops in [1, 2, 5] {
            let prefill = s.logprobs(&input, Some(loops)).unwrap();
            let decode = s.logprobs_decode(&input, Some(loops)).unwrap();
            assert_eq!(decode.len(), input.len() - 1);
            assert_eq!(bits(&decode), bits(&prefill), "{preset} loops {loops}");
        }
    }
}

/// The decode path feeds one row per step, so `prefill_chunk` (which bounds the step buffers and
/// refuses longer one-step scores) does not limit it; the values equal the chunked logprobs.
#[test]
fn decode_path_logprobs_are_not_limited_by_the_prefill_chunk() {
    let options = ModelOptions {
        prefill_chunk: 8,
        ..common::cpu_options()
    };
    let model = Model::open(synth_file("tiny", 1, 4), &options).unwrap();
    let mut s = model.new_session().unwrap();
    let input = tokens(20, 256, 6);
    assert!(s.logprobs(&input, Some(3)).is_err(), "one step of 20 rows");
    let chunked = s.logprobs_with(&input, Some(3), None).unwrap();
    let decode = s.logprobs_decode(&input, Some(3)).unwrap();
    assert_eq!(bits(&decode), bits(&chunked));
}

#[test]
fn stop_tokens_end_generation_and_are_not_returned() {
    let model = open_cpu(&synth_file("tiny", 1, 4));
    let mut s = model.new_session().unwrap();
    let prompt = tokens(4, 256, 5);
    let free = s.generate(&prompt, &greedy(20, 2)).unwrap();
    let stop = free[5];
    let first_stop = free.iter().position(|&t| t == stop).unwrap();
    let params = GenerateParams {
        stop_tokens: vec![stop],
        ..greedy(20, 2)
    };
    assert_eq!(s.generate(&prompt, &params).unwrap(), &free[..first_stop]);
}

#[test]
fn stream_callback_sees_every_token_and_can_stop() {
    let model = open_cpu(&synth_file("tiny", 1, 4));
    let mut s = model.new_session().unwrap();
    let prompt = tokens(4, 256, 6);
    let mut seen = Vec::new();
    let out = s
        .generate_stream(&prompt, &greedy(10, 2), &mut |t| {
            seen.push(t);
            seen.len() < 4
        })
        .unwrap();
    assert_eq!(out, seen);
    assert_eq!(out.len(), 4);
}

#[test]
fn cancel_from_another_thread_stops_generation() {
    let model = open_cpu(&synth_file("small", 1, 4));
    let mut s = model.new_session().unwrap();
    let handle = s.cancel_handle();
    let (tx, rx) = std::sync::mpsc::channel();
    let canceller = std::thread::spawn(move || {
        rx.recv().unwrap();
        handle.cancel();
    });
    let mut count = 0;
    let result = s.generate_stream(&tokens(4, 256, 7), &greedy(200, 2), &mut |_| {
        count += 1;
        if count == 2 {
            tx.send(()).unwrap();
        }
        true
    });
    canceller.join().unwrap();
    assert!(matches!(result, Err(Error::Cancelled)), "{result:?}");
    assert!(count < 200);
    // A cancel only affects the call in flight: the next call runs to completion.
    assert_eq!(
        s.generate(&tokens(4, 256, 7), &greedy(5, 2)).unwrap().len(),
        5
    );
}

#[test]
fn sessions_on_two_threads_match_sequential_runs() {
    let model = open_cpu(&synth_file("tiny", 8, 4));
    let prompts = [tokens(5, 256, 10), tokens(9, 256, 11)];
    let sequential: Vec<_> = prompts
        .iter()
        .map(|p| {
            model
                .new_session()
                .unwrap()
                .generate(p, &greedy(24, 4))
                .unwrap()
        })
        .collect();
    let parallel: Vec<_> = std::thread::scope(|scope| {
        let handles: Vec<_> = prompts
            .iter()
            .map(|p| {
                let model = model.clone();
                scope.spawn(move || {
                    model
                        .new_session()
                        .unwrap()
                        .generate(p, &greedy(24, 4))
                        .unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(parallel, sequential);
}

#[test]
fn memory_accounting_tracks_sessions() {
    let model = open_cpu(&synth_file("tiny", 1, 4));
    let weights_only = model.memory_bytes();
    assert!(weights_only > 0);
    let mut s = model.new_session().unwrap();
    s.generate(&tokens(4, 256, 1), &greedy(2, 4)).unwrap();
    let with_session = model.memory_bytes();
    assert_eq!(with_session, weights_only + s.memory_bytes());
    drop(s);
    assert_eq!(model.memory_bytes(), weights_only);
}

/// Each bad input fails with InvalidArgument and a message naming the problem.
#[test]
fn bad_inputs_are_clear_errors() {
    let model = open_cpu(&synth_file("tiny", 1, 4));
    let mut s = model.new_session().unwrap();
    let ok = tokens(4, 256, 1);
    let cases: Vec<(&str, Result<Vec<u32>, Error>)> = vec![
        ("empty token sequence", s.generate(&[], &greedy(4, 2))),
        (
            "out of range for vocab_size 256",
            s.generate(&[1, 256], &greedy(4, 2)),
        ),
        (
            "loops must be in 1..=64, got 0",
            s.generate(&ok, &greedy(4, 0)),
        ),
        (
            "loops must be in 1..=64, got 65",
            s.generate(&ok, &greedy(4, 65)),
        ),
        ("max_tokens must be >= 1", s.generate(&ok, &greedy(0, 2))),
        (
            "prompt of 256 tokens leaves no room to generate in max_seq_len 256",
            s.generate(&tokens(256, 256, 0), &greedy(1, 2)),
        ),
        (
            "257 tokens exceed max_seq_len 256",
            s.score_last(&tokens(257, 256, 0), None).map(|_| vec![]),
        ),
        (
            "temperature must be",
            s.generate(
                &ok,
                &GenerateParams {
                    sampling: SamplingParams {
                        temperature: f32::NAN,
                        ..Default::default()
                    },
                    ..greedy(4, 2)
                },
            ),
        ),
        (
            "top_p must be in (0, 1]",
            s.generate(
                &ok,
                &GenerateParams {
                    sampling: SamplingParams {
                        temperature: 1.0,
                        top_p: 0.0,
                        ..Default::default()
                    },
                    ..greedy(4, 2)
                },
            ),
        ),
        (
            "stop token 300",
            s.generate(
                &ok,
                &GenerateParams {
                    stop_tokens: vec![300],
                    ..greedy(4, 2)
                },
            ),
        ),
        ("at least 2 tokens", s.logprobs(&[3], None).map(|_| vec![])),
        (
            "at least 2 tokens",
            s.logprobs_decode(&[3], None).map(|_| vec![]),
        ),
        (
            "257 tokens exceed max_seq_len 256",
            s.logprobs_decode(&tokens(257, 256, 0), None)
                .map(|_| vec![]),
        ),
        (
            "out of range for vocab_size 256",
            s.logprobs_decode(&[1, 256], None).map(|_| vec![]),
        ),
    ];
    for (expected, result) in cases {
        match result {
            Err(Error::InvalidArgument(msg)) => {
                assert!(msg.contains(expected), "{msg:?} lacks {expected:?}")
            }
            other => panic!("expected InvalidArgument({expected:?}), got {other:?}"),
        }
    }
}

/// `max_seq_len` 0 (the default) opens a model for 2048 tokens, or for its max_position when
/// that is smaller; an explicit value above max_position stays an error.
#[test]
fn max_seq_len_defaults_to_the_model_s_positions() {
    let options = |max_seq_len| ModelOptions {
        device: Some(Device::Cpu),
        log: false,
        max_seq_len,
        ..ModelOptions::default()
    };
    assert_eq!(ModelOptions::default().max_seq_len, 0);
    for (max_position, expected) in [(256, 256), (2048, 2048), (4096, 2048)] {
        let model = Model::open(synth_with_max_position(max_position), &options(0)).unwrap();
        assert_eq!(
            model.options().max_seq_len,
            expected,
            "max_position {max_position}"
        );
        // Exactly that many tokens fit: generation stops there, and a prompt of that many
        // tokens leaves no room.
        let mut session = model.new_session().unwrap();
        let prompt = tokens(expected - 2, 256, 3);
        assert_eq!(session.generate(&prompt, &greedy(3, 1)).unwrap().len(), 2);
        let full = tokens(expected, 256, 3);
        let err = session.generate(&full, &greedy(1, 1)).unwrap_err();
        assert!(
            err.to_string().contains(&format!(
                "leaves no room to generate in max_seq_len {expected}"
            )),
            "{err}"
        );
    }
    let err = Model::open(synth_with_max_position(256), &options(257)).unwrap_err();
    assert!(
        err.to_string()
            .contains("max_seq_len 257 exceeds the model's max_position 256"),
        "{err}"
    );
}
