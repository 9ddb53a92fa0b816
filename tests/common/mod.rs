//! Helpers shared by the integration tests.
#![allow(dead_code)] // each test crate uses a different subset

pub mod beta_mon;
pub mod exit_agreement;
pub mod ffi;
pub mod reference;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

use tinyloop::model::layout::expected_tensors;
use tinyloop::model::synth::{preset, random_model};
use tinyloop::{Device, GenerateParams, Model, ModelOptions, SamplingParams};

/// A fresh scratch directory for one test.
pub fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tinyloop-test-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Write a synthetic model and return its path.
pub fn synth_file(preset_name: &str, seed: u64, bits: u32) -> PathBuf {
    let path = scratch("models").join(format!("{preset_name}-{seed}-{bits}.tinyloop"));
    write_once(&path, &preset(preset_name).unwrap(), seed, bits);
    path
}

/// Write the `tiny` preset with `max_position` positions (seed 1, INT4) and return its path.
pub fn synth_with_max_position(max_position: usize) -> PathBuf {
    let path = scratch("models").join(format!("tiny-positions-{max_position}.tinyloop"));
    let config = tinyloop::ModelConfig {
        max_position,
        ..preset("tiny").unwrap()
    };
    write_once(&path, &config, 1, 4);
    path
}

/// The tokenizer fixture (tests/data/tokenizer: a byte-level BPE of 384 tokens with a ChatML
/// template).
pub fn tokenizer_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/tokenizer")
}

/// The `tiny` preset (seed 1, INT4) with a vocabulary of 384 tokens and the tokenizer fixture
/// in its metadata, as a converted checkpoint carries it; returns its path.
pub fn synth_with_tokenizer() -> PathBuf {
    let path = scratch("models").join("tiny-tokenizer.tinyloop");
    if !path.exists() {
        let metadata = tinyloop::tokenizer::metadata_from_dir(&tokenizer_dir()).unwrap();
        let config = tinyloop::ModelConfig {
            vocab_size: tinyloop::tokenizer::vocab_size(&metadata).unwrap(),
            ..preset("tiny").unwrap()
        };
        let mut writer = random_model(&config, 1, 4, 32).unwrap();
        for (key, value) in metadata {
            writer.set_metadata(&key, value);
        }
        let tmp = path.with_extension(format!("tmp{:?}", std::thread::current().id()));
        writer.write(&tmp).unwrap();
        std::fs::rename(&tmp, &path).unwrap();
    }
    path
}

/// Random weights for `config` at `path`, unless a test wrote them already (written under a
/// temporary name first, so a concurrent test never maps a half-written file).
fn write_once(path: &std::path::Path, config: &tinyloop::ModelConfig, seed: u64, bits: u32) {
    if !path.exists() {
        let tmp = path.with_extension(format!("tmp{:?}", std::thread::current().id()));
        random_model(config, seed, bits, 32)
            .unwrap()
            .write(&tmp)
            .unwrap();
        std::fs::rename(&tmp, path).unwrap();
    }
}

pub fn cpu_options() -> ModelOptions {
    ModelOptions {
        device: Some(Device::Cpu),
        max_seq_len: 256,
        log: false,
        ..ModelOptions::default()
    }
}

pub fn open_cpu(path: &std::path::Path) -> Model {
    Model::open(path, &cpu_options()).unwrap()
}

/// A checkpoint of random f32 tensors for `preset_name`, plus its config file. Every call
/// writes new files: the converter maps the checkpoint, so rewriting a file another test has
/// mapped would fault that test.
pub fn checkpoint(
    preset_name: &str,
    drop: Option<&str>,
    extra: Option<&str>,
) -> (PathBuf, PathBuf) {
    let dir = scratch("convert");
    let config = preset(preset_name).unwrap();
    let mut data: HashMap<String, (Vec<usize>, Vec<u8>)> = HashMap::new();
    let mut state = 1u64;
    for spec in expected_tensors(&config) {
        let shape: Vec<usize> = spec.shape.iter().map(|&d| d as usize).collect();
        let n: usize = shape.iter().product();
        let scale = if spec.name.ends_with("norm") {
            0.0
        } else {
            1.0 / (shape[shape.len() - 1] as f32).sqrt()
        };
        let bytes = (0..n)
            .flat_map(|_| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let u = (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                (1.0 + scale * u * 3.0 - if scale > 0.0 { 1.0 } else { 0.0 }).to_le_bytes()
            })
            .collect();
        data.insert(spec.name.clone(), (shape, bytes));
    }
    if let Some(name) = drop {
        data.remove(name);
    }
    if let Some(name) = extra {
        data.insert(name.to_string(), (vec![2], vec![0; 8]));
    }
    let views: Vec<(String, safetensors::tensor::TensorView)> = data
        .iter()
        .map(|(k, (shape, bytes))| {
            (
                k.clone(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), bytes)
                    .unwrap(),
            )
        })
        .collect();
    static CALLS: AtomicUsize = AtomicUsize::new(0);
    let tag = format!(
        "{preset_name}-{}-{}-{}",
        drop.unwrap_or(""),
        extra.unwrap_or(""),
        CALLS.fetch_add(1, Ordering::Relaxed)
    );
    let st = dir.join(format!("{tag}.safetensors"));
    safetensors::serialize_to_file(views, None, &st).unwrap();
    let cfg = dir.join(format!("{tag}.json"));
    std::fs::write(&cfg, serde_json::to_string(&config).unwrap()).unwrap();
    (st, cfg)
}

