//! The `tinyloop` command line as a user runs it: every command works, and bad input exits
//! non-zero with one clear line and no panic.

mod common;

use std::process::{Command, Output};

fn tinyloop(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tinyloop"))
        .args(args)
        .env("TINYLOOP_DEVICE", "cpu")
        .output()
        .unwrap()
}

fn stdout(out: &Output) -> String {
    assert!(
        out.status.success(),
        "failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout.clone()).unwrap()
}

fn model() -> String {
    common::synth_file("tiny", 1, 4)
        .to_string_lossy()
        .into_owned()
}

#[test]
fn synth_writes_a_loadable_model_deterministically() {
    let dir = common::scratch("cli");
    let (a, b) = (dir.join("a.tinyloop"), dir.join("b.tinyloop"));
    for path in [&a, &b] {
        stdout(&tinyloop(&[
            "synth",
            "--preset",
            "tiny-gqa",
            "--seed",
            "3",
            "--bits",
            "2",
            "--out",
            path.to_str().unwrap(),
        ]));
    }
    assert_eq!(std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
    let info: serde_json::Value =
        serde_json::from_str(&stdout(&tinyloop(&[a.to_str().unwrap(), "info", "--json"]))).unwrap();
    let config = &info["config"];
    for key in [
        "dim",
        "n_heads",
        "ffn_dim",
        "vocab_size",
        "embed_factor_dim",
        "n_pre_blocks",
        "default_loops",
    ] {
        assert!(config[key].is_u64(), "info lacks {key}");
    }
    assert_eq!(config["n_kv_heads"], 2);
    assert_eq!(info["dtypes"]["int2"]["tensors"], 20);
}

#[test]
fn generate_json_prints_tokens_and_text() {
    let out = stdout(&tinyloop(&[
        &model(),
        "generate",
        "--prompt",
        "Hi",
        "--max-tokens",
        "8",
        "--json",
    ]));
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["tokens"].as_array().unwrap().len(), 8);
    assert!(v["text"].is_string());
    // Same request via token ids ('H' = 72, 'i' = 105) gives the same tokens.
    let out2 = stdout(&tinyloop(&[
        &model(),
        "generate",
        "--tokens",
        "72,105",
        "--max-tokens",
        "8",
        "--json",
    ]));
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&out2).unwrap()["tokens"],
        v["tokens"]
    );
}

#[test]
fn generate_streams_text() {
    let out = stdout(&tinyloop(&[
        &model(),
        "generate",
        "--prompt",
        "ab",
        "--max-tokens",
        "5",
        "-q",
    ]));
    assert!(out.starts_with("ab"), "{out:?}");
}

#[test]
fn score_reports_nll_and_perplexity() {
    let out = stdout(&tinyloop(&[
        &model(),
        "score",
        "--text",
        "hello world",
        "--loops",
        "2",
        "--json",
    ]));
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let (nll, ppl) = (v["nll"].as_f64().unwrap(), v["ppl"].as_f64().unwrap());
    assert_eq!(v["tokens"], 10);
    // exp(nll) = ppl up to printing precision.
    assert!((nll.exp() - ppl).abs() < 1e-9 * ppl);
    assert!(nll > 0.0);
}

/// `--decode-path` scores through one-row decode steps. On the CPU they compute every row as the
/// one-step score does (docs/NUMERICS.md "Scoring through the decode path"), so the report is
/// the same to the last digit. A tier policy would observe other steps: the two conflict.
#[test]
fn score_through_the_decode_path_reports_the_same_numbers() {
    let m = model();
    let score = |extra: &[&str]| {
        let mut args = vec![
            &m[..],
            "score",
            "--text",
            "hello world, hello",
            "--window",
            "8",
        ];
        args.extend_from_slice(extra);
        args.push("--json");
        serde_json::from_str::<serde_json::Value>(&stdout(&tinyloop(&args))).unwrap()
    };
    assert_eq!(score(&["--decode-path"]), score(&[]));
    assert_one_line_error(
        &tinyloop(&[&m, "score", "--text", "xyz", "--decode-path", "--ctx-tier"]),
        "--decode-path with --ctx-tier",
        "cannot be used with",
    );
}

#[test]
fn bench_reports_every_field() {
    let out = stdout(&tinyloop(&[
        &model(),
        "bench",
        "--prompt-len",
        "16",
        "--gen-len",
        "4",
        "--repeats",
        "1",
        "--json",
    ]));
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    for key in [
        "load_ms",
        "prefill_tokens_per_s",
        "decode_ms_per_token",
        "memory_mb",
    ] {
        assert!(v[key].as_f64().unwrap() > 0.0, "{key}");
    }
}

