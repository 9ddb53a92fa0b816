//! No argument value makes TinyLoop panic. Every numeric option of every CLI command, every
//! count of the Rust API and every count field of the C ABI is driven with extreme integers (0,
//! 1, 2^31, 2^32 ± k, 2^63, u64::MAX − k and, where the type is signed or the command line takes
//! the text, negative values): an accepted value runs to completion, a refused one is a clean
//! error (exit status 1 from the CLI, `Error::InvalidArgument` from the API,
//! `TL_ERR_INVALID_ARGUMENT` or `TL_ERR_BUFFER_TOO_SMALL` from the C ABI) whose message names the
//! option. The runs use the tiny model with room for 16 tokens, so a value that is accepted stays
//! cheap (a huge `max_tokens` stops at max_seq_len).

mod common;

use std::process::{Command, Output};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use tinyloop::ffi::*;
use tinyloop::{
    BetaMonitor, CtxTier, Error, GenerateParams, Model, ModelOptions, SamplingParams, Speculation,
};

/// Values every option gets.
const ALWAYS: [&str; 4] = ["0", "1", "18446744073709551615", "-1"];

/// Each option also gets two of these, in turn, so that every one is used by several options
/// while the number of runs stays bounded.
const POOL: [&str; 11] = [
    "2",
    "2147483648",
    "4294967295",
    "4294967296",
    "4294967298",
    "9223372036854775808",
    "18446744073709551614",
    "18446744073709551610",
    "-2147483648",
    "-9223372036854775808",
    "4294967297",
];

/// The values option number `i` is run with.
fn values(i: usize) -> Vec<&'static str> {
    let mut values = ALWAYS.to_vec();
    values.push(POOL[(2 * i) % POOL.len()]);
    values.push(POOL[(2 * i + 1) % POOL.len()]);
    values
}

/// A numeric option of a command.
#[derive(Clone)]
struct NumericOption {
    flag: &'static str,
    /// Words that name the option in an error: the flag, or the parameter it sets.
    names: &'static [&'static str],
    /// Other arguments the option needs to take effect (e.g. `--ctx-tier`).
    context: &'static [&'static str],
    /// The argument's text for a value: `V` is replaced by it.
    template: &'static str,
}

const fn opt(flag: &'static str, names: &'static [&'static str]) -> NumericOption {
    NumericOption {
        flag,
        names,
        context: &[],
        template: "V",
    }
}

const fn with(
    flag: &'static str,
    names: &'static [&'static str],
    context: &'static [&'static str],
) -> NumericOption {
    NumericOption {
        flag,
        names,
        context,
        template: "V",
    }
}

const COMMON: [NumericOption; 3] = [
    opt("--loops", &["--loops"]),
    opt("--max-seq-len", &["--max-seq-len", "max_seq_len"]),
    opt("--prefill-chunk", &["--prefill-chunk", "prefill_chunk"]),
];

const SAMPLED: &[&str] = &["--temperature", "1"];
const SAMPLING: [NumericOption; 4] = [
    opt("--temperature", &["--temperature", "temperature"]),
    with("--top-k", &["--top-k", "top_k"], SAMPLED),
    with("--top-p", &["--top-p", "top_p"], SAMPLED),
    with("--seed", &["--seed"], SAMPLED),
];

const SPECULATION: [NumericOption; 2] = [
    with(
        "--draft-loops",
        &["--draft-loops", "draft_loops"],
        &["--loops", "4"],
    ),
    with(
        "--draft-len",
        &["--draft-len", "draft_len"],
        &["--draft-loops", "2", "--loops", "4"],
    ),
];

const TIERED: &[&str] = &["--ctx-tier"];
const CTX_TIER: [NumericOption; 3] = [
    with(
        "--ctx-tier-short-t",
        &["--ctx-tier-short-t", "short_t"],
        TIERED,
    ),
    with(
        "--ctx-tier-long-t",
        &["--ctx-tier-long-t", "long_t"],
        TIERED,
    ),
    with("--ctx-tier-long-bits", &["--ctx-tier-long-bits"], TIERED),
];

