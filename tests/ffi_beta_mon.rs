//! BETA-MON through the C ABI: `tl_generate_params.beta_monitor` and its thresholds give the
//! Rust API's summary in `tl_generate_stats`; a caller of the previous header (whose params end
//! before `beta_monitor`, whose stats end before `beta_mon`) is served as before; bad thresholds
//! are `TL_ERR_INVALID_ARGUMENT` naming the field. (tests/c/abi_test.c drives the same rows
//! from C.)

mod common;

use std::ffi::{CStr, CString};
use std::ptr;

use tinyloop::ffi::*;
use tinyloop::{BetaMonitor, Device, GenerateParams, Model, ModelOptions};

const PROMPT: [i32; 6] = [82, 79, 77, 69, 79, 58];

struct Handle(*mut tl_model);

impl Drop for Handle {
    fn drop(&mut self) {
        tl_model_free(self.0);
    }
}

fn last_error() -> String {
    // SAFETY: the library returns a valid NUL-terminated string for this thread.
    unsafe { CStr::from_ptr(tl_last_error_message()) }
        .to_string_lossy()
        .into_owned()
}

fn open(path: &std::path::Path) -> Handle {
    let mut params = std::mem::MaybeUninit::<tl_model_params>::uninit();
    // SAFETY: a valid out-pointer.
    assert_eq!(
        unsafe { tl_model_default_params(params.as_mut_ptr()) },
        tl_status::TL_OK
    );
    // SAFETY: initialized by the call above.
    let mut params = unsafe { params.assume_init() };
    let device = CString::new("cpu").unwrap();
    params.device = device.as_ptr();
    params.max_seq_len = 128;
    params.log = false;
    let cpath = CString::new(path.to_str().unwrap()).unwrap();
    let mut model = ptr::null_mut();
    // SAFETY: valid strings, params and out-pointer.
    let status = unsafe { tl_model_open(cpath.as_ptr(), &params, &mut model) };
    assert_eq!(status, tl_status::TL_OK, "{}", last_error());
    Handle(model)
}

fn gen_params(max_tokens: u32) -> tl_generate_params {
    let mut p = std::mem::MaybeUninit::<tl_generate_params>::uninit();
    // SAFETY: a valid out-pointer.
    assert_eq!(
        unsafe { tl_generate_default_params(p.as_mut_ptr()) },
        tl_status::TL_OK
    );
    // SAFETY: initialized above.
    let mut p = unsafe { p.assume_init() };
    p.max_tokens = max_tokens;
    p.loops = 3;
    p
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
    let model = open(&path);
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
    let model = open(&common::synth_file("tiny", 8, 4));
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
    let model = open(&common::synth_file("tiny", 8, 4));
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
