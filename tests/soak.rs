//! Soak test of the C ABI's resource lifecycle: 10 000 open → use → close cycles and 100 000
//! generated tokens, with resident memory (and, on a GPU, device memory) flat.
//!
//! Each cycle uses the seed surface only (open, generate, score_last, vram_usage_mb, close;
//! never `tl_model_free`) plus one session (new, free); the token phase alternates greedy and
//! sampled calls of 100 tokens on one model. Memory is read after a
//! warm-up, which lets the allocator, the CPU thread pool and, on a GPU, the driver reach their
//! steady state, and again at the end.
//!
//! Tolerances, and why:
//! * **RSS**: growth ≤ 1 MiB over the measured phase. Resident memory moves in 4 KiB pages and
//!   the allocator keeps freed blocks for reuse, so a few hundred KiB of drift are normal; 1 MiB
//!   over 10 000 cycles is ≈ 105 bytes per cycle (over 100 000 tokens, ≈ 10 bytes per token), so
//!   a leak of one small allocation per model, session or call fails the test. (Before the
//!   model handle was released by `tl_close`, the seed surface lost 656 bytes per cycle.)
//! * **Device memory** (CUDA only; used = total − free from `cuMemGetInfo`): growth ≤ 16 MiB, the
//!   driver's allocation granularity (2 MiB pages) several times over, ≈ 1.7 KB per cycle; the
//!   tiny model's weights and session alone are far more than that, so losing them fails.
//!   `tl_vram_usage_mb` (the library's own count) must be identical in every cycle.
//!
//! The tests take minutes, so `cargo test` skips them; scripts/test runs them (`cargo test
//! --release --test soak -- --ignored --nocapture`), and so does the GPU bundle. Device:
//! `TINYLOOP_SOAK_DEVICE`, else `TINYLOOP_DEVICE`, else `cpu` (the GPU bundle's run-tests.sh
//! sets `TINYLOOP_DEVICE=cuda`). `TINYLOOP_SOAK_CYCLES` and `TINYLOOP_SOAK_TOKENS` change the
//! counts. Figures and commands: docs/RELIABILITY.md.

use std::ffi::{CStr, CString};
use std::path::PathBuf;
use std::ptr;
use std::str::FromStr;
use std::sync::Mutex;
use std::time::Instant;

use tinyloop::ffi::*;
use tinyloop::model::synth::{preset, random_model};
use tinyloop::{Device, ModelConfig};

const RSS_TOLERANCE: usize = 1 << 20;
const DEVICE_TOLERANCE: usize = 16 << 20;
const PROMPT: [i32; 6] = [82, 79, 77, 69, 79, 58];
/// Tokens per generate call in the token phase.
const TOKENS_PER_CALL: u32 = 100;
/// Loop iterations of every call: the soak is about what calls allocate and release, which one
/// iteration exercises as fully as many (every token still runs prefill or a decode step,
/// sampling and a KV write); more would only cost time.
const LOOPS: i32 = 1;

/// The phases measure process-wide memory, so they must not run at the same time.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn count(var: &str, default: usize) -> usize {
    match std::env::var(var) {
        Ok(v) => v
            .parse()
            .unwrap_or_else(|_| panic!("{var}={v:?} is not a count")),
        Err(_) => default,
    }
}

fn device() -> String {
    ["TINYLOOP_SOAK_DEVICE", "TINYLOOP_DEVICE"]
        .iter()
        .find_map(|var| std::env::var(var).ok().filter(|v| !v.trim().is_empty()))
        .unwrap_or_else(|| "cpu".to_string())
}

fn model_file() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tinyloop-soak-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("tiny.tinyloop");
    if !path.exists() {
        // default_loops may not exceed the max_loops the soak opens with.
        let config = ModelConfig {
            default_loops: LOOPS as usize,
            ..preset("tiny").unwrap()
        };
        random_model(&config, 7, 4, 32)
            .unwrap()
            .write(&path)
            .unwrap();
    }
    path
}

fn last_error() -> String {
    // SAFETY: never NULL; valid until the next failing call on this thread.
    unsafe { CStr::from_ptr(tl_last_error_message()) }
        .to_string_lossy()
        .into_owned()
}

fn check(status: tl_status, what: &str) {
    assert_eq!(status, tl_status::TL_OK, "{what}: {}", last_error());
}

