//! CTX-TIER on the CPU backend: the INT4 → INT2 re-pack, the tier policy and its observations,
//! the loop-body memory shared by sessions, scoring in steps, and the C ABI and CLI surfaces.
//! (The CUDA re-pack kernel and the same model-level checks on the GPU are in cuda_parity.rs.)

mod common;

use std::process::Command;

use common::{loop_body_bytes, open_cpu, scratch, synth_file, tokens, with_int2_loop_body};
use tinyloop::backend::cpu::CpuBackend;
use tinyloop::backend::{Backend, HostLinear};
use tinyloop::format::DType;
use tinyloop::generate::sampling::Rng;
use tinyloop::model::quant::{quantize_rtn, QuantizedMatrix};
use tinyloop::{CtxTier, GenerateParams, Model, ModelOptions, Tier};

fn policy(short_t: usize, long_t: usize) -> CtxTier {
    CtxTier {
        short_t,
        long_t,
        ..CtxTier::default()
    }
}

fn greedy(max_tokens: usize, ctx_tier: Option<CtxTier>) -> GenerateParams {
    GenerateParams {
        max_tokens,
        loops: Some(3),
        ctx_tier,
        ..GenerateParams::default()
    }
}

fn gaussian(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = Rng::new(seed);
    let mut uniform = move || (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
    (0..n)
        .map(|_| {
            let (u1, u2) = (uniform().max(1e-300), uniform());
            ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
        })
        .collect()
}

fn dequantized(q: &QuantizedMatrix) -> Vec<f32> {
    let mut out = vec![0f32; q.rows * q.cols];
    for (row, values) in out.chunks_exact_mut(q.cols).enumerate() {
        q.dequantize_row(row, values);
    }
    out
}

fn distance(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(&x, &y)| (x as f64 - y as f64).powi(2))
        .sum::<f64>()
        .sqrt()
}

#[test]
fn repack_equals_int2_quantization_of_the_dequantized_int4_weights() {
    for (rows, cols, group) in [(64, 256, 128), (48, 96, 32), (8, 2048, 2048), (3, 64, 4)] {
        let w = gaussian(rows * cols, rows as u64 * 31 + cols as u64);
        let int4 = quantize_rtn(&w, rows, cols, DType::Int4, group).unwrap();
        // The definition: round-to-nearest INT2 of the dequantized INT4 values.
        let direct = quantize_rtn(&dequantized(&int4), rows, cols, DType::Int2, group).unwrap();
        assert_eq!(int4.requantize(DType::Int2).unwrap(), direct);
        // The CPU backend's re-pack, through upload and download.
        let bytes = int4.to_bytes();
        let host = HostLinear {
            rows,
            cols,
            dtype: DType::Int4,
            group_size: group,
            bytes: &bytes,
        };
        let uploaded = CpuBackend.upload_linear(&host).unwrap();
        let repacked = CpuBackend
            .requantize_linear(&uploaded, DType::Int2)
            .unwrap();
        let down = CpuBackend.download_linear(&repacked).unwrap();
        assert_eq!((down.dtype, down.group_size), (DType::Int2, group));
        assert_eq!(down.bytes, direct.to_bytes(), "{rows}x{cols} g{group}");
    }
}

/// The page's error ratio: ‖W − deq(re-pack)‖ / ‖W − deq(INT2 RTN of W)‖ for Gaussian W.
/// The INT4 step (range / 15) is a fifth of the INT2 step (range / 3), so its rounding error adds
/// to the INT2 error in quadrature as √(1 + (3/15)²) ≈ 1.02 (and the re-pack's group range
/// shrinks by at most half an INT4 step). Bound: 0.95 ≤ ratio ≤ 1.10.
#[test]
fn repack_error_is_that_of_direct_int2_quantization() {
    let (rows, cols, group) = (64, 256, 128);
    let w = gaussian(rows * cols, 7);
    let int4 = quantize_rtn(&w, rows, cols, DType::Int4, group).unwrap();
    let repacked = int4.requantize(DType::Int2).unwrap();
    let direct = quantize_rtn(&w, rows, cols, DType::Int2, group).unwrap();
    let ratio = distance(&w, &dequantized(&repacked)) / distance(&w, &dequantized(&direct));
    assert!((0.95..=1.10).contains(&ratio), "ratio {ratio}");
}