/// `bench --prompt-file` takes its prompt from a text (through the model's tokenizer, or as bytes),
/// starting at `--prompt-offset` (moved to the next character for a tokenizer); a text with too
/// few tokens is an error that says how many it holds.
#[test]
fn bench_takes_its_prompt_from_a_file() {
    let text = common::scratch("cli-bench-prompt").join("prose.txt");
    // Two-byte characters: offset 1 falls inside one.
    std::fs::write(&text, "été à Noël, ".repeat(20)).unwrap();
    let text = text.to_str().unwrap();
    let bench = |m: &str, len: &str| {
        tinyloop(&[
            m,
            "bench",
            "--prompt-len",
            len,
            "--gen-len",
            "2",
            "--repeats",
            "1",
            "--json",
            "--prompt-file",
            text,
            "--prompt-offset",
            "1",
        ])
    };
    for m in [model(), text_model()] {
        let v = json_of(&bench(&m, "8"));
        assert_eq!(v["prompt_file"].as_str(), Some(text), "{m}");
        assert_eq!(v["prompt_offset"].as_u64(), Some(1), "{m}");
        assert_eq!(v["prompt_len"].as_u64(), Some(8), "{m}");
        assert_one_line_error(
            &bench(&m, "1000"),
            "a text shorter than --prompt-len",
            "fewer than --prompt-len 1000",
        );
    }
    assert_one_line_error(
        &tinyloop(&[&model(), "bench", "--prompt-offset", "3"]),
        "--prompt-offset without --prompt-file",
        "--prompt-file",
    );
    let past = tinyloop(&[
        &model(),
        "bench",
        "--prompt-file",
        text,
        "--prompt-offset",
        "100000",
    ]);
    assert_one_line_error(
        &past,
        "an offset past the end",
        "is past the end of --prompt-file",
    );
}

/// `--concurrency N` runs N clients at once, --repeats generations each, on a session each or
/// through one engine, and counts them all.
#[test]
fn bench_concurrency_reports_the_aggregate_and_latency_percentiles() {
    let args = [
        &model(),
        "bench",
        "--prompt-len",
        "16",
        "--gen-len",
        "4",
        "--repeats",
        "2",
        "--json",
        "--concurrency",
        "3",
    ];
    for (via, extra) in [
        ("sessions", &[][..]),
        ("engine", &["--engine", "--max-step-rows", "8"][..]),
    ] {
        let all: Vec<&str> = args.iter().copied().chain(extra.iter().copied()).collect();
        let v: serde_json::Value = serde_json::from_str(&stdout(&tinyloop(&all))).unwrap();
        let c = &v["concurrency"];
        assert_eq!(
            (
                c["clients"].as_u64(),
                c["requests"].as_u64(),
                c["via"].as_str()
            ),
            (Some(3), Some(6), Some(via))
        );
        assert_eq!(c["tokens"].as_u64(), Some(24));
        let (tokens, wall) = (
            c["tokens"].as_f64().unwrap(),
            c["wall_ms"].as_f64().unwrap(),
        );
        let rate = c["aggregate_tokens_per_s"].as_f64().unwrap();
        assert!((rate - tokens / wall * 1e3).abs() <= 1e-9 * rate, "{c}");
        for key in ["ttft_ms", "itl_ms"] {
            let p = |q: &str| c[key][q].as_f64().unwrap();
            assert!(
                0.0 < p("p50") && p("p50") <= p("p90") && p("p90") <= p("p99"),
                "{key}: {c}"
            );
        }
        if via == "engine" {
            assert_eq!(c["engine"]["max_step_rows"].as_u64(), Some(8));
            assert!(c["engine"]["rows_per_step"].as_f64().unwrap() >= 1.0, "{c}");
        }
    }
    // Without the option there is no such report; with speculation it is refused, and so is
    // --engine without it.
    let single = stdout(&tinyloop(&args[..args.len() - 2]));
    assert!(serde_json::from_str::<serde_json::Value>(&single).unwrap()["concurrency"].is_null());
    for bad in [
        &[
            &model(),
            "bench",
            "--concurrency",
            "2",
            "--draft-loops",
            "1",
        ][..],
        &[&model(), "bench", "--engine"][..],
    ] {
        let err = tinyloop(bad);
        assert!(String::from_utf8_lossy(&err.stderr).contains("--concurrency"));
    }
}