/// Resident set size of this process in bytes (/proc/self/statm, field 2, in pages).
fn rss_bytes() -> usize {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("/proc/self/statm");
    let pages: usize = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    pages * page as usize
}

/// Device memory in use on a CUDA device (total − free), read through the driver.
struct DeviceMemory(std::sync::Arc<cudarc::driver::CudaContext>);

impl DeviceMemory {
    /// For a model on `cuda:N`; `None` on the CPU.
    fn for_device(device: &str) -> Option<DeviceMemory> {
        let name = device.split_whitespace().next().unwrap_or("");
        let ordinal = match Device::from_str(name) {
            Ok(Device::Cuda(n)) => n,
            _ => return None,
        };
        let ctx = cudarc::driver::CudaContext::new(ordinal).expect("CUDA context");
        Some(DeviceMemory(ctx))
    }

    fn used(&self) -> usize {
        let (free, total) = self.0.mem_get_info().expect("cuMemGetInfo");
        total - free
    }
}

/// Memory readings at the start of the measured phase.
struct Baseline {
    rss: usize,
    device: Option<(DeviceMemory, usize)>,
}

impl Baseline {
    fn take(device: Option<DeviceMemory>) -> Baseline {
        Baseline {
            rss: rss_bytes(),
            device: device.map(|d| {
                let used = d.used();
                (d, used)
            }),
        }
    }

    /// Assert that memory is flat since the baseline; `what` names the phase.
    fn assert_flat(&self, what: &str) {
        let rss = rss_bytes();
        eprintln!(
            "{what}: RSS {:.2} MiB -> {:.2} MiB ({:+} KiB)",
            self.rss as f64 / 1048576.0,
            rss as f64 / 1048576.0,
            (rss as i64 - self.rss as i64) / 1024
        );
        assert!(
            rss <= self.rss + RSS_TOLERANCE,
            "{what}: RSS grew by {} bytes (tolerance {RSS_TOLERANCE})",
            rss - self.rss
        );
        if let Some((device, before)) = &self.device {
            let used = device.used();
            eprintln!(
                "{what}: device memory used {:.1} MiB -> {:.1} MiB",
                *before as f64 / 1048576.0,
                used as f64 / 1048576.0
            );
            assert!(
                used <= before + DEVICE_TOLERANCE,
                "{what}: device memory grew by {} bytes (tolerance {DEVICE_TOLERANCE})",
                used - before
            );
        }
    }
}

fn open(path: &CStr, device: &CStr) -> *mut tl_model {
    let mut params = std::mem::MaybeUninit::<tl_model_params>::uninit();
    // SAFETY: a valid out-pointer.
    check(
        unsafe { tl_model_default_params(params.as_mut_ptr()) },
        "tl_model_default_params",
    );
    // SAFETY: initialized above.
    let mut params = unsafe { params.assume_init() };
    params.device = device.as_ptr();
    params.max_seq_len = 128;
    // The KV cache holds max_loops iterations; calls use LOOPS, so more would only be zeroed.
    params.max_loops = LOOPS as u32;
    params.log = false;
    let mut model = ptr::null_mut();
    // SAFETY: valid strings, params and out-pointer.
    check(
        unsafe { tl_model_open(path.as_ptr(), &params, &mut model) },
        "tl_model_open",
    );
    model
}

fn gen_params(max_tokens: u32) -> tl_generate_params {
    let mut p = std::mem::MaybeUninit::<tl_generate_params>::uninit();
    // SAFETY: a valid out-pointer.
    check(
        unsafe { tl_generate_default_params(p.as_mut_ptr()) },
        "tl_generate_default_params",
    );
    // SAFETY: initialized above.
    let mut p = unsafe { p.assume_init() };
    p.max_tokens = max_tokens;
    p.loops = LOOPS;
    p
}