/// A prompt that reaches long_t runs its positions below long_t − 1 at INT4 and the rest at INT2
/// (the tier of position p is the one observed at seq_len p + 1), whether prefilled in one step
/// or in chunks: the prefill step is cut at the change.
#[test]
fn a_prompt_across_long_t_switches_at_its_position() {
    let path = synth_file("tiny", 3, 4);
    let int2 = open_cpu(&with_int2_loop_body(&path));
    let model = open_cpu(&path);
    let prompt = tokens(10, model.config().vocab_size, 5);
    let mut session = model.new_session().unwrap();
    let got = session
        .generate(&prompt, &greedy(12, Some(policy(4, 8))))
        .unwrap();
    let stats = session.last_generate_stats().ctx_tier.unwrap();
    // The prefill is two steps (positions 0..7 at SHORT, 7..10 at LONG), then 11 decode steps.
    assert_eq!((stats.observations, stats.transitions), (13, 1));
    assert_eq!((stats.short_steps, stats.long_steps), (1, 12));
    assert_eq!(stats.tier, Tier::Long);
    // Chunked prefill cuts at the same position: the same tokens.
    let chunked = Model::open(
        &path,
        &ModelOptions {
            prefill_chunk: 3,
            ..common::cpu_options()
        },
    )
    .unwrap();
    let in_chunks = chunked
        .new_session()
        .unwrap()
        .generate(&prompt, &greedy(12, Some(policy(4, 8))))
        .unwrap();
    assert_eq!(in_chunks, got);
    // Every logit: positions 0..=6 are the INT4 model's, the later ones neither model's alone.
    let scored = session
        .logprobs_with(&prompt, Some(3), Some(&policy(4, 8)))
        .unwrap();
    let at = |m: &Model| m.new_session().unwrap().logprobs(&prompt, Some(3)).unwrap();
    let (int4_lp, int2_lp) = (at(&model), at(&int2));
    assert_eq!(scored[..7], int4_lp[..7]);
    assert_ne!(scored[7..], int4_lp[7..]);
    assert_ne!(scored[7..], int2_lp[7..]);
    // A call that stays LONG from its first position (the session is LONG and short_t = 1 keeps
    // it there) runs entirely at INT2: the same weights through the same ops as the INT2 model.
    let all_long = session
        .generate(&prompt, &greedy(12, Some(policy(1, 8))))
        .unwrap();
    let stats = session.last_generate_stats().ctx_tier.unwrap();
    assert_eq!((stats.transitions, stats.short_steps), (0, 0));
    let expected = int2
        .new_session()
        .unwrap()
        .generate(&prompt, &greedy(12, None))
        .unwrap();
    assert_eq!(all_long, expected);
    // And without a policy the session is back on the INT4 body.
    let plain = session.generate(&prompt, &greedy(12, None)).unwrap();
    let int4 = model
        .new_session()
        .unwrap()
        .generate(&prompt, &greedy(12, None))
        .unwrap();
    assert_eq!(plain, int4);
    assert_ne!(
        plain, all_long,
        "INT2 and INT4 bodies should not agree on 12 tokens"
    );
}

/// Prefix caches and resume handles hold INT4 results: a call whose policy keeps the handle's
/// positions at SHORT gives what a fresh generation gives; one that would run them at LONG is
/// refused.
#[test]
fn prefix_caches_and_resume_handles_under_a_policy() {
    let model = open_cpu(&synth_file("tiny", 6, 4));
    let vocab = model.config().vocab_size;
    let (prefix, prompt) = (tokens(6, vocab, 1), tokens(4, vocab, 2));
    let whole: Vec<u32> = prefix.iter().chain(&prompt).copied().collect();
    let mut s = model.new_session().unwrap();
    let params = |long_t| greedy(10, Some(policy(2, long_t)));
    let cache = s.build_prefix_cache(&prefix, Some(3)).unwrap();
    let handle = s.build_resume_handle(&whole, Some(3)).unwrap();
    // long_t 13: LONG from position 12, inside the generation.
    let fresh = s.generate(&whole, &params(13)).unwrap();
    let with_prefix = s
        .generate_with_prefix(&cache, &prompt, &params(13), &mut |_| true)
        .unwrap();
    assert_eq!(with_prefix, fresh);
    let resumed = s
        .resume_generate(&handle, &params(13), &mut |_| true)
        .unwrap();
    assert_eq!(resumed, fresh);
    // long_t 5: the prefix's position 4 would run at LONG.
    for result in [
        s.generate_with_prefix(&cache, &prompt, &params(5), &mut |_| true),
        s.resume_generate(&handle, &params(5), &mut |_| true),
    ] {
        match result {
            Err(tinyloop::Error::InvalidArgument(msg)) => {
                assert!(msg.contains("SHORT tier"), "{msg}")
            }
            other => panic!("expected a refusal, got {other:?}"),
        }
    }
}

