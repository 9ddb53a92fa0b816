//! The server's Prometheus metrics: request counts by endpoint and status, tokens, latency
//! histograms, and the engine's queue, KV pool and step counts (text exposition format 0.0.4).

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use axum::response::{IntoResponse, Response};
use tinyloop::{EngineStats, STEP_MS_BOUNDS};

use super::api::{ApiError, Kind};
use super::End;

/// Upper bounds (seconds) of the latency histograms.
const SECONDS_BOUNDS: [f64; 12] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// A cumulative histogram.
#[derive(Default)]
struct Histogram {
    counts: [u64; SECONDS_BOUNDS.len()],
    count: u64,
    sum: f64,
}

impl Histogram {
    fn observe(&mut self, seconds: f64) {
        for (count, bound) in self.counts.iter_mut().zip(SECONDS_BOUNDS) {
            if seconds <= bound {
                *count += 1;
            }
        }
        self.count += 1;
        self.sum += seconds;
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (count, bound) in self.counts.iter().zip(SECONDS_BOUNDS) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{bound}\"}} {count}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum {}\n{name}_count {}", self.sum, self.count);
    }
}

#[derive(Default)]
pub struct Metrics {
    /// Responses by (endpoint, HTTP status).
    responses: Mutex<BTreeMap<(&'static str, u16), u64>>,
    prompt_tokens: AtomicU64,
    completion_tokens: AtomicU64,
    first_token: Mutex<Histogram>,
    request: Mutex<Histogram>,
}

impl Metrics {
    pub fn count(&self, kind: Kind, status: u16) {
        let mut responses = self.responses.lock().unwrap_or_else(|p| p.into_inner());
        *responses.entry((kind.name(), status)).or_default() += 1;
    }

    /// Count a failed request and answer it.
    pub fn failed(&self, kind: Kind, e: ApiError) -> Response {
        self.count(kind, e.status);
        e.into_response()
    }

    pub fn first_token(&self, started: Instant) {
        let mut h = self.first_token.lock().unwrap_or_else(|p| p.into_inner());
        h.observe(started.elapsed().as_secs_f64());
    }

    pub fn finished(&self, kind: Kind, started: Instant, end: &End) {
        self.count(kind, 200);
        self.prompt_tokens
            .fetch_add(end.prompt_tokens as u64, Ordering::Relaxed);
        self.completion_tokens
            .fetch_add(end.completion_tokens as u64, Ordering::Relaxed);
        let mut h = self.request.lock().unwrap_or_else(|p| p.into_inner());
        h.observe(started.elapsed().as_secs_f64());
    }

    pub fn render(&self, engine: &EngineStats) -> String {
        let mut out = String::new();
        out.push_str(
            "# HELP tinyloop_requests_total Responses by endpoint and HTTP status.\n\
             # TYPE tinyloop_requests_total counter\n",
        );
        for ((endpoint, status), n) in self
            .responses
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
        {
            let _ = writeln!(
                out,
                "tinyloop_requests_total{{endpoint=\"{endpoint}\",status=\"{status}\"}} {n}"
            );
        }
        let scalars = [
            (
                "tinyloop_prompt_tokens_total",
                "counter",
                "Prompt tokens of finished requests.",
                self.prompt_tokens.load(Ordering::Relaxed),
            ),
            (
                "tinyloop_generated_tokens_total",
                "counter",
                "Tokens returned by finished requests.",
                self.completion_tokens.load(Ordering::Relaxed),
            ),
            (
                "tinyloop_engine_steps_total",
                "counter",
                "Steps the engine ran.",
                engine.steps,
            ),
            (
                "tinyloop_engine_rows_total",
                "counter",
                "Rows the engine's steps carried (prompt and decode).",
                engine.rows,
            ),
            (
                "tinyloop_engine_tokens_total",
                "counter",
                "Tokens the engine generated.",
                engine.tokens,
            ),
            (
                "tinyloop_engine_preemptions_total",
                "counter",
                "Requests that gave their KV pages up to older ones.",
                engine.preemptions,
            ),
            (
                "tinyloop_queued_requests",
                "gauge",
                "Requests waiting for admission.",
                engine.queued as u64,
            ),
            (
                "tinyloop_running_requests",
                "gauge",
                "Requests running.",
                engine.running as u64,
            ),
            (
                "tinyloop_kv_pool_pages",
                "gauge",
                "Pages of the KV pool.",
                engine.pool_pages as u64,
            ),
            (
                "tinyloop_kv_pool_pages_used",
                "gauge",
                "Pages held by running requests.",
                engine.pages_used as u64,
            ),
            (
                "tinyloop_kv_pool_pages_cached",
                "gauge",
                "Pages nobody holds that keep a prompt prefix for later requests.",
                engine.cached_pages as u64,
            ),
        ];
        for (name, kind, help, value) in scalars {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}"
            );
        }
        let name = "tinyloop_engine_step_seconds";
        let _ = writeln!(
            out,
            "# HELP {name} Duration of the engine's steps.\n# TYPE {name} histogram"
        );
        for (count, bound) in engine.step_ms_buckets.iter().zip(STEP_MS_BOUNDS) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{}\"}} {count}", bound / 1e3);
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", engine.steps);
        let _ = writeln!(
            out,
            "{name}_sum {}\n{name}_count {}",
            engine.step_ms_sum / 1e3,
            engine.steps
        );
        self.first_token
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .render(
                &mut out,
                "tinyloop_time_to_first_token_seconds",
                "From a request's arrival to its first token.",
            );
        self.request
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .render(
                &mut out,
                "tinyloop_request_seconds",
                "From a request's arrival to its end.",
            );
        out
    }
}
