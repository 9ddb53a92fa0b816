//! The stable-toolchain fuzz runner: a deterministic mutation loop over the seed corpus for a
//! bounded time, with the checks libFuzzer would make. Every finding stops the run, is saved
//! under `fuzz/artifacts/TARGET/` and can be replayed:
//!
//! ```text
//! fuzz-stable run TARGET [--seconds N] [--seed S]     one target (header, open_decode, safetensors)
//! fuzz-stable all [--seconds N] [--seed S]            every target, N seconds each
//! fuzz-stable replay TARGET FILE...                   run saved inputs once
//! fuzz-stable seeds [DIR]                             write the seed corpus (default fuzz/corpus)
//! fuzz-stable dump TARGET N DIR [--seed S]            write N mutated inputs, to test other programs
//! ```
//!
//! Detected: panics (the panic message and place), aborts and fatal signals (the input is saved
//! from a signal handler), inputs that run longer than 10 s, any allocation request that would
//! take the process above 2 GiB (refused, then reported even if the library handled the failure),
//! and the targets' own findings (for example NaN logits from a model that opened).

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::BTreeMap;
use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tinyloop_fuzz::rng::Rng;
use tinyloop_fuzz::{Outcome, Target};

/// The most memory the process may hold (the threshold libFuzzer runs use as `-malloc_limit_mb`).
const MEMORY_LIMIT: usize = 2 << 30;
/// An input that runs longer than this is a hang.
const TIME_LIMIT: Duration = Duration::from_secs(10);
/// Accepted inputs kept as bases for further mutation, besides the seeds.
const POOL_LIMIT: usize = 512;

/// The system allocator with a ceiling: requests that would exceed [`MEMORY_LIMIT`] fail (as
/// they would on a machine without the memory) and are remembered.
struct CappedAllocator;

static LIVE_BYTES: AtomicUsize = AtomicUsize::new(0);
static REFUSED_BYTES: AtomicUsize = AtomicUsize::new(0);

impl CappedAllocator {
    fn admit(&self, size: usize) -> bool {
        let live = LIVE_BYTES.load(Ordering::Relaxed);
        if size > MEMORY_LIMIT || live + size > MEMORY_LIMIT {
            REFUSED_BYTES.fetch_max(size, Ordering::Relaxed);
            return false;
        }
        true
    }
}

// SAFETY: forwards to the system allocator; only adds accounting and refusals (a null return,
// which every caller must handle).
unsafe impl GlobalAlloc for CappedAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if !self.admit(layout.size()) {
            return std::ptr::null_mut();
        }
        let p = System.alloc(layout);
        if !p.is_null() {
            LIVE_BYTES.fetch_add(layout.size(), Ordering::Relaxed);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if !self.admit(layout.size()) {
            return std::ptr::null_mut();
        }
        let p = System.alloc_zeroed(layout);
        if !p.is_null() {
            LIVE_BYTES.fetch_add(layout.size(), Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout);
        LIVE_BYTES.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size > layout.size() && !self.admit(new_size - layout.size()) {
            return std::ptr::null_mut();
        }
        let p = System.realloc(ptr, layout, new_size);
        if !p.is_null() {
            LIVE_BYTES.fetch_add(new_size, Ordering::Relaxed);
            LIVE_BYTES.fetch_sub(layout.size(), Ordering::Relaxed);
        }
        p
    }
}

#[global_allocator]
static ALLOCATOR: CappedAllocator = CappedAllocator;

/// The input being run, for the fatal-signal handler (pointer and length) and the watchdog.
static CURRENT_PTR: AtomicPtr<u8> = AtomicPtr::new(std::ptr::null_mut());
static CURRENT_LEN: AtomicUsize = AtomicUsize::new(0);
static CURRENT: Mutex<Vec<u8>> = Mutex::new(Vec::new());
/// Where the signal handler saves the input (a leaked C string).
static SIGNAL_ARTIFACT: AtomicPtr<libc::c_char> = AtomicPtr::new(std::ptr::null_mut());
/// Milliseconds since `EPOCH` at which the current input started; 0 when idle.
static STARTED_MS: AtomicU64 = AtomicU64::new(0);
/// The last panic's message and place, recorded by the panic hook.
static PANIC: Mutex<Option<String>> = Mutex::new(None);

fn epoch() -> Instant {
    static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

fn now_ms() -> u64 {
    epoch().elapsed().as_millis() as u64 + 1
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("run") => target_arg(&args).and_then(|t| fuzz(&[t], &args)),
        Some("all") => fuzz(&Target::ALL, &args),
        Some("replay") => target_arg(&args).and_then(|t| replay(t, &args[2..])),
        Some("seeds") => write_seeds(args.get(1).map_or_else(default_corpus, PathBuf::from)),
        Some("dump") => target_arg(&args).and_then(|t| dump(t, &args)),
        _ => Err(
            "usage: fuzz-stable run TARGET | all | replay TARGET FILE... | seeds [DIR] | \
                  dump TARGET N DIR, with [--seconds N] [--seed S] \
                  (targets: header, open_decode, safetensors)"
                .into(),
        ),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("{message}");
            ExitCode::FAILURE
        }
    }
}