#[test]
fn a_transition_in_the_middle_of_generation() {
    let path = synth_file("tiny", 4, 4);
    let model = open_cpu(&path);
    let prompt = tokens(5, model.config().vocab_size, 9);
    let mut session = model.new_session().unwrap();
    // Observation 1 is the prefill (seq_len 5); decode step k feeds position 4 + k, so
    // observation 4 (seq_len 8) reaches long_t. The prefill and the first two decode steps ran
    // at INT4: they chose the first three tokens.
    let got = session
        .generate(&prompt, &greedy(10, Some(policy(4, 8))))
        .unwrap();
    let stats = session.last_generate_stats().ctx_tier.unwrap();
    assert_eq!(stats.observations, 10);
    assert_eq!((stats.short_steps, stats.long_steps), (3, 7));
    assert_eq!((stats.transitions, stats.last_seq_len), (1, 14));
    let plain = model
        .new_session()
        .unwrap()
        .generate(&prompt, &greedy(10, None))
        .unwrap();
    assert_eq!(got[..3], plain[..3]);
    // Hysteresis acts along a sequence: a new call starts at position 0 (seq_len 1), below
    // short_t, so it goes back to SHORT for its first positions and its output does not depend on
    // the session's earlier calls.
    let again = session
        .generate(&prompt, &greedy(10, Some(policy(4, 8))))
        .unwrap();
    assert_eq!(again, got);
    let stats = session.last_generate_stats().ctx_tier.unwrap();
    assert_eq!((stats.transitions, stats.tier), (2, Tier::Long));
    // With short_t = 1 nothing is below it: the session stays LONG from the first position.
    session
        .generate(&prompt[..2], &greedy(1, Some(policy(1, 8))))
        .unwrap();
    let kept = session.last_generate_stats().ctx_tier.unwrap();
    assert_eq!((kept.transitions, kept.short_steps), (0, 0));
}

fn cpu_weight_bytes(rows: usize, cols: usize, bits: usize, group: usize) -> usize {
    // Packed codes, then scales and zeros widened to f32 (src/backend/cpu/linear.rs).
    rows * cols * bits / 8 + 2 * 4 * rows * (cols / group)
}

#[test]
fn memory_follows_the_loop_bodies_the_sessions_hold() {
    let path = synth_file("small", 2, 4);
    let (int4, int2) = loop_body_bytes(&path, cpu_weight_bytes);
    let model = open_cpu(&path);
    let full = model.weight_bytes();
    let long = Some(policy(1, 2));
    let prompt = tokens(6, model.config().vocab_size, 1);
    let mut a = model.new_session().unwrap();
    let mut b = model.new_session().unwrap();
    let at_int4 = a.generate(&prompt, &greedy(4, None)).unwrap();

    // A at LONG, B at SHORT: both bodies.
    a.generate(&prompt, &greedy(4, long.clone())).unwrap();
    assert_eq!(model.weight_bytes(), full + int2);
    assert_eq!(
        model.memory_bytes(),
        model.weight_bytes() + a.memory_bytes() + b.memory_bytes()
    );
    // B at LONG too: nobody holds INT4, which is freed; the re-pack is shared.
    b.generate(&prompt, &greedy(4, long.clone())).unwrap();
    assert_eq!(model.weight_bytes(), full - int4 + int2);
    let freed = b.last_generate_stats().ctx_tier.unwrap().freed_bytes;
    assert_eq!(freed, int4 as i64);
    assert_eq!(
        a.last_generate_stats().ctx_tier.unwrap().freed_bytes,
        -(int2 as i64)
    );
    // A new session starts at SHORT: INT4 comes back from the host copy.
    let c = model.new_session().unwrap();
    assert_eq!(model.weight_bytes(), full + int2);
    drop(c);
    assert_eq!(model.weight_bytes(), full - int4 + int2);
    // A call without a policy needs INT4; B still holds INT2.
    let restored = a.generate(&prompt, &greedy(4, None)).unwrap();
    assert_eq!(
        restored, at_int4,
        "the host copy restores the INT4 weights exactly"
    );
    assert_eq!(model.weight_bytes(), full + int2);
    // Once no session is at LONG the re-pack is freed.
    drop(b);
    assert_eq!(model.weight_bytes(), full);
    assert_eq!(model.memory_bytes(), full + a.memory_bytes());
}

