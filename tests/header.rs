//! The checked-in C header must equal the one cbindgen generates during this build.
//! `TINYLOOP_BLESS=1 cargo test --test header` rewrites include/tinyloop.h instead of failing.

use std::path::Path;

#[test]
fn checked_in_header_is_fresh() {
    let generated_path = env!("TINYLOOP_GENERATED_HEADER");
    let generated = std::fs::read_to_string(generated_path)
        .unwrap_or_else(|e| panic!("cannot read generated header {generated_path}: {e}"));
    let checked_in_path = Path::new(env!("CARGO_MANIFEST_DIR")).join("include/tinyloop.h");
    if std::env::var_os("TINYLOOP_BLESS").is_some() {
        std::fs::write(&checked_in_path, &generated).expect("include/tinyloop.h is writable");
        return;
    }
    let checked_in = std::fs::read_to_string(&checked_in_path).unwrap_or_default();
    if checked_in != generated {
        let first_diff = checked_in
            .lines()
            .zip(generated.lines())
            .position(|(a, b)| a != b)
            .unwrap_or_else(|| checked_in.lines().count().min(generated.lines().count()));
        panic!(
            "include/tinyloop.h is stale (first difference at line {}); regenerate it with \
             `TINYLOOP_BLESS=1 cargo test --test header` (or copy {generated_path})",
            first_diff + 1
        );
    }
}

#[test]
fn header_declares_the_abi_surface() {
    let header = std::fs::read_to_string(env!("TINYLOOP_GENERATED_HEADER")).unwrap();
    for name in [
        "#define TL_ABI_VERSION",
        "TL_ERR_PANIC = 9",
        "tl_model_open(",
        "tl_close(",
        "tl_model_free(",
        "tl_generate(",
        "tl_generate_stream(",
        "tl_score_last(",
        "tl_score_exit(",
        "tl_session_score_exit(",
        "tl_logprobs_decode(",
        "tl_session_logprobs_decode(",
        "tl_vram_usage_mb(",
        "tl_model_config(",
        "tl_session_new(",
        "tl_session_cancel(",
        "tl_last_error_message(",
        "tl_status_string(",
        "#define TL_MAX_DRAFT_LEN 15",
        "tl_score_logit_lens(",
        "tl_session_score_trajectory(",
        "tl_generate_speculative(",
        "tl_speculative_default_params(",
        "tl_prefix_cache_new(",
        "tl_prefix_cache_free(",
        "const struct tl_prefix_cache *prefix_cache;",
        "tl_resume_handle_new(",
        "tl_resume_handle_free(",
        "tl_session_resume_generate(",
        "tl_last_generate_stats(",
    ] {
        assert!(header.contains(name), "header lacks {name}");
    }
    // Only the FFI module is exported: constants of other modules must not leak in.
    assert!(
        !header.contains("LOGIT_ROWS"),
        "non-FFI constant leaked into the header"
    );
}