/// Every bad input exits with status 1 and a single `error:` line, never a panic.
#[test]
fn bad_input_exits_with_one_clear_line() {
    let dir = common::scratch("cli-bad");
    let corrupt = dir.join("corrupt.tinyloop");
    let mut bytes = std::fs::read(model()).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    std::fs::write(&corrupt, bytes).unwrap();
    let m = model();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec!["/missing.tinyloop", "info"],
            "cannot read /missing.tinyloop",
        ),
        (
            vec![corrupt.to_str().unwrap(), "generate", "--prompt", "x"],
            "checksum mismatch",
        ),
        (
            vec![&m, "generate", "--tokens", "1,999"],
            "token id 999 is outside 0 to 255 (vocab_size 256)",
        ),
        (
            vec![&m, "generate", "--prompt", "x", "--loops", "0"],
            "--loops <LOOPS>': expected an integer from 1 to 64",
        ),
        (vec![&m, "generate", "--prompt", ""], "empty token sequence"),
        (
            vec![&m, "generate", "--tokens", "-4"],
            "token id -4 is outside",
        ),
        (
            vec![&m, "generate", "--prompt", "x", "--temperature", "-1"],
            "temperature",
        ),
        (
            vec![&m, "generate", "--prompt", "x", "--device", "tpu"],
            "unknown device",
        ),
        (
            vec![&m, "generate", "--prompt", "x", "--exit", "kl:x"],
            "exit rule \"kl:x\": expected gate or gate:T",
        ),
        (
            vec![&m, "score", "--file", "/missing.txt"],
            "cannot read /missing.txt",
        ),
        (
            vec!["synth", "--preset", "huge", "--out", "/tmp/x"],
            "unknown preset",
        ),
        (
            vec![
                "synth", "--preset", "tiny", "--bits", "3", "--out", "/tmp/x",
            ],
            "'3' for '--bits <BITS>': expected 16, 4 or 2",
        ),
    ];
    for (args, expected) in cases {
        let out = tinyloop(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(!stderr.contains("panicked"), "{args:?} panicked: {stderr}");
        assert!(
            stderr.contains(expected),
            "{args:?}: {stderr:?} lacks {expected:?}"
        );
        let error_lines = stderr.lines().filter(|l| l.starts_with("error")).count();
        assert_eq!(error_lines, 1, "{args:?}: {stderr}");
    }
}

#[test]
fn synth_help_names_every_preset() {
    let help = stdout(&tinyloop(&["synth", "--help"]));
    for preset in tinyloop::model::synth::PRESETS {
        assert!(
            help.contains(&format!(" {preset},")) || help.contains(&format!(" {preset}\n")),
            "`synth --help` does not name the preset {preset}:\n{help}"
        );
    }
}

/// Run the CLI with raw (possibly non-UTF-8) arguments.
fn tinyloop_os(args: &[&std::ffi::OsStr]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tinyloop"))
        .args(args)
        .env("TINYLOOP_DEVICE", "cpu")
        .output()
        .unwrap()
}

/// Exit status 1, exactly one line on stderr, which starts with `error:` and contains `expected`.
fn assert_one_line_error(out: &Output, what: &str, expected: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{what}: {stderr}");
    assert!(!stderr.contains("panicked"), "{what} panicked: {stderr}");
    let lines: Vec<&str> = stderr
        .lines()
        .filter(|l| !l.starts_with("[tinyloop]"))
        .collect();
    assert_eq!(lines.len(), 1, "{what}: {stderr}");
    assert!(lines[0].starts_with("error: "), "{what}: {stderr}");
    assert!(
        lines[0].contains(expected),
        "{what}: {stderr:?} lacks {expected:?}"
    );
}

#[test]
fn non_utf8_arguments_are_errors_not_panics() {
    use std::ffi::OsStr;
    use std::os::unix::ffi::OsStrExt;
    let m = model();
    let m = OsStr::new(&m);
    let bad = OsStr::from_bytes(b"caf\xe9");
    let (generate, score) = (OsStr::new("generate"), OsStr::new("score"));
    let cases: [(Vec<&OsStr>, &str); 4] = [
        (
            vec![m, generate, OsStr::new("--prompt"), bad],
            "--prompt is not valid UTF-8",
        ),
        (
            vec![m, score, OsStr::new("--text"), bad],
            "--text is not valid UTF-8",
        ),
        (
            vec![
                OsStr::from_bytes(b"/tmp/caf\xe9.tinyloop"),
                OsStr::new("info"),
            ],
            "cannot read /tmp/caf",
        ),
        (
            vec![
                OsStr::new("synth"),
                OsStr::new("--preset"),
                bad,
                OsStr::new("--out"),
                OsStr::new("/tmp/x"),
            ],
            "the value of --preset is not valid UTF-8",
        ),
    ];
    for (args, expected) in cases {
        assert_one_line_error(&tinyloop_os(&args), &format!("{args:?}"), expected);
    }
}

#[test]
fn argument_errors_exit_1_with_one_line() {
    let m = model();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec![&m, "generate", "--prompt", "x", "--bogus"],
            "unexpected argument '--bogus'",
        ),
        (vec![&m, "generate"], "--prompt"),
        (vec![&m, "frobnicate"], "unexpected argument 'frobnicate'"),
        (
            vec![&m, "generate", "--prompt", "x", "--max-tokens", "1.5"],
            "'1.5'",
        ),
        (vec![&m, "generate", "--tokens", "1,x"], "'x'"),
        (vec!["synth", "--out", "/tmp/x"], "--preset"),
        (vec!["help", "frobnicate"], "unknown command \"frobnicate\""),
    ];
    for (args, expected) in cases {
        assert_one_line_error(&tinyloop(&args), &format!("{args:?}"), expected);
    }
}