/// Deterministic pseudo-random tokens below `vocab`.
pub fn tokens(n: usize, vocab: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i.wrapping_add(salt).wrapping_mul(2_654_435_761) >> 9) % vocab as u32)
        .collect()
}

/// Prefill `prompt` through the forward pass in steps of `chunk` rows (0: one step, both cut at
/// age-tier changes as the library's prefill is), then decode
/// `steps` greedy tokens. Returns the logits after the prompt and after each decode step, and
/// the tokens chosen from them.
pub fn prefill_and_decode<B: tinyloop::backend::Backend>(
    backend: &B,
    weights: &tinyloop::model::weights::Weights<B>,
    layout: tinyloop::kv::KvLayout,
    chunk: usize,
    prompt: &[u32],
    loops: usize,
    steps: usize,
) -> (Vec<Vec<f32>>, Vec<u32>) {
    use tinyloop::backend::{Choice, StepInput};
    use tinyloop::model::forward::{
        choose, chosen_token, decode_step, final_norm, forward, logits, step_rows, Buffers,
        CallRows, Decode,
    };
    let rows = if chunk == 0 { prompt.len() } else { chunk };
    let mut buf = Buffers::new(
        backend,
        &weights.config,
        rows,
        layout,
        weights.body.loaded().unwrap(),
        tinyloop::StateInit::Model,
    )
    .unwrap();
    let never = std::sync::atomic::AtomicBool::new(false);
    let vocab = weights.config.vocab_size;
    // Steps as the library cuts them: at most `rows`, never across an age-tier change, each
    // computed as part of the whole prompt.
    let call = CallRows::new(backend, prompt.len());
    let mut start = 0;
    let mut last = 0;
    while start < prompt.len() {
        let n = step_rows(&buf, start, prompt.len() - start);
        let input = StepInput {
            tokens: &prompt[start..start + n],
            start_pos: start,
            choice: Choice::Greedy,
        };
        forward(backend, weights, &mut buf, input, loops, &never).unwrap();
        (start, last) = (start + n, n - 1);
    }
    drop(call);
    final_norm(backend, weights, &mut buf, last + 1);
    logits(backend, weights, &mut buf, last, 1);
    choose(backend, weights, &mut buf);
    let mut out = vec![backend.read_float(&buf.logits, 0, vocab).unwrap()];
    let mut next = chosen_token(backend, &buf).unwrap();
    let mut tokens = vec![next];
    for pos in prompt.len()..prompt.len() + steps {
        let input = StepInput {
            tokens: &[next],
            start_pos: pos,
            choice: Choice::Greedy,
        };
        decode_step(backend, weights, &mut buf, input, Decode::plain(loops)).unwrap();
        out.push(backend.read_float(&buf.logits, 0, vocab).unwrap());
        next = chosen_token(backend, &buf).unwrap();
        tokens.push(next);
    }
    (out, tokens)
}

/// ‖a − b‖₂ / ‖b‖₂ in f64; NaN anywhere gives infinity.
pub fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len(), "length mismatch");
    let (mut num, mut den) = (0f64, 0f64);
    for (&x, &y) in a.iter().zip(b) {
        if x.is_nan() || y.is_nan() {
            return f64::INFINITY;
        }
        num += (x as f64 - y as f64).powi(2);
        den += (y as f64).powi(2);
    }
    if den == 0.0 {
        return if num == 0.0 { 0.0 } else { f64::INFINITY };
    }
    (num / den).sqrt()
}