fn target_arg(args: &[String]) -> Result<Target, String> {
    let name = args.get(1).ok_or("missing TARGET")?;
    Target::from_name(name).ok_or_else(|| format!("unknown target {name:?}"))
}

fn option(args: &[String], name: &str, default: u64) -> Result<u64, String> {
    match args.iter().position(|a| a == name) {
        None => Ok(default),
        Some(i) => args
            .get(i + 1)
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| format!("{name} needs a number")),
    }
}

fn default_corpus() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus")
}

fn artifacts(target: Target) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("artifacts")
        .join(target.name())
}

/// Fuzz each target for `--seconds` (default 20) with generator seed `--seed` (default 0).
fn fuzz(targets: &[Target], args: &[String]) -> Result<(), String> {
    let seconds = option(args, "--seconds", 20)?;
    let seed = option(args, "--seed", 0)?;
    install_detectors();
    for &target in targets {
        fuzz_one(target, Duration::from_secs(seconds), seed)?;
    }
    Ok(())
}

fn fuzz_one(target: Target, budget: Duration, seed: u64) -> Result<(), String> {
    arm_signal_artifact(target);
    let seeds = target.seeds();
    let mut pool = seeds.clone();
    let mut rng = Rng::new(seed);
    let mut counts = BTreeMap::<Outcome, u64>::new();
    let start = Instant::now();
    let mut inputs = seeds.clone().into_iter();
    let mut executions = 0u64;
    while start.elapsed() < budget || inputs.len() > 0 {
        let input = inputs.next().unwrap_or_else(|| {
            let base = rng.below(pool.len());
            target.mutate(&pool[base], &mut rng)
        });
        let outcome =
            execute(target, &input).map_err(|finding| report(target, &input, &finding))?;
        executions += 1;
        *counts.entry(outcome).or_default() += 1;
        // Inputs that got all the way through are good bases for deeper mutations.
        if !outcome.starts_with("rejected") && rng.below(4) == 0 {
            if pool.len() < seeds.len() + POOL_LIMIT {
                pool.push(input);
            } else {
                let i = seeds.len() + rng.below(POOL_LIMIT);
                pool[i] = input;
            }
        }
    }
    let secs = start.elapsed().as_secs_f64();
    println!(
        "{}: {executions} inputs in {secs:.1} s ({:.0}/s), seed {seed}, 0 findings",
        target.name(),
        executions as f64 / secs
    );
    for (outcome, n) in &counts {
        println!("  {outcome:<28} {n:>9}");
    }
    Ok(())
}

/// Run one input under the detectors.
fn execute(target: Target, input: &[u8]) -> Result<Outcome, String> {
    *CURRENT.lock().unwrap() = input.to_vec();
    CURRENT_PTR.store(input.as_ptr() as *mut u8, Ordering::SeqCst);
    CURRENT_LEN.store(input.len(), Ordering::SeqCst);
    REFUSED_BYTES.store(0, Ordering::SeqCst);
    STARTED_MS.store(now_ms(), Ordering::SeqCst);
    let result = std::panic::catch_unwind(|| target.run(input));
    STARTED_MS.store(0, Ordering::SeqCst);
    let refused = REFUSED_BYTES.swap(0, Ordering::SeqCst);
    let outcome = match result {
        Err(_) => {
            let message = PANIC.lock().unwrap().take();
            return Err(format!("panic: {}", message.unwrap_or_default()));
        }
        Ok(result) => result?,
    };
    if refused > 0 {
        return Err(format!(
            "an allocation of {refused} bytes was requested (limit {MEMORY_LIMIT}); \
             the input was handled as {outcome:?}"
        ));
    }
    Ok(outcome)
}

/// Save a finding's input and say how to replay it.
fn report(target: Target, input: &[u8], finding: &str) -> String {
    let path = artifacts(target).join(format!("crash-{:08x}", crc32fast::hash(input)));
    let saved = std::fs::create_dir_all(artifacts(target))
        .and_then(|()| std::fs::write(&path, input))
        .map_or_else(
            |e| format!("could not save the input: {e}"),
            |()| format!("input saved to {}", path.display()),
        );
    format!(
        "{}: FINDING: {finding}\n  {saved}\n  replay: cargo run --release --no-default-features \
         --manifest-path fuzz/Cargo.toml --bin fuzz-stable -- replay {} {}",
        target.name(),
        target.name(),
        path.display()
    )
}

fn replay(target: Target, files: &[String]) -> Result<(), String> {
    install_detectors();
    arm_signal_artifact(target);
    let mut findings = 0;
    for file in files {
        let input = std::fs::read(file).map_err(|e| format!("{file}: {e}"))?;
        match execute(target, &input) {
            Ok(outcome) => println!("{file}: {outcome}"),
            Err(finding) => {
                findings += 1;
                println!("{file}: FINDING: {finding}");
            }
        }
    }
    match findings {
        0 => Ok(()),
        n => Err(format!("{n} of {} inputs had findings", files.len())),
    }
}

