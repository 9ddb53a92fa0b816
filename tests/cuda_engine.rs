//! The continuous-batching engine on CUDA.
//!
//! * **Pooled steps against the CPU**: steps whose rows belong to several sequences, each with
//!   its page table scattered over a KV pool, at different loop depths: the residual stream after
//!   the step on the GPU within the whole-model bound of docs/NUMERICS.md of the CPU reference,
//!   in the fp16, int8 and delta modes. This covers every kernel that reads a row's place (RoPE
//!   and the KV write, attention over f16 and over quantized entries).
//! * **Rows do not depend on the batch**: each request's tokens from an engine that runs it alone
//!   equal, bit for bit, its tokens when it shares steps with others, under every step budget,
//!   page size and KV mode, greedy and sampled. An engine's backend computes each row the same
//!   way whatever runs with it (src/backend/cuda/mod.rs `RowInvariant`), so this is exact.
//! * **Greedy tokens against the CPU engine**: identical, or different only after a near tie of
//!   the CPU's own logits (the bound of tests/cuda_parity.rs `generate_parity`).
//!
//! Without a usable GPU each test prints "skipped: no CUDA device (why)" and returns; with
//! TINYLOOP_REQUIRE_CUDA=1 absence is a failure.
//!
//! # Tolerance of the pooled steps
//!
//! The GPU and the CPU evaluate the same operations on the same f16-rounded inputs and differ in
//! the order of f32 additions only; an f16 rounding flipped by that difference moves the
//! residual stream by at most one f16 ulp per block application, so after A applications the
//! relative L2 difference is at most (A + 1) · 2⁻¹¹ (`model_tol`); quantized modes add the code
//! flips of tests/cuda_parity.rs `mode_tol`: √(√head_dim · model_tol / qmax).

mod common;

use std::path::Path;
use std::sync::atomic::AtomicBool;

use common::{
    cuda_or_skip, greedy_params as greedy, rel_l2, sampled_params as sampled, synth_file,
};
use tinyloop::backend::cpu::CpuBackend;
use tinyloop::backend::cuda::CudaBackend;
use tinyloop::backend::{Backend, PooledRow, PooledRows};
use tinyloop::format::ModelFile;
use tinyloop::kv::KvLayout;
use tinyloop::model::forward::{run_rows, stage_pooled, Buffers, Rows, Span};
use tinyloop::model::weights::Weights;
use tinyloop::{Device, Engine, EngineOptions, GenerateParams, KvMode, Model, ModelOptions};

fn model_tol(applications: usize) -> f64 {
    (applications + 1) as f64 * 2f64.powi(-11)
}

fn mode_tol(mode: KvMode, applications: usize, head_dim: usize) -> f64 {
    let base = model_tol(applications);
    let qmax = match mode {
        KvMode::Fp16 => return base,
        _ => 127.0,
    };
    base + ((head_dim as f64).sqrt() * base / qmax).sqrt()
}

fn open(path: &Path, device: Device, kv_mode: KvMode) -> Model {
    let options = ModelOptions {
        max_seq_len: 256,
        device: Some(device),
        kv_mode: Some(kv_mode),
        log: false,
        ..ModelOptions::default()
    };
    Model::open(path, &options).unwrap_or_else(|e| panic!("open {}: {e}", path.display()))
}

fn tokens(n: usize, vocab: usize, salt: u32) -> Vec<u32> {
    common::tokens(n, vocab, salt)
}

/// One pooled step over both backends; returns the residual streams of its rows.
struct PooledStep<'a> {
    tokens: &'a [u32],
    places: &'a [PooledRow<'a>],
    loops: &'a [usize],
}

/// Rows of pooled steps, built one sequence at a time.
#[derive(Default)]
struct RowsOf<'a> {
    tokens: Vec<u32>,
    places: Vec<PooledRow<'a>>,
    loops: Vec<usize>,
}

impl<'a> RowsOf<'a> {
    /// Positions `range` of the sequence with page table `table`, at `loops` loops; their
    /// tokens are `tokens[range]` (or `tokens[0]` when one token stands for the range).
    fn add(
        &mut self,
        table: &'a [u32],
        tokens: &[u32],
        range: std::ops::Range<usize>,
        loops: usize,
    ) {
        for position in range {
            let token = tokens.get(position).copied().unwrap_or(tokens[0]);
            self.tokens.push(token);
            self.places.push(PooledRow { position, table });
            self.loops.push(loops);
        }
    }

    fn step(&self) -> PooledStep<'_> {
        PooledStep {
            tokens: &self.tokens,
            places: &self.places,
            loops: &self.loops,
        }
    }
}

