//! `bench --concurrency N`: N requests at once against one model, each on its own session and
//! thread (how the library serves concurrent callers: every session steps its own rows), timed
//! together. Reports the aggregate generation rate and the latencies a caller sees.

use std::sync::Barrier;
use std::time::Instant;

use serde_json::json;
use tinyloop::{GenerateParams, Model, Result, Session};

/// What one session saw in its timed runs: when they began and ended (ms from the common start),
/// and for every run the times of its tokens from the run's start.
struct Timeline {
    begin_ms: f64,
    end_ms: f64,
    runs: Vec<Vec<f64>>,
}

/// Run `repeats` generations of `prompt` on each of `sessions` sessions of `model` at once (after
/// one untimed warm-up generation each, in turn) and report them as JSON.
pub fn run(
    model: &Model,
    prompt: &[u32],
    params: &GenerateParams,
    sessions: usize,
    repeats: usize,
) -> Result<serde_json::Value> {
    let mut warmed = Vec::with_capacity(sessions);
    for _ in 0..sessions {
        let mut session = model.new_session()?;
        session.generate_stream(prompt, params, &mut |_| true)?;
        warmed.push(session);
    }
    // Nothing fallible runs before the barrier, so no thread waits there for one that failed.
    let barrier = Barrier::new(sessions);
    let origin = Instant::now();
    let timelines: Vec<Result<Timeline>> = std::thread::scope(|scope| {
        let workers: Vec<_> = warmed
            .into_iter()
            .map(|mut session| {
                let barrier = &barrier;
                scope.spawn(move || {
                    barrier.wait();
                    timed_runs(&mut session, prompt, params, repeats, origin)
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| w.join().expect("a bench thread panicked"))
            .collect()
    });
    let timelines = timelines.into_iter().collect::<Result<Vec<_>>>()?;
    Ok(report(&timelines, sessions))
}

fn timed_runs(
    session: &mut Session,
    prompt: &[u32],
    params: &GenerateParams,
    repeats: usize,
    origin: Instant,
) -> Result<Timeline> {
    let since = |t: Instant| t.duration_since(origin).as_secs_f64() * 1e3;
    let begin_ms = since(Instant::now());
    let mut runs = Vec::with_capacity(repeats);
    for _ in 0..repeats {
        let start = Instant::now();
        let mut stamps = Vec::with_capacity(params.max_tokens);
        session.generate_stream(prompt, params, &mut |_| {
            stamps.push(start.elapsed().as_secs_f64() * 1e3);
            true
        })?;
        runs.push(stamps);
    }
    Ok(Timeline {
        begin_ms,
        end_ms: since(Instant::now()),
        runs,
    })
}

fn report(timelines: &[Timeline], sessions: usize) -> serde_json::Value {
    let begin = timelines
        .iter()
        .map(|t| t.begin_ms)
        .fold(f64::MAX, f64::min);
    let end = timelines.iter().map(|t| t.end_ms).fold(0.0, f64::max);
    let runs = timelines.iter().flat_map(|t| &t.runs);
    let tokens: usize = runs.clone().map(Vec::len).sum();
    let first: Vec<f64> = runs.clone().filter_map(|r| r.first().copied()).collect();
    let gaps: Vec<f64> = runs
        .flat_map(|r| r.windows(2).map(|w| w[1] - w[0]))
        .collect();
    let wall_ms = end - begin;
    json!({
        "sessions": sessions,
        "requests": first.len(),
        "tokens": tokens,
        "wall_ms": wall_ms,
        "aggregate_tokens_per_s": tokens as f64 / wall_ms * 1e3,
        "ttft_ms": percentiles(first),
        "itl_ms": percentiles(gaps),
    })
}

/// The 50th, 90th and 99th percentiles (nearest rank) of `values`; null when there are none.
fn percentiles(mut values: Vec<f64>) -> serde_json::Value {
    if values.is_empty() {
        return serde_json::Value::Null;
    }
    values.sort_by(f64::total_cmp);
    let rank =
        |p: f64| values[((p * values.len() as f64).ceil() as usize).clamp(1, values.len()) - 1];
    json!({ "p50": rank(0.50), "p90": rank(0.90), "p99": rank(0.99) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_take_the_nearest_rank() {
        let values: Vec<f64> = (1..=100).map(f64::from).collect();
        let p = percentiles(values);
        assert_eq!(
            (p["p50"].as_f64(), p["p90"].as_f64(), p["p99"].as_f64()),
            (Some(50.0), Some(90.0), Some(99.0))
        );
        assert_eq!(percentiles(vec![7.0])["p99"], json!(7.0));
        assert!(percentiles(Vec::new()).is_null());
    }

    #[test]
    fn the_report_counts_every_session_s_tokens_over_the_common_window() {
        let timelines = [
            Timeline {
                begin_ms: 10.0,
                end_ms: 110.0,
                runs: vec![vec![5.0, 6.0, 8.0]],
            },
            Timeline {
                begin_ms: 12.0,
                end_ms: 60.0,
                runs: vec![vec![4.0, 5.0], vec![3.0, 7.0]],
            },
        ];
        let r = report(&timelines, 2);
        assert_eq!(r["tokens"], json!(7));
        assert_eq!(r["requests"], json!(3));
        assert_eq!(r["wall_ms"], json!(100.0));
        assert_eq!(r["aggregate_tokens_per_s"], json!(70.0));
        // Gaps 1, 2, 1, 4; first tokens 3, 4, 5.
        assert_eq!(r["itl_ms"]["p50"], json!(1.0));
        assert_eq!(r["itl_ms"]["p99"], json!(4.0));
        assert_eq!(r["ttft_ms"]["p50"], json!(4.0));
    }
}