fn device_name(model: *const tl_model) -> String {
    let mut buf = [0 as std::ffi::c_char; 256];
    let mut len = 0;
    // SAFETY: buf holds buf.len() bytes.
    check(
        unsafe { tl_model_device(model, buf.as_mut_ptr(), buf.len(), &mut len) },
        "tl_model_device",
    );
    // SAFETY: NUL-terminated by tl_model_device.
    unsafe { CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

/// One cycle: the seed surface (open, generate, score_last, vram_usage_mb, close) and a session
/// (new, free). Returns the library's device-memory count while the model was open.
fn cycle(path: &CStr, device: &CStr) -> f64 {
    let model = open(path, device);
    let p = gen_params(1);
    let (mut token, mut len) = (0i32, 0usize);
    let mut logits = [0f32; 256];
    let mut session = ptr::null_mut();
    let mut mb = 0.0;
    // SAFETY: valid buffers of the stated lengths and valid out-pointers.
    unsafe {
        check(
            tl_generate(model, PROMPT.as_ptr(), 6, &p, &mut token, 1, &mut len),
            "tl_generate",
        );
        check(
            tl_score_last(
                model,
                PROMPT.as_ptr(),
                6,
                LOOPS,
                logits.as_mut_ptr(),
                256,
                &mut len,
            ),
            "tl_score_last",
        );
        check(tl_vram_usage_mb(model, &mut mb), "tl_vram_usage_mb");
        check(tl_session_new(model, &mut session), "tl_session_new");
    }
    tl_session_free(session);
    check(tl_close(model), "tl_close");
    mb
}

#[test]
#[ignore = "minutes long: scripts/test runs it with --ignored"]
fn open_close_cycles_keep_memory_flat() {
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let cycles = count("TINYLOOP_SOAK_CYCLES", 10_000);
    let warmup = (cycles / 20).max(1);
    let path = CString::new(model_file().to_str().unwrap()).unwrap();
    let device = device();
    let device_c = CString::new(device.clone()).unwrap();

    let probe = open(&path, &device_c);
    let name = device_name(probe);
    check(tl_close(probe), "tl_close");
    let first_mb = cycle(&path, &device_c);
    for _ in 1..warmup {
        cycle(&path, &device_c);
    }
    let baseline = Baseline::take(DeviceMemory::for_device(&name));
    let start = Instant::now();
    for i in 0..cycles {
        let mb = cycle(&path, &device_c);
        assert_eq!(mb, first_mb, "cycle {i}: tl_vram_usage_mb changed");
        if (i + 1) % (cycles / 10).max(1) == 0 {
            eprintln!(
                "  {} cycles: RSS {:.2} MiB",
                i + 1,
                rss_bytes() as f64 / 1048576.0
            );
        }
    }
    eprintln!(
        "{cycles} open/close cycles on {name} (after {warmup} warm-up cycles) in {:.1} s",
        start.elapsed().as_secs_f64()
    );
    baseline.assert_flat(&format!("{cycles} open/close cycles"));
}

#[test]
#[ignore = "minutes long: scripts/test runs it with --ignored"]
fn generated_tokens_keep_memory_flat() {
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let tokens = count("TINYLOOP_SOAK_TOKENS", 100_000);
    let calls = tokens.div_ceil(TOKENS_PER_CALL as usize);
    let path = CString::new(model_file().to_str().unwrap()).unwrap();
    let device_c = CString::new(device()).unwrap();
    let model = open(&path, &device_c);
    let name = device_name(model);
    let greedy = gen_params(TOKENS_PER_CALL);
    let mut sampled = greedy;
    sampled.temperature = 0.8;
    sampled.top_k = 40;
    sampled.top_p = 0.95;
    let mut out = vec![0i32; TOKENS_PER_CALL as usize];
    let mut run = |i: usize| {
        let mut p = if i.is_multiple_of(2) { greedy } else { sampled };
        p.seed = i as u64;
        let mut len = 0;
        // SAFETY: out holds max_tokens entries.
        check(
            unsafe {
                tl_generate(
                    model,
                    PROMPT.as_ptr(),
                    PROMPT.len(),
                    &p,
                    out.as_mut_ptr(),
                    out.len(),
                    &mut len,
                )
            },
            "tl_generate",
        );
        assert_eq!(
            len, TOKENS_PER_CALL as usize,
            "no stop tokens: every call is full"
        );
    };
    let warmup = (calls / 20).max(1);
    (0..warmup).for_each(&mut run);
    let baseline = Baseline::take(DeviceMemory::for_device(&name));
    let start = Instant::now();
    (0..calls).for_each(&mut run);
    let generated = calls * TOKENS_PER_CALL as usize;
    eprintln!(
        "{generated} tokens on {name} in {calls} calls (after {warmup} warm-up calls) in {:.1} s",
        start.elapsed().as_secs_f64()
    );
    baseline.assert_flat(&format!("{generated} generated tokens"));
    check(tl_close(model), "tl_close");
}