fn pooled_streams<B: Backend>(
    backend: &B,
    w: &Weights<B>,
    buf: &mut Buffers<B>,
    steps: &[PooledStep],
    page_size: usize,
) -> Vec<Vec<f32>> {
    let dim = w.config.dim;
    steps
        .iter()
        .map(|s| {
            let places = PooledRows {
                page_size,
                rows: s.places,
            };
            stage_pooled(backend, w, buf, s.tokens, places, s.loops).unwrap();
            let span = Span::all(s.loops[0]);
            run_rows(
                backend,
                w,
                buf,
                Rows::Deepest(s.loops),
                span,
                None::<&AtomicBool>,
            )
            .unwrap();
            backend
                .read_float(buf.residual(), 0, s.tokens.len() * dim)
                .unwrap()
        })
        .collect()
}

#[test]
fn cuda_pooled_steps_match_the_cpu() {
    if !cuda_or_skip("cuda_pooled_steps_match_the_cpu") {
        return;
    }
    let path = synth_file("small", 3, 4);
    let file = ModelFile::open(&path).unwrap();
    let config = file.config.clone();
    let vocab = config.vocab_size;
    let page = 4;
    // Three sequences on scattered pages of a 64-page pool.
    let tables: [Vec<u32>; 3] = [vec![7, 2, 40, 13, 5], vec![0, 33, 9], vec![61, 18, 26, 3]];
    let prompts: Vec<Vec<u32>> = [13, 9, 11]
        .iter()
        .enumerate()
        .map(|(i, &n)| tokens(n, vocab, 50 + i as u32))
        .collect();
    for mode in [KvMode::Fp16, KvMode::Int8, KvMode::Delta] {
        let layout = KvLayout::new(&config, mode, 64 * page).unwrap();
        let cpu = CpuBackend;
        let wc = Weights::load(&cpu, &file, 256).unwrap();
        let new = |b: &CpuBackend| {
            Buffers::new(
                b,
                &config,
                32,
                layout.clone(),
                wc.body.loaded().unwrap(),
                tinyloop::StateInit::Model,
            )
            .unwrap()
        };
        let mut bc = new(&cpu);
        let device = CudaBackend::open(0).unwrap();
        let wg = Weights::load(&device, &file, 256).unwrap();
        device.finish_load(&wg).unwrap();
        let engine = device.engine(&config, 32, 256).unwrap();
        let mut bg = Buffers::new(
            &engine,
            &config,
            32,
            layout.clone(),
            wg.body.loaded().unwrap(),
            tinyloop::StateInit::Model,
        )
        .unwrap();
        // Step 1: sequence 0's whole prompt at 6 loops, sequence 1's first 5 tokens at 3 loops,
        // sequence 2's first 7 at 2 loops (deepest first).
        let mut first = RowsOf::default();
        first.add(&tables[0], &prompts[0], 0..13, 6);
        first.add(&tables[1], &prompts[1], 0..5, 3);
        first.add(&tables[2], &prompts[2], 0..7, 2);
        // Step 2: one decode row of sequence 0, the rest of sequences 1 and 2's prompts.
        let mut second = RowsOf::default();
        second.add(&tables[0], &[prompts[0][0]], 13..14, 6);
        second.add(&tables[1], &prompts[1], 5..9, 3);
        second.add(&tables[2], &prompts[2], 7..11, 2);
        // Step 3: one row alone (the decode shape), deep into its page table.
        let mut third = RowsOf::default();
        third.add(&tables[0], &[3], 14..15, 6);
        let steps = [first.step(), second.step(), third.step()];
        let c = pooled_streams(&cpu, &wc, &mut bc, &steps, page);
        let g = pooled_streams(&engine, &wg, &mut bg, &steps, page);
        let tol = mode_tol(mode, config.applications(6), config.head_dim());
        for (i, (c, g)) in c.iter().zip(&g).enumerate() {
            let e = rel_l2(g, c);
            eprintln!("pooled step {i} {mode}: rel {e:.2e} (tol {tol:.2e})");
            assert!(e <= tol, "pooled step {i} in {mode}: {e:.3e} > {tol:.3e}");
        }
    }
}

/// Requests of mixed prompt lengths, depths and lengths, every third one sampled.
fn workload(vocab: usize) -> Vec<(Vec<u32>, GenerateParams)> {
    let loops = [1, 4, 2, 6, 3, 4, 1, 8];
    (0..loops.len())
        .map(|i| {
            let prompt = tokens(3 + 9 * i, vocab, i as u32 + 1);
            let n = 6 + 4 * i;
            let p = if i % 3 == 2 {
                sampled(i as u64, n, loops[i])
            } else {
                greedy(n, loops[i])
            };
            (prompt, p)
        })
        .collect()
}