#[test]
fn scoring_in_steps_switches_at_the_step_that_reaches_long_t() {
    let path = synth_file("tiny", 5, 4);
    let (t, chunk, n) = (8, 4, 20);
    let options = ModelOptions {
        prefill_chunk: chunk,
        ..common::cpu_options()
    };
    let model = Model::open(&path, &options).unwrap();
    let whole = open_cpu(&path);
    let window = tokens(n, model.config().vocab_size, 3);
    let mut session = model.new_session().unwrap();
    let reference = whole
        .new_session()
        .unwrap()
        .logprobs(&window, Some(3))
        .unwrap();
    // Steps of `chunk` tokens give what one step gives (fp16 KV: bit-identical).
    let stepped = session.logprobs_with(&window, Some(3), None).unwrap();
    assert_eq!(stepped, reference);
    assert!(session.last_ctx_tier_stats().is_none());
    // long_t = T + 1: positions below T at INT4, from T on at INT2.
    let tiered = session
        .logprobs_with(&window, Some(3), Some(&policy(1, t + 1)))
        .unwrap();
    assert_eq!(tiered[..t], reference[..t]);
    assert_ne!(tiered[t..], reference[t..]);
    let stats = session.last_ctx_tier_stats().unwrap();
    assert_eq!(
        (stats.short_steps, stats.long_steps),
        (t / chunk, (n - t) / chunk)
    );
    // Each window is a new call: the first step is short again, so it starts at SHORT.
    let again = session
        .logprobs_with(&window, Some(3), Some(&policy(chunk + 1, t + 1)))
        .unwrap();
    assert_eq!(again, tiered);
}

#[test]
fn bad_policies_are_rejected_with_clear_errors() {
    let path = synth_file("tiny", 3, 4);
    let model = open_cpu(&path);
    let mut session = model.new_session().unwrap();
    let prompt = tokens(4, model.config().vocab_size, 2);
    let cases = [
        (policy(9, 8), "short_t (9) must be <= long_t (8)"),
        (policy(0, 8), "short_t must be >= 1"),
        (
            CtxTier {
                long_bits: 3,
                ..policy(4, 8)
            },
            "long_bits must be 2",
        ),
    ];
    for (bad, message) in cases {
        let err = session
            .generate(&prompt, &greedy(2, Some(bad)))
            .unwrap_err();
        assert!(err.to_string().contains(message), "{err}");
    }
    // Only an INT4 loop body can be re-packed.
    for bits in [2, 16] {
        let other = open_cpu(&synth_file("tiny", 3, bits));
        let err = other
            .new_session()
            .unwrap()
            .generate(&prompt, &greedy(2, Some(policy(4, 8))))
            .unwrap_err();
        assert!(
            err.to_string().contains("re-packs an INT4 loop body"),
            "{err}"
        );
    }
}

fn cli(args: &[&str], env: &[(&str, &str)]) -> std::process::Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_tinyloop"));
    command.args(args);
    for var in [
        "TINYLOOP_CTX_TIER",
        "TINYLOOP_CTX_TIER_SHORT_T",
        "TINYLOOP_CTX_TIER_LONG_T",
        "TINYLOOP_CTX_TIER_LONG_BITS",
        "TINYLOOP_CTX_TIER_VERBOSE",
        "TINYLOOP_CTX_TIER_FILE",
    ] {
        command.env_remove(var);
    }
    command.env("TINYLOOP_DEVICE", "cpu");
    command.envs(env.iter().copied());
    command.output().unwrap()
}

