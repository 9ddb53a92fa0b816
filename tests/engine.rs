//! The continuous-batching engine: every request's tokens equal what a session generates for it
//! alone, whatever runs beside it; cancellation, shutdown and bad input.

mod common;

use common::{
    cpu_options, greedy_params as params, open_cpu, sampled_params as sampled, synth_file, tokens,
};
use tinyloop::{
    Engine, EngineOptions, Error, Event, Exit, ExitPolicy, ExitRule, Finish, GenerateParams,
    KvMode, Model, ModelOptions,
};

fn small_steps() -> EngineOptions {
    // Few rows per step: prompts are cut into chunks and share steps with decode rows.
    EngineOptions {
        max_step_rows: 8,
        page_size: 4,
        ..EngineOptions::default()
    }
}

/// Requests of mixed prompt lengths, loop counts and lengths.
fn workload(vocab: usize) -> Vec<(Vec<u32>, GenerateParams)> {
    let loops = [1, 4, 2, 6, 3, 4, 1];
    (0..loops.len())
        .map(|i| {
            let prompt = tokens(3 + 7 * i, vocab, i as u32 + 1);
            (prompt, params(5 + 3 * i, loops[i]))
        })
        .collect()
}

/// Submit every request at once, then check each against a session generating it alone.
fn check_against_sessions(
    model: &Model,
    options: &EngineOptions,
    requests: &[(Vec<u32>, GenerateParams)],
) {
    let engine = Engine::new(model, options).unwrap();
    let submitted: Vec<_> = requests
        .iter()
        .map(|(prompt, p)| engine.submit(prompt, p).unwrap())
        .collect();
    let mut session = model.new_session().unwrap();
    for ((prompt, p), sub) in requests.iter().zip(submitted) {
        let (got, stats) = sub.wait().unwrap();
        let alone = session.generate(prompt, p).unwrap();
        assert_eq!(
            got,
            alone,
            "prompt of {} tokens at {:?} loops",
            prompt.len(),
            p.loops
        );
        assert_eq!(stats.tokens, got.len());
        assert_eq!(stats.prompt_tokens, prompt.len());
        assert!(stats.first_token_ms <= stats.total_ms);
    }
    let stats = engine.stats();
    assert_eq!((stats.running, stats.queued, stats.pages_used), (0, 0, 0));
    assert!(stats.steps > 0 && stats.rows >= stats.tokens);
}

#[test]
fn greedy_under_batching_equals_generation_alone() {
    for preset in [
        "tiny",
        "tiny-gqa",
        "tiny-tied",
        "tiny-sandwich",
        "tiny-recurrent",
    ] {
        let model = open_cpu(&synth_file(preset, 3, 4));
        let vocab = model.config().vocab_size;
        check_against_sessions(&model, &small_steps(), &workload(vocab));
    }
}

#[test]
fn every_step_budget_gives_the_same_tokens() {
    let model = open_cpu(&synth_file("tiny", 3, 4));
    let requests = workload(256);
    for max_step_rows in [1, 3, 64] {
        let options = EngineOptions {
            max_step_rows,
            ..small_steps()
        };
        check_against_sessions(&model, &options, &requests);
    }
}

#[test]
fn int8_and_delta_pools_equal_sessions_in_the_same_mode() {
    let path = synth_file("tiny", 4, 4);
    for mode in [KvMode::Int8, KvMode::Delta] {
        let options = ModelOptions {
            kv_mode: Some(mode),
            ..cpu_options()
        };
        let model = Model::open(&path, &options).unwrap();
        check_against_sessions(&model, &small_steps(), &workload(256));
    }
}

#[test]
fn sampled_requests_equal_sampling_alone() {
    let model = open_cpu(&synth_file("tiny", 5, 4));
    let requests: Vec<_> = (0..4)
        .map(|i| (tokens(5 + i as usize, 256, 7), sampled(10 + i, 12, 3)))
        .collect();
    check_against_sessions(&model, &small_steps(), &requests);
}

#[test]
fn a_small_pool_admits_requests_as_pages_free() {
    let model = open_cpu(&synth_file("tiny", 3, 4));
    // Room for about two of the workload's requests at a time.
    let options = EngineOptions {
        pool_positions: 96,
        ..small_steps()
    };
    check_against_sessions(&model, &options, &workload(256));
    let engine = Engine::new(&model, &options).unwrap();
    assert_eq!(engine.options().pool_positions, 96);
    let e = engine
        .submit(&tokens(90, 256, 1), &params(20, 2))
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("needs 28 KV pages; the engine's pool has 24"),
        "{e}"
    );
}

#[test]
fn stop_tokens_end_a_request_and_are_not_returned() {
    let model = open_cpu(&synth_file("tiny", 3, 4));
    let prompt = tokens(9, 256, 3);
    let free = model
        .new_session()
        .unwrap()
        .generate(&prompt, &params(12, 2))
        .unwrap();
    let stop = free[4];
    let cut = free.iter().position(|&t| t == stop).unwrap();
    let p = GenerateParams {
        stop_tokens: vec![stop],
        ..params(12, 2)
    };
    let engine = Engine::new(&model, &small_steps()).unwrap();
    let (got, stats) = engine.submit(&prompt, &p).unwrap().wait().unwrap();
    assert_eq!(got, free[..cut]);
    assert_eq!(stats.finish, Finish::Stop);
    let (_, stats) = engine
        .submit(&prompt, &params(12, 2))
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(stats.finish, Finish::Length);
}