fn write_seeds(dir: PathBuf) -> Result<(), String> {
    for target in Target::ALL {
        let dir = dir.join(target.name());
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        for (i, seed) in target.seeds().iter().enumerate() {
            let path = dir.join(format!("seed-{i:02}"));
            std::fs::write(&path, seed).map_err(|e| format!("{}: {e}", path.display()))?;
        }
        println!(
            "{}: {} seeds in {}",
            target.name(),
            target.seeds().len(),
            dir.display()
        );
    }
    Ok(())
}

/// Write `N` mutations of the seeds (each of one seed, chosen at random) to `DIR/in-NNNNNN`.
fn dump(target: Target, args: &[String]) -> Result<(), String> {
    let count: usize = args
        .get(2)
        .and_then(|n| n.parse().ok())
        .ok_or("dump needs a count N")?;
    let dir = PathBuf::from(args.get(3).ok_or("dump needs a directory")?);
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let seeds = target.seeds();
    let mut rng = Rng::new(option(args, "--seed", 0)?);
    for i in 0..count {
        let input = target.mutate(&seeds[rng.below(seeds.len())], &mut rng);
        let path = dir.join(format!("in-{i:06}"));
        std::fs::write(&path, input).map_err(|e| format!("{}: {e}", path.display()))?;
    }
    Ok(())
}

/// The panic hook, the hang watchdog and the fatal-signal handlers.
fn install_detectors() {
    epoch();
    std::panic::set_hook(Box::new(|info| {
        *PANIC.lock().unwrap() = Some(info.to_string());
    }));
    std::thread::spawn(|| loop {
        std::thread::sleep(Duration::from_millis(200));
        let started = STARTED_MS.load(Ordering::SeqCst);
        if started != 0 && now_ms() - started > TIME_LIMIT.as_millis() as u64 {
            let input = CURRENT.lock().unwrap().clone();
            let target = hang_target();
            eprintln!(
                "{}",
                report(
                    target,
                    &input,
                    &format!("hang: input ran longer than {TIME_LIMIT:?}")
                )
            );
            std::process::exit(1);
        }
    });
    for signal in [
        libc::SIGABRT,
        libc::SIGSEGV,
        libc::SIGBUS,
        libc::SIGILL,
        libc::SIGFPE,
    ] {
        // SAFETY: installs an async-signal-safe handler (it only calls open, write, close,
        // sigaction and raise) on the alternate stack Rust sets up for its threads.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_fatal_signal as *const () as usize;
            action.sa_flags = libc::SA_ONSTACK;
            libc::sigaction(signal, &action, std::ptr::null_mut());
        }
    }
}

/// The target whose artifact directory the signal handler writes to, for the watchdog's report.
static ARMED_TARGET: AtomicUsize = AtomicUsize::new(0);

fn hang_target() -> Target {
    Target::ALL[ARMED_TARGET.load(Ordering::SeqCst)]
}

fn arm_signal_artifact(target: Target) {
    let dir = artifacts(target);
    std::fs::create_dir_all(&dir).ok();
    let path = CString::new(dir.join("crash-signal").to_string_lossy().into_owned())
        .expect("no NUL in the path");
    let old = SIGNAL_ARTIFACT.swap(path.into_raw(), Ordering::SeqCst);
    if !old.is_null() {
        // SAFETY: created by `CString::into_raw` above and no longer reachable.
        drop(unsafe { CString::from_raw(old) });
    }
    let index = Target::ALL.iter().position(|&t| t == target).unwrap_or(0);
    ARMED_TARGET.store(index, Ordering::SeqCst);
}

extern "C" fn on_fatal_signal(signal: libc::c_int) {
    let message = b"\nFINDING: fatal signal while running an input (abort, or a memory error); \
the input is saved as artifacts/TARGET/crash-signal under fuzz/\n";
    // SAFETY: only async-signal-safe calls, on memory that stays valid while the input runs.
    unsafe {
        libc::write(2, message.as_ptr().cast(), message.len());
        let path = SIGNAL_ARTIFACT.load(Ordering::SeqCst);
        let (data, len) = (
            CURRENT_PTR.load(Ordering::SeqCst),
            CURRENT_LEN.load(Ordering::SeqCst),
        );
        if !path.is_null() && !data.is_null() {
            let fd = libc::open(path, libc::O_WRONLY | libc::O_CREAT | libc::O_TRUNC, 0o644);
            if fd >= 0 {
                libc::write(fd, data.cast(), len);
                libc::close(fd);
            }
        }
        let mut default: libc::sigaction = std::mem::zeroed();
        default.sa_sigaction = libc::SIG_DFL;
        libc::sigaction(signal, &default, std::ptr::null_mut());
        libc::raise(signal);
    }
}