#[test]
fn counts_out_of_range_state_the_accepted_range() {
    let m = model();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec![&m, "generate", "--prompt", "x", "--max-tokens", "-5"],
            "invalid value '-5' for '--max-tokens <N>': expected an integer ≥ 1",
        ),
        (
            vec![&m, "generate", "--prompt", "x", "--loops", "-1"],
            "invalid value '-1' for '--loops <LOOPS>': expected an integer from 1 to 64",
        ),
        (
            vec![&m, "generate", "--prompt", "x", "--loops", "0"],
            "invalid value '0' for '--loops <LOOPS>': expected an integer from 1 to 64",
        ),
        (
            vec![&m, "generate", "--prompt", "x", "--loops", "65"],
            "invalid value '65' for '--loops <LOOPS>': expected an integer from 1 to 64",
        ),
        (
            vec![&m, "generate", "--prompt", "x", "--seed", "-3"],
            "invalid value '-3' for '--seed <S>': expected an integer ≥ 0",
        ),
        (
            vec![
                &m,
                "generate",
                "--prompt",
                "x",
                "--draft-loops",
                "2",
                "--draft-len",
                "16",
            ],
            "invalid value '16' for '--draft-len <K>': expected an integer from 1 to 15",
        ),
        (
            vec![&m, "score", "--text", "xyz", "--window", "-2"],
            "invalid value '-2' for '--window <N>': expected an integer ≥ 2",
        ),
        (
            vec![&m, "bench", "--repeats", "18446744073709551615"],
            "invalid value '18446744073709551615' for '--repeats <N>': expected an integer \
             from 1 to 10000",
        ),
        (
            vec![&m, "requantize", "--loop-body-bits", "3", "--out", "/tmp/x"],
            "invalid value '3' for '--loop-body-bits <BITS>': expected 2 or 4",
        ),
        (
            vec![
                "synth",
                "--preset",
                "tiny",
                "--group-size",
                "-32",
                "--out",
                "/tmp/x",
            ],
            "invalid value '-32' for '--group-size <G>': expected an integer ≥ 0",
        ),
        (
            vec![
                "synth", "--preset", "tiny", "--bits", "8", "--out", "/tmp/x",
            ],
            "invalid value '8' for '--bits <BITS>': expected 16, 4 or 2",
        ),
    ];
    for (args, expected) in cases {
        assert_one_line_error(&tinyloop(&args), &format!("{args:?}"), expected);
    }
    // Token ids are values of a list, checked against the model's vocabulary.
    for id in ["-4", "256", "4294967298"] {
        assert_one_line_error(
            &tinyloop(&[&m, "generate", "--tokens", &format!("5,{id}")]),
            "token id",
            &format!("--tokens: token id {id} is outside 0 to 255 (vocab_size 256)"),
        );
    }
}

#[test]
fn model_path_problems_are_named() {
    let dir = common::scratch("cli-dir");
    assert_one_line_error(
        &tinyloop(&[dir.to_str().unwrap(), "info"]),
        "directory",
        "is a directory",
    );
    assert_one_line_error(
        &tinyloop(&[
            &model(),
            "generate",
            "--prompt",
            "x",
            "--max-seq-len",
            "67108864",
        ]),
        "max_seq_len",
        "max_seq_len 67108864 exceeds the model's max_position 2048",
    );
    assert_one_line_error(
        &tinyloop(&[
            "synth",
            "--preset",
            "tiny",
            "--group-size",
            "1",
            "--out",
            "/tmp/x",
        ]),
        "group size",
        "tensor pre.0.attn_qkv: group_size 1 is not a positive multiple of 2",
    );
}

/// Every command a user can run.
const COMMANDS: [&str; 10] = [
    "info",
    "generate",
    "tokenize",
    "score",
    "bench",
    "lens",
    "trajectory",
    "requantize",
    "synth",
    "convert",
];

#[test]
fn help_works_for_every_command() {
    for command in COMMANDS {
        let usage = match command {
            "synth" | "convert" => format!("Usage: tinyloop {command}"),
            _ => format!("Usage: tinyloop MODEL {command}"),
        };
        let out = stdout(&tinyloop(&["help", command]));
        assert!(out.contains(&usage), "help {command}: {out}");
    }
    for command in ["convert", "synth"] {
        let out = stdout(&tinyloop(&[command, "--help"]));
        assert!(out.contains(&format!("Usage: tinyloop {command}")), "{out}");
    }
    let out = stdout(&tinyloop(&[&model(), "generate", "--help"]));
    assert!(out.contains("--prompt"), "{out}");
    let out = stdout(&tinyloop(&["help"]));
    assert!(out.contains("tinyloop convert --safetensors"), "{out}");
}