#[test]
fn cli_reports_tiers_only_when_asked() {
    let path = synth_file("tiny", 3, 4);
    let model = path.to_str().unwrap();
    let gen = [
        model,
        "generate",
        "--tokens",
        "1,2,3,4,5",
        "--max-tokens",
        "6",
        "--json",
    ];
    let plain = cli(&gen, &[]);
    assert!(plain.status.success());
    let stderr = String::from_utf8_lossy(&plain.stderr);
    assert!(!stderr.contains("[ctx_tier]"), "{stderr}");

    let json = scratch("ctx-tier-cli").join("summary.json");
    let env = [
        ("TINYLOOP_CTX_TIER", "1"),
        ("TINYLOOP_CTX_TIER_SHORT_T", "4"),
        ("TINYLOOP_CTX_TIER_LONG_T", "8"),
        ("TINYLOOP_CTX_TIER_VERBOSE", "1"),
        ("TINYLOOP_CTX_TIER_FILE", json.to_str().unwrap()),
    ];
    // The lines are the library's log: printed by a model that logs, silenced by --json and -q
    // (the model's log option off), which leave the file and the JSON statistics.
    let text = &gen[..gen.len() - 1];
    let logged = cli(text, &env);
    assert!(logged.status.success());
    let stderr = String::from_utf8_lossy(&logged.stderr);
    for line in [
        "[ctx_tier] enabled: short_t=4 long_t=8 long_bits=INT2",
        "[ctx_tier] transition at observation 4 (seq_len=8): SHORT -> LONG",
        "[ctx_tier] apply: loop body, 5 weights re-packed (INT4 → INT2, ",
        "[ctx_tier] summary: n_obs=6 elapsed=",
        "SHORT=50.0% LONG=50.0% transitions=1 last_seq_len=10",
        "[ctx_tier]   t=4 seq_len=8 : SHORT -> LONG",
    ] {
        assert!(stderr.contains(line), "missing {line:?} in\n{stderr}");
    }
    let quiet = cli(&[text, &["-q"]].concat(), &env);
    assert!(quiet.status.success());
    assert_eq!(quiet.stdout, logged.stdout, "-q changes no token");
    assert_eq!(String::from_utf8_lossy(&quiet.stderr), "");
    std::fs::remove_file(&json).unwrap();
    let tiered = cli(&gen, &env);
    assert!(tiered.status.success());
    let stderr = String::from_utf8_lossy(&tiered.stderr);
    assert!(!stderr.contains("[ctx_tier]"), "{stderr}");
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(summary["n_obs"], 6);
    assert_eq!(summary["transitions"], 1);
    assert_eq!(summary["tier"], "LONG");
    // The flags give the same run; the output carries the tier statistics.
    let flags = [
        &gen[..],
        &[
            "--ctx-tier",
            "--ctx-tier-short-t",
            "4",
            "--ctx-tier-long-t",
            "8",
        ],
    ]
    .concat();
    let by_flags = cli(&flags, &[]);
    let out: serde_json::Value = serde_json::from_slice(&by_flags.stdout).unwrap();
    let env_out: serde_json::Value = serde_json::from_slice(&tiered.stdout).unwrap();
    assert_eq!(out["tokens"], env_out["tokens"]);
    assert_eq!(out["stats"]["ctx_tier"]["long_steps"], 3);

    let bad = cli(
        &gen,
        &[
            ("TINYLOOP_CTX_TIER", "1"),
            ("TINYLOOP_CTX_TIER_LONG_BITS", "3"),
        ],
    );
    assert_eq!(bad.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&bad.stderr);
    assert!(
        stderr.contains("TINYLOOP_CTX_TIER_LONG_BITS=\"3\" is not accepted: expected 2"),
        "{stderr}"
    );
    let bad = cli(
        &[&gen[..], &["--ctx-tier", "--ctx-tier-long-bits", "4"]].concat(),
        &[],
    );
    assert_eq!(bad.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&bad.stderr);
    assert!(
        stderr.contains("invalid value '4' for '--ctx-tier-long-bits <BITS>': expected 2"),
        "{stderr}"
    );
}

#[test]
fn cli_scores_windows_in_steps_under_a_tier() {
    let path = synth_file("tiny", 3, 4);
    let text = scratch("ctx-tier-score").join("text.txt");
    std::fs::write(
        &text,
        "To be, or not to be, that is the question: whether 'tis nobler",
    )
    .unwrap();
    let model = path.to_str().unwrap();
    let base = [
        model,
        "score",
        "--file",
        text.to_str().unwrap(),
        "--window",
        "32",
        "--json",
    ];
    let run = |extra: &[&str]| -> serde_json::Value {
        let out = cli(&[&base[..], extra].concat(), &[]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let whole = run(&[]);
    let stepped = run(&["--prefill-chunk", "8"]);
    assert_eq!(whole["nll"], stepped["nll"]);
    let tiered = run(&[
        "--prefill-chunk",
        "8",
        "--ctx-tier",
        "--ctx-tier-short-t",
        "9",
        "--ctx-tier-long-t",
        "17",
    ]);
    // Windows of 32 and 30 tokens: steps ending at 8 and 16 run at INT4, the later ones at
    // INT2; the second window's first step (seq_len 8 < short_t) returns to SHORT.
    assert_eq!(tiered["ctx_tier"]["short_steps"], 4);
    assert_eq!(tiered["ctx_tier"]["long_steps"], 4);
    assert_eq!(tiered["ctx_tier"]["transitions"], 3);
    assert_ne!(tiered["nll"], whole["nll"]);
}
