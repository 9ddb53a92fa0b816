//! BETA-MON on the GPU: the entropies the device computes (the `entropy_f32` kernel, inside the
//! captured decode graph and after the verify rows) against an f64 recomputation from the same
//! logits, and generation with BETA-MON on giving the tokens of generation with it off.
//!
//! Without a usable GPU each test writes "skipped: no CUDA device (why)" to stderr and returns;
//! with TINYLOOP_REQUIRE_CUDA=1 absence is a failure (as tests/cuda_parity.rs).
//!
//! # Tolerance: `|h_gpu − h_f64| ≤ 10⁻⁴ · h_f64 + 10⁻⁵` bits
//!
//! The kernel forms `S = Σ e^z` and `T = Σ z e^z` over `z = l − max` in f32 and returns
//! `(ln S − T/S) / ln 2`. Both `ln S` and `−T/S` lie in [0, H] (`−T/S = H − ln S`), so H is a sum
//! of two non-negative terms and its relative error is about that of S and T. Each term has a
//! relative error of a few 2⁻²⁴ (the subtraction, `expf` to 2 ulp, the product); a thread adds
//! len / (256 · blocks) ≤ 4 terms sequentially, then trees of 5 + 3 + 5 + 3 levels merge the
//! partial moments (each merge rescales by one `expf`). Worst case about 25 roundings of 2⁻²⁴:
//! 1.5·10⁻⁶ relative, so 10⁻⁴ relative leaves a factor of 60. The absolute 10⁻⁵ covers the
//! f32 logarithm and division near H = 0 (a single dominant logit).

mod common;
use common::cuda_or_skip;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;

use tinyloop::backend::cuda::CudaBackend;
use tinyloop::backend::{Backend, Choice, StepInput};
use tinyloop::generate::sampling::{Rng, SamplingParams};
use tinyloop::kv::{KvLayout, KvMode, TierBounds};
use tinyloop::model::forward::{
    choose, chosen, decode_step, final_norm, forward, logits, measure, Buffers, Decode, LOGIT_ROWS,
};
use tinyloop::model::synth::{preset, random_model};
use tinyloop::model::weights::Weights;
use tinyloop::telemetry::beta_monitor::entropy_bits;
use tinyloop::{BetaMonitor, Device, GenerateParams, Model, ModelFile, ModelOptions, Speculation};

fn tol(h: f64) -> f64 {
    1e-4 * h + 1e-5
}

fn gpu() -> CudaBackend {
    CudaBackend::open(0).unwrap_or_else(|e| panic!("CUDA device present but unusable: {e}"))
}

fn normal(rng: &mut Rng) -> f32 {
    let u1 = rng.next_f64().max(f64::MIN_POSITIVE);
    let u2 = rng.next_f64();
    ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
}

/// The device's entropies of `rows` (all of one length), measured together.
fn device_entropies(b: &CudaBackend, rows: &[Vec<f32>]) -> Vec<f32> {
    let len = rows[0].len();
    let flat: Vec<f32> = rows.concat();
    let mut x = b.alloc_float(flat.len()).unwrap();
    b.write_float(&mut x, &flat).unwrap();
    let mut step = b.alloc_step(1).unwrap();
    let input = StepInput {
        tokens: &[0],
        start_pos: 0,
        choice: Choice::Greedy,
    };
    b.set_step(&mut step, input, TierBounds::default()).unwrap();
    b.entropy_rows(&x, rows.len(), len, &mut step);
    b.entropies(&step, rows.len()).unwrap()
}

fn check(h_gpu: f32, h_ref: f64, what: &str, worst: &mut f64) {
    let err = (h_gpu as f64 - h_ref).abs();
    *worst = worst.max(err / tol(h_ref));
    assert!(
        err <= tol(h_ref),
        "{what}: device {h_gpu} vs f64 {h_ref} (error {err:.2e}, tolerance {:.2e})",
        tol(h_ref)
    );
}

