//! The C ABI called from Rust: results equal the Rust API, sessions run concurrently with the
//! same results as sequential runs, BUSY / CANCELLED / CLOSED behave as documented, closed and
//! freed handles stay closed, and `tl_close` refuses new calls while it waits for a running one.
//! (tests/c/abi_test.c drives the full bad-input table from C.)

mod common;

use std::ffi::{c_void, CStr, CString};
use std::path::PathBuf;
use std::ptr;
use std::sync::mpsc;
use std::sync::{Arc, Barrier};

use common::ffi::{gen_params, last_error, model_params, open, Handle};
use tinyloop::ffi::*;
use tinyloop::model::synth::{preset, random_model};
use tinyloop::{Device, Exit, ExitPolicy, GenerateParams, Model, ModelOptions, SamplingParams};

/// Write (once per process) a synthetic `preset` model and return its path.
fn model_file(preset_name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tinyloop-ffi-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{preset_name}.tinyloop"));
    if !path.exists() {
        let tmp = path.with_extension(format!("tmp{:?}", std::thread::current().id()));
        random_model(&preset(preset_name).unwrap(), 7, 4, 32)
            .unwrap()
            .write(&tmp)
            .unwrap();
        std::fs::rename(&tmp, &path).unwrap();
    }
    path
}

struct SessionHandle(*mut tl_session);

// SAFETY: sessions may be used from any thread, one call at a time.
unsafe impl Send for SessionHandle {}
// SAFETY: as above (a concurrent call gets TL_ERR_BUSY).
unsafe impl Sync for SessionHandle {}

impl Drop for SessionHandle {
    fn drop(&mut self) {
        tl_session_free(self.0);
    }
}

fn generate(model: &Handle, prompt: &[i32], p: &tl_generate_params) -> (tl_status, Vec<i32>) {
    let mut out = vec![0i32; p.max_tokens as usize];
    let mut len = 0usize;
    // SAFETY: all pointers valid for the stated lengths.
    let status = unsafe {
        tl_generate(
            model.0,
            prompt.as_ptr(),
            prompt.len(),
            p,
            out.as_mut_ptr(),
            out.len(),
            &mut len,
        )
    };
    out.truncate(if status == tl_status::TL_OK { len } else { 0 });
    (status, out)
}

fn session_generate(
    session: &SessionHandle,
    prompt: &[i32],
    p: &tl_generate_params,
) -> (tl_status, Vec<i32>) {
    let mut out = vec![0i32; p.max_tokens as usize];
    let mut len = 0usize;
    // SAFETY: all pointers valid for the stated lengths.
    let status = unsafe {
        tl_session_generate(
            session.0,
            prompt.as_ptr(),
            prompt.len(),
            p,
            out.as_mut_ptr(),
            out.len(),
            &mut len,
        )
    };
    out.truncate(if status == tl_status::TL_OK { len } else { 0 });
    (status, out)
}

fn new_session(model: &Handle) -> SessionHandle {
    let mut s = ptr::null_mut();
    // SAFETY: a live model and a valid out-pointer.
    assert_eq!(
        unsafe { tl_session_new(model.0, &mut s) },
        tl_status::TL_OK,
        "{}",
        last_error()
    );
    SessionHandle(s)
}

const PROMPT: [i32; 6] = [82, 79, 77, 69, 79, 58];

fn rust_model(path: &std::path::Path) -> Model {
    let options = ModelOptions {
        device: Some(Device::Cpu),
        max_seq_len: 128,
        log: false,
        ..ModelOptions::default()
    };
    Model::open(path, &options).unwrap()
}

#[test]
fn generate_and_score_equal_the_rust_api() {
    for name in ["tiny", "tiny-gqa", "tiny-tied"] {
        let path = model_file(name);
        let model = open(&path, 128);
        let rust = rust_model(&path);
        let mut session = rust.new_session().unwrap();
        let prompt_u32: Vec<u32> = PROMPT.iter().map(|&t| t as u32).collect();

        // Greedy, and seeded sampling with a stop token: both deterministic, so exact equality.
        let mut p = gen_params(20);
        let (status, tokens) = generate(&model, &PROMPT, &p);
        assert_eq!(status, tl_status::TL_OK, "{name}: {}", last_error());
        let expected = session
            .generate(
                &prompt_u32,
                &GenerateParams {
                    max_tokens: 20,
                    ..GenerateParams::default()
                },
            )
            .unwrap();
        assert_eq!(
            tokens,
            expected.iter().map(|&t| t as i32).collect::<Vec<_>>()
        );

        let stop = [tokens[5]];
        p.temperature = 0.7;
        p.top_k = 50;
        p.top_p = 0.9;
        p.seed = 99;
        p.loops = 2;
        p.stop_tokens = stop.as_ptr();
        p.n_stop_tokens = 1;
        let (status, sampled) = generate(&model, &PROMPT, &p);
        assert_eq!(status, tl_status::TL_OK, "{name}: {}", last_error());
        let expected = session
            .generate(
                &prompt_u32,
                &GenerateParams {
                    max_tokens: 20,
                    loops: Some(2),
                    sampling: SamplingParams {
                        temperature: 0.7,
                        top_k: 50,
                        top_p: 0.9,
                        seed: 99,
                    },
                    stop_tokens: vec![stop[0] as u32],
                    ..GenerateParams::default()
                },
            )
            .unwrap();
        assert_eq!(
            sampled,
            expected.iter().map(|&t| t as i32).collect::<Vec<_>>()
        );

        // score_last: the same computation on the same device, so bitwise equal.
        let vocab = rust.config().vocab_size;
        let mut logits = vec![0f32; vocab];
        let mut len = 0;
        // SAFETY: valid buffers.
        let status = unsafe {
            tl_score_last(
                model.0,
                PROMPT.as_ptr(),
                PROMPT.len(),
                3,
                logits.as_mut_ptr(),
                logits.len(),
                &mut len,
            )
        };
        assert_eq!(status, tl_status::TL_OK, "{}", last_error());
        assert_eq!(len, vocab);
        let expected = session.score_last(&prompt_u32, Some(3)).unwrap();
        assert_eq!(logits, expected, "{name}: score_last differs");

        // Config mirrors the Rust config.
        let mut cfg = std::mem::MaybeUninit::<tl_config>::zeroed();
        // SAFETY: zeroed is a valid bit pattern for tl_config (NULL pointers, zero numbers).
        let mut cfg = unsafe { cfg.assume_init_mut() }.to_owned();
        cfg.struct_size = std::mem::size_of::<tl_config>();
        // SAFETY: valid pointers.
        assert_eq!(
            unsafe { tl_model_config(model.0, &mut cfg) },
            tl_status::TL_OK
        );
        let c = rust.config();
        assert_eq!(
            (cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.vocab_size),
            (
                c.dim as u32,
                c.n_heads as u32,
                c.n_kv_heads as u32,
                c.vocab_size as u32
            )
        );
        assert_eq!(cfg.embed_factor_dim as usize, c.embed_factor_dim);
        assert_eq!(
            (cfg.n_pre_blocks, cfg.n_loop_blocks, cfg.n_post_blocks),
            (
                c.n_pre_blocks as u32,
                c.n_loop_blocks as u32,
                c.n_post_blocks as u32
            )
        );
        assert_eq!(cfg.default_loops as usize, c.default_loops);
        // SAFETY: static NUL-terminated strings.
        let norm = unsafe { CStr::from_ptr(cfg.norm) }.to_str().unwrap();
        assert_eq!(
            norm,
            serde_json::to_value(c.norm).unwrap().as_str().unwrap()
        );
        // SAFETY: as above.
        let head = unsafe { CStr::from_ptr(cfg.head) }.to_str().unwrap();
        assert_eq!(
            head,
            serde_json::to_value(c.head).unwrap().as_str().unwrap()
        );
    }
}