/// Each request's tokens from an engine that runs it alone.
fn alone(model: &Model, requests: &[(Vec<u32>, GenerateParams)]) -> Vec<Vec<u32>> {
    let engine = Engine::new(model, &EngineOptions::default()).unwrap();
    requests
        .iter()
        .map(|(prompt, p)| engine.submit(prompt, p).unwrap().wait().unwrap().0)
        .collect()
}

/// Every request submitted at once.
fn together(
    model: &Model,
    options: &EngineOptions,
    requests: &[(Vec<u32>, GenerateParams)],
) -> Vec<Vec<u32>> {
    let engine = Engine::new(model, options).unwrap();
    let submitted: Vec<_> = requests
        .iter()
        .map(|(prompt, p)| engine.submit(prompt, p).unwrap())
        .collect();
    submitted.into_iter().map(|s| s.wait().unwrap().0).collect()
}

#[test]
fn cuda_engine_requests_do_not_depend_on_the_batch() {
    if !cuda_or_skip("cuda_engine_requests_do_not_depend_on_the_batch") {
        return;
    }
    for (preset, mode) in [
        ("small", KvMode::Fp16),
        ("tiny-gqa", KvMode::Fp16),
        ("small", KvMode::Int8),
        ("small", KvMode::Delta),
    ] {
        let model = open(&synth_file(preset, 1, 4), Device::Cuda(0), mode);
        let requests = workload(model.config().vocab_size);
        let reference = alone(&model, &requests);
        let budgets = [
            EngineOptions::default(),
            // Few rows per step and small pages: prompts are cut into chunks sharing steps with
            // decode rows, and page tables are long.
            EngineOptions {
                max_step_rows: 8,
                page_size: 4,
                ..EngineOptions::default()
            },
            // A pool too small for everyone at once: requests wait and are preempted.
            EngineOptions {
                max_step_rows: 16,
                page_size: 8,
                pool_positions: 160,
                ..EngineOptions::default()
            },
            // Every prompt in one step: 276 rows, whose attention launch on the 8-head preset
            // (2 208 blocks of one head) takes the kernels with a head per warp on GPUs of up to
            // 138 SMs; alone, no request's launch does.
            EngineOptions {
                max_step_rows: 1024,
                ..EngineOptions::default()
            },
        ];
        for options in &budgets {
            let got = together(&model, options, &requests);
            for (i, (g, r)) in got.iter().zip(&reference).enumerate() {
                assert_eq!(
                    g, r,
                    "{preset} {mode}, request {i} with {options:?}: tokens differ from the \
                     request alone"
                );
            }
        }
        eprintln!(
            "{preset} {mode}: {} requests identical under 4 budgets",
            requests.len()
        );
    }
}

#[test]
fn cuda_engine_greedy_tokens_match_the_cpu_engine() {
    if !cuda_or_skip("cuda_engine_greedy_tokens_match_the_cpu_engine") {
        return;
    }
    let path = synth_file("small", 1, 4);
    let cpu = open(&path, Device::Cpu, KvMode::Fp16);
    let gpu = open(&path, Device::Cuda(0), KvMode::Fp16);
    let config = cpu.config().clone();
    let requests: Vec<_> = workload(config.vocab_size)
        .into_iter()
        .filter(|(_, p)| p.sampling.temperature == 0.0)
        .collect();
    let options = EngineOptions {
        max_step_rows: 8,
        page_size: 4,
        ..EngineOptions::default()
    };
    let c = together(&cpu, &options, &requests);
    let g = together(&gpu, &options, &requests);
    let mut session = cpu.new_session().unwrap();
    for (((prompt, p), c), g) in requests.iter().zip(&c).zip(&g) {
        let Some(i) = c.iter().zip(g).position(|(a, b)| a != b) else {
            assert_eq!(c.len(), g.len());
            continue;
        };
        // A difference is allowed only where the CPU's own top two logits are within the
        // whole-model bound of each other (a near tie that the summation order may break).
        let loops = p.loops.unwrap();
        let mut seq = prompt.clone();
        seq.extend(&c[..i]);
        let l = session.score_last(&seq, Some(loops)).unwrap();
        let tol = model_tol(config.applications(loops));
        let norm = l.iter().map(|v| (*v as f64).powi(2)).sum::<f64>().sqrt();
        let margin = (l[c[i] as usize] - l[g[i] as usize]) as f64;
        assert!(
            margin <= 2.0 * tol * norm,
            "prompt of {} tokens at {loops} loops: greedy tokens differ at {i} with margin \
             {margin:.3e} > {:.3e}",
            prompt.len(),
            2.0 * tol * norm
        );
        eprintln!("differ at {i} after a near tie (margin {margin:.2e})");
    }
}
