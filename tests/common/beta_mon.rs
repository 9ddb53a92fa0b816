//! BETA-MON checks shared by the CPU and CUDA suites: the entropies of a generation call,
//! recomputed in f64 from `score_last` logits, and the summary they must give.

use tinyloop::telemetry::beta_monitor::entropy_bits;
use tinyloop::{BetaMonSummary, BetaMonitor, Session};

/// The f64 entropy (bits) of the distribution each of `tokens` was chosen from: the
/// `score_last` logits of the prompt followed by the tokens before it.
pub fn reference_entropies(
    session: &mut Session,
    prompt: &[u32],
    tokens: &[u32],
    loops: usize,
) -> Vec<f64> {
    (0..tokens.len())
        .map(|i| {
            let mut seq = prompt.to_vec();
            seq.extend_from_slice(&tokens[..i]);
            entropy_bits(&session.score_last(&seq, Some(loops)).unwrap())
        })
        .collect()
}

/// Thresholds that split `entropies` as near a quarter and three quarters of the way as a gap
/// wider than `2 · margin` allows (above them all when there is no such gap), so that the low
/// and high counts cannot depend on rounding within `margin`.
pub fn thresholds_between(entropies: &[f64], margin: f64) -> BetaMonitor {
    let mut sorted = entropies.to_vec();
    sorted.sort_by(f64::total_cmp);
    let n = sorted.len();
    let split = |target: usize| {
        let mut gaps: Vec<usize> = (1..n)
            .filter(|&i| sorted[i] - sorted[i - 1] > 2.0 * margin)
            .collect();
        gaps.sort_by_key(|&i| i.abs_diff(target));
        match gaps.first() {
            Some(&i) => (sorted[i - 1] + sorted[i]) / 2.0,
            None => sorted[n - 1] + 2.0 * margin,
        }
    };
    let low = split(n / 4);
    let high = split(3 * n / 4).max(low);
    BetaMonitor {
        low_entropy_bits: low,
        high_entropy_bits: high,
        ..BetaMonitor::default()
    }
}

/// `summary` is what `reference` gives, each entropy within `tol(h)` bits of its reference h.
///
/// Bounds: the mean moves by at most the largest per-token error; so do the min, the max and the
/// population standard deviation (centering is a projection, so ‖c(a) − c(b)‖₂ ≤ ‖a − b‖₂, and
/// dividing by √n keeps the bound). The low and high counts are exact when no reference lies
/// within the tolerance of a threshold ([`thresholds_between`]).
pub fn assert_summary_matches(
    summary: &BetaMonSummary,
    reference: &[f64],
    tol: impl Fn(f64) -> f64,
    what: &str,
) {
    let n = reference.len();
    assert_eq!(summary.n_tokens, n, "{what}: n_tokens");
    let bound = reference.iter().map(|&h| tol(h)).fold(0.0, f64::max);
    let mean = reference.iter().sum::<f64>() / n as f64;
    let std = (reference.iter().map(|h| (h - mean).powi(2)).sum::<f64>() / n as f64).sqrt();
    let min = reference.iter().copied().fold(f64::INFINITY, f64::min);
    let max = reference.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    for (name, got, want) in [
        ("mean", summary.entropy_mean_bits, mean),
        ("std", summary.entropy_std_bits, std),
        ("min", summary.entropy_min_bits, min),
        ("max", summary.entropy_max_bits, max),
    ] {
        assert!(
            (got - want).abs() <= bound,
            "{what}: {name} {got} vs reference {want} (bound {bound:.2e})"
        );
    }
    let t = &summary.thresholds;
    for &h in reference {
        for threshold in [t.low_entropy_bits, t.high_entropy_bits] {
            assert!(
                (h - threshold).abs() > tol(h),
                "{what}: reference {h} is too close to threshold {threshold} to count exactly"
            );
        }
    }
    let low = reference
        .iter()
        .filter(|&&h| h < t.low_entropy_bits)
        .count();
    let high = reference
        .iter()
        .filter(|&&h| h > t.high_entropy_bits)
        .count();
    assert_eq!(summary.low_rate, low as f64 / n as f64, "{what}: low_rate");
    assert_eq!(
        summary.high_rate,
        high as f64 / n as f64,
        "{what}: high_rate"
    );
}