/// Stderr of the CLI run with a pseudo-terminal as stderr (stdout stays a pipe).
fn stderr_on_a_terminal(args: &[&str]) -> String {
    use std::io::Read;
    use std::os::fd::FromRawFd;
    // SAFETY: plain POSIX pseudo-terminal calls; every descriptor is owned by one File.
    let (mut master, slave) = unsafe {
        let master = libc::posix_openpt(libc::O_RDWR | libc::O_NOCTTY);
        assert!(master >= 0, "posix_openpt");
        assert_eq!(libc::grantpt(master), 0);
        assert_eq!(libc::unlockpt(master), 0);
        let mut name = [0 as libc::c_char; 128];
        assert_eq!(libc::ptsname_r(master, name.as_mut_ptr(), name.len()), 0);
        let slave = libc::open(name.as_ptr(), libc::O_RDWR | libc::O_NOCTTY);
        assert!(slave >= 0, "open the terminal");
        (
            std::fs::File::from_raw_fd(master),
            std::fs::File::from_raw_fd(slave),
        )
    };
    let child = Command::new(env!("CARGO_BIN_EXE_tinyloop"))
        .args(args)
        .env("TINYLOOP_DEVICE", "cpu")
        .stdout(std::process::Stdio::piped())
        .stderr(slave)
        .spawn()
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{args:?}");
    let mut text = Vec::new();
    // Reading a terminal whose other side is closed ends with EIO, not EOF.
    let mut buf = [0u8; 4096];
    while let Ok(n @ 1..) = master.read(&mut buf) {
        text.extend(&buf[..n]);
    }
    String::from_utf8_lossy(&text).into_owned()
}

#[test]
fn score_and_bench_show_progress_on_a_terminal_only() {
    let m = model();
    let text = "To be, or not to be, that is the question.";
    let score = [&m, "score", "--text", text, "--window", "8"];
    let progress = stderr_on_a_terminal(&score);
    assert!(progress.contains("[score] 5/6"), "{progress:?}");
    let bench = [
        &m,
        "bench",
        "--prompt-len",
        "8",
        "--gen-len",
        "2",
        "--repeats",
        "2",
    ];
    let progress = stderr_on_a_terminal(&bench);
    assert!(progress.contains("[bench] 3/4"), "{progress:?}");
    for quiet in ["--json", "-q"] {
        for args in [&score[..], &bench[..]] {
            let args: Vec<&str> = args.iter().copied().chain([quiet]).collect();
            let stderr = stderr_on_a_terminal(&args);
            assert!(!stderr.contains('['), "{args:?}: {stderr:?}");
        }
    }
    // Not a terminal: no progress either.
    let out = tinyloop(&score);
    assert!(!String::from_utf8_lossy(&out.stderr).contains("[score]"));
}

/// The usage line, the footer of `tinyloop help` and the unknown-command error name every
/// command, and every option of every command has a description.
#[test]
fn help_is_complete() {
    let help = stdout(&tinyloop(&["help"]));
    let usage = help.lines().find(|l| l.starts_with("Usage: ")).unwrap();
    let footer = help.lines().last().unwrap();
    let unknown = tinyloop(&["help", "frobnicate"]);
    let unknown = String::from_utf8_lossy(&unknown.stderr);
    for command in COMMANDS {
        if !matches!(command, "synth" | "convert") {
            assert!(usage.contains(command), "usage lacks {command}: {usage}");
        }
        assert!(footer.contains(command), "footer lacks {command}: {footer}");
        assert!(
            unknown.contains(command),
            "error lacks {command}: {unknown}"
        );
    }
    for command in COMMANDS {
        let text = stdout(&tinyloop(&["help", command]));
        let lines: Vec<&str> = text.lines().collect();
        // The long help puts each option on its own line, its description on the next.
        for (i, line) in lines.iter().enumerate() {
            let option = line.trim_start();
            if !(option.starts_with("--")
                || option.starts_with("-q, ")
                || option.starts_with("-h, "))
            {
                continue;
            }
            let next = lines.get(i + 1).map_or("", |l| l.trim());
            assert!(
                !next.is_empty() && !next.starts_with("[default"),
                "help {command}: {option} has no description"
            );
        }
    }
}

/// A call the library refuses prints nothing on stdout: the prompt is echoed only with the
/// first generated token.
#[test]
fn generate_checks_everything_before_printing() {
    let m = model();
    let cases: [(&[&str], &str); 3] = [
        (
            &["--tokens", "1,2,300"],
            "--tokens: token id 300 is outside 0 to 255 (vocab_size 256)",
        ),
        (
            &["--prompt", "abc", "--max-tokens", "0"],
            "invalid value '0' for '--max-tokens <N>': expected an integer ≥ 1",
        ),
        (
            &["--prompt", "abcdefghijklmnop", "--max-seq-len", "16"],
            "prompt of 16 tokens leaves no room to generate in max_seq_len 16",
        ),
    ];
    for (args, expected) in cases {
        let args: Vec<&str> = [&m, "generate"]
            .into_iter()
            .chain(args.iter().copied())
            .collect();
        let out = tinyloop(&args);
        assert_one_line_error(&out, &format!("{args:?}"), expected);
        assert!(out.stdout.is_empty(), "{args:?} printed {:?}", out.stdout);
    }
    let out = stdout(&tinyloop(&[
        &m,
        "generate",
        "--tokens",
        "72,105",
        "--max-tokens",
        "3",
        "-q",
    ]));
    assert!(
        out.starts_with("Hi"),
        "the prompt is echoed before the tokens: {out:?}"
    );
}