#[test]
fn cuda_entropy_matches_an_f64_recomputation() {
    if !cuda_or_skip("cuda_entropy_matches_an_f64_recomputation") {
        return;
    }
    let b = gpu();
    let mut rng = Rng::new(41);
    let mut worst = 0f64;
    let mut cases = 0;
    for len in [1, 2, 7, 256, 1000, 1025, 50304, 131072] {
        // Flat to peaked distributions, and a shifted copy (only differences matter).
        for scale in [0.01f32, 1.0, 3.0, 30.0] {
            let rows: Vec<Vec<f32>> = (0..LOGIT_ROWS)
                .map(|r| {
                    let shift = if r % 2 == 0 { 0.0 } else { 50.0 };
                    (0..len).map(|_| scale * normal(&mut rng) + shift).collect()
                })
                .collect();
            let device = device_entropies(&b, &rows);
            for (r, row) in rows.iter().enumerate() {
                let what = format!("len {len} scale {scale} row {r}");
                check(device[r], entropy_bits(row), &what, &mut worst);
                cases += 1;
            }
        }
    }
    // Exact cases: uniform rows, a single dominant logit, a two-point distribution.
    let uniform = vec![vec![2.5f32; 50304]];
    check(
        device_entropies(&b, &uniform)[0],
        50304f64.log2(),
        "uniform",
        &mut worst,
    );
    let mut peaked = vec![-100.0f32; 4096];
    peaked[1234] = 100.0;
    let h = device_entropies(&b, &[peaked])[0];
    assert!((0.0..=1e-5).contains(&h), "one dominant logit: {h}");
    // A logit that is not finite: NaN, as the host reference.
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let mut row: Vec<f32> = (0..3000).map(|_| normal(&mut rng)).collect();
        row[1777] = bad;
        assert!(entropy_bits(&row).is_nan());
        let h = device_entropies(&b, &[row])[0];
        assert!(h.is_nan(), "a {bad} logit gives {h}");
    }
    let _ = writeln!(
        std::io::stderr(),
        "op entropy: {cases} rows, worst error {worst:.3} of the tolerance 1e-4 H + 1e-5 bits"
    );
}

/// A synthetic model file, written once per process (or under TINYLOOP_PARITY_MODELS).
fn synth(name: &str) -> PathBuf {
    let dir = std::env::var_os("TINYLOOP_PARITY_MODELS")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            std::env::temp_dir().join(format!("tinyloop-beta-mon-{}", std::process::id()))
        });
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{name}-b4-g128.tinyloop"));
    if !path.exists() {
        random_model(&preset(name).unwrap(), 1, 4, 128)
            .unwrap()
            .write(&path)
            .unwrap();
    }
    path
}

fn demo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("models/demo.tinyloop")
}

/// Prefill and decode on the GPU with the entropy measured at every token (the first through
/// `choose` + `measure`, the rest inside captured decode graphs, greedy and sampled): each
/// entropy read with the token equals the f64 entropy of the logits of that step; the same steps
/// without measuring choose the same tokens.
#[test]
fn cuda_decode_graph_entropy_matches_its_logits() {
    if !cuda_or_skip("cuda_decode_graph_entropy_matches_its_logits") {
        return;
    }
    let mut worst = 0f64;
    for path in [demo(), synth("tiny-gqa"), synth("tl-407m")] {
        let file = ModelFile::open(&path).unwrap();
        let config = file.config.clone();
        let max_seq = 96;
        let layout = KvLayout::new(&config, KvMode::Fp16, max_seq).unwrap();
        let engine = gpu();
        let w = Weights::load(&engine, &file, max_seq).unwrap();
        engine.finish_load(&w).unwrap();
        let session = engine.session(&config).unwrap();
        let mut buf = Buffers::new(
            &session,
            &config,
            16,
            layout,
            w.body.loaded().unwrap(),
            tinyloop::StateInit::Model,
        )
        .unwrap();
        let never = AtomicBool::new(false);
        let vocab = config.vocab_size;
        let loops = config.default_loops;
        let prompt: Vec<u32> = (0..9u32).map(|i| (i * 37 + 5) % vocab as u32).collect();
        let mut runs: Vec<Vec<u32>> = Vec::new();
        for measured in [true, false, true] {
            let input = StepInput {
                tokens: &prompt,
                start_pos: 0,
                choice: Choice::Greedy,
            };
            forward(&session, &w, &mut buf, input, loops, &never).unwrap();
            final_norm(&session, &w, &mut buf, prompt.len());
            logits(&session, &w, &mut buf, prompt.len() - 1, 1);
            choose(&session, &w, &mut buf);
            if measured {
                measure(&session, &w, &mut buf, 1);
            }
            let mut next = chosen(&session, &buf, measured).unwrap();
            let mut tokens = vec![next.token];
            let mut draws = Rng::new(3);
            for i in 0..24 {
                if measured {
                    let row = session.read_float(&buf.logits, 0, vocab).unwrap();
                    let h = next.entropy_bits.expect("measured");
                    let what = format!("{} step {i}", path.display());
                    check(h, entropy_bits(&row), &what, &mut worst);
                } else {
                    assert_eq!(next.entropy_bits, None);
                }
                let choice = if i % 3 == 2 {
                    Choice::Sample {
                        params: SamplingParams {
                            temperature: 0.9,
                            top_k: 0,
                            top_p: 0.95,
                            seed: 0,
                        },
                        draw: draws.next_draw(),
                    }
                } else {
                    Choice::Greedy
                };
                let input = StepInput {
                    tokens: &[next.token],
                    start_pos: prompt.len() + i,
                    choice,
                };
                let step = Decode::plain(loops).measured(measured);
                decode_step(&session, &w, &mut buf, input, step).unwrap();
                next = chosen(&session, &buf, measured).unwrap();
                tokens.push(next.token);
            }
            runs.push(tokens);
        }
        assert_eq!(
            runs[0],
            runs[1],
            "{}: measuring changed tokens",
            path.display()
        );
        assert_eq!(runs[0], runs[2], "{}: graphs of both keys", path.display());
    }
    let _ = writeln!(
        std::io::stderr(),
        "decode entropy: worst error {worst:.3} of the tolerance"
    );
}