#[test]
fn requests_are_cut_to_max_seq_len() {
    let model = open_cpu(&synth_file("tiny", 3, 4));
    let max_seq = model.options().max_seq_len;
    let prompt = tokens(max_seq - 3, 256, 4);
    let engine = Engine::new(&model, &EngineOptions::default()).unwrap();
    let (got, stats) = engine
        .submit(&prompt, &params(50, 1))
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(got.len(), 3);
    assert_eq!(stats.finish, Finish::Length);
    let alone = model
        .new_session()
        .unwrap()
        .generate(&prompt, &params(50, 1))
        .unwrap();
    assert_eq!(got, alone);
}

#[test]
fn cancelled_requests_end_with_cancelled_and_free_their_pages() {
    let model = open_cpu(&synth_file("tiny", 3, 4));
    let engine = Engine::new(&model, &small_steps()).unwrap();
    let long = engine.submit(&tokens(20, 256, 1), &params(200, 6)).unwrap();
    let short = engine.submit(&tokens(5, 256, 2), &params(4, 1)).unwrap();
    // The first token shows the long request is running.
    assert!(matches!(long.events.recv().unwrap(), Event::Token(_)));
    engine.cancel(long.id).unwrap();
    let mut tail = long.events.iter();
    let end = tail.find(|e| !matches!(e, Event::Token(_))).unwrap();
    assert!(matches!(end, Event::Failed(Error::Cancelled)), "{end:?}");
    assert!(short.wait().is_ok(), "the other request is unaffected");
    let e = engine.cancel(long.id).unwrap_err().to_string();
    assert!(e.contains("request 0 has already ended"), "{e}");
    let e = engine.cancel(99).unwrap_err().to_string();
    assert!(
        e.contains("no request 99: this engine has given ids 0..2"),
        "{e}"
    );
    let stats = engine.stats();
    assert_eq!((stats.running, stats.pages_used), (0, 0));
}

#[test]
fn a_dropped_receiver_ends_its_request() {
    let model = open_cpu(&synth_file("tiny", 3, 4));
    let engine = Engine::new(&model, &small_steps()).unwrap();
    drop(engine.submit(&tokens(5, 256, 1), &params(200, 2)).unwrap());
    let after = engine.submit(&tokens(5, 256, 2), &params(3, 2)).unwrap();
    assert!(after.wait().is_ok());
    // The abandoned request gave its pages back once a token could not be delivered.
    let stats = engine.stats();
    assert_eq!((stats.running, stats.pages_used), (0, 0));
}

#[test]
fn dropping_the_engine_cancels_what_is_in_flight() {
    let model = open_cpu(&synth_file("tiny", 3, 4));
    let engine = Engine::new(
        &model,
        &EngineOptions {
            max_running: 1,
            ..small_steps()
        },
    )
    .unwrap();
    let running = engine.submit(&tokens(10, 256, 1), &params(200, 6)).unwrap();
    let queued = engine.submit(&tokens(10, 256, 2), &params(200, 6)).unwrap();
    assert!(matches!(running.events.recv().unwrap(), Event::Token(_)));
    let memory_with = model.memory_bytes();
    drop(engine);
    for sub in [running, queued] {
        assert!(matches!(sub.wait(), Err(Error::Cancelled)));
    }
    assert!(
        model.memory_bytes() < memory_with,
        "the engine's buffers and pool are counted"
    );
}

#[test]
fn bad_options_and_requests_are_clear_errors() {
    let model = open_cpu(&synth_file("tiny", 3, 4));
    for (name, options) in [
        (
            "max_step_rows",
            EngineOptions {
                max_step_rows: 0,
                ..EngineOptions::default()
            },
        ),
        (
            "max_running",
            EngineOptions {
                max_running: 0,
                ..EngineOptions::default()
            },
        ),
        (
            "page_size",
            EngineOptions {
                page_size: 0,
                ..EngineOptions::default()
            },
        ),
        (
            "max_queued",
            EngineOptions {
                max_queued: 0,
                ..EngineOptions::default()
            },
        ),
    ] {
        let e = Engine::new(&model, &options).unwrap_err().to_string();
        assert!(
            e.contains(&format!("engine option {name} must be at least 1")),
            "{e}"
        );
    }
    let h_mode = Model::open(
        synth_file("tiny", 3, 4),
        &ModelOptions {
            kv_mode: Some(KvMode::Fp16H),
            ..cpu_options()
        },
    )
    .unwrap();
    let e = Engine::new(&h_mode, &EngineOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("KV mode fp16-h is not supported (use fp16, int8 or delta)"),
        "{e}"
    );

    let engine = Engine::new(&model, &EngineOptions::default()).unwrap();
    let cases: Vec<(Vec<u32>, GenerateParams, &str)> = vec![
        (vec![], params(4, 2), "empty token sequence"),
        (vec![1, 999], params(4, 2), "token 1: 999 is out of range"),
        (vec![1, 2], params(0, 2), "max_tokens must be >= 1"),
        (vec![1, 2], params(4, 0), "loops must be in 1..=64"),
        (
            vec![1, 2],
            GenerateParams {
                exit: Some(Exit {
                    rule: "kl:0.01".parse::<ExitRule>().unwrap(),
                    policy: ExitPolicy::Reference,
                }),
                ..params(4, 2)
            },
            "does not run requests with an exit rule",
        ),
    ];
    for (prompt, p, expected) in cases {
        let e = engine.submit(&prompt, &p).unwrap_err().to_string();
        assert!(e.contains(expected), "{e}");
    }
}