const MONITORED: &[&str] = &["--beta-monitor"];
const BETA_MON: [NumericOption; 3] = [
    with(
        "--beta-mon-low-entropy-bits",
        &["--beta-mon-low-entropy-bits", "low_entropy_bits"],
        MONITORED,
    ),
    with(
        "--beta-mon-high-entropy-bits",
        &["--beta-mon-high-entropy-bits", "high_entropy_bits"],
        MONITORED,
    ),
    with(
        "--beta-mon-agreement-floor",
        &["--beta-mon-agreement-floor", "agreement_floor"],
        MONITORED,
    ),
];

/// A command: the arguments before its options, the options every run passes unless the one
/// under test replaces them, and its numeric options.
struct CommandCase {
    head: Vec<String>,
    base: Vec<(&'static str, String)>,
    options: Vec<NumericOption>,
}

/// A command line, and the words that name its option under test.
type Case = (Vec<String>, &'static [&'static str]);

/// The command lines of every (command, option, value) case.
fn command_lines() -> Vec<Case> {
    let model = common::synth_file("tiny", 1, 4)
        .to_string_lossy()
        .into_owned();
    let dir = common::scratch("extremes");
    // Replaced by a file of the case's own: the cases run in parallel.
    let out = || "OUT".to_string();
    let on_model = |command: &str| vec![model.clone(), command.to_string(), "-q".to_string()];
    let room = ("--max-seq-len", "16".to_string());
    let (st, cfg) = common::checkpoint("tiny", None, None);
    let calib = dir.join("calib.txt");
    std::fs::write(&calib, "To be, or not to be, that is the question.").unwrap();
    let convert_head = vec![
        "convert".into(),
        "--safetensors".into(),
        st.to_string_lossy().into_owned(),
        "--config".into(),
        cfg.to_string_lossy().into_owned(),
    ];
    let gptq = &[
        "--method", "gptq", "--calib", // Replaced by the calibration file below.
        "CALIB",
    ];
    let gptq_short = &[
        "--method",
        "gptq",
        "--calib",
        "CALIB",
        "--calib-bytes",
        "16",
    ];
    let commands = vec![
        CommandCase {
            head: on_model("generate"),
            base: vec![
                ("--tokens", "1,2,3".into()),
                ("--max-tokens", "2".into()),
                room.clone(),
            ],
            options: [
                &COMMON[..],
                &[
                    opt("--max-tokens", &["--max-tokens", "max_tokens"]),
                    NumericOption {
                        template: "1,V",
                        ..opt("--tokens", &["--tokens"])
                    },
                ],
                &SAMPLING,
                &SPECULATION,
                &CTX_TIER,
                &BETA_MON,
            ]
            .into_iter()
            .flat_map(|group| group.iter().cloned())
            .collect(),
        },
        CommandCase {
            head: on_model("score"),
            base: vec![("--tokens", "1,2,3,4,5".into()), room.clone()],
            options: [
                &COMMON[..],
                &[
                    opt("--window", &["--window"]),
                    opt("--limit", &["--limit"]),
                    opt("--buckets", &["--buckets"]),
                    NumericOption {
                        template: "2,V",
                        ..opt("--buckets", &["--buckets"])
                    },
                    NumericOption {
                        template: "1,2,V",
                        ..opt("--tokens", &["--tokens"])
                    },
                ],
                &CTX_TIER,
            ]
            .into_iter()
            .flat_map(|group| group.iter().cloned())
            .collect(),
        },
        lens_case(on_model("lens"), room.clone(), true),
        lens_case(on_model("trajectory"), room.clone(), false),
        CommandCase {
            head: on_model("bench"),
            base: vec![
                ("--prompt-len", "4".into()),
                ("--gen-len", "2".into()),
                ("--repeats", "1".into()),
                room.clone(),
            ],
            options: [
                &COMMON[..],
                &[
                    opt("--prompt-len", &["--prompt-len"]),
                    opt("--gen-len", &["--gen-len"]),
                    opt("--repeats", &["--repeats"]),
                    opt("--prefix-cache", &["--prefix-cache"]),
                    opt("--resume-from", &["--resume-from"]),
                    with(
                        "--prompt-offset",
                        &["--prompt-offset", "--prompt-file"],
                        &["--prompt-file", "tests/data/heldout.txt"],
                    ),
                ],
                &SAMPLING,
                &SPECULATION,
                &CTX_TIER,
                &BETA_MON,
            ]
            .into_iter()
            .flat_map(|group| group.iter().cloned())
            .collect(),
        },
        CommandCase {
            head: vec![model.clone(), "requantize".into()],
            base: vec![("--out", out())],
            options: vec![
                opt("--loop-body-bits", &["--loop-body-bits"]),
                opt("--head-bits", &["--head-bits"]),
                with(
                    "--head-group-size",
                    &["--head-group-size", "tensor head"],
                    &["--head-bits", "4"],
                ),
            ],
        },
        CommandCase {
            head: vec!["synth".into()],
            base: vec![("--preset", "tiny".into()), ("--out", out())],
            options: vec![
                opt("--seed", &["--seed"]),
                opt("--bits", &["--bits"]),
                opt("--group-size", &["--group-size", "group_size"]),
            ],
        },
        CommandCase {
            head: convert_head,
            // The tiny preset's linears have 64 columns: one group per row fits every one.
            base: vec![("--out", out()), ("--group-size", "0".into())],
            options: vec![
                opt("--bits", &["--bits"]),
                opt("--group-size", &["--group-size", "group_size"]),
                with("--calib-bytes", &["--calib-bytes"], gptq),
                with("--calib-loops", &["--calib-loops"], gptq_short),
                with("--window", &["--window", "window"], gptq_short),
            ],
        },
    ];
    let calib = calib.to_string_lossy().into_owned();
    let mut lines = Vec::new();
    let mut index = 0;
    for command in &commands {
        for option in &command.options {
            for value in values(index) {
                let mut line = command.head.clone();
                for (flag, base) in &command.base {
                    if *flag != option.flag {
                        line.extend([flag.to_string(), base.clone()]);
                    }
                }
                line.extend(option.context.iter().map(|arg| arg.to_string()));
                line.push(option.flag.to_string());
                line.push(option.template.replace('V', value));
                let own = dir.join(format!("case-{}.tinyloop", lines.len()));
                for arg in &mut line {
                    match arg.as_str() {
                        "OUT" => *arg = own.to_string_lossy().into_owned(),
                        "CALIB" => *arg = calib.clone(),
                        _ => {}
                    }
                }
                lines.push((line, option.names));
            }
            index += 1;
        }
    }
    lines
}