fn open_gpu(path: &Path) -> Model {
    let options = ModelOptions {
        max_seq_len: 256,
        device: Some(Device::Cuda(0)),
        log: false,
        ..ModelOptions::default()
    };
    Model::open(path, &options).unwrap()
}

/// Through the session API on the GPU: plain, sampled and speculative calls return the same
/// tokens with BETA-MON on as off, one entropy per token, the agreement of the speculative
/// statistics, and entropies inside the range an f64 recomputation allows.
#[test]
fn cuda_monitored_generation_keeps_its_tokens() {
    if !cuda_or_skip("cuda_monitored_generation_keeps_its_tokens") {
        return;
    }
    let model = open_gpu(&demo());
    let mut s = model.new_session().unwrap();
    let prompt: Vec<u32> = b"ROMEO:\n".iter().map(|&b| b as u32).collect();
    let off = GenerateParams {
        max_tokens: 48,
        loops: Some(8),
        ..GenerateParams::default()
    };
    let sampled = GenerateParams {
        sampling: SamplingParams {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            seed: 11,
        },
        ..off.clone()
    };
    let spec = Speculation {
        draft_loops: 2,
        draft_len: 4,
        reuse: true,
    };
    for (name, params, speculative) in [
        ("greedy", &off, false),
        ("sampled", &sampled, false),
        ("speculative", &off, true),
        ("speculative sampled", &sampled, true),
    ] {
        let mut run = |p: &GenerateParams| {
            if speculative {
                s.generate_speculative(&prompt, p, &spec, &mut |_| true)
                    .unwrap()
            } else {
                s.generate(&prompt, p).unwrap()
            }
        };
        let plain = run(params);
        let on = GenerateParams {
            beta_monitor: Some(BetaMonitor::default()),
            ..params.clone()
        };
        let watched = run(&on);
        assert_eq!(watched, plain, "{name}: BETA-MON changed the tokens");
        let stats = s.last_generate_stats();
        let b = stats.beta_mon.expect("a summary");
        assert_eq!(b.n_tokens, plain.len(), "{name}");
        assert!(
            0.0 <= b.entropy_min_bits
                && b.entropy_min_bits <= b.entropy_mean_bits
                && b.entropy_mean_bits <= b.entropy_max_bits
                && b.entropy_max_bits <= 8.0 + tol(8.0),
            "{name}: {b:?}"
        );
        if speculative {
            assert!(stats.drafted > 0);
            assert_eq!(b.agreement_rate, Some(stats.agreement()), "{name}");
        } else {
            assert_eq!(b.agreement_rate, None, "{name}");
        }
    }
}