#[test]
fn a_full_queue_is_busy() {
    let model = open_cpu(&synth_file("tiny", 3, 4));
    let engine = Engine::new(
        &model,
        &EngineOptions {
            max_running: 1,
            max_queued: 2,
            ..small_steps()
        },
    )
    .unwrap();
    let first = engine.submit(&tokens(5, 256, 1), &params(100, 4)).unwrap();
    // Wait until the first runs, so the queue holds exactly what follows.
    assert!(matches!(first.events.recv().unwrap(), Event::Token(_)));
    let _queued = [
        engine.submit(&tokens(5, 256, 2), &params(4, 4)).unwrap(),
        engine.submit(&tokens(5, 256, 3), &params(4, 4)).unwrap(),
    ];
    assert!(matches!(
        engine.submit(&tokens(5, 256, 4), &params(4, 4)),
        Err(Error::Busy)
    ));
}

#[test]
fn requests_with_a_common_prefix_share_its_pages() {
    let model = open_cpu(&synth_file("tiny", 3, 4));
    let options = EngineOptions {
        max_running: 1,
        ..small_steps()
    };
    let engine = Engine::new(&model, &options).unwrap();
    let prefix = tokens(30, 256, 9);
    let with =
        |tail: u32| -> Vec<u32> { prefix.iter().copied().chain(tokens(5, 256, tail)).collect() };
    let mut session = model.new_session().unwrap();
    // The first request computes every position; the second takes the 7 pages of four
    // positions that hold the first 28 prompt tokens of both, and starts after them.
    for (tail, loops, cached) in [(1, 3, 0), (2, 3, 28), (3, 5, 0), (4, 5, 28), (2, 3, 32)] {
        let prompt = with(tail);
        let (got, stats) = engine
            .submit(&prompt, &params(8, loops))
            .unwrap()
            .wait()
            .unwrap();
        assert_eq!(got, session.generate(&prompt, &params(8, loops)).unwrap());
        assert_eq!(stats.cached_tokens, cached, "tail {tail} at {loops} loops");
    }
    let stats = engine.stats();
    assert_eq!(stats.pages_used, 0);
    assert!(stats.cached_pages > 0);
}

#[test]
fn shared_and_evicted_pages_keep_every_request_equal_to_generation_alone() {
    let model = open_cpu(&synth_file("tiny-sandwich", 3, 4));
    let prefix = tokens(21, 256, 5);
    let requests: Vec<_> = (0..8)
        .map(|i| {
            let prompt = prefix
                .iter()
                .copied()
                .chain(tokens(2 + i, 256, i as u32))
                .collect();
            (prompt, params(6, 1 + i % 3))
        })
        .collect();
    for pool_positions in [0, 96] {
        let options = EngineOptions {
            pool_positions,
            ..small_steps()
        };
        check_against_sessions(&model, &options, &requests);
    }
}

#[test]
fn preempted_requests_continue_with_the_tokens_they_would_have_given() {
    let model = open_cpu(&synth_file("tiny", 3, 4));
    // Each request needs 10 of the pool's 12 pages by its end: running them together makes the
    // newer ones give their pages up, run their prompt and tokens again, and continue.
    let options = EngineOptions {
        pool_positions: 48,
        ..small_steps()
    };
    let requests: Vec<_> = (0..4)
        .map(|i| {
            let p = if i % 2 == 0 {
                params(30, 1 + i)
            } else {
                sampled(i as u64, 30, 2)
            };
            (tokens(9 + i, 256, i as u32), p)
        })
        .collect();
    let engine = Engine::new(&model, &options).unwrap();
    let submitted: Vec<_> = requests
        .iter()
        .map(|(prompt, p)| engine.submit(prompt, p).unwrap())
        .collect();
    let mut session = model.new_session().unwrap();
    for ((prompt, p), sub) in requests.iter().zip(submitted) {
        let (got, _) = sub.wait().unwrap();
        assert_eq!(got, session.generate(prompt, p).unwrap());
    }
    let stats = engine.stats();
    assert!(stats.preemptions > 0, "{stats:?}");
    assert_eq!((stats.running, stats.queued, stats.pages_used), (0, 0, 0));
}
