//! End to end: a bad value of any environment variable fails opening a model, with an
//! invalid-argument error that names the variable and the value (docs/ABI.md "Environment
//! variables"). The variables belong to the process, so each case runs the CLI with its own
//! environment; the unit tests next to each reader cover every accepted and refused value.

mod common;

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::process::{Command, Output};

/// `tinyloop MODEL generate` with the TINYLOOP_ variables of this process removed and `vars` set.
fn generate(vars: &[(&str, &OsStr)]) -> Output {
    let model = common::synth_file("tiny", 1, 4);
    let mut command = Command::new(env!("CARGO_BIN_EXE_tinyloop"));
    command
        .arg(&model)
        .args(["generate", "--tokens", "1,2", "--max-tokens", "2", "-q"]);
    for (name, _) in std::env::vars_os() {
        if name.to_str().is_some_and(|n| n.starts_with("TINYLOOP_")) {
            command.env_remove(name);
        }
    }
    command.env("TINYLOOP_DEVICE", "cpu");
    command.envs(vars.iter().map(|(k, v)| (k, v)));
    command.output().unwrap()
}

fn assert_refused(vars: &[(&str, &OsStr)], expected: &str) {
    let out = generate(vars);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{vars:?}: {stderr}");
    assert!(
        stderr.starts_with("error: invalid argument: ") && stderr.contains(expected),
        "{vars:?}: {stderr:?} lacks {expected:?}"
    );
}

#[test]
fn a_bad_value_fails_the_open_naming_variable_and_value() {
    let cpu = OsStr::new("cpu");
    // The CUDA variables are read when an open tries CUDA, which `auto` does.
    let auto = OsStr::new("auto");
    for (var, value, device) in [
        ("TINYLOOP_DEVICE", "gpu0", "gpu0"),
        ("TINYLOOP_KV_INT8", "yes", "cpu"),
        ("TINYLOOP_KV_DELTA", "2", "cpu"),
        ("TINYLOOP_EXPERIMENTAL_FP16_BODY", "enable", "cpu"),
        ("TINYLOOP_CTX_TIER", "yes please", "cpu"),
        ("TINYLOOP_CTX_TIER_SHORT_T", "0", "cpu"),
        ("TINYLOOP_CTX_TIER_LONG_T", "-5", "cpu"),
        ("TINYLOOP_CTX_TIER_LONG_BITS", "4294967298", "cpu"),
        ("TINYLOOP_CTX_TIER_VERBOSE", "2", "cpu"),
        ("TINYLOOP_BETA_MONITOR", "yes", "cpu"),
        ("TINYLOOP_BETA_MON_VERBOSE", "2", "cpu"),
        ("TINYLOOP_BETA_MON_LOW_ENTROPY_BITS", "low", "cpu"),
        ("TINYLOOP_BETA_MON_HIGH_ENTROPY_BITS", "inf", "cpu"),
        ("TINYLOOP_BETA_MON_AGREEMENT_FLOOR", "0,9", "cpu"),
        ("TINYLOOP_CUDA_GRAPHS", "no", "auto"),
        ("TINYLOOP_CUDA_PDL", "2", "auto"),
        ("TINYLOOP_CUDA_UPLOAD", "pinned", "auto"),
        ("TINYLOOP_CUDA_GEMV_TPR", "3", "auto"),
        ("TINYLOOP_CUDA_DEFINES", "4X=1", "auto"),
    ] {
        let device = match device {
            "cpu" => cpu,
            "auto" => auto,
            other => OsStr::new(other),
        };
        let vars = [("TINYLOOP_DEVICE", device), (var, OsStr::new(value))];
        assert_refused(
            &vars,
            &format!("{var}={value:?} is not accepted: expected "),
        );
    }
    // Range checks of a feature name the variable and the value too.
    assert_refused(
        &[("TINYLOOP_BETA_MON_AGREEMENT_FLOOR", OsStr::new("95"))],
        "TINYLOOP_BETA_MON_AGREEMENT_FLOOR must be in [0, 1], got 95",
    );
    let on = OsStr::new("1");
    assert_refused(
        &[
            ("TINYLOOP_CTX_TIER", on),
            ("TINYLOOP_CTX_TIER_SHORT_T", OsStr::new("99")),
            ("TINYLOOP_CTX_TIER_LONG_T", OsStr::new("9")),
        ],
        "TINYLOOP_CTX_TIER_SHORT_T and TINYLOOP_CTX_TIER_LONG_T: ctx_tier short_t (99) must be <= \
         long_t (9)",
    );
    assert_refused(
        &[("TINYLOOP_KV_INT8", on), ("TINYLOOP_KV_DELTA", on)],
        "TINYLOOP_KV_INT8 and TINYLOOP_KV_DELTA are both on: choose one KV mode",
    );
    assert_refused(
        &[("TINYLOOP_KV_DELTA", OsStr::from_bytes(b"1\xff"))],
        "TINYLOOP_KV_DELTA=\"1\\xFF\" is not valid UTF-8",
    );
}

#[test]
fn accepted_values_open_and_unset_or_empty_ones_take_the_defaults() {
    let on = OsStr::new("on");
    let empty = OsStr::new("");
    for vars in [
        &[("TINYLOOP_KV_INT8", on)][..],
        &[
            ("TINYLOOP_KV_DELTA", OsStr::new("true")),
            ("TINYLOOP_KV_INT8", OsStr::new("off")),
        ],
        &[
            ("TINYLOOP_CTX_TIER", OsStr::new("1")),
            (
                "TINYLOOP_CTX_TIER_LONG_T",
                OsStr::new("18446744073709551615"),
            ),
        ],
        &[
            ("TINYLOOP_BETA_MON_FILE", empty),
            ("TINYLOOP_CTX_TIER_FILE", empty),
            ("TINYLOOP_KV_INT8", empty),
        ],
        &[("TINYLOOP_DEVICE", empty)],
    ] {
        let out = generate(vars);
        assert!(
            out.status.success(),
            "{vars:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