/// A copy of the model at `path` whose loop-block linears are re-quantized to INT2 with
/// `QuantizedMatrix::requantize` (what CTX-TIER runs at the LONG tier), written next to it.
pub fn with_int2_loop_body(path: &std::path::Path) -> PathBuf {
    use tinyloop::format::{DType, FileWriter, ModelFile};
    use tinyloop::model::quant::{f16_from_bytes, LinearData, QuantizedMatrix};
    let out = path.with_extension("int2-body.tinyloop");
    let file = ModelFile::open(path).unwrap();
    let mut writer = FileWriter::new(file.config.clone());
    for (key, value) in &file.metadata {
        writer.set_metadata(key, value.clone());
    }
    let mut names: Vec<String> = file.tensor_entries().map(|e| e.name.clone()).collect();
    names.sort();
    for name in names {
        let (entry, bytes) = file.tensor(&name).unwrap();
        let shape: Vec<usize> = entry.shape.iter().map(|&d| d as usize).collect();
        match entry.dtype {
            DType::F16 => writer.add_f16(&name, &shape, &f16_from_bytes(bytes)),
            DType::Int4 | DType::Int2 => {
                let group = entry.group_size.unwrap() as usize;
                let q = QuantizedMatrix::from_bytes(entry.dtype, shape[0], shape[1], group, bytes)
                    .unwrap();
                let q = if name.starts_with("loop.") {
                    q.requantize(DType::Int2).unwrap()
                } else {
                    q
                };
                writer.add_linear(&name, shape[0], shape[1], &LinearData::Quantized(q));
            }
            DType::F32 => panic!("{name}: the synthetic models hold no f32 tensors"),
        }
    }
    let tmp = out.with_extension(format!("tmp{:?}", std::thread::current().id()));
    writer.write(&tmp).unwrap();
    std::fs::rename(&tmp, &out).unwrap();
    out
}

/// Device bytes of the loop body of the model at `path`, at its own encoding and after a
/// re-pack to INT2, as `bytes_of(rows, cols, bits, group)` counts one weight.
pub fn loop_body_bytes(
    path: &std::path::Path,
    bytes_of: impl Fn(usize, usize, usize, usize) -> usize,
) -> (usize, usize) {
    let file = tinyloop::format::ModelFile::open(path).unwrap();
    let (mut loaded, mut repacked) = (0, 0);
    for e in file
        .tensor_entries()
        .filter(|e| e.name.starts_with("loop."))
    {
        if let Some(g) = e.group_size {
            let (rows, cols) = (e.shape[0] as usize, e.shape[1] as usize);
            loaded += bytes_of(rows, cols, e.dtype.bits() as usize, g as usize);
            repacked += bytes_of(rows, cols, 2, g as usize);
        }
    }
    (loaded, repacked)
}

/// The index of a row's largest value (the first of equal ones), as greedy decoding picks it.
pub fn argmax(row: &[f32]) -> u32 {
    (0..row.len()).fold(0, |best, j| if row[j] > row[best] { j } else { best }) as u32
}

/// Whether to run CUDA work: true with a device; otherwise print why and return false, or fail
/// when TINYLOOP_REQUIRE_CUDA=1 (set by the GPU bundle's run-tests.sh).
pub fn cuda_or_skip(test: &str) -> bool {
    use std::io::Write;
    match tinyloop::backend::cuda::available() {
        Ok(_) => true,
        Err(why) => {
            if std::env::var("TINYLOOP_REQUIRE_CUDA").as_deref() == Ok("1") {
                panic!("{test}: TINYLOOP_REQUIRE_CUDA=1 but there is no usable CUDA device: {why}");
            }
            // Straight to stderr: the test harness does not capture this, so a skip is visible.
            let _ = writeln!(std::io::stderr(), "skipped: no CUDA device ({why}): {test}");
            false
        }
    }
}

/// Greedy generation of `max_tokens` tokens at `loops` loops.
pub fn greedy_params(max_tokens: usize, loops: usize) -> GenerateParams {
    GenerateParams {
        max_tokens,
        loops: Some(loops),
        ..GenerateParams::default()
    }
}

/// Sampling with a seed (temperature 0.9, top-k 40, top-p 0.95).
pub fn sampled_params(seed: u64, max_tokens: usize, loops: usize) -> GenerateParams {
    GenerateParams {
        sampling: SamplingParams {
            temperature: 0.9,
            top_k: 40,
            top_p: 0.95,
            seed,
        },
        ..greedy_params(max_tokens, loops)
    }
}