/// An option that only means something beside another is an error without it.
#[test]
fn options_without_their_companion_are_errors() {
    let m = model();
    let dir = common::scratch("cli-companions");
    let calib = dir.join("calib.txt");
    std::fs::write(&calib, "calibration text").unwrap();
    let calib = calib.to_str().unwrap();
    let convert = [
        "convert",
        "--safetensors",
        "/x.safetensors",
        "--config",
        "/x.json",
        "--out",
        "/tmp/x",
    ];
    let generate = [m.as_str(), "generate", "--prompt", "x"];
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["--draft-len", "3"], "--draft-loops"),
        (vec!["--no-draft-reuse"], "--draft-loops"),
        (vec!["--seed", "3"], "pass --temperature > 0"),
        (vec!["--top-k", "5"], "pass --temperature > 0"),
        (vec!["--top-p", "0.5"], "pass --temperature > 0"),
        (vec!["--ctx-tier-long-t", "8"], "--ctx-tier"),
        (vec!["--beta-mon-low-entropy-bits", "1"], "--beta-monitor"),
    ]
    .into_iter()
    .map(|(extra, expected)| ([&generate[..], &extra].concat(), expected))
    .chain([
        (
            vec![&m, "bench", "--prefix-cache", "4", "--draft-loops", "1"],
            "'--prefix-cache <N>' cannot be used with '--draft-loops <D>'",
        ),
        (
            vec![&m, "trajectory", "--text", "ab", "--top", "3"],
            "unexpected argument '--top'",
        ),
        (
            vec![&m, "lens", "--text", "ab", "--top", "3", "--json"],
            "'--top <K>' cannot be used with '--json'",
        ),
        (
            [&convert[..], &["--calib-bytes", "100"]].concat(),
            "--calib <FILE>",
        ),
        (
            [&convert[..], &["--window", "64"]].concat(),
            "--calib <FILE>",
        ),
        (
            [&convert[..], &["--calib", calib]].concat(),
            "calibrate --method gptq",
        ),
        (
            [
                &convert[..],
                &["--method", "gptq", "--bits", "16", "--calib", calib],
            ]
            .concat(),
            "--method gptq quantizes to --bits 4 or 2",
        ),
        (
            [&convert[..], &["--bits", "16", "--group-size", "64"]].concat(),
            "--group-size applies to --bits 4 and 2",
        ),
        (
            vec![
                "synth",
                "--preset",
                "tiny",
                "--bits",
                "16",
                "--group-size",
                "64",
                "--out",
                "/tmp/x",
            ],
            "--group-size applies to --bits 4 and 2",
        ),
    ])
    .collect();
    for (args, expected) in cases {
        assert_one_line_error(&tinyloop(&args), &format!("{args:?}"), expected);
    }
    // With their companions they run.
    let sampled = [
        &generate[..],
        &[
            "--temperature",
            "0.8",
            "--seed",
            "3",
            "--top-k",
            "5",
            "--max-tokens",
            "2",
            "-q",
        ],
    ]
    .concat();
    stdout(&tinyloop(&sampled));
    let drafted = [
        &generate[..],
        &[
            "--loops",
            "4",
            "--draft-loops",
            "1",
            "--draft-len",
            "3",
            "--max-tokens",
            "2",
            "-q",
        ],
    ]
    .concat();
    stdout(&tinyloop(&drafted));
}

/// Without --max-seq-len a model runs at 2048 tokens or its max_position, whichever is smaller.
#[test]
fn max_seq_len_defaults_to_the_model_s_positions() {
    let short = common::synth_with_max_position(256);
    let short = short.to_str().unwrap();
    // 250 prompt tokens leave room for 6: generation stops at max_seq_len 256 (the model's
    // max_position), however many tokens were asked for; a 256-token prompt leaves none.
    let out = stdout(&tinyloop(&[
        short,
        "generate",
        "--prompt",
        &"x".repeat(250),
        "--max-tokens",
        "100",
        "--json",
        "-q",
    ]));
    let tokens = serde_json::from_str::<serde_json::Value>(&out).unwrap()["tokens"].clone();
    assert_eq!(tokens.as_array().map(Vec::len), Some(6), "{out}");
    assert_one_line_error(
        &tinyloop(&[short, "generate", "--prompt", &"x".repeat(256), "-q"]),
        "a prompt that fills max_seq_len",
        "prompt of 256 tokens leaves no room to generate in max_seq_len 256",
    );
    let bench = |path: &str| -> serde_json::Value {
        let args = [
            path,
            "bench",
            "--prompt-len",
            "8",
            "--gen-len",
            "2",
            "--repeats",
            "1",
            "--json",
        ];
        serde_json::from_str(&stdout(&tinyloop(&args))).unwrap()
    };
    assert_eq!(bench(short)["max_seq_len"], 256);
    assert_eq!(bench(&model())["max_seq_len"], 2048, "max_position 2048");
    assert_one_line_error(
        &tinyloop(&[short, "generate", "--prompt", "x", "--max-seq-len", "300"]),
        "above max_position",
        "max_seq_len 300 exceeds the model's max_position 256",
    );
}