fn lens_case(head: Vec<String>, room: (&'static str, String), top: bool) -> CommandCase {
    let mut options = COMMON.to_vec();
    options.push(NumericOption {
        template: "1,V",
        ..opt("--tokens", &["--tokens"])
    });
    if top {
        options.push(opt("--top", &["--top"]));
    }
    CommandCase {
        head,
        base: vec![("--tokens", "1,2,3".into()), room],
        options,
    }
}

fn run(args: &[String]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_tinyloop"));
    command.args(args).env("TINYLOOP_DEVICE", "cpu");
    // The feature variables would change what the flags do.
    for (name, _) in std::env::vars_os() {
        if name
            .to_str()
            .is_some_and(|n| n.starts_with("TINYLOOP_") && n != "TINYLOOP_DEVICE")
        {
            command.env_remove(name);
        }
    }
    command.output().unwrap()
}

/// What is wrong with one run, if anything.
fn judge(args: &[String], names: &[&str], out: &Output) -> Option<String> {
    let stderr = String::from_utf8_lossy(&out.stderr);
    let what = format!("{args:?}: exit {:?}, stderr {stderr:?}", out.status.code());
    if stderr.contains("panicked") {
        return Some(format!("panicked: {what}"));
    }
    match out.status.code() {
        Some(0) => None,
        Some(1) => {
            let error = stderr.lines().find(|l| l.starts_with("error: "));
            match error {
                Some(line) if names.iter().any(|n| line.contains(n)) => None,
                _ => Some(format!("the error does not name {names:?}: {what}")),
            }
        }
        _ => Some(format!("not a clean exit: {what}")),
    }
}

#[test]
fn cli_options_take_any_integer_without_panicking() {
    let cases = command_lines();
    let next = AtomicUsize::new(0);
    let failures = Mutex::new(Vec::new());
    let workers = std::thread::available_parallelism().map_or(2, |n| n.get());
    std::thread::scope(|scope| {
        for _ in 0..workers {
            scope.spawn(|| {
                while let Some((args, names)) = cases.get(next.fetch_add(1, Ordering::Relaxed)) {
                    let out = run(args);
                    if let Some(failure) = judge(args, names, &out) {
                        failures.lock().unwrap().push(failure);
                    }
                }
            });
        }
    });
    let failures = failures.into_inner().unwrap();
    assert!(
        failures.is_empty(),
        "{} of {} runs failed:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

/// The usize extremes of the Rust API.
const USIZE: [usize; 10] = [
    0,
    1,
    2,
    1 << 31,
    (1 << 32) - 1,
    (1 << 32) + 2,
    1 << 63,
    usize::MAX - 5,
    usize::MAX - 1,
    usize::MAX,
];

/// The u32 extremes (token ids, bit widths).
const U32: [u32; 6] = [0, 1, 2, 1 << 31, u32::MAX - 1, u32::MAX];

/// A result is a success or an invalid-argument error that names `name`.
fn accept_or_name<T>(what: &str, name: &str, result: tinyloop::Result<T>) {
    match result {
        Ok(_) => {}
        Err(Error::InvalidArgument(message)) => {
            assert!(
                message.contains(name),
                "{what}: {message:?} does not name {name}"
            )
        }
        Err(other) => panic!("{what}: not an invalid-argument error: {other}"),
    }
}

fn options(max_seq_len: usize) -> ModelOptions {
    ModelOptions {
        max_seq_len,
        ..common::cpu_options()
    }
}

fn greedy(max_tokens: usize) -> GenerateParams {
    GenerateParams {
        max_tokens,
        ..GenerateParams::default()
    }
}

fn sampled() -> GenerateParams {
    GenerateParams {
        sampling: SamplingParams {
            temperature: 1.0,
            ..SamplingParams::default()
        },
        ..greedy(2)
    }
}

#[test]
fn rust_api_counts_take_any_value_without_panicking() {
    let path = common::synth_file("tiny", 1, 4);
    for v in USIZE {
        let what = |field: &str| format!("{field} = {v}");
        let opened = [
            ("max_seq_len", options(v)),
            (
                "prefill_chunk",
                ModelOptions {
                    prefill_chunk: v,
                    ..options(16)
                },
            ),
            (
                "max_loops",
                ModelOptions {
                    max_loops: v,
                    ..options(16)
                },
            ),
        ];
        for (field, opts) in opened {
            let model = Model::open(&path, &opts);
            if let Ok(model) = &model {
                let mut session = model.new_session().unwrap();
                let generated = session.generate(&[1], &greedy(2));
                accept_or_name(&what(field), field, generated);
            }
            accept_or_name(&what(field), field, model);
        }
    }
    let model = Model::open(&path, &options(16)).unwrap();
    let mut s = model.new_session().unwrap();
    let prompt = [1, 2, 3];
    for v in USIZE {
        let what = |field: &str| format!("{field} = {v}");
        let generated = s.generate(&prompt, &greedy(v));
        if let Ok(tokens) = &generated {
            // Generation stops at max_seq_len.
            assert_eq!(
                tokens.len(),
                v.min(16 - prompt.len()),
                "{}",
                what("max_tokens")
            );
        }
        accept_or_name(&what("max_tokens"), "max_tokens", generated);
        let loops = GenerateParams {
            loops: Some(v),
            ..greedy(2)
        };
        accept_or_name(&what("loops"), "loops", s.generate(&prompt, &loops));
        let mut top_k = sampled();
        top_k.sampling.top_k = v;
        accept_or_name(&what("top_k"), "top_k", s.generate(&prompt, &top_k));
        let mut seed = sampled();
        seed.sampling.seed = v as u64;
        accept_or_name(&what("seed"), "seed", s.generate(&prompt, &seed));
        for (field, spec) in [
            (
                "draft_loops",
                Speculation {
                    draft_loops: v,
                    draft_len: 2,
                    reuse: true,
                },
            ),
            (
                "draft_len",
                Speculation {
                    draft_loops: 2,
                    draft_len: v,
                    reuse: false,
                },
            ),
        ] {
            let params = GenerateParams {
                loops: Some(4),
                ..greedy(v.max(1))
            };
            let result = s.generate_speculative(&prompt, &params, &spec, &mut |_| true);
            accept_or_name(&what(field), field, result);
        }
        for (field, tier) in [
            (
                "short_t",
                CtxTier {
                    short_t: v,
                    ..CtxTier::default()
                },
            ),
            (
                "long_t",
                CtxTier {
                    long_t: v,
                    ..CtxTier::default()
                },
            ),
        ] {
            let params = GenerateParams {
                ctx_tier: Some(tier.clone()),
                ..greedy(v.max(1))
            };
            accept_or_name(&what(field), field, s.generate(&prompt, &params));
            let scored = s.logprobs_with(&prompt, None, Some(&tier));
            accept_or_name(&what(field), field, scored);
        }
        let loops = Some(v);
        accept_or_name(&what("loops"), "loops", s.score(&prompt, loops));
        accept_or_name(&what("loops"), "loops", s.logprobs(&prompt, loops));
        accept_or_name(&what("loops"), "loops", s.score_last(&prompt, loops));
        accept_or_name(&what("loops"), "loops", s.score_logit_lens(&prompt, loops));
        accept_or_name(&what("loops"), "loops", s.score_trajectory(&prompt, loops));
        accept_or_name(
            &what("loops"),
            "loops",
            s.build_prefix_cache(&prompt, loops),
        );
        let handle = s.build_resume_handle(&prompt, loops);
        accept_or_name(&what("loops"), "loops", handle);
        let handle = s.build_resume_handle(&prompt, None).unwrap();
        let resumed = s.resume_generate(&handle, &loops_params(v), &mut |_| true);
        accept_or_name(&what("loops"), "loops", resumed);
        let cache = s.build_prefix_cache(&prompt, None).unwrap();
        let after = s.generate_with_prefix(&cache, &[4], &greedy(v), &mut |_| true);
        if let Ok(tokens) = &after {
            assert_eq!(
                tokens.len(),
                v.min(16 - 4),
                "{}",
                what("max_tokens after a prefix")
            );
        }
        accept_or_name(&what("max_tokens"), "max_tokens", after);
    }
    for t in U32 {
        let what = format!("token {t}");
        accept_or_name(&what, "token", s.generate(&[1, t], &greedy(2)));
        accept_or_name(&what, "token", s.score(&[1, t], None));
        let stop = GenerateParams {
            stop_tokens: vec![t],
            ..greedy(2)
        };
        accept_or_name(&what, "stop token", s.generate(&[1], &stop));
        let bits = GenerateParams {
            ctx_tier: Some(CtxTier {
                long_bits: t,
                ..CtxTier::default()
            }),
            ..greedy(2)
        };
        accept_or_name(
            &format!("long_bits {t}"),
            "long_bits",
            s.generate(&[1], &bits),
        );
    }
    for x in [f64::NAN, f64::INFINITY, -1.0, 0.0, 1.0, 1e300, -1e300] {
        for (field, monitor) in [
            (
                "low_entropy_bits",
                BetaMonitor {
                    low_entropy_bits: x,
                    ..BetaMonitor::default()
                },
            ),
            (
                "high_entropy_bits",
                BetaMonitor {
                    high_entropy_bits: x,
                    ..BetaMonitor::default()
                },
            ),
            (
                "agreement_floor",
                BetaMonitor {
                    agreement_floor: x,
                    ..BetaMonitor::default()
                },
            ),
        ] {
            let params = GenerateParams {
                beta_monitor: Some(monitor),
                ..greedy(2)
            };
            accept_or_name(&format!("{field} {x}"), field, s.generate(&[1], &params));
        }
    }
}

fn loops_params(loops: usize) -> GenerateParams {
    GenerateParams {
        loops: Some(loops),
        ..greedy(2)
    }
}

/// The u32 extremes of the C ABI's count fields.
const C_U32: [u32; 7] = [0, 1, 2, 1 << 31, u32::MAX - 1, u32::MAX, 64];

/// The i32 extremes of `loops`.
const C_I32: [i32; 8] = [i32::MIN, -2, -1, 0, 1, 2, 65, i32::MAX];

/// A status of the C ABI is success, a buffer too small for the request, or an invalid argument
/// whose message names `name`; never a panic.
fn c_accept_or_name(what: &str, name: &str, status: tl_status) {
    match status {
        tl_status::TL_OK | tl_status::TL_ERR_BUFFER_TOO_SMALL => {}
        tl_status::TL_ERR_INVALID_ARGUMENT => {
            let message = common::ffi::last_error();
            assert!(
                message.contains(name),
                "{what}: {message:?} does not name {name}"
            );
        }
        other => panic!("{what}: {other:?}: {}", common::ffi::last_error()),
    }
}

/// `tl_generate` of `prompt` into a 64-token buffer.
fn c_generate(
    model: &common::ffi::Handle,
    prompt: &[i32],
    params: &tl_generate_params,
) -> tl_status {
    let mut out = [0i32; 64];
    let mut len = 0;
    // SAFETY: the prompt and the buffer are valid for the lengths given.
    unsafe {
        tl_generate(
            model.0,
            prompt.as_ptr(),
            prompt.len(),
            params,
            out.as_mut_ptr(),
            out.len(),
            &mut len,
        )
    }
}

#[test]
fn c_abi_counts_take_any_value_without_panicking() {
    let path = common::synth_file("tiny", 1, 4);
    let cpath = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
    let cpu = std::ffi::CString::new("cpu").unwrap();
    for v in C_U32 {
        for field in ["max_seq_len", "prefill_chunk", "max_loops"] {
            let mut params = common::ffi::model_params();
            (params.device, params.log, params.max_seq_len) = (cpu.as_ptr(), false, 16);
            match field {
                "max_seq_len" => params.max_seq_len = v,
                "prefill_chunk" => params.prefill_chunk = v,
                _ => params.max_loops = v,
            }
            let mut model = std::ptr::null_mut();
            // SAFETY: a valid path, params and out-pointer.
            let status = unsafe { tl_model_open(cpath.as_ptr(), &params, &mut model) };
            c_accept_or_name(&format!("{field} = {v}"), field, status);
            let model = common::ffi::Handle(model);
            if status == tl_status::TL_OK {
                let status = c_generate(&model, &[1], &common::ffi::gen_params(2));
                c_accept_or_name(&format!("generate after {field} = {v}"), field, status);
            }
        }
    }
    let model = common::ffi::open(&path, 16);
    let prompt = [1, 2, 3];
    for v in C_U32 {
        let what = |field: &str| format!("{field} = {v}");
        let status = c_generate(&model, &prompt, &common::ffi::gen_params(v));
        c_accept_or_name(&what("max_tokens"), "max_tokens", status);
        let mut sampled = common::ffi::gen_params(2);
        (sampled.temperature, sampled.top_k, sampled.seed) = (1.0, v, u64::from(v) << 32);
        c_accept_or_name(
            &what("top_k"),
            "top_k",
            c_generate(&model, &prompt, &sampled),
        );
        let mut tiered = common::ffi::gen_params(2);
        for (field, short_t, long_t, long_bits) in [
            ("short_t", v, 2048, 2),
            ("long_t", 512, v, 2),
            ("long_bits", 512, 2048, v),
        ] {
            let mut tier = std::mem::MaybeUninit::<tl_ctx_tier_params>::uninit();
            // SAFETY: a valid out-pointer.
            unsafe { tl_ctx_tier_default_params(tier.as_mut_ptr()) };
            // SAFETY: initialized above.
            let mut tier = unsafe { tier.assume_init() };
            (tier.short_t, tier.long_t, tier.long_bits) = (short_t, long_t, long_bits);
            tiered.ctx_tier = &tier;
            c_accept_or_name(&what(field), field, c_generate(&model, &prompt, &tiered));
        }
        for (field, draft_loops, draft_len) in [("draft_loops", v, 2), ("draft_len", 2, v)] {
            let mut spec = std::mem::MaybeUninit::<tl_speculative_params>::uninit();
            // SAFETY: a valid out-pointer.
            unsafe { tl_speculative_default_params(spec.as_mut_ptr()) };
            // SAFETY: initialized above.
            let mut spec = unsafe { spec.assume_init() };
            (spec.draft_loops, spec.draft_len) = (draft_loops, draft_len);
            let mut params = common::ffi::gen_params(8);
            params.loops = 4;
            let (mut out, mut len) = ([0i32; 8], 0);
            // SAFETY: the prompt and the buffer are valid for the lengths given.
            let status = unsafe {
                tl_generate_speculative(
                    model.0,
                    prompt.as_ptr(),
                    prompt.len(),
                    &params,
                    &spec,
                    out.as_mut_ptr(),
                    out.len(),
                    &mut len,
                )
            };
            c_accept_or_name(&what(field), field, status);
        }
    }
    for loops in C_I32 {
        let mut params = common::ffi::gen_params(2);
        params.loops = loops;
        let what = format!("loops = {loops}");
        c_accept_or_name(&what, "loops", c_generate(&model, &prompt, &params));
        let (mut out, mut len) = (vec![0f32; 4 * 256], 0);
        // SAFETY: the prompt and the buffer are valid for the lengths given.
        let status = unsafe {
            tl_score_logit_lens(
                model.0,
                prompt.as_ptr(),
                prompt.len(),
                loops,
                out.as_mut_ptr(),
                out.len(),
                &mut len,
            )
        };
        c_accept_or_name(&what, "loops", status);
    }
    // The prompt of a score call with an exit: 1..=n_tokens.
    let rule = std::ffi::CString::new("argmax:1").unwrap();
    let mut exit = common::ffi::gen_params(1);
    exit.exit = rule.as_ptr();
    for prompt_len in [0, 1, 3, 4, 1 << 32, isize::MAX as usize + 1, usize::MAX] {
        let (mut out, mut len) = (vec![0f32; 3 * 256], 0);
        // SAFETY: the prompt, params and buffer are valid for the lengths given.
        let status = unsafe {
            tl_score_exit(
                model.0,
                prompt.as_ptr(),
                prompt.len(),
                prompt_len,
                &exit,
                out.as_mut_ptr(),
                out.len(),
                &mut len,
                std::ptr::null_mut(),
            )
        };
        c_accept_or_name(&format!("prompt_len = {prompt_len}"), "prompt_len", status);
    }
    for t in [i32::MIN, -1, 256, i32::MAX] {
        let what = format!("token {t}");
        c_accept_or_name(
            &what,
            "token",
            c_generate(&model, &[1, t], &common::ffi::gen_params(2)),
        );
    }
    // A length no buffer can have is refused before the pointer is read past the prompt.
    for n in [usize::MAX, isize::MAX as usize / 4 + 1] {
        let (mut out, mut len) = ([0i32; 2], 0);
        // SAFETY: the length is refused before any read (what the call under test promises).
        let status = unsafe {
            tl_generate(
                model.0,
                prompt.as_ptr(),
                n,
                &common::ffi::gen_params(2),
                out.as_mut_ptr(),
                out.len(),
                &mut len,
            )
        };
        assert_eq!(status, tl_status::TL_ERR_INVALID_ARGUMENT, "n_tokens = {n}");
        let message = common::ffi::last_error();
        assert!(message.contains("exceeds the address space"), "{message}");
    }
}