#[test]
fn two_threads_with_own_sessions_match_sequential_runs() {
    let path = model_file("tiny");
    let model = Arc::new(open(&path, 256));
    let prompts: [Vec<i32>; 2] = [vec![72, 101, 108, 108, 111], vec![84, 111, 32, 98, 101]];
    let params = |i: usize| {
        let mut p = gen_params(40);
        if i == 1 {
            p.temperature = 1.0;
            p.seed = 5;
        }
        p
    };
    let sessions: Vec<Arc<SessionHandle>> = (0..2).map(|_| Arc::new(new_session(&model))).collect();
    let sequential: Vec<Vec<i32>> = (0..2)
        .map(|i| {
            let (status, out) = session_generate(&sessions[i], &prompts[i], &params(i));
            assert_eq!(status, tl_status::TL_OK, "{}", last_error());
            out
        })
        .collect();
    let barrier = Arc::new(Barrier::new(2));
    let threads: Vec<_> = (0..2)
        .map(|i| {
            let (session, prompt, barrier) =
                (sessions[i].clone(), prompts[i].clone(), barrier.clone());
            std::thread::spawn(move || {
                let p = params(i);
                barrier.wait();
                (0..3)
                    .map(|_| {
                        let (status, out) = session_generate(&session, &prompt, &p);
                        assert_eq!(status, tl_status::TL_OK, "{}", last_error());
                        out
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    for (i, t) in threads.into_iter().enumerate() {
        for run in t.join().unwrap() {
            assert_eq!(run, sequential[i], "session {i}: concurrent != sequential");
        }
    }
    // The model's memory accounts for both sessions.
    let mut mb = 0.0;
    // SAFETY: valid pointers.
    assert_eq!(
        unsafe { tl_vram_usage_mb(model.0, &mut mb) },
        tl_status::TL_OK
    );
    assert!(mb > 0.0);
}

/// State shared with a stream callback that blocks on the first token until released.
struct Gate {
    started: mpsc::Sender<()>,
    release: mpsc::Receiver<()>,
    tokens: usize,
}

unsafe extern "C" fn gate_callback(_token: i32, user_data: *mut c_void) -> bool {
    // SAFETY: user_data is the &mut Gate passed by the test, alive for the whole call.
    let gate = unsafe { &mut *(user_data as *mut Gate) };
    gate.tokens += 1;
    if gate.tokens == 1 {
        gate.started.send(()).unwrap();
        gate.release.recv().unwrap();
    }
    true
}

#[test]
fn busy_then_cancelled_on_one_session() {
    let path = model_file("tiny");
    let model = open(&path, 256);
    let session = Arc::new(new_session(&model));
    let (started_tx, started_rx) = mpsc::channel();
    let (release_tx, release_rx) = mpsc::channel();
    let worker = {
        let session = session.clone();
        std::thread::spawn(move || {
            let mut gate = Gate {
                started: started_tx,
                release: release_rx,
                tokens: 0,
            };
            let p = gen_params(100);
            // SAFETY: valid pointers; gate outlives the call.
            let status = unsafe {
                tl_session_generate_stream(
                    session.0,
                    PROMPT.as_ptr(),
                    PROMPT.len(),
                    &p,
                    Some(gate_callback),
                    &mut gate as *mut Gate as *mut c_void,
                )
            };
            (status, gate.tokens)
        })
    };
    started_rx.recv().unwrap();
    let (status, _) = session_generate(&session, &PROMPT, &gen_params(4));
    assert_eq!(status, tl_status::TL_ERR_BUSY);
    assert!(last_error().contains("busy"), "{}", last_error());
    assert_eq!(tl_session_cancel(session.0), tl_status::TL_OK);
    release_tx.send(()).unwrap();
    let (status, tokens) = worker.join().unwrap();
    assert_eq!(status, tl_status::TL_ERR_CANCELLED);
    assert_eq!(tokens, 1, "cancellation stops at the next token");
    // The session works again, and the cancel did not leak into the new call.
    let (status, out) = session_generate(&session, &PROMPT, &gen_params(4));
    assert_eq!(status, tl_status::TL_OK, "{}", last_error());
    assert_eq!(out.len(), 4);
}

#[test]
fn closed_model_names_the_function_and_free_is_null_safe() {
    let path = model_file("tiny");
    let model = open(&path, 64);
    assert_eq!(tl_close(model.0), tl_status::TL_OK);
    assert_eq!(tl_close(model.0), tl_status::TL_OK, "idempotent");
    tl_model_free(model.0);
    let (status, _) = generate(&model, &PROMPT, &gen_params(4));
    assert_eq!(status, tl_status::TL_ERR_CLOSED);
    assert!(last_error().starts_with("tl_generate called on a closed model"));
    let mut mb = -1.0;
    // SAFETY: a valid out-pointer; the handle is only looked up.
    let status = unsafe { tl_vram_usage_mb(model.0, &mut mb) };
    assert_eq!(status, tl_status::TL_ERR_CLOSED);
    assert_eq!(mb, -1.0, "outputs are written only on success");
    assert_eq!(tl_cancel(model.0), tl_status::TL_OK, "cancel after close");
    tl_model_free(ptr::null_mut());
    tl_session_free(ptr::null_mut());
    assert_eq!(tl_close(ptr::null_mut()), tl_status::TL_OK);
}

#[test]
fn closed_handles_stay_closed_when_new_models_open() {
    let path = model_file("tiny");
    let old = open(&path, 64);
    let old_session = new_session(&old);
    assert_eq!(tl_close(old.0), tl_status::TL_OK);
    tl_session_free(old_session.0);
    // Open and close many models: none gets the old handle values, which stay closed.
    for _ in 0..20 {
        let fresh = open(&path, 64);
        let fresh_session = new_session(&fresh);
        assert_ne!(fresh.0, old.0);
        assert_ne!(fresh_session.0, old_session.0);
        let (status, _) = generate(&old, &PROMPT, &gen_params(2));
        assert_eq!(status, tl_status::TL_ERR_CLOSED, "{}", last_error());
        let (status, _) = session_generate(&old_session, &PROMPT, &gen_params(2));
        assert_eq!(status, tl_status::TL_ERR_CLOSED, "{}", last_error());
        let (status, out) = generate(&fresh, &PROMPT, &gen_params(2));
        assert_eq!((status, out.len()), (tl_status::TL_OK, 2));
    }
}

#[test]
fn freed_session_is_closed_and_freeing_twice_is_harmless() {
    let model = open(&model_file("tiny"), 64);
    let session = new_session(&model);
    tl_session_free(session.0);
    tl_session_free(session.0);
    let (status, _) = session_generate(&session, &PROMPT, &gen_params(2));
    assert_eq!(status, tl_status::TL_ERR_CLOSED);
    assert!(
        last_error().starts_with("tl_session_generate called on a freed session"),
        "{}",
        last_error()
    );
    assert_eq!(tl_session_cancel(session.0), tl_status::TL_OK);
    // The model and its other sessions are unaffected.
    let other = new_session(&model);
    let (status, out) = session_generate(&other, &PROMPT, &gen_params(2));
    assert_eq!((status, out.len()), (tl_status::TL_OK, 2));
}

#[test]
fn values_that_are_not_handles_of_the_kind_are_invalid_arguments() {
    let model = open(&model_file("tiny"), 64);
    let session = new_session(&model);
    let session_as_model = Handle(session.0.cast());
    let (status, _) = generate(&session_as_model, &PROMPT, &gen_params(2));
    assert_eq!(status, tl_status::TL_ERR_INVALID_ARGUMENT);
    assert_eq!(
        last_error(),
        "tl_generate: model is a tl_session handle, not a tl_model"
    );
    // Closing the wrong kind is refused and closes nothing.
    assert_eq!(
        tl_close(session_as_model.0),
        tl_status::TL_ERR_INVALID_ARGUMENT
    );
    std::mem::forget(session_as_model);
    let (status, _) = session_generate(&session, &PROMPT, &gen_params(2));
    assert_eq!(status, tl_status::TL_OK, "{}", last_error());
    // An address (what a handle was before) is not a handle.
    let mut local = 0u64;
    let forged = Handle(ptr::addr_of_mut!(local).cast());
    let (status, _) = generate(&forged, &PROMPT, &gen_params(2));
    assert_eq!(status, tl_status::TL_ERR_INVALID_ARGUMENT);
    assert!(last_error().contains("not a handle"), "{}", last_error());
    assert_eq!(tl_cancel(forged.0), tl_status::TL_ERR_INVALID_ARGUMENT);
    std::mem::forget(forged);
    assert_eq!(local, 0, "the library did not write through the value");
    // Handle values are scattered by a random key of the process: the handles made one after
    // the other are far apart (a chance failure: about 2^-40), and a value next to a live
    // handle is no handle at all, so a guess or an off-by-one never reaches another object.
    let next = new_session(&model);
    let gap = session.0.addr().abs_diff(next.0.addr());
    assert!(
        gap > 1 << 20,
        "consecutive sessions {:?}, {:?}",
        session.0,
        next.0
    );
    let value = model.0.addr();
    for near in [
        value + 1,
        value - 1,
        value ^ 1,
        value ^ (1 << (usize::BITS - 20)),
    ] {
        let forged = Handle(ptr::without_provenance_mut(near));
        let (status, _) = generate(&forged, &PROMPT, &gen_params(2));
        assert_eq!(status, tl_status::TL_ERR_INVALID_ARGUMENT, "{near:#x}");
        assert!(last_error().contains("not a handle"), "{}", last_error());
        assert_eq!(tl_close(forged.0), tl_status::TL_ERR_INVALID_ARGUMENT);
        std::mem::forget(forged);
    }
    let (status, _) = generate(&model, &PROMPT, &gen_params(2));
    assert_eq!(status, tl_status::TL_OK, "the model is untouched");
}

/// Calls `tl_generate` on `model` until it returns `TL_ERR_CLOSED` and returns the other
/// statuses seen before. Fails after `LIVENESS_LIMIT`: a bound against hanging, not a timing.
fn generate_until_closed(model: &Handle) -> Vec<tl_status> {
    let start = std::time::Instant::now();
    let mut seen = Vec::new();
    loop {
        let (status, _) = generate(model, &PROMPT, &gen_params(2));
        if status == tl_status::TL_ERR_CLOSED {
            return seen;
        }
        seen.push(status);
        assert!(
            start.elapsed() < LIVENESS_LIMIT,
            "calls kept running for {LIVENESS_LIMIT:?}, the last one: {:?}",
            seen.last()
        );
        std::thread::yield_now();
    }
}

/// Generous: on a loaded 2-core machine the model's calls take milliseconds.
const LIVENESS_LIMIT: std::time::Duration = std::time::Duration::from_secs(60);

#[test]
fn close_refuses_new_calls_while_it_waits_for_the_running_one() {
    let model = Arc::new(open(&model_file("tiny"), 256));
    let (started_tx, started_rx) = mpsc::channel();
    let (release_tx, release_rx) = mpsc::channel();
    let streamer = {
        let model = model.clone();
        std::thread::spawn(move || {
            let mut gate = Gate {
                started: started_tx,
                release: release_rx,
                tokens: 0,
            };
            let p = gen_params(100);
            // SAFETY: valid pointers; gate outlives the call.
            let status = unsafe {
                tl_generate_stream(
                    model.0,
                    PROMPT.as_ptr(),
                    PROMPT.len(),
                    &p,
                    Some(gate_callback),
                    &mut gate as *mut Gate as *mut c_void,
                )
            };
            (status, gate.tokens)
        })
    };
    started_rx.recv().unwrap();
    let closer = {
        let model = model.clone();
        std::thread::spawn(move || tl_close(model.0))
    };
    // The stream is parked in its callback, so close cannot finish; calls made meanwhile are
    // BUSY until close starts and CLOSED from then on (before this change: BUSY forever).
    let before = generate_until_closed(&model);
    assert!(
        before.iter().all(|&s| s == tl_status::TL_ERR_BUSY),
        "{before:?}"
    );
    assert!(!closer.is_finished(), "close waits for the running call");
    let mut mb = 0.0;
    // SAFETY: a valid out-pointer.
    let status = unsafe { tl_vram_usage_mb(model.0, &mut mb) };
    assert_eq!(status, tl_status::TL_ERR_CLOSED, "non-waiting calls too");
    let mut session = ptr::null_mut();
    // SAFETY: a valid out-pointer.
    let status = unsafe { tl_session_new(model.0, &mut session) };
    assert_eq!(status, tl_status::TL_ERR_CLOSED);
    release_tx.send(()).unwrap();
    let (status, tokens) = streamer.join().unwrap();
    assert_eq!(status, tl_status::TL_ERR_CANCELLED);
    assert_eq!(tokens, 1, "cancelled at the next token");
    assert_eq!(closer.join().unwrap(), tl_status::TL_OK);
}

#[test]
fn eight_threads_retrying_calls_do_not_hold_off_close() {
    let model = Arc::new(open(&model_file("tiny"), 256));
    let running = Arc::new(Barrier::new(9));
    let workers: Vec<_> = (0..8)
        .map(|_| {
            let (model, running) = (model.clone(), running.clone());
            std::thread::spawn(move || {
                let (status, _) = generate(&model, &PROMPT, &gen_params(2));
                assert!(
                    matches!(status, tl_status::TL_OK | tl_status::TL_ERR_BUSY),
                    "{status:?}"
                );
                running.wait();
                generate_until_closed(&model)
            })
        })
        .collect();
    running.wait();
    assert_eq!(tl_close(model.0), tl_status::TL_OK);
    for w in workers {
        let before = w.join().unwrap();
        assert!(
            before.iter().all(|s| matches!(
                s,
                tl_status::TL_OK | tl_status::TL_ERR_BUSY | tl_status::TL_ERR_CANCELLED
            )),
            "{before:?}"
        );
    }
}

/// Every worker of rayon's global pool, held until dropped. The CPU backend runs each product
/// on that pool, so a call that reaches a block application meanwhile waits inside it, holding
/// its session: how a test keeps a score call, which has no callback, in flight.
struct PoolHold {
    release: Arc<Barrier>,
}

impl PoolHold {
    fn new() -> PoolHold {
        let workers = rayon::current_num_threads();
        let entered = Arc::new(Barrier::new(workers + 1));
        let release = Arc::new(Barrier::new(workers + 1));
        for _ in 0..workers {
            let (entered, release) = (entered.clone(), release.clone());
            // A blocked task keeps its worker, so the barrier opens once every worker has one.
            rayon::spawn(move || {
                entered.wait();
                release.wait();
            });
        }
        entered.wait();
        PoolHold { release }
    }
}

impl Drop for PoolHold {
    fn drop(&mut self) {
        self.release.wait();
    }
}

/// `tl_score_last` on the model's default session: its status and what it left in `*len` and
/// `out` (filled with -1 and `usize::MAX` first). Retried while another call holds the session.
fn score_last_until_it_runs(model: &Handle) -> (tl_status, usize, Vec<f32>) {
    loop {
        let mut out = vec![-1.0f32; 256];
        let mut len = usize::MAX;
        // SAFETY: all pointers valid for the stated lengths.
        let status = unsafe {
            tl_score_last(
                model.0,
                PROMPT.as_ptr(),
                PROMPT.len(),
                TL_LOOPS_DEFAULT,
                out.as_mut_ptr(),
                out.len(),
                &mut len,
            )
        };
        if status != tl_status::TL_ERR_BUSY {
            return (status, len, out);
        }
        std::thread::yield_now();
    }
}

/// Returns once a call is running on the model's default session: a probe that would fail on
/// its arguments (loops 0) answers `TL_ERR_BUSY` instead.
fn wait_until_busy(model: &Handle) {
    let start = std::time::Instant::now();
    loop {
        let mut len = 0usize;
        let mut out = [0f32; 256];
        // SAFETY: all pointers valid for the stated lengths.
        let status = unsafe {
            tl_score_last(
                model.0,
                PROMPT.as_ptr(),
                PROMPT.len(),
                0,
                out.as_mut_ptr(),
                out.len(),
                &mut len,
            )
        };
        match status {
            tl_status::TL_ERR_BUSY => return,
            tl_status::TL_ERR_INVALID_ARGUMENT => {}
            other => panic!("probe: {other:?} ({})", last_error()),
        }
        assert!(
            start.elapsed() < LIVENESS_LIMIT,
            "the score call never started"
        );
        std::thread::yield_now();
    }
}

/// Opens a model, runs `tl_score_last` on its default session in another thread, and while that
/// call is held inside its forward pass, stops it with `tl_cancel` or `tl_close`. Returns what
/// the call returned.
fn score_stopped_in_flight(close: bool) -> (tl_status, usize, Vec<f32>) {
    let model = Arc::new(open(&model_file("tiny"), 64));
    let hold = PoolHold::new();
    let scorer = {
        let model = model.clone();
        std::thread::spawn(move || score_last_until_it_runs(&model))
    };
    wait_until_busy(&model);
    let closer = close.then(|| {
        let closing = model.clone();
        let closer = std::thread::spawn(move || tl_close(closing.0));
        let before = generate_until_closed(&model);
        assert!(
            before.iter().all(|&s| s == tl_status::TL_ERR_BUSY),
            "{before:?}"
        );
        assert!(!closer.is_finished(), "close waits for the running call");
        closer
    });
    if !close {
        assert_eq!(tl_cancel(model.0), tl_status::TL_OK);
    }
    drop(hold);
    let result = scorer.join().unwrap();
    if let Some(closer) = closer {
        assert_eq!(closer.join().unwrap(), tl_status::TL_OK);
    }
    result
}

/// Score calls are cancelled like generation: `tl_cancel`, and `tl_close` (which then waits
/// for the call), stop a score call in flight at its next block application with
/// `TL_ERR_CANCELLED`, writing nothing.
///
/// The test sees the call holding its session, which it takes just before it starts; a cancel
/// in between is for no call (a call clears the request as it starts, see `tl_cancel`), and
/// that call runs to its end. Such an attempt must return the logits, and the next is tried.
/// More than half the attempts land inside the call (measured with the whole suite running on
/// 2 cores: 29 to 40 of 40 for `tl_cancel`, every one for `tl_close`, which repeats its
/// cancel while it waits), so 50 attempts all missing would be a failure, not chance (< 2^-50).
#[test]
fn score_calls_are_cancelled_by_tl_cancel_and_tl_close() {
    for close in [false, true] {
        let cancelled = (0..50).any(|_| match score_stopped_in_flight(close) {
            (tl_status::TL_ERR_CANCELLED, len, out) => {
                assert_eq!(len, usize::MAX, "*len unwritten");
                assert!(out.iter().all(|&v| v == -1.0), "out unwritten");
                true
            }
            (tl_status::TL_OK, len, _) => {
                assert_eq!(len, 256, "a call that ran to its end");
                false
            }
            (other, _, _) => panic!("close: {close}: {other:?} ({})", last_error()),
        });
        assert!(cancelled, "close: {close}: no attempt was cancelled");
    }
}

#[test]
fn session_free_refuses_new_calls_and_waits_for_the_running_one() {
    let model = open(&model_file("tiny"), 256);
    let session = Arc::new(new_session(&model));
    let (started_tx, started_rx) = mpsc::channel();
    let (release_tx, release_rx) = mpsc::channel();
    let streamer = {
        let session = session.clone();
        std::thread::spawn(move || {
            let mut gate = Gate {
                started: started_tx,
                release: release_rx,
                tokens: 0,
            };
            let p = gen_params(100);
            // SAFETY: valid pointers; gate outlives the call.
            unsafe {
                tl_session_generate_stream(
                    session.0,
                    PROMPT.as_ptr(),
                    PROMPT.len(),
                    &p,
                    Some(gate_callback),
                    &mut gate as *mut Gate as *mut c_void,
                )
            }
        })
    };
    started_rx.recv().unwrap();
    let freer = {
        let session = session.clone();
        std::thread::spawn(move || tl_session_free(session.0))
    };
    let start = std::time::Instant::now();
    loop {
        let (status, _) = session_generate(&session, &PROMPT, &gen_params(2));
        if status == tl_status::TL_ERR_CLOSED {
            break;
        }
        assert_eq!(status, tl_status::TL_ERR_BUSY);
        assert!(start.elapsed() < LIVENESS_LIMIT, "free never refused calls");
        std::thread::yield_now();
    }
    assert!(!freer.is_finished(), "free waits for the running call");
    release_tx.send(()).unwrap();
    assert_eq!(streamer.join().unwrap(), tl_status::TL_ERR_CANCELLED);
    freer.join().unwrap();
}

#[test]
fn status_names_and_abi_version() {
    assert_eq!(tl_abi_version(), TL_ABI_VERSION);
    for (code, name) in [
        (tl_status::TL_OK, "TL_OK"),
        (
            tl_status::TL_ERR_INVALID_ARGUMENT,
            "TL_ERR_INVALID_ARGUMENT",
        ),
        (tl_status::TL_ERR_IO, "TL_ERR_IO"),
        (tl_status::TL_ERR_FORMAT, "TL_ERR_FORMAT"),
        (tl_status::TL_ERR_OUT_OF_MEMORY, "TL_ERR_OUT_OF_MEMORY"),
        (tl_status::TL_ERR_DEVICE, "TL_ERR_DEVICE"),
        (tl_status::TL_ERR_CLOSED, "TL_ERR_CLOSED"),
        (tl_status::TL_ERR_BUSY, "TL_ERR_BUSY"),
        (tl_status::TL_ERR_CANCELLED, "TL_ERR_CANCELLED"),
        (tl_status::TL_ERR_PANIC, "TL_ERR_PANIC"),
        (
            tl_status::TL_ERR_BUFFER_TOO_SMALL,
            "TL_ERR_BUFFER_TOO_SMALL",
        ),
    ] {
        // SAFETY: tl_status_string returns a static NUL-terminated string.
        let got = unsafe { CStr::from_ptr(tl_status_string(code as i32)) };
        assert_eq!(got.to_str().unwrap(), name);
    }
    // SAFETY: as above.
    let unknown = unsafe { CStr::from_ptr(tl_status_string(-3)) };
    assert_eq!(unknown.to_str().unwrap(), "TL_UNKNOWN_STATUS");
}

#[test]
fn last_error_is_per_thread() {
    let mut params = gen_params(1);
    params.struct_size = 1;
    let model = open(&model_file("tiny"), 64);
    let (status, _) = generate(&model, &PROMPT, &params);
    assert_eq!(status, tl_status::TL_ERR_INVALID_ARGUMENT);
    let here = last_error();
    assert!(here.contains("struct_size"), "{here}");
    let there = std::thread::spawn(last_error).join().unwrap();
    assert_eq!(there, "", "another thread sees no failure");
    // A later success leaves the message in place.
    let (status, _) = generate(&model, &PROMPT, &gen_params(1));
    assert_eq!(status, tl_status::TL_OK);
    assert_eq!(last_error(), here);
}

/// `tl_model_params` of the header's first version (without `kv_mode`, 32 bytes) is still
/// accepted, the missing field taking its default; a size that is no version's is refused.
#[test]
fn model_params_of_an_earlier_header_version_are_accepted() {
    let path = model_file("tiny");
    let mut params = model_params();
    let device = CString::new("cpu").unwrap();
    let garbage = CString::new("not a mode").unwrap();
    params.device = device.as_ptr();
    params.log = false;
    // A v1 caller's struct ends before kv_mode: whatever lies there must not be read.
    params.kv_mode = garbage.as_ptr();
    let cpath = CString::new(path.to_str().unwrap()).unwrap();
    for (size, expect) in [
        (
            std::mem::offset_of!(tl_model_params, kv_mode),
            tl_status::TL_OK,
        ),
        (36, tl_status::TL_ERR_INVALID_ARGUMENT),
    ] {
        params.struct_size = size;
        let mut model = ptr::null_mut();
        // SAFETY: valid strings, params (read up to struct_size) and out-pointer.
        let status = unsafe { tl_model_open(cpath.as_ptr(), &params, &mut model) };
        assert_eq!(status, expect, "struct_size {size}: {}", last_error());
        if status == tl_status::TL_OK {
            let mut mode = [0 as std::ffi::c_char; 32];
            let mut len = 0usize;
            // SAFETY: a live model, a 32-byte buffer and a length out-pointer.
            let st = unsafe { tl_model_kv_mode(model, mode.as_mut_ptr(), 32, &mut len) };
            assert_eq!(st, tl_status::TL_OK);
            // SAFETY: NUL-terminated by the call.
            assert_eq!(
                unsafe { CStr::from_ptr(mode.as_ptr()) }.to_str(),
                Ok("fp16")
            );
            tl_model_free(model);
        }
    }
}

/// `tl_model_params.max_seq_len` 0 (the default) opens the model for 2048 tokens, or for its
/// max_position when that is smaller, and `tl_model_config` reports the value in use.
#[test]
fn model_params_max_seq_len_0_is_the_model_s_default() {
    assert_eq!(model_params().max_seq_len, 0);
    for (max_position, expected) in [(256, 256), (4096, 2048)] {
        let model = open(&common::synth_with_max_position(max_position), 0);
        let mut cfg = std::mem::MaybeUninit::<tl_config>::zeroed();
        // SAFETY: zeroed is a valid bit pattern for tl_config (NULL pointers, zero numbers).
        let mut cfg = unsafe { cfg.assume_init_mut() }.to_owned();
        cfg.struct_size = std::mem::size_of::<tl_config>();
        // SAFETY: a live model and a config of its struct_size.
        assert_eq!(
            unsafe { tl_model_config(model.0, &mut cfg) },
            tl_status::TL_OK
        );
        assert_eq!(
            (cfg.max_position, cfg.max_seq_len),
            (max_position as u32, expected),
            "{}",
            last_error()
        );
    }
}

/// `tl_model_params.fp16_body` takes -1, 0 or 1 and names itself otherwise; a caller of the
/// second header version (whose struct ends before it) is not read past its end. On the CPU the
/// FP16 body cache has no effect, so turning it on opens the model as usual.
#[test]
fn model_params_fp16_body_is_checked_and_versioned() {
    let path = model_file("tiny");
    let mut params = model_params();
    assert_eq!(params.fp16_body, -1, "default: follow the environment");
    let device = CString::new("cpu").unwrap();
    params.device = device.as_ptr();
    params.log = false;
    let cpath = CString::new(path.to_str().unwrap()).unwrap();
    let full = std::mem::size_of::<tl_model_params>();
    let v2 = std::mem::offset_of!(tl_model_params, fp16_body);
    for (size, value, expect) in [
        (full, 2, tl_status::TL_ERR_INVALID_ARGUMENT),
        (full, -2, tl_status::TL_ERR_INVALID_ARGUMENT),
        (v2, 2, tl_status::TL_OK),
        (full, 1, tl_status::TL_OK),
        (full, 0, tl_status::TL_OK),
    ] {
        params.struct_size = size;
        params.fp16_body = value;
        let mut model = ptr::null_mut();
        // SAFETY: valid strings, params (read up to struct_size) and out-pointer.
        let status = unsafe { tl_model_open(cpath.as_ptr(), &params, &mut model) };
        assert_eq!(
            status,
            expect,
            "size {size} value {value}: {}",
            last_error()
        );
        if status == tl_status::TL_OK {
            tl_model_free(model);
        } else {
            let message = last_error();
            assert!(message.contains("fp16_body"), "{message}");
        }
    }
}

/// `state_init`: a model with a random loop state takes every choice; one that carries its state
/// only "model"; anything unparsable is refused, naming the field; an older header leaves it out.
#[test]
fn model_params_state_init_is_checked() {
    let mut params = model_params();
    assert!(params.state_init.is_null(), "default: the model's own rule");
    let device = CString::new("cpu").unwrap();
    params.device = device.as_ptr();
    params.log = false;
    let garbage = CString::new("seed:x").unwrap();
    for (preset_name, value, expect) in [
        ("tiny-recurrent", "zeros", tl_status::TL_OK),
        ("tiny-recurrent", "seed:42", tl_status::TL_OK),
        ("tiny-recurrent", "model", tl_status::TL_OK),
        (
            "tiny-recurrent",
            "seed:x",
            tl_status::TL_ERR_INVALID_ARGUMENT,
        ),
        ("tiny", "model", tl_status::TL_OK),
        ("tiny", "zeros", tl_status::TL_ERR_INVALID_ARGUMENT),
    ] {
        let cpath = CString::new(model_file(preset_name).to_str().unwrap()).unwrap();
        let value_c = CString::new(value).unwrap();
        params.state_init = value_c.as_ptr();
        let mut model = ptr::null_mut();
        // SAFETY: valid strings, params and out-pointer.
        let status = unsafe { tl_model_open(cpath.as_ptr(), &params, &mut model) };
        assert_eq!(status, expect, "{preset_name} {value}: {}", last_error());
        if status == tl_status::TL_OK {
            tl_model_free(model);
        } else {
            assert!(last_error().contains("state_init"), "{}", last_error());
        }
    }
    // A caller of the previous header: the field is not read.
    params.state_init = garbage.as_ptr();
    params.struct_size = std::mem::offset_of!(tl_model_params, state_init);
    let cpath = CString::new(model_file("tiny").to_str().unwrap()).unwrap();
    let mut model = ptr::null_mut();
    // SAFETY: as above.
    let status = unsafe { tl_model_open(cpath.as_ptr(), &params, &mut model) };
    assert_eq!(status, tl_status::TL_OK, "{}", last_error());
    tl_model_free(model);
}

/// The exit fields of `tl_generate_params`: each bad value is refused naming its field or the
/// reason; a threshold or a gate rule works on a model with an exit gate, a criterion on any.
#[test]
fn generate_params_exit_is_checked() {
    let gated = open(&model_file("tiny-sandwich"), 128);
    let plain = open(&model_file("tiny"), 128);
    let c = |s: &str| CString::new(s).unwrap();
    let (gate, own, bad_rule, skip, bad_policy) =
        (c("gate:0.5"), c("gate"), c("kl:1e-3x"), c("skip"), c("all"));
    let (kl, argmax) = (c("kl:1e-3"), c("argmax:1"));
    let with = |threshold: f64, rule: &CString, policy: Option<&CString>| {
        let mut p = gen_params(4);
        p.exit_threshold = threshold;
        p.exit = if rule.is_empty() {
            ptr::null()
        } else {
            rule.as_ptr()
        };
        p.exit_policy = policy.map_or(ptr::null(), |s| s.as_ptr());
        p
    };
    let none = c("");
    for (model, p, expect, says) in [
        (&gated, with(0.5, &none, None), tl_status::TL_OK, ""),
        (&gated, with(-1.0, &gate, Some(&skip)), tl_status::TL_OK, ""),
        (
            &gated,
            with(1.5, &none, None),
            tl_status::TL_ERR_INVALID_ARGUMENT,
            "exit_threshold",
        ),
        (
            &gated,
            with(0.5, &gate, None),
            tl_status::TL_ERR_INVALID_ARGUMENT,
            "not both",
        ),
        (
            &gated,
            with(-1.0, &bad_rule, None),
            tl_status::TL_ERR_INVALID_ARGUMENT,
            "exit rule",
        ),
        (
            &gated,
            with(0.5, &none, Some(&bad_policy)),
            tl_status::TL_ERR_INVALID_ARGUMENT,
            "exit_policy",
        ),
        (
            &gated,
            with(-1.0, &none, Some(&skip)),
            tl_status::TL_ERR_INVALID_ARGUMENT,
            "without an exit rule",
        ),
        // tiny-sandwich names no default threshold.
        (
            &gated,
            with(-1.0, &own, None),
            tl_status::TL_ERR_INVALID_ARGUMENT,
            "no default threshold",
        ),
        (
            &plain,
            with(0.5, &none, None),
            tl_status::TL_ERR_INVALID_ARGUMENT,
            "no exit gate",
        ),
        (&plain, with(-1.0, &kl, None), tl_status::TL_OK, ""),
        (
            &plain,
            with(-1.0, &argmax, Some(&skip)),
            tl_status::TL_OK,
            "",
        ),
        (&gated, with(-1.0, &kl, None), tl_status::TL_OK, ""),
    ] {
        let (status, tokens) = generate(model, &PROMPT, &p);
        assert_eq!(status, expect, "{}", last_error());
        if status == tl_status::TL_OK {
            assert_eq!(tokens.len(), 4);
            let s = stats(model);
            assert_eq!(s.exit_tokens, 4);
            assert!(
                (1.0..=4.0).contains(&s.exit_mean_steps),
                "{}",
                s.exit_mean_steps
            );
        } else {
            assert!(last_error().contains(says), "{says}: {}", last_error());
        }
    }
}

/// Where a score call with an exit runs.
#[derive(Clone, Copy)]
enum On<'a> {
    Model(&'a Handle),
    Session(&'a SessionHandle),
}

/// What `tl_score_exit` (or its session form) returned and left: the status, `*len`, the logits
/// and the exit iterations (the buffers start as NaN and -1, `*len` as 7, so what a failed call
/// wrote shows). `steps` false passes `exit_steps` NULL.
struct ExitScored {
    status: tl_status,
    len: usize,
    logits: Vec<f32>,
    steps: Vec<i32>,
}

fn score_exit(
    on: On,
    tokens: &[i32],
    prompt_len: usize,
    p: Option<&tl_generate_params>,
    cap: usize,
    steps: bool,
) -> ExitScored {
    let (mut logits, mut exits, mut len) = (vec![f32::NAN; cap], vec![-1i32; tokens.len()], 7);
    let exit_steps = if steps {
        exits.as_mut_ptr()
    } else {
        ptr::null_mut()
    };
    let p = p.map_or(ptr::null(), |p| p as *const tl_generate_params);
    let (t, n, out) = (tokens.as_ptr(), tokens.len(), logits.as_mut_ptr());
    // SAFETY: the tokens, params and buffers are valid for the lengths given.
    let status = unsafe {
        match on {
            On::Model(m) => tl_score_exit(m.0, t, n, prompt_len, p, out, cap, &mut len, exit_steps),
            On::Session(s) => {
                tl_session_score_exit(s.0, t, n, prompt_len, p, out, cap, &mut len, exit_steps)
            }
        }
    };
    ExitScored {
        status,
        len,
        logits,
        steps: exits,
    }
}

/// `gen_params` with an exit rule: `threshold` (negative: none), `rule` and `policy` ("": NULL).
fn exit_params(threshold: f64, rule: &CStr, policy: &CStr) -> tl_generate_params {
    let mut p = gen_params(1);
    p.loops = 4;
    p.exit_threshold = threshold;
    let or_null = |s: &CStr| {
        if s.is_empty() {
            ptr::null()
        } else {
            s.as_ptr()
        }
    };
    (p.exit, p.exit_policy) = (or_null(rule), or_null(policy));
    p
}

/// "ROMEO:" and six more bytes, scored with the first six as the prompt.
const SCORED: [i32; 12] = [82, 79, 77, 69, 79, 58, 32, 87, 104, 101, 114, 101];

/// `tl_score_exit` and its session form return `Session::score_exit`'s logits and exit
/// iterations (the same computation on the same device, so exactly), with `exit_steps` or
/// without, under the gate (both policies) and a criterion.
#[test]
fn score_exit_equals_the_rust_api() {
    let path = model_file("tiny-sandwich");
    let (model, rust) = (open(&path, 128), rust_model(&path));
    let session = new_session(&model);
    let mut rs = rust.new_session().unwrap();
    let vocab = rust.config().vocab_size;
    let tokens: Vec<u32> = SCORED.iter().map(|&t| t as u32).collect();
    let n = PROMPT.len();
    let c = |s: &str| CString::new(s).unwrap();
    let (none, gate, skip, argmax) = (c(""), c("gate:0.5"), c("skip"), c("argmax:1"));
    for (p, rule, policy) in [
        (
            exit_params(0.5, &none, &none),
            "gate:0.5",
            ExitPolicy::Reference,
        ),
        (
            exit_params(-1.0, &gate, &skip),
            "gate:0.5",
            ExitPolicy::Skip,
        ),
        (
            exit_params(-1.0, &argmax, &none),
            "argmax:1",
            ExitPolicy::Reference,
        ),
        (
            exit_params(-1.0, &argmax, &skip),
            "argmax:1",
            ExitPolicy::Skip,
        ),
    ] {
        let exit = Exit {
            rule: rule.parse().unwrap(),
            policy,
        };
        let (logits, steps) = rs.score_exit(&tokens, n, Some(4), exit).unwrap();
        let steps: Vec<i32> = steps.iter().map(|&e| e as i32).collect();
        println!("{rule} {policy}: exit iterations {steps:?}");
        assert!(steps.iter().any(|&e| e < 4), "{rule} {policy}: {steps:?}");
        for on in [On::Model(&model), On::Session(&session)] {
            let got = score_exit(on, &SCORED, n, Some(&p), SCORED.len() * vocab, true);
            assert_eq!(got.status, tl_status::TL_OK, "{}", last_error());
            assert_eq!(got.len, SCORED.len() * vocab);
            assert_eq!(
                (&got.logits, &got.steps),
                (&logits, &steps),
                "{rule} {policy}"
            );
            let without = score_exit(on, &SCORED, n, Some(&p), SCORED.len() * vocab, false);
            assert_eq!(
                (without.status, &without.logits),
                (tl_status::TL_OK, &logits)
            );
        }
    }
}

/// Each bad input of `tl_score_exit` is refused with a message naming it, writing nothing.
#[test]
fn score_exit_refuses_bad_inputs_naming_them() {
    let gated = open(&model_file("tiny-sandwich"), 128);
    let plain = open(&model_file("tiny"), 128);
    let c = |s: &str| CString::new(s).unwrap();
    let (none, bad_rule) = (c(""), c("kl:x"));
    let gate = exit_params(0.5, &none, &none);
    let full = SCORED.len() * 256;
    let mut cached = gate;
    let mut cache = ptr::null_mut();
    // SAFETY: valid tokens and out-pointer.
    let status = unsafe { tl_prefix_cache_new(gated.0, PROMPT.as_ptr(), 2, 4, &mut cache) };
    assert_eq!(status, tl_status::TL_OK, "{}", last_error());
    cached.prefix_cache = cache;
    let no_rule = gen_params(1);
    for (model, prompt_len, p, cap, expect, says) in [
        (
            &gated,
            0,
            Some(&gate),
            full,
            tl_status::TL_ERR_INVALID_ARGUMENT,
            "prompt_len 0",
        ),
        (
            &gated,
            13,
            Some(&gate),
            full,
            tl_status::TL_ERR_INVALID_ARGUMENT,
            "prompt_len 13",
        ),
        (
            &gated,
            6,
            None,
            full,
            tl_status::TL_ERR_INVALID_ARGUMENT,
            "no exit rule",
        ),
        (
            &gated,
            6,
            Some(&no_rule),
            full,
            tl_status::TL_ERR_INVALID_ARGUMENT,
            "no exit rule",
        ),
        (
            &plain,
            6,
            Some(&gate),
            full,
            tl_status::TL_ERR_INVALID_ARGUMENT,
            "no exit gate",
        ),
        (
            &gated,
            6,
            Some(&exit_params(-1.0, &bad_rule, &none)),
            full,
            tl_status::TL_ERR_INVALID_ARGUMENT,
            "exit rule",
        ),
        (
            &gated,
            6,
            Some(&cached),
            full,
            tl_status::TL_ERR_INVALID_ARGUMENT,
            "prefix cache",
        ),
        (
            &gated,
            6,
            Some(&gate),
            full - 1,
            tl_status::TL_ERR_BUFFER_TOO_SMALL,
            "needs 3072",
        ),
        (
            &gated,
            6,
            Some(&gate),
            0,
            tl_status::TL_ERR_BUFFER_TOO_SMALL,
            "needs 3072",
        ),
    ] {
        let got = score_exit(On::Model(model), &SCORED, prompt_len, p, cap, true);
        assert_eq!(got.status, expect, "{says}: {}", last_error());
        assert!(last_error().contains(says), "{says}: {}", last_error());
        assert!(
            last_error().starts_with("tl_score_exit"),
            "{}",
            last_error()
        );
        let required = if expect == tl_status::TL_ERR_BUFFER_TOO_SMALL {
            full
        } else {
            7
        };
        assert_eq!(got.len, required, "{says}: *len");
        assert!(got.logits.iter().all(|v| v.is_nan()), "{says}: out written");
        assert!(
            got.steps.iter().all(|&e| e == -1),
            "{says}: exit_steps written"
        );
    }
    tl_prefix_cache_free(cache);
    // A NULL len, and NULL tokens, on the session form too.
    let session = new_session(&gated);
    let (mut out, mut steps) = (vec![0f32; full], vec![0i32; SCORED.len()]);
    // SAFETY: the buffers are valid; the NULL pointers are what is refused.
    let status = unsafe {
        tl_session_score_exit(
            session.0,
            SCORED.as_ptr(),
            SCORED.len(),
            6,
            &gate,
            out.as_mut_ptr(),
            full,
            ptr::null_mut(),
            steps.as_mut_ptr(),
        )
    };
    assert_eq!(status, tl_status::TL_ERR_INVALID_ARGUMENT);
    assert!(last_error().contains("len is NULL"), "{}", last_error());
    let empty = score_exit(On::Session(&session), &[], 1, Some(&gate), full, true);
    assert_eq!(empty.status, tl_status::TL_ERR_INVALID_ARGUMENT);
    assert!(
        last_error().starts_with("tl_session_score_exit"),
        "{}",
        last_error()
    );
    assert!(last_error().contains("n_tokens is 0"), "{}", last_error());
}

/// `tl_generate_params` of the header's first version (without `prefix_cache`) is still
/// accepted; a size that is no version's is refused.
#[test]
fn generate_params_of_an_earlier_header_version_are_accepted() {
    let model = open(&model_file("tiny"), 128);
    let mut p = gen_params(6);
    let (status, expected) = generate(&model, &PROMPT, &p);
    assert_eq!(status, tl_status::TL_OK, "{}", last_error());
    // A v1 caller's struct ends before prefix_cache: whatever lies there must not be read.
    p.prefix_cache = std::ptr::without_provenance(usize::MAX);
    p.struct_size = std::mem::offset_of!(tl_generate_params, prefix_cache);
    assert_eq!(generate(&model, &PROMPT, &p), (tl_status::TL_OK, expected));
    p.struct_size += 4;
    let (status, _) = generate(&model, &PROMPT, &p);
    assert_eq!(status, tl_status::TL_ERR_INVALID_ARGUMENT);
    assert!(last_error().contains("tl_generate_params.struct_size"));
}

fn spec_params(draft_loops: u32, draft_len: u32, reuse: bool) -> tl_speculative_params {
    let mut p = std::mem::MaybeUninit::<tl_speculative_params>::uninit();
    // SAFETY: a valid out-pointer.
    assert_eq!(
        unsafe { tl_speculative_default_params(p.as_mut_ptr()) },
        tl_status::TL_OK
    );
    // SAFETY: initialized above.
    let mut p = unsafe { p.assume_init() };
    (p.draft_loops, p.draft_len, p.reuse) = (draft_loops, draft_len, reuse);
    p
}

fn stats(model: &Handle) -> tl_generate_stats {
    let mut s = std::mem::MaybeUninit::<tl_generate_stats>::zeroed();
    // SAFETY: zeroed is a valid tl_generate_stats.
    let mut s = unsafe { s.assume_init_mut() }.to_owned();
    s.struct_size = std::mem::size_of::<tl_generate_stats>();
    // SAFETY: a valid out-struct.
    let status = unsafe { tl_last_generate_stats(model.0, &mut s) };
    assert_eq!(status, tl_status::TL_OK, "{}", last_error());
    s
}

/// The looped-model calls through the C ABI return what the Rust API returns: the same
/// computations on the same device, so the comparisons are exact.
#[test]
fn looped_calls_equal_the_rust_api() {
    let path = model_file("tiny");
    let model = open(&path, 128);
    let rust = rust_model(&path);
    let mut session = rust.new_session().unwrap();
    let prompt_u32: Vec<u32> = PROMPT.iter().map(|&t| t as u32).collect();
    let vocab = rust.config().vocab_size;
    let as_i32 = |v: Vec<u32>| v.into_iter().map(|t| t as i32).collect::<Vec<_>>();

    let mut lens = vec![0f32; 5 * vocab];
    let mut len = 0;
    // SAFETY: valid buffers.
    let status = unsafe {
        tl_score_logit_lens(
            model.0,
            PROMPT.as_ptr(),
            PROMPT.len(),
            5,
            lens.as_mut_ptr(),
            lens.len(),
            &mut len,
        )
    };
    assert_eq!(status, tl_status::TL_OK, "{}", last_error());
    assert_eq!(
        lens,
        session.score_logit_lens(&prompt_u32, Some(5)).unwrap()
    );

    let mut points = vec![
        tl_trajectory_point {
            hidden_norm: 0.0,
            rel_change: 0.0,
            kl_prev: 0.0,
            entropy: 0.0,
            argmax: -1,
        };
        5
    ];
    // SAFETY: valid buffers.
    let status = unsafe {
        tl_score_trajectory(
            model.0,
            PROMPT.as_ptr(),
            PROMPT.len(),
            5,
            points.as_mut_ptr(),
            points.len(),
            &mut len,
        )
    };
    assert_eq!(status, tl_status::TL_OK, "{}", last_error());
    let expected = session.score_trajectory(&prompt_u32, Some(5)).unwrap();
    let expected: Vec<tl_trajectory_point> = expected.iter().map(Into::into).collect();
    assert_eq!(points, expected);

    let mut p = gen_params(20);
    p.loops = 4;
    let spec = spec_params(2, 3, true);
    let mut out = vec![0i32; 20];
    // SAFETY: valid buffers and params.
    let status = unsafe {
        tl_generate_speculative(
            model.0,
            PROMPT.as_ptr(),
            PROMPT.len(),
            &p,
            &spec,
            out.as_mut_ptr(),
            out.len(),
            &mut len,
        )
    };
    assert_eq!(status, tl_status::TL_OK, "{}", last_error());
    out.truncate(len);
    let params = GenerateParams {
        max_tokens: 20,
        loops: Some(4),
        ..GenerateParams::default()
    };
    let speculation = tinyloop::Speculation {
        draft_loops: 2,
        draft_len: 3,
        reuse: true,
    };
    let expected = session
        .generate_speculative(&prompt_u32, &params, &speculation, &mut |_| true)
        .unwrap();
    assert_eq!(out, as_i32(expected));
    let (c, r) = (stats(&model), session.last_generate_stats());
    assert_eq!(
        (c.tokens, c.drafted, c.accepted),
        (r.tokens, r.drafted, r.accepted)
    );
    assert_eq!(
        (c.acceptance_rate, c.agreement),
        (r.acceptance_rate(), r.agreement())
    );

    let mut handle = ptr::null_mut();
    // SAFETY: valid tokens and out-pointer.
    let status =
        unsafe { tl_resume_handle_new(model.0, PROMPT.as_ptr(), PROMPT.len(), 2, &mut handle) };
    assert_eq!(status, tl_status::TL_OK, "{}", last_error());
    let mut resumed = vec![0i32; 20];
    // SAFETY: a live handle, valid buffers and params.
    let status = unsafe {
        tl_resume_generate(
            model.0,
            handle,
            &p,
            resumed.as_mut_ptr(),
            resumed.len(),
            &mut len,
        )
    };
    assert_eq!(status, tl_status::TL_OK, "{}", last_error());
    resumed.truncate(len);
    assert_eq!(
        resumed,
        as_i32(session.generate(&prompt_u32, &params).unwrap())
    );
    tl_resume_handle_free(handle);
}

/// A stats struct of an earlier size than this header's (before the CTX-TIER fields) is
/// accepted with only its fields written; larger ones keep their extra bytes.
#[test]
fn generate_stats_leave_bytes_beyond_the_struct_alone() {
    let model = open(&model_file("tiny"), 128);
    let (status, _) = generate(&model, &PROMPT, &gen_params(3));
    assert_eq!(status, tl_status::TL_OK);
    #[repr(C)]
    struct Bigger {
        stats: tl_generate_stats,
        future: [u8; 16],
    }
    let mut bigger = Bigger {
        stats: stats(&model),
        future: [0x5a; 16],
    };
    bigger.stats.struct_size = std::mem::size_of::<Bigger>();
    bigger.stats.tokens = 0;
    // SAFETY: a valid out-struct of its struct_size bytes.
    let status = unsafe { tl_last_generate_stats(model.0, &mut bigger.stats) };
    assert_eq!(status, tl_status::TL_OK, "{}", last_error());
    assert_eq!(bigger.stats.tokens, 3);
    assert_eq!(bigger.stats.struct_size, std::mem::size_of::<Bigger>());
    assert_eq!(bigger.future, [0x5a; 16]);
    let mut older = stats(&model);
    older.struct_size = std::mem::offset_of!(tl_generate_stats, ctx_tier_observations);
    (older.tokens, older.ctx_tier_final) = (0, 77);
    // SAFETY: a valid out-struct.
    let status = unsafe { tl_last_generate_stats(model.0, &mut older) };
    assert_eq!(status, tl_status::TL_OK, "{}", last_error());
    assert_eq!((older.tokens, older.ctx_tier_final), (3, 77));
}

fn ctx_tier_params(short_t: u32, long_t: u32) -> tl_ctx_tier_params {
    let mut p = std::mem::MaybeUninit::<tl_ctx_tier_params>::uninit();
    // SAFETY: a valid out-pointer.
    assert_eq!(
        unsafe { tl_ctx_tier_default_params(p.as_mut_ptr()) },
        tl_status::TL_OK
    );
    // SAFETY: initialized above.
    let mut p = unsafe { p.assume_init() };
    assert_eq!((p.short_t, p.long_t, p.long_bits), (512, 2048, 2));
    (p.short_t, p.long_t) = (short_t, long_t);
    p
}

/// `tl_generate_params.ctx_tier` gives the Rust API's tokens and statistics; a header before
/// the field is read without it; bad policies are rejected naming the field.
#[test]
fn ctx_tier_policies_reach_the_call() {
    let path = model_file("tiny");
    let model = open(&path, 128);
    let mut p = gen_params(10);
    p.loops = 3;
    let (status, plain) = generate(&model, &PROMPT, &p);
    assert_eq!(status, tl_status::TL_OK, "{}", last_error());
    let mut tier = ctx_tier_params(4, 9);
    p.ctx_tier = &tier;
    let (status, tiered) = generate(&model, &PROMPT, &p);
    assert_eq!(status, tl_status::TL_OK, "{}", last_error());
    let s = stats(&model);

    let options = ModelOptions {
        device: Some(Device::Cpu),
        max_seq_len: 128,
        log: false,
        ..ModelOptions::default()
    };
    let mut session = Model::open(&path, &options).unwrap().new_session().unwrap();
    let prompt: Vec<u32> = PROMPT.iter().map(|&t| t as u32).collect();
    let params = GenerateParams {
        max_tokens: 10,
        loops: Some(3),
        ctx_tier: Some(tinyloop::CtxTier {
            short_t: 4,
            long_t: 9,
            ..Default::default()
        }),
        ..GenerateParams::default()
    };
    let expected: Vec<i32> = session
        .generate(&prompt, &params)
        .unwrap()
        .iter()
        .map(|&t| t as i32)
        .collect();
    assert_eq!(tiered, expected);
    assert_eq!(tiered[..3], plain[..3]);
    let rust = session.last_generate_stats().ctx_tier.unwrap();
    assert_eq!(
        (
            s.ctx_tier_observations,
            s.ctx_tier_short_steps,
            s.ctx_tier_long_steps
        ),
        (rust.observations, rust.short_steps, rust.long_steps)
    );
    assert_eq!((s.ctx_tier_transitions, s.ctx_tier_final), (1, 2));
    assert_eq!(s.ctx_tier_last_seq_len, 15);

    // A caller built against the header before `ctx_tier`: the field is not read.
    p.ctx_tier = std::ptr::without_provenance(usize::MAX);
    p.struct_size = std::mem::offset_of!(tl_generate_params, ctx_tier);
    let (status, again) = generate(&model, &PROMPT, &p);
    assert_eq!((status, again), (tl_status::TL_OK, plain));
    p.struct_size = std::mem::size_of::<tl_generate_params>();
    p.ctx_tier = &tier;

    for (short_t, long_t, bits, size, message) in [
        (10, 9, 2, None, "short_t (10) must be <= long_t (9)"),
        (0, 9, 2, None, "short_t must be >= 1"),
        (4, 9, 3, None, "long_bits must be 2"),
        (4, 9, 2, Some(8), "tl_ctx_tier_params.struct_size"),
    ] {
        tier = ctx_tier_params(short_t, long_t);
        tier.long_bits = bits;
        if let Some(size) = size {
            tier.struct_size = size;
        }
        p.ctx_tier = &tier;
        let (status, out) = generate(&model, &PROMPT, &p);
        assert_eq!(status, tl_status::TL_ERR_INVALID_ARGUMENT, "{message}");
        assert!(out.is_empty());
        assert!(last_error().contains(message), "{}", last_error());
    }
}

fn score_into<T: Clone>(
    f: unsafe extern "C" fn(
        *const tl_model,
        *const i32,
        usize,
        i32,
        *mut T,
        usize,
        *mut usize,
    ) -> tl_status,
    model: &Handle,
    loops: i32,
    rows: usize,
    fill: T,
) -> Vec<T> {
    let mut out = vec![fill; rows];
    let mut len = 0;
    // SAFETY: valid tokens, buffer and length.
    let status = unsafe {
        f(
            model.0,
            PROMPT.as_ptr(),
            PROMPT.len(),
            loops,
            out.as_mut_ptr(),
            out.len(),
            &mut len,
        )
    };
    assert_eq!(status, tl_status::TL_OK, "{}", last_error());
    assert_eq!(len, rows);
    out
}

const NO_POINT: tl_trajectory_point = tl_trajectory_point {
    hidden_norm: 0.0,
    rel_change: 0.0,
    kl_prev: 0.0,
    entropy: 0.0,
    argmax: -1,
};

/// The equalities of tests/looped.rs through the C ABI: lens row L is `tl_score_last` at L
/// loops (bitwise: the CPU computes the same block applications in the same order), and each
/// trajectory point is the entropy / KL / argmax of its lens row.
#[test]
fn lens_rows_are_score_last_and_the_trajectory_reads_them() {
    let model = open(&model_file("tiny"), 128);
    let vocab = rust_model(&model_file("tiny")).config().vocab_size;
    let lens = score_into(tl_score_logit_lens, &model, 5, 5 * vocab, 0f32);
    for l in 1..=5 {
        let last = score_into(tl_score_last, &model, l as i32, vocab, 0f32);
        assert_eq!(&lens[(l - 1) * vocab..l * vocab], &last[..], "row {l}");
    }
    let path = score_into(tl_score_trajectory, &model, 5, 5, NO_POINT);
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
        // f64 recomputations of the same sums (as tests/looped.rs): 1e-9 relative.
        assert!(
            (point.entropy - entropy).abs() <= 1e-9 * entropy.max(1.0),
            "{i}"
        );
        assert!((point.kl_prev - kl).abs() <= 1e-9 * kl.max(1.0), "{i}");
        let argmax = common::argmax(row) as usize;
        assert_eq!(point.argmax as usize, argmax, "{i}");
        previous = Some(p);
    }
    assert_eq!(path[0].kl_prev, 0.0);
}

fn speculate(
    model: &Handle,
    p: &tl_generate_params,
    spec: &tl_speculative_params,
) -> (tl_status, Vec<i32>) {
    let mut out = vec![0i32; p.max_tokens as usize];
    let mut len = 0;
    // SAFETY: valid tokens, params and buffers.
    let status = unsafe {
        tl_generate_speculative(
            model.0,
            PROMPT.as_ptr(),
            PROMPT.len(),
            p,
            spec,
            out.as_mut_ptr(),
            out.len(),
            &mut len,
        )
    };
    out.truncate(if status == tl_status::TL_OK { len } else { 0 });
    (status, out)
}

/// Greedy speculation equals plain greedy generation at the verify loops, with the drafts
/// counted in the statistics; bad speculative params are refused with a message naming them.
#[test]
fn greedy_speculation_equals_plain_generation_and_bad_params_are_refused() {
    let model = open(&model_file("tiny"), 128);
    let mut p = gen_params(24);
    p.loops = 4;
    let (status, plain) = generate(&model, &PROMPT, &p);
    assert_eq!(status, tl_status::TL_OK, "{}", last_error());
    for draft_loops in [1, 3] {
        for draft_len in [1, 4, TL_MAX_DRAFT_LEN] {
            for reuse in [false, true] {
                let spec = spec_params(draft_loops, draft_len, reuse);
                let (status, out) = speculate(&model, &p, &spec);
                assert_eq!(status, tl_status::TL_OK, "{}", last_error());
                assert_eq!(
                    out, plain,
                    "draft {draft_loops} len {draft_len} reuse {reuse}"
                );
                let s = stats(&model);
                assert_eq!(s.tokens, out.len());
                assert!(s.drafted > 0 && s.accepted <= s.drafted, "{s:?}");
            }
        }
    }
    for (spec, needle) in [
        (spec_params(4, 4, true), "draft_loops"),
        (spec_params(0, 4, true), "draft_loops"),
        (spec_params(2, 0, true), "draft_len"),
        (spec_params(2, TL_MAX_DRAFT_LEN + 1, true), "draft_len"),
    ] {
        let (status, _) = speculate(&model, &p, &spec);
        assert_eq!(status, tl_status::TL_ERR_INVALID_ARGUMENT);
        assert!(last_error().contains(needle), "{}", last_error());
    }
    let mut small = spec_params(2, 4, true);
    small.struct_size = 8;
    assert_eq!(
        speculate(&model, &p, &small).0,
        tl_status::TL_ERR_INVALID_ARGUMENT
    );
    assert!(last_error().contains("tl_speculative_params.struct_size"));
    let mut s = stats(&model);
    s.struct_size = 8;
    // SAFETY: a valid out-struct.
    let status = unsafe { tl_last_generate_stats(model.0, &mut s) };
    assert_eq!(status, tl_status::TL_ERR_INVALID_ARGUMENT);
    assert!(last_error().contains("tl_generate_stats.struct_size"));
}

/// Generating after a prefix cache gives the tokens of generating from prefix + prompt, on the
/// model and on a session; freed and closed caches are `TL_ERR_CLOSED`.
#[test]
fn prefix_cache_equals_the_whole_text_and_dies_with_its_model() {
    let model = open(&model_file("tiny"), 128);
    let prefix: Vec<i32> = (0..19).map(|i| (i * 7 + 3) % 64).collect();
    let whole: Vec<i32> = prefix.iter().chain(PROMPT.iter()).copied().collect();
    let mut p = gen_params(12);
    p.loops = 3;
    let (status, expected) = generate(&model, &whole, &p);
    assert_eq!(status, tl_status::TL_OK, "{}", last_error());
    let mut cache = ptr::null_mut();
    // SAFETY: valid tokens and out-pointer.
    let status =
        unsafe { tl_prefix_cache_new(model.0, prefix.as_ptr(), prefix.len(), 3, &mut cache) };
    assert_eq!(status, tl_status::TL_OK, "{}", last_error());
    p.prefix_cache = cache;
    assert_eq!(
        generate(&model, &PROMPT, &p),
        (tl_status::TL_OK, expected.clone())
    );
    let session = new_session(&model);
    assert_eq!(
        session_generate(&session, &PROMPT, &p),
        (tl_status::TL_OK, expected)
    );

    tl_prefix_cache_free(cache);
    assert_eq!(generate(&model, &PROMPT, &p).0, tl_status::TL_ERR_CLOSED);
    assert!(last_error().contains("freed"), "{}", last_error());
    tl_prefix_cache_free(cache);

    // SAFETY: valid tokens and out-pointer.
    let status =
        unsafe { tl_prefix_cache_new(model.0, prefix.as_ptr(), prefix.len(), 3, &mut cache) };
    assert_eq!(status, tl_status::TL_OK, "{}", last_error());
    p.prefix_cache = cache;
    assert_eq!(tl_close(model.0), tl_status::TL_OK);
    assert_eq!(
        session_generate(&session, &PROMPT, &p).0,
        tl_status::TL_ERR_CLOSED
    );
    assert!(
        last_error().contains("whose model was closed"),
        "{}",
        last_error()
    );
    p.prefix_cache = ptr::null();
    assert_eq!(session_generate(&session, &PROMPT, &p).0, tl_status::TL_OK);
    tl_prefix_cache_free(cache);
}

/// A resume handle used after it was freed, or after its model was closed, is `TL_ERR_CLOSED`;
/// a resume handle from another model is refused.
#[test]
fn resume_handles_after_free_and_close_are_closed() {
    let path = model_file("tiny");
    let (model, other) = (open(&path, 128), open(&path, 128));
    let mut handle = ptr::null_mut();
    // SAFETY: valid tokens and out-pointer.
    let status =
        unsafe { tl_resume_handle_new(model.0, PROMPT.as_ptr(), PROMPT.len(), 2, &mut handle) };
    assert_eq!(status, tl_status::TL_OK, "{}", last_error());
    let resume = |m: &Handle, h: *const tl_resume_handle| {
        let p = gen_params(4);
        let (mut out, mut len) = (vec![0i32; 4], 0);
        // SAFETY: valid params and buffers; handles are looked up, never dereferenced.
        unsafe { tl_resume_generate(m.0, h, &p, out.as_mut_ptr(), out.len(), &mut len) }
    };
    assert_eq!(resume(&model, handle), tl_status::TL_OK, "{}", last_error());
    assert_eq!(resume(&other, handle), tl_status::TL_ERR_INVALID_ARGUMENT);
    assert!(last_error().contains("another model"), "{}", last_error());
    tl_resume_handle_free(handle);
    assert_eq!(resume(&model, handle), tl_status::TL_ERR_CLOSED);

    // SAFETY: valid tokens and out-pointer.
    let status =
        unsafe { tl_resume_handle_new(model.0, PROMPT.as_ptr(), PROMPT.len(), 2, &mut handle) };
    assert_eq!(status, tl_status::TL_OK, "{}", last_error());
    assert_eq!(tl_close(model.0), tl_status::TL_OK);
    let session = new_session(&other);
    let p = gen_params(4);
    let (mut out, mut len) = (vec![0i32; 4], 0);
    // SAFETY: valid params and buffers.
    let status = unsafe {
        tl_session_resume_generate(session.0, handle, &p, out.as_mut_ptr(), out.len(), &mut len)
    };
    assert_eq!(status, tl_status::TL_ERR_CLOSED);
    tl_resume_handle_free(handle);
}

/// An engine handle, freed on drop.
struct EngineHandle(*mut tl_engine);

// SAFETY: engines may be used from any thread.
unsafe impl Send for EngineHandle {}
// SAFETY: as above.
unsafe impl Sync for EngineHandle {}

impl Drop for EngineHandle {
    fn drop(&mut self) {
        tl_engine_free(self.0);
    }
}

fn engine_params() -> tl_engine_params {
    let mut p = std::mem::MaybeUninit::<tl_engine_params>::uninit();
    // SAFETY: a valid out-pointer.
    assert_eq!(
        unsafe { tl_engine_default_params(p.as_mut_ptr()) },
        tl_status::TL_OK
    );
    // SAFETY: initialized above.
    let mut p = unsafe { p.assume_init() };
    // Small steps: prompts are cut into chunks beside other requests' decode rows.
    p.max_step_rows = 8;
    p.page_size = 4;
    p
}

fn new_engine(model: &Handle, p: &tl_engine_params) -> EngineHandle {
    let mut engine = ptr::null_mut();
    // SAFETY: valid handle, params and out-pointer.
    let status = unsafe { tl_engine_new(model.0, p, &mut engine) };
    assert_eq!(status, tl_status::TL_OK, "{}", last_error());
    EngineHandle(engine)
}

fn submit(engine: &EngineHandle, prompt: &[i32], p: &tl_generate_params) -> u64 {
    let mut id = u64::MAX;
    // SAFETY: valid pointers for the stated lengths.
    let status = unsafe { tl_engine_submit(engine.0, prompt.as_ptr(), prompt.len(), p, &mut id) };
    assert_eq!(status, tl_status::TL_OK, "{}", last_error());
    id
}

fn next_event(engine: *const tl_engine, id: u64, timeout_ms: i32) -> (tl_status, tl_engine_event) {
    let mut event = std::mem::MaybeUninit::<tl_engine_event>::zeroed();
    // SAFETY: a valid out-pointer.
    let status = unsafe { tl_engine_next(engine, id, timeout_ms, event.as_mut_ptr()) };
    // SAFETY: zeroed, then written on success; every field is valid at zero.
    (status, unsafe { event.assume_init() })
}

/// Every event of a request until it ends: its tokens, and its stats or its failure.
fn drain(engine: &EngineHandle, id: u64) -> (Vec<i32>, Result<tl_request_stats, tl_status>) {
    let mut tokens = Vec::new();
    loop {
        let (status, event) = next_event(engine.0, id, -1);
        if status != tl_status::TL_OK {
            return (tokens, Err(status));
        }
        match event.kind {
            tl_event_kind::TL_EVENT_TOKEN => tokens.push(event.token),
            tl_event_kind::TL_EVENT_DONE => return (tokens, Ok(event.stats)),
            tl_event_kind::TL_EVENT_NONE => panic!("waiting without a timeout returned nothing"),
        }
    }
}

#[test]
fn engine_requests_equal_tl_generate() {
    let model = open(&model_file("tiny"), 256);
    let engine = new_engine(&model, &engine_params());
    let requests: Vec<(Vec<i32>, tl_generate_params)> = [(1, 3), (4, 11), (2, 20), (6, 7)]
        .iter()
        .enumerate()
        .map(|(i, &(loops, len))| {
            let mut p = gen_params(6 + 2 * i as u32);
            p.loops = loops;
            ((0..len).map(|t| (t * 31 + i as i32) % 256).collect(), p)
        })
        .collect();
    let ids: Vec<u64> = requests
        .iter()
        .map(|(t, p)| submit(&engine, t, p))
        .collect();
    assert_eq!(ids, [0, 1, 2, 3]);
    for ((prompt, p), id) in requests.iter().zip(ids) {
        let (tokens, stats) = drain(&engine, id);
        let (status, alone) = generate(&model, prompt, p);
        assert_eq!(status, tl_status::TL_OK);
        assert_eq!(tokens, alone);
        let stats = stats.unwrap();
        assert_eq!(
            (
                stats.tokens as usize,
                stats.prompt_tokens as usize,
                stats.finish
            ),
            (tokens.len(), prompt.len(), tl_finish::TL_FINISH_LENGTH)
        );
        // The id is forgotten once its last event was taken.
        let (status, _) = next_event(engine.0, id, 0);
        assert_eq!(status, tl_status::TL_ERR_INVALID_ARGUMENT);
        assert!(
            last_error().contains(&format!("no request {id} on this engine")),
            "{}",
            last_error()
        );
    }
    let mut stats = tl_engine_stats::default();
    // SAFETY: a valid out-pointer.
    assert_eq!(
        unsafe { tl_engine_get_stats(engine.0, &mut stats) },
        tl_status::TL_OK
    );
    assert_eq!((stats.running, stats.queued, stats.pages_used), (0, 0, 0));
    assert!(stats.steps > 0 && stats.tokens == 6 + 8 + 10 + 12);
}

#[test]
fn engine_cancel_and_free_end_requests_with_cancelled() {
    let model = open(&model_file("tiny"), 256);
    let engine = new_engine(&model, &engine_params());
    let mut p = gen_params(200);
    p.loops = 6;
    let id = submit(&engine, &[1, 2, 3, 4, 5], &p);
    let (status, first) = next_event(engine.0, id, -1);
    assert_eq!(
        (status, first.kind),
        (tl_status::TL_OK, tl_event_kind::TL_EVENT_TOKEN)
    );
    assert_eq!(tl_engine_cancel(engine.0, id), tl_status::TL_OK);
    let (_, end) = drain(&engine, id);
    assert_eq!(end.unwrap_err(), tl_status::TL_ERR_CANCELLED);
    assert_eq!(
        tl_engine_cancel(engine.0, id),
        tl_status::TL_ERR_INVALID_ARGUMENT
    );
    assert!(
        last_error().contains("request 0 has already ended"),
        "{}",
        last_error()
    );
    assert_eq!(
        tl_engine_cancel(engine.0, 77),
        tl_status::TL_ERR_INVALID_ARGUMENT
    );
    assert!(last_error().contains("no request 77"), "{}", last_error());

    // Freeing the engine while another thread waits on a request ends it as cancelled. The
    // request waits in the queue behind a long one, so it has no event before the free.
    let mut one_at_a_time = engine_params();
    one_at_a_time.max_running = 1;
    let engine = new_engine(&model, &one_at_a_time);
    let running = submit(&engine, &[9, 8, 7], &p);
    let queued = submit(&engine, &[3, 4], &p);
    let handle = engine.0 as usize;
    let waiter = std::thread::spawn(move || loop {
        // BUSY while the main thread's poll below holds the queue; then it waits here.
        let (status, _) = next_event(handle as *const tl_engine, queued, -1);
        if status != tl_status::TL_ERR_BUSY {
            return status;
        }
    });
    // Once the waiter holds the request's queue, a second taker is refused: then it is waiting.
    let refused = (0..10_000_000).find_map(|_| {
        let (status, event) = next_event(engine.0, queued, 0);
        assert!(status != tl_status::TL_OK || event.kind == tl_event_kind::TL_EVENT_NONE);
        (status != tl_status::TL_OK).then_some(status)
    });
    assert_eq!(refused, Some(tl_status::TL_ERR_BUSY));
    assert!(last_error().contains("another thread is taking the events of request 1"));
    tl_engine_free(engine.0);
    assert_eq!(waiter.join().unwrap(), tl_status::TL_ERR_CANCELLED);
    let (status, _) = next_event(engine.0, running, 0);
    assert_eq!(status, tl_status::TL_ERR_CLOSED);
    let mut id = 0;
    // SAFETY: valid pointers.
    let status = unsafe { tl_engine_submit(engine.0, [1].as_ptr(), 1, &p, &mut id) };
    assert_eq!(status, tl_status::TL_ERR_CLOSED);
    assert!(
        last_error().contains("tl_engine_submit called on a freed engine"),
        "{}",
        last_error()
    );
    tl_engine_free(engine.0); // twice: a no-op (and again when `engine` drops)
    tl_engine_free(ptr::null_mut());
}

#[test]
fn engine_bad_input_is_a_clear_error() {
    let model = open(&model_file("tiny"), 256);
    let mut out = ptr::null_mut();
    let mut p = engine_params();
    // SAFETY (each call): valid or deliberately NULL pointers, as the cases say.
    let status = unsafe { tl_engine_new(ptr::null(), &p, &mut out) };
    assert_eq!(status, tl_status::TL_ERR_INVALID_ARGUMENT);
    assert!(last_error().contains("model is NULL"));
    let status = unsafe { tl_engine_new(model.0, &p, ptr::null_mut()) };
    assert_eq!(status, tl_status::TL_ERR_INVALID_ARGUMENT);
    assert!(last_error().contains("out_engine is NULL"));
    p.page_size = 0;
    let status = unsafe { tl_engine_new(model.0, &p, &mut out) };
    assert_eq!(status, tl_status::TL_ERR_INVALID_ARGUMENT);
    assert!(
        last_error().contains("engine option page_size must be at least 1"),
        "{}",
        last_error()
    );
    p = engine_params();
    p.struct_size = 8;
    let status = unsafe { tl_engine_new(model.0, &p, &mut out) };
    assert_eq!(status, tl_status::TL_ERR_INVALID_ARGUMENT);
    assert!(
        last_error().contains("tl_engine_params.struct_size is 8"),
        "{}",
        last_error()
    );
    assert_eq!(
        unsafe { tl_engine_default_params(ptr::null_mut()) },
        tl_status::TL_ERR_INVALID_ARGUMENT
    );

    let engine = new_engine(&model, &engine_params());
    let g = gen_params(4);
    let mut id = 0;
    let cases: [(&[i32], &str); 3] = [
        (&[], "empty token sequence"),
        (&[1, 256], "out of range for vocab_size 256"),
        (&[-1], "-1"),
    ];
    for (prompt, expected) in cases {
        let status =
            unsafe { tl_engine_submit(engine.0, prompt.as_ptr(), prompt.len(), &g, &mut id) };
        assert_eq!(status, tl_status::TL_ERR_INVALID_ARGUMENT, "{prompt:?}");
        assert!(last_error().contains(expected), "{}", last_error());
    }
    let status = unsafe { tl_engine_submit(engine.0, [1].as_ptr(), 1, &g, ptr::null_mut()) };
    assert_eq!(status, tl_status::TL_ERR_INVALID_ARGUMENT);
    assert!(last_error().contains("out_id is NULL"));
    let id = submit(&engine, &[1, 2], &g);
    let (status, _) = next_event(engine.0, id, -2);
    assert_eq!(status, tl_status::TL_ERR_INVALID_ARGUMENT);
    assert!(
        last_error().contains("timeout_ms is -2"),
        "{}",
        last_error()
    );
    let status = unsafe { tl_engine_next(engine.0, id, 0, ptr::null_mut()) };
    assert_eq!(status, tl_status::TL_ERR_INVALID_ARGUMENT);
    let (_, end) = drain(&engine, id);
    assert!(end.is_ok());
    let status = unsafe { tl_engine_get_stats(ptr::null(), &mut tl_engine_stats::default()) };
    assert_eq!(status, tl_status::TL_ERR_INVALID_ARGUMENT);
    assert!(last_error().contains("engine is NULL"));
    let status = unsafe { tl_engine_get_stats(engine.0, ptr::null_mut()) };
    assert_eq!(status, tl_status::TL_ERR_INVALID_ARGUMENT);
    assert!(last_error().contains("out_stats is NULL"));
    // A model handle is not an engine handle.
    assert_eq!(
        tl_engine_cancel(model.0.cast(), 0),
        tl_status::TL_ERR_INVALID_ARGUMENT
    );
    assert!(
        last_error().contains("engine is a tl_model handle, not a tl_engine"),
        "{}",
        last_error()
    );
}
