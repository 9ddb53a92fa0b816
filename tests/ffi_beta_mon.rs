//! BETA-MON through the C ABI: `tl_generate_params.beta_monitor` and its thresholds give the
//! Rust API's summary in `tl_generate_stats`; a caller of the previous header (whose params end
//! before `beta_monitor`, whose stats end before `beta_mon`) is served as before; bad thresholds
//! are `TL_ERR_INVALID_ARGUMENT` naming the field. (tests/c/abi_test.c drives the same rows
//! from C.)

mod common;

use common::ffi::{last_error, open, Handle};
use tinyloop::ffi::*;
use tinyloop::{BetaMonitor, Device, GenerateParams, Model, ModelOptions};

const PROMPT: [i32; 6] = [82, 79, 77, 69, 79, 58];

/// Default params for `max_tokens` tokens at 3 loops.
fn gen_params(max_tokens: u32) -> tl_generate_params {
    tl_generate_params {
        loops: 3,
        ..common::ffi::gen_params(max_tokens)
    }
}

fn generate(model: &Handle, p: &tl_generate_params) -> (tl_status, Vec<i32>) {
    let mut out = vec![0i32; p.max_tokens as usize];
    let mut len = 0usize;
    // SAFETY: all pointers valid for the stated lengths.
    let status = unsafe {
        tl_generate(
            model.0,
            PROMPT.as_ptr(),
            PROMPT.len(),
            p,
            out.as_mut_ptr(),
            out.len(),
            &mut len,
        )
    };
    out.truncate(if status == tl_status::TL_OK { len } else { 0 });
    (status, out)
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

#[test]
fn the_summary_equals_the_rust_api() {
    let path = common::synth_file("tiny", 8, 4);
    let model = open(&path, 128);
    let mut p = gen_params(20);
    p.beta_monitor = true;
    p.beta_mon_low_entropy_bits = 7.0;
    p.beta_mon_high_entropy_bits = 7.5;
    p.beta_mon_agreement_floor = 0.5;
    let (status, tokens) = generate(&model, &p);
    assert_eq!(status, tl_status::TL_OK, "{}", last_error());
    let s = stats(&model);

    let rust = Model::open(
        &path,
        &ModelOptions {
            device: Some(Device::Cpu),
            max_seq_len: 128,
            log: false,
            ..ModelOptions::default()
        },
    )
    .unwrap();
    let mut session = rust.new_session().unwrap();
    let prompt: Vec<u32> = PROMPT.iter().map(|&t| t as u32).collect();
    let thresholds = BetaMonitor {
        low_entropy_bits: 7.0,
        high_entropy_bits: 7.5,
        agreement_floor: 0.5,
    };
    let params = GenerateParams {
        max_tokens: 20,
        loops: Some(3),
        beta_monitor: Some(thresholds),
        ..GenerateParams::default()
    };
    let expected: Vec<i32> = session
        .generate(&prompt, &params)
        .unwrap()
        .iter()
        .map(|&t| t as i32)
        .collect();
    assert_eq!(tokens, expected);
    // The same computation on the same backend: equal, not merely close.
    let b = session.last_generate_stats().beta_mon.unwrap();
    assert!(s.beta_mon);
    assert_eq!(s.beta_mon_n_tokens, b.n_tokens);
    assert_eq!(s.beta_mon_entropy_mean_bits, b.entropy_mean_bits);
    assert_eq!(s.beta_mon_entropy_std_bits, b.entropy_std_bits);
    assert_eq!(s.beta_mon_entropy_min_bits, b.entropy_min_bits);
    assert_eq!(s.beta_mon_entropy_max_bits, b.entropy_max_bits);
    assert_eq!(s.beta_mon_low_rate, b.low_rate);
    assert_eq!(s.beta_mon_high_rate, b.high_rate);
    assert_eq!(
        (
            s.beta_mon_low_entropy_bits,
            s.beta_mon_high_entropy_bits,
            s.beta_mon_agreement_floor
        ),
        (7.0, 7.5, 0.5)
    );
    assert!(!s.beta_mon_agreement_below_floor);

    // Off again: the fields return to zero.
    let (status, plain) = generate(&model, &gen_params(20));
    assert_eq!(status, tl_status::TL_OK);
    assert_eq!(plain, tokens, "monitoring changed the tokens");
    let s = stats(&model);
    assert!(!s.beta_mon);
    assert_eq!(s.beta_mon_n_tokens, 0);
    assert_eq!(s.beta_mon_entropy_max_bits, 0.0);
}

#[test]
fn defaults_are_off_with_the_documented_thresholds() {
    let p = gen_params(1);
    assert!(!p.beta_monitor);
    assert_eq!(
        (
            p.beta_mon_low_entropy_bits,
            p.beta_mon_high_entropy_bits,
            p.beta_mon_agreement_floor
        ),
        (0.5, 6.0, 0.95)
    );
}

/// Params of the previous header end before `ctx_tier`: whatever lies past it (the BETA-MON
/// fields included) is not read. Stats of the previous header end before the CTX-TIER fields:
/// nothing is written past them.
#[test]
fn callers_of_the_previous_header_are_served_as_before() {
    let model = open(&common::synth_file("tiny", 8, 4), 128);
    let mut p = gen_params(5);
    p.beta_monitor = true;
    p.beta_mon_low_entropy_bits = -1.0; // would be refused if read
    p.struct_size = std::mem::offset_of!(tl_generate_params, ctx_tier);
    let (status, _) = generate(&model, &p);
    assert_eq!(status, tl_status::TL_OK, "{}", last_error());
    assert!(
        !stats(&model).beta_mon,
        "the old caller's call was monitored"
    );

    let mut p = gen_params(5);
    p.beta_monitor = true;
    let (status, _) = generate(&model, &p);
    assert_eq!(status, tl_status::TL_OK);
    #[repr(C)]
    struct Previous {
        head: [u8; std::mem::offset_of!(tl_generate_stats, ctx_tier_observations)],
        beyond: [u8; 64],
    }
    let mut old = Previous {
        head: [0; std::mem::offset_of!(tl_generate_stats, ctx_tier_observations)],
        beyond: [0x5a; 64],
    };
    let size = std::mem::offset_of!(tl_generate_stats, ctx_tier_observations);
    old.head[..std::mem::size_of::<usize>()].copy_from_slice(&size.to_ne_bytes());
    // SAFETY: `old` holds `size` writable bytes that start with struct_size (and 64 more).
    let status = unsafe {
        tl_last_generate_stats(model.0, &mut old as *mut Previous as *mut tl_generate_stats)
    };
    assert_eq!(status, tl_status::TL_OK, "{}", last_error());
    assert_eq!(
        old.beyond, [0x5a; 64],
        "bytes past the previous struct were written"
    );
    let tokens_offset = std::mem::offset_of!(tl_generate_stats, tokens);
    let width = std::mem::size_of::<usize>();
    let mut tokens = [0u8; std::mem::size_of::<usize>()];
    tokens.copy_from_slice(&old.head[tokens_offset..tokens_offset + width]);
    assert_eq!(usize::from_ne_bytes(tokens), 5);
}

#[test]
fn bad_thresholds_name_the_field() {
    let model = open(&common::synth_file("tiny", 8, 4), 128);
    type Spoil = fn(&mut tl_generate_params);
    let cases: [(Spoil, &str); 5] = [
        (
            |p| p.beta_mon_low_entropy_bits = -0.5,
            "beta_monitor.low_entropy_bits must be a finite number of bits >= 0",
        ),
        (
            |p| p.beta_mon_high_entropy_bits = f64::NAN,
            "beta_monitor.high_entropy_bits must be a finite number",
        ),
        (
            |p| p.beta_mon_low_entropy_bits = 9.0,
            "beta_monitor.low_entropy_bits (9) must not exceed beta_monitor.high_entropy_bits (6)",
        ),
        (
            |p| p.beta_mon_agreement_floor = 1.5,
            "beta_monitor.agreement_floor must be in [0, 1], got 1.5",
        ),
        (
            |p| p.beta_mon_agreement_floor = f64::NAN,
            "beta_monitor.agreement_floor must be in [0, 1]",
        ),
    ];
    for (spoil, expected) in cases {
        let mut p = gen_params(3);
        p.beta_monitor = true;
        spoil(&mut p);
        let (status, _) = generate(&model, &p);
        assert_eq!(status, tl_status::TL_ERR_INVALID_ARGUMENT, "{expected}");
        assert!(last_error().contains(expected), "{}", last_error());
    }
}