/// A model with the tokenizer fixture in its metadata, as `synth --tokenizer` writes it.
fn text_model() -> String {
    let path = common::scratch("cli").join("tiny-text.tinyloop");
    let dir = common::tokenizer_dir();
    stdout(&tinyloop(&[
        "synth",
        "--preset",
        "tiny",
        "--seed",
        "1",
        "--tokenizer",
        dir.to_str().unwrap(),
        "--out",
        path.to_str().unwrap(),
    ]));
    path.to_string_lossy().into_owned()
}

fn json_of(out: &Output) -> serde_json::Value {
    serde_json::from_str(&stdout(out)).unwrap()
}

#[test]
fn generate_prompt_goes_through_the_model_s_tokenizer() {
    let m = text_model();
    let info = json_of(&tinyloop(&[&m, "info", "--json"]));
    assert_eq!(info["config"]["vocab_size"], 384);
    assert_eq!(info["metadata"]["tokenizer"], "huggingface");
    let args = [
        &m,
        "generate",
        "--prompt",
        "ROMEO: But soft",
        "--max-tokens",
        "16",
        "--loops",
        "2",
    ];
    let v = json_of(&tinyloop(&[&args[..], &["--json"]].concat()));
    // The same tokens from the prompt's ids (with the BOS the tokenizer adds), and the text is
    // their decoding without special tokens.
    let ids = json_of(&tinyloop(&[
        &m,
        "tokenize",
        "--prompt",
        "ROMEO: But soft",
        "--json",
    ]));
    let ids: Vec<String> = ids["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.to_string())
        .collect();
    assert_eq!(ids[0], "381");
    let by_ids = json_of(&tinyloop(&[
        &m,
        "generate",
        "--tokens",
        &ids.join(","),
        "--max-tokens",
        "16",
        "--loops",
        "2",
        "--json",
    ]));
    let n = v["tokens"].as_array().unwrap().len();
    assert_eq!(
        v["tokens"].as_array().unwrap()[..],
        by_ids["tokens"].as_array().unwrap()[..n]
    );
    assert!(v["text"].is_string());
    // Streamed: the prompt, then the same text.
    let streamed = stdout(&tinyloop(&[&args[..], &["-q"]].concat()));
    assert_eq!(
        streamed,
        format!("ROMEO: But soft{}\n", v["text"].as_str().unwrap())
    );
}

#[test]
fn generate_stop_ends_the_text_before_the_stop_string() {
    let m = text_model();
    let args = [
        &m,
        "generate",
        "--prompt",
        "Hello",
        "--max-tokens",
        "40",
        "--loops",
        "2",
        "--json",
    ];
    let full = json_of(&tinyloop(&args));
    let text = full["text"].as_str().unwrap();
    let stop: String = text.chars().skip(3).take(2).collect();
    assert_eq!(stop.chars().count(), 2, "the text is long enough: {text:?}");
    let cut = json_of(&tinyloop(
        &[&args[..], &["--stop", "never there", "--stop", &stop]].concat(),
    ));
    assert_eq!(cut["text"], text[..text.find(&stop).unwrap()]);
}

#[test]
fn generate_chat_renders_the_template_and_prints_only_the_reply() {
    let m = text_model();
    let args = [
        &m,
        "generate",
        "--prompt",
        "Hi",
        "--chat",
        "--max-tokens",
        "8",
        "--loops",
        "2",
    ];
    let v = json_of(&tinyloop(&[&args[..], &["--json"]].concat()));
    let streamed = stdout(&tinyloop(&[&args[..], &["-q"]].concat()));
    assert_eq!(streamed, format!("{}\n", v["text"].as_str().unwrap()));
    let rendered = json_of(&tinyloop(&[
        &m, "tokenize", "--prompt", "Hi", "--chat", "--json",
    ]));
    let text = rendered["text"].as_str().unwrap();
    assert!(
        text.starts_with("<|im_start|>system\n") && text.ends_with("<|im_start|>assistant\n"),
        "{text:?}"
    );
    assert_eq!(rendered["tokens"][0], 382, "<|im_start|>, no BOS added");
}

#[test]
fn tokenize_prints_the_ids_of_the_fixture() {
    let m = text_model();
    let expected: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(common::tokenizer_dir().join("expected.json")).unwrap(),
    )
    .unwrap();
    let case = &expected["cases"][0];
    let ids = |key: &str| -> String {
        let ids: Vec<String> = case[key]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.to_string())
            .collect();
        ids.join(",") + "\n"
    };
    let text = case["text"].as_str().unwrap();
    assert_eq!(
        stdout(&tinyloop(&[&m, "tokenize", "--prompt", text])),
        ids("ids_with_special_tokens")
    );
    let plain = tinyloop(&[&m, "tokenize", "--prompt", text, "--no-special-tokens"]);
    assert_eq!(stdout(&plain), ids("ids"));
    // A byte-level model: the bytes.
    assert_eq!(
        stdout(&tinyloop(&[&model(), "tokenize", "--prompt", "é!"])),
        "195,169,33\n"
    );
}

