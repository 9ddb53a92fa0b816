//! `bench --concurrency N`: N clients at once against one model, each generating the bench
//! prompt `--repeats` times, timed together: either each on its own session and thread (every
//! session steps its own rows), or all through one [`Engine`] (continuous batching: one step for
//! every running request). Reports the aggregate generation rate and the latencies a caller sees.

use std::sync::Barrier;
use std::time::Instant;

use serde_json::json;
use tinyloop::{Engine, EngineOptions, Error, Event, GenerateParams, Model, Result, Session};

/// What one client saw in its timed runs: when they began and ended (ms from the common start),
/// and for every run the times of its tokens from the run's start.
struct Timeline {
    begin_ms: f64,
    end_ms: f64,
    runs: Vec<Vec<f64>>,
}

/// How the clients are served.
pub enum Via {
    Sessions,
    Engine(EngineOptions),
}

/// One client's way to generate: the prompt, calling `on_token` for each token.
trait Client: Send {
    fn generate(&mut self, on_token: &mut dyn FnMut()) -> Result<()>;
}

struct SessionClient<'a> {
    session: Session,
    prompt: &'a [u32],
    params: &'a GenerateParams,
}

impl Client for SessionClient<'_> {
    fn generate(&mut self, on_token: &mut dyn FnMut()) -> Result<()> {
        let mut each = |_| {
            on_token();
            true
        };
        self.session
            .generate_stream(self.prompt, self.params, &mut each)
            .map(drop)
    }
}

struct EngineClient<'a> {
    engine: &'a Engine,
    prompt: &'a [u32],
    params: &'a GenerateParams,
}

impl Client for EngineClient<'_> {
    fn generate(&mut self, on_token: &mut dyn FnMut()) -> Result<()> {
        let submitted = self.engine.submit(self.prompt, self.params)?;
        for event in submitted.events {
            match event {
                Event::Token(_) => on_token(),
                Event::Done(_) => return Ok(()),
                Event::Failed(e) => return Err(e),
            }
        }
        Err(Error::Device(
            "the engine ended without finishing a request".into(),
        ))
    }
}

/// Run `repeats` generations of `prompt` for each of `clients` clients of `model` at once, after
/// one untimed warm-up generation each, also all at once (so that an engine's warm-up is a batch
/// like the timed runs, and its graphs for that batch exist), and report them as JSON.
pub fn run(
    model: &Model,
    prompt: &[u32],
    params: &GenerateParams,
    clients: usize,
    repeats: usize,
    via: &Via,
) -> Result<serde_json::Value> {
    let engine = match via {
        Via::Sessions => None,
        Via::Engine(options) => Some(Engine::new(model, options)?),
    };
    let mut ready: Vec<Box<dyn Client + '_>> = Vec::with_capacity(clients);
    for _ in 0..clients {
        ready.push(match &engine {
            None => Box::new(SessionClient {
                session: model.new_session()?,
                prompt,
                params,
            }),
            Some(engine) => Box::new(EngineClient {
                engine,
                prompt,
                params,
            }),
        });
    }
    // Every thread reaches both barriers whatever its warm-up gave, so none waits there for one
    // that failed. Between them the engine's counters are read: the step figures are the timed
    // runs' alone.
    let (warmed, timed) = (Barrier::new(clients), Barrier::new(clients));
    let before = std::sync::Mutex::new(None);
    let origin = Instant::now();
    let timelines: Vec<Result<Timeline>> = std::thread::scope(|scope| {
        let workers: Vec<_> = ready
            .into_iter()
            .map(|mut client| {
                let (warmed, timed, before, engine) = (&warmed, &timed, &before, &engine);
                scope.spawn(move || {
                    let warm = client.generate(&mut || {});
                    if warmed.wait().is_leader() {
                        *before.lock().expect("not poisoned") = engine.as_ref().map(Engine::stats);
                    }
                    timed.wait();
                    warm?;
                    timed_runs(client.as_mut(), repeats, params.max_tokens, origin)
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| w.join().expect("a bench thread panicked"))
            .collect()
    });
    let timelines = timelines.into_iter().collect::<Result<Vec<_>>>()?;
    let mut report = report(&timelines, clients);
    report["via"] = json!(match via {
        Via::Sessions => "sessions",
        Via::Engine(_) => "engine",
    });
    if let (Some(engine), Some(before)) = (&engine, before.into_inner().expect("not poisoned")) {
        let stats = engine.stats();
        let steps = stats.steps - before.steps;
        report["engine"] = json!({
            "max_step_rows": engine.options().max_step_rows,
            "steps": steps,
            "rows_per_step": (stats.rows - before.rows) as f64 / steps.max(1) as f64,
            "step_ms_mean": (stats.step_ms_sum - before.step_ms_sum) / steps.max(1) as f64,
            "preemptions": stats.preemptions - before.preemptions,
        });
    }
    Ok(report)
}

fn timed_runs(
    client: &mut dyn Client,
    repeats: usize,
    max_tokens: usize,
    origin: Instant,
) -> Result<Timeline> {
    let since = |t: Instant| t.duration_since(origin).as_secs_f64() * 1e3;
    let begin_ms = since(Instant::now());
    let mut runs = Vec::with_capacity(repeats);
    for _ in 0..repeats {
        let start = Instant::now();
        let mut stamps = Vec::with_capacity(max_tokens);
        client.generate(&mut || stamps.push(start.elapsed().as_secs_f64() * 1e3))?;
        runs.push(stamps);
    }
    Ok(Timeline {
        begin_ms,
        end_ms: since(Instant::now()),
        runs,
    })
}

fn report(timelines: &[Timeline], clients: usize) -> serde_json::Value {
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
        "clients": clients,
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