#[test]
fn text_options_fail_with_one_line_naming_the_problem() {
    let (m, bytes) = (text_model(), model());
    // `synth` names no tokenizer for a vocabulary other than 256 bytes.
    let no_tokenizer = common::scratch("cli").join("no-tokenizer.tinyloop");
    let config = tinyloop::ModelConfig {
        vocab_size: 384,
        ..tinyloop::model::synth::preset("tiny").unwrap()
    };
    let writer = tinyloop::model::synth::random_model(&config, 1, 4, 32).unwrap();
    writer.write(&no_tokenizer).unwrap();
    let no_tokenizer = no_tokenizer.to_str().unwrap();
    for (args, message) in [
        (
            vec![&bytes[..], "generate", "--prompt", "x", "--chat"],
            "byte-level and has no chat template",
        ),
        (
            vec![&m, "generate", "--prompt", "x", "--stop", ""],
            "stop string 0 is empty",
        ),
        (
            vec![&m, "generate", "--tokens", "1", "--stop", "x"],
            "--prompt",
        ),
        (
            vec![no_tokenizer, "tokenize", "--prompt", "x"],
            "the model has no tokenizer",
        ),
        (
            vec![no_tokenizer, "generate", "--prompt", "x"],
            "the model has no tokenizer",
        ),
        (
            vec![
                "synth",
                "--preset",
                "tiny",
                "--tokenizer",
                "/missing",
                "--out",
                "/tmp/x",
            ],
            "cannot read /missing/tokenizer.json",
        ),
    ] {
        let out = tinyloop(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && out.stdout.is_empty(),
            "{args:?}: {err}"
        );
        assert!(err.contains(message), "{args:?}: {err}");
        let error_lines = err.lines().filter(|l| l.starts_with("error")).count();
        assert_eq!(error_lines, 1, "{args:?}: {err}");
    }
}

/// `convert --hf` of both families' checkpoint folders: round to nearest and GPTQ (calibrated on
/// text through the folder's tokenizer); the files load and generate text through their stored
/// tokenizer, with Ouro's exit gate and Huginn's seeded initial state and an exit criterion.
#[test]
fn convert_hf_writes_models_that_generate_text() {
    let dir = common::scratch("cli-hf");
    let root = env!("CARGO_MANIFEST_DIR");
    let calib = format!("{root}/tests/data/train_excerpt.txt");
    for (family, run) in [
        ("ouro-tiny", vec!["--exit-threshold", "0.5"]),
        (
            "huginn-tiny",
            vec!["--state-init", "seed:7", "--exit", "kl:1e-3"],
        ),
    ] {
        let folder = format!("{root}/tests/data/hf/{family}");
        for method in ["rtn", "gptq"] {
            let out = dir.join(format!("{family}-{method}.tinyloop"));
            let out = out.to_str().unwrap();
            let mut args = vec![
                "convert",
                "--hf",
                &folder,
                "--bits",
                "4",
                "--group-size",
                "32",
            ];
            args.extend(["--method", method, "--out", out]);
            if method == "gptq" {
                args.extend(["--calib", &calib, "--calib-bytes", "4000"]);
            }
            let converted = tinyloop(&args);
            assert!(
                converted.status.success(),
                "{}",
                String::from_utf8_lossy(&converted.stderr)
            );
            let info = stdout(&tinyloop(&[out, "info"]));
            assert!(info.contains(&format!("\"int4 g32 {method}\"")), "{info}");
            let mut generate = vec![out, "generate", "--prompt", "ROMEO:", "--max-tokens", "6"];
            generate.extend(run.iter().copied());
            generate.extend(["--device", "cpu"]);
            let text = tinyloop(&generate);
            assert!(
                text.status.success(),
                "{}",
                String::from_utf8_lossy(&text.stderr)
            );
            assert!(stdout(&text).starts_with("ROMEO:"), "{}", stdout(&text));
        }
    }
}
