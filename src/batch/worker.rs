//! The engine's thread: admit requests into the KV pool, plan a step, run it, hand out tokens.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::Instant;

use super::schedule::{self, Demand, Segment};
use super::{EngineOptions, Event, Finish, Inbox, Queued, RequestStats, State, STEP_MS_BOUNDS};
use crate::backend::{choose_on_host, Backend, Choice, PooledRow, PooledRows};
use crate::ctx_tier::Tier;
use crate::error::{Error, Result};
use crate::generate::next_choice;
use crate::generate::sampling::Rng;
use crate::kv::pool::PagePool;
use crate::kv::KvLayout;
use crate::model::forward::{
    argmax_rows, chosen_rows, final_norm, logits, pooled_decode_step, run_rows, stage_pooled,
    Buffers, Rows, Span,
};
use crate::model::weights::Weights;
use crate::shared::{OnDevice, Shared};

/// Start the engine's thread once its buffers and pool exist (an error allocating them is
/// returned here).
pub(super) fn start(
    shared: Arc<Shared>,
    inbox: Arc<Inbox>,
    options: EngineOptions,
) -> Result<JoinHandle<()>> {
    let (ready, started) = std::sync::mpsc::channel();
    let thread = std::thread::Builder::new()
        .name("tinyloop-engine".into())
        .spawn(move || {
            let run = || match &shared.on_device {
                OnDevice::Cpu(l) => serve(&shared, &l.backend, &l.weights, &inbox, &options, ready),
                OnDevice::Cuda(l) => match l.backend.engine(
                    &l.weights.config,
                    options.max_step_rows,
                    shared.options.max_seq_len,
                ) {
                    Ok(backend) => serve(&shared, &backend, &l.weights, &inbox, &options, ready),
                    Err(e) => drop(ready.send(Err(e))),
                },
            };
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(run)).is_err() {
                // A bug. The running requests saw their channels close; the queued ones and
                // every later submit hear that the engine is gone.
                let mut state = inbox.lock();
                state.shutdown = true;
                for q in std::mem::take(&mut state.queue) {
                    state.live.remove(&q.id);
                    let e = Error::Device("the engine's thread panicked".into());
                    let _ = q.events.send(Event::Failed(e));
                }
            }
        })
        .map_err(|e| Error::Device(format!("cannot start the engine's thread: {e}")))?;
    match started.recv() {
        Ok(Ok(())) => Ok(thread),
        Ok(Err(e)) => {
            let _ = thread.join();
            Err(e)
        }
        Err(_) => {
            let _ = thread.join();
            Err(Error::Device(
                "the engine's thread ended while starting".into(),
            ))
        }
    }
}

/// A running request.
struct Sequence {
    queued: Queued,
    rng: Rng,
    /// The tokens the sequence runs as its prompt: the request's, and after a preemption also
    /// the tokens it had generated (their entries are computed again).
    prompt: Vec<u32>,
    /// The tokens generated so far.
    output: Vec<u32>,
    /// Positions whose KV entries are written.
    fed: usize,
    /// Prompt positions whose entries came from cached pages.
    cached: usize,
    /// The last generated token, to be fed next (none while the prompt is being fed).
    next: Option<u32>,
    pages: Vec<u32>,
    /// When the request was first admitted.
    admitted: Option<Instant>,
    first_token: Option<Instant>,
    /// Set once the sequence has produced all it may.
    finish: Option<Finish>,
}

impl Sequence {
    fn new(queued: Queued) -> Sequence {
        let rng = Rng::new(queued.request.sampling.seed);
        Sequence {
            prompt: queued.prompt.clone(),
            queued,
            rng,
            output: Vec::new(),
            fed: 0,
            cached: 0,
            next: None,
            pages: Vec::new(),
            admitted: None,
            first_token: None,
            finish: None,
        }
    }

    fn demand(&self) -> Demand {
        Demand {
            prompt_left: self.prompt.len().saturating_sub(self.fed),
            loops: self.queued.request.loops,
        }
    }

    /// Positions the sequence's next step writes up to: its prompt while prefilling (reserved
    /// at admission), one more once it decodes.
    fn next_end(&self) -> usize {
        if self.fed < self.prompt.len() {
            self.prompt.len()
        } else {
            self.fed + 1
        }
    }

    /// Give up the sequence's pages to make room for older ones: it will run its prompt and
    /// what it has generated again as its prompt, and then continue as it would have.
    fn preempt(&mut self, pool: &mut PagePool) {
        pool.release(&mut self.pages);
        self.prompt = [&self.queued.prompt[..], &self.output[..]].concat();
        self.fed = 0;
        self.next = None;
    }

    /// Send an event; false when nobody listens any more (the receiver was dropped).
    fn send(&self, event: Event) -> bool {
        self.queued.events.send(event).is_ok()
    }

    fn stats(&self, finish: Finish) -> RequestStats {
        let since = |t: Instant| t.duration_since(self.queued.submitted).as_secs_f64() * 1e3;
        RequestStats {
            prompt_tokens: self.queued.prompt.len(),
            cached_tokens: self.cached,
            tokens: self.output.len(),
            finish,
            queue_ms: self.admitted.map_or(0.0, since),
            first_token_ms: self.first_token.map_or(0.0, since),
            total_ms: since(Instant::now()),
        }
    }
}

/// What one step's rows are: tokens, places and loop counts, by row.
struct Step<'a> {
    tokens: Vec<u32>,
    places: Vec<PooledRow<'a>>,
    loops: Vec<usize>,
}

fn step_rows<'a>(running: &'a [Sequence], plan: &[Segment]) -> Step<'a> {
    let mut step = Step {
        tokens: Vec::new(),
        places: Vec::new(),
        loops: Vec::new(),
    };
    for s in plan {
        let seq = &running[s.sequence];
        for r in 0..s.rows {
            let position = seq.fed + r;
            let token = match seq.next {
                Some(token) if s.decode => token,
                _ => seq.prompt[position],
            };
            step.tokens.push(token);
            step.places.push(PooledRow {
                position,
                table: &seq.pages,
            });
            step.loops.push(s.loops);
        }
    }
    step
}

fn serve<B: Backend>(
    shared: &Shared,
    backend: &B,
    w: &Weights<B>,
    inbox: &Inbox,
    options: &EngineOptions,
    ready: std::sync::mpsc::Sender<Result<()>>,
) {
    let made = (|| {
        let layout = KvLayout::new(&w.config, shared.kv_layout.mode, options.pool_positions)?;
        let (body, _) = w.body.acquire(backend, Tier::Short)?;
        let mut buf = Buffers::new(
            backend,
            &w.config,
            options.max_step_rows,
            layout,
            body,
            shared.options.state_init,
        )?;
        buf.grow_logits(backend, &w.config, options.max_step_rows)?;
        let pool = PagePool::new(
            options.page_size,
            options.pool_positions / options.page_size,
        )?;
        Ok((buf, pool))
    })();
    let (mut buf, mut pool) = match made {
        Ok(parts) => parts,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    // The engine's buffers and pool count in the model's memory from its start to its end.
    let mut accounted = 0;
    let mut account = |buf: &Buffers<B>| {
        let bytes = buf.bytes + buf.kv.bytes();
        shared.session_bytes.fetch_add(bytes, Ordering::Relaxed);
        shared.session_bytes.fetch_sub(accounted, Ordering::Relaxed);
        accounted = bytes;
    };
    account(&buf);
    let _ = ready.send(Ok(()));
    let mut running: Vec<Sequence> = Vec::new();
    let mut graphs = GraphKeys::default();
    // Preempted sequences; the last one pushed (the oldest of a step's preemptions) resumes first.
    let mut preempted: Vec<Sequence> = Vec::new();
    loop {
        {
            let mut state = inbox.lock();
            while state.queue.is_empty()
                && running.is_empty()
                && preempted.is_empty()
                && !state.shutdown
            {
                state = inbox.wait(state);
            }
            if state.shutdown {
                break;
            }
            drop_cancelled_queued(&mut state);
            let max_running = options.max_running;
            admit(
                &mut state,
                &mut preempted,
                &mut running,
                &mut pool,
                max_running,
            );
        }
        // Requests that end in this iteration hear it once the stats say so.
        let mut ended = Vec::new();
        drop_cancelled(&mut running, &mut pool, &mut ended);
        drop_cancelled(&mut preempted, &mut pool, &mut ended);
        let preemptions = make_room(&mut running, &mut preempted, &mut pool);
        let plan = schedule::plan(
            &running.iter().map(Sequence::demand).collect::<Vec<_>>(),
            options.max_step_rows,
        );
        let mut rows = 0;
        let mut tokens = 0;
        let started = Instant::now();
        if !plan.is_empty() {
            rows = plan.iter().map(|s| s.rows).sum::<usize>();
            match run_step(
                backend,
                w,
                &mut buf,
                &pool,
                &mut running,
                &plan,
                &mut graphs,
            ) {
                Ok(chosen) => tokens = hand_out(&mut running, &plan, chosen, &mut pool),
                Err(e) => fail_all(&mut running, &mut pool, &mut ended, &e),
            }
        }
        finish_ended(&mut running, &mut pool, &mut ended);
        account(&buf);
        let mut state = inbox.lock();
        state.stats.queued = state.queue.len() + preempted.len();
        let stats = &mut state.stats;
        stats.running = running.len();
        stats.pages_used = pool.pages() - pool.free_pages();
        stats.cached_pages = pool.cached_pages();
        if !plan.is_empty() {
            let ms = started.elapsed().as_secs_f64() * 1e3;
            stats.steps += 1;
            stats.step_ms_sum += ms;
            for (count, _) in stats
                .step_ms_buckets
                .iter_mut()
                .zip(STEP_MS_BOUNDS)
                .filter(|(_, bound)| ms <= *bound)
            {
                *count += 1;
            }
        }
        stats.rows += rows as u64;
        stats.tokens += tokens as u64;
        stats.preemptions += preemptions as u64;
        for end in &ended {
            state.live.remove(&end.id);
        }
        drop(state);
        for end in ended {
            let _ = end.events.send(end.event);
        }
    }
    // Shutdown: every request still queued or running ends as cancelled.
    let mut state = inbox.lock();
    for q in std::mem::take(&mut state.queue) {
        state.live.remove(&q.id);
        let _ = q.events.send(Event::Failed(Error::Cancelled));
    }
    for seq in running.into_iter().chain(preempted) {
        state.live.remove(&seq.queued.id);
        seq.send(Event::Failed(Error::Cancelled));
    }
    state.stats.queued = 0;
    state.stats.running = 0;
    drop(state);
    shared.session_bytes.fetch_sub(accounted, Ordering::Relaxed);
}

/// End the cancelled requests of the queue.
fn drop_cancelled_queued(state: &mut State) {
    let State { queue, live, .. } = state;
    queue.retain(|q| {
        let cancelled = q.cancel.load(Ordering::Acquire);
        if cancelled {
            let _ = q.events.send(Event::Failed(Error::Cancelled));
            live.remove(&q.id);
        }
        !cancelled
    });
}

/// A request that ended in this iteration, and its last event.
struct Ended {
    id: u64,
    events: mpsc::Sender<Event>,
    event: Event,
}

impl Sequence {
    /// This sequence ends with `event`; its pages go back to the pool.
    fn end(mut self, pool: &mut PagePool, event: Event) -> Ended {
        pool.release(&mut self.pages);
        Ended {
            id: self.queued.id,
            events: self.queued.events,
            event,
        }
    }
}

/// End the cancelled running requests (and those whose receiver is gone, found when a token
/// could not be delivered).
fn drop_cancelled(running: &mut Vec<Sequence>, pool: &mut PagePool, ended: &mut Vec<Ended>) {
    let (cancelled, kept): (Vec<_>, Vec<_>) = std::mem::take(running)
        .into_iter()
        .partition(|seq| seq.queued.cancel.load(Ordering::Acquire));
    *running = kept;
    ended.extend(
        cancelled
            .into_iter()
            .map(|seq| seq.end(pool, Event::Failed(Error::Cancelled))),
    );
}

/// Admit preempted sequences first, then queued requests oldest first, while a place is free
/// and the pool has the pages of the prompt (decode pages are taken as the sequence grows,
/// [`make_room`]). A sequence takes the cached pages of its prompt's prefix (all but its last
/// token, which must run to give the next token's logits) and starts after them.
fn admit(
    state: &mut State,
    preempted: &mut Vec<Sequence>,
    running: &mut Vec<Sequence>,
    pool: &mut PagePool,
    max_running: usize,
) {
    while running.len() < max_running {
        let mut seq = match preempted.pop() {
            Some(seq) => seq,
            None => match state.queue.pop_front() {
                Some(queued) => Sequence::new(queued),
                None => break,
            },
        };
        if !take_prompt_pages(&mut seq, pool) {
            // Not yet: it keeps its place at the front.
            if seq.admitted.is_none() {
                state.queue.push_front(seq.queued);
            } else {
                preempted.push(seq);
            }
            break;
        }
        running.push(seq);
    }
    state.stats.queued = state.queue.len() + preempted.len();
}

/// The pages of `seq`'s prompt: the cached ones of its prefix, then new ones; false (and
/// nothing held) when the pool cannot give them.
fn take_prompt_pages(seq: &mut Sequence, pool: &mut PagePool) -> bool {
    let (prompt, loops) = (&seq.prompt, seq.queued.request.loops);
    let page = pool.page_size();
    let mut pages = Vec::new();
    for end in (page..prompt.len()).step_by(page) {
        match pool.share(&(loops, prompt[..end].to_vec())) {
            Some(p) => pages.push(p),
            None => break,
        }
    }
    let shared = pages.len() * page;
    if !pool.grow(&mut pages, prompt.len()) {
        pool.release(&mut pages);
        return false;
    }
    if seq.admitted.is_none() {
        seq.cached = shared;
        seq.admitted = Some(Instant::now());
    }
    (seq.pages, seq.fed) = (pages, shared);
    true
}

/// Give every running sequence the pages of the positions its next step writes, oldest first;
/// when the pool has none left, the newest sequences give theirs up (they run again later,
/// before any new request). Returns how many were preempted.
fn make_room(
    running: &mut Vec<Sequence>,
    preempted: &mut Vec<Sequence>,
    pool: &mut PagePool,
) -> usize {
    let mut count = 0;
    let mut i = 0;
    while i < running.len() {
        let end = running[i].next_end();
        if pool.grow(&mut running[i].pages, end) {
            i += 1;
            continue;
        }
        // The newest gives way (possibly the sequence itself).
        if let Some(mut newest) = running.pop() {
            newest.preempt(pool);
            preempted.push(newest);
            count += 1;
        }
    }
    count
}

/// Register the pages that `seq`'s last step filled with prompt tokens, for later requests
/// with the same prefix.
fn register_prompt_pages(seq: &Sequence, before: usize, pool: &mut PagePool) {
    let page = pool.page_size();
    let prompt = &seq.prompt;
    let full = seq.fed.min(prompt.len()) / page;
    for k in before / page..full {
        let key = (seq.queued.request.loops, prompt[..(k + 1) * page].to_vec());
        pool.register(seq.pages[k], key);
    }
}

/// The ids of the decode steps' graphs, one per distinct (rows' loop counts, backend's key of
/// the places) pair, at most [`GraphKeys::MAX`] of them (then every graph is dropped and ids
/// start again).
#[derive(Default)]
struct GraphKeys {
    ids: HashMap<(Vec<usize>, u64), u64>,
}

impl GraphKeys {
    const MAX: usize = 64;

    fn id(&mut self, loops: &[usize], places: u64) -> u64 {
        let next = self.ids.len() as u64;
        *self.ids.entry((loops.to_vec(), places)).or_insert(next)
    }

    /// Make room for a new id, dropping the graphs when the ids are used up.
    fn make_room<B: Backend>(&mut self, backend: &B, buf: &mut Buffers<B>) {
        if self.ids.len() >= Self::MAX {
            self.ids.clear();
            buf.reset_graphs(backend);
        }
    }
}

/// Run the planned step; returns the token chosen for each segment that produces one (a decode
/// row, or a prompt's last row), by segment, in plan order. Greedy rows take the argmax on the
/// device; a sampled row's logits come to the host, where its request's draw picks the token. A
/// step of decode rows only is one graph per shape ([`pooled_decode_step`]).
fn run_step<B: Backend>(
    backend: &B,
    w: &Weights<B>,
    buf: &mut Buffers<B>,
    pool: &PagePool,
    running: &mut [Sequence],
    plan: &[Segment],
    graphs: &mut GraphKeys,
) -> Result<Vec<Option<u32>>> {
    let step = step_rows(running, plan);
    let places = PooledRows {
        page_size: pool.page_size(),
        rows: &step.places,
    };
    let decode_only = plan.iter().all(|s| s.decode);
    if decode_only {
        graphs.make_room(backend, buf);
        let key = |places: u64| graphs.id(&step.loops, places);
        pooled_decode_step(backend, w, buf, &step.tokens, places, &step.loops, key)?;
    } else {
        stage_pooled(backend, w, buf, &step.tokens, places, &step.loops)?;
        let span = Span::all(step.loops[0]);
        run_rows(backend, w, buf, Rows::Deepest(&step.loops), span, None)?;
        final_norm(backend, w, buf, step.tokens.len());
    }
    let rows = step.tokens.len();
    drop(step);
    let last_row = |s: &Segment| {
        let seq = &running[s.sequence];
        let prompt_done = seq.fed + s.rows == seq.prompt.len();
        (s.decode || prompt_done).then_some(s.first_row + s.rows - 1)
    };
    let wanted: Vec<Option<usize>> = plan.iter().map(last_row).collect();
    // Each producing segment's choice, drawn in plan order.
    let choices: Vec<(usize, Choice)> = plan
        .iter()
        .zip(&wanted)
        .filter_map(|(s, row)| {
            let seq = &mut running[s.sequence];
            row.map(|row| (row, next_choice(&seq.queued.request.sampling, &mut seq.rng)))
        })
        .collect();
    let vocab = w.config.vocab_size;
    let mut tokens = Vec::with_capacity(choices.len());
    if decode_only {
        // Row r's logits are logits row r, their argmax the step's row r.
        let greedy = chosen_rows(backend, buf, rows)?;
        for &(row, choice) in &choices {
            tokens.push(choose(backend, buf, &greedy, row, &choice, vocab)?);
        }
    }
    // Otherwise runs of consecutive rows share a head call.
    let mut i = 0;
    while !decode_only && i < choices.len() {
        let first = choices[i].0;
        let mut n = 1;
        while i + n < choices.len() && n < buf.logit_rows && choices[i + n].0 == first + n {
            n += 1;
        }
        logits(backend, w, buf, first, n);
        let greedy = argmax_rows(backend, w, buf, n)?;
        for (k, (_, choice)) in choices[i..i + n].iter().enumerate() {
            tokens.push(choose(backend, buf, &greedy, k, choice, vocab)?);
        }
        i += n;
    }
    let mut tokens = tokens.into_iter();
    Ok(wanted
        .iter()
        .map(|r| r.and_then(|_| tokens.next()))
        .collect())
}

/// The token of logits row `row`, whose argmax is `greedy[row]`.
fn choose<B: Backend>(
    backend: &B,
    buf: &Buffers<B>,
    greedy: &[u32],
    row: usize,
    choice: &Choice,
    vocab: usize,
) -> Result<u32> {
    Ok(match choice {
        Choice::Greedy => greedy[row],
        sample => {
            let logits = backend.read_float(&buf.logits, row * vocab, vocab)?;
            choose_on_host(&logits, sample)
        }
    })
}

/// Advance every planned sequence past its rows and hand out the token the step chose for it,
/// if any; returns the tokens handed out.
fn hand_out(
    running: &mut [Sequence],
    plan: &[Segment],
    chosen: Vec<Option<u32>>,
    pool: &mut PagePool,
) -> usize {
    let mut handed = 0;
    for (s, token) in plan.iter().zip(chosen) {
        let seq = &mut running[s.sequence];
        let before = seq.fed;
        seq.fed += s.rows;
        register_prompt_pages(seq, before, pool);
        let Some(token) = token else {
            continue;
        };
        seq.first_token.get_or_insert_with(Instant::now);
        if seq.queued.request.stop_tokens.contains(&token) {
            seq.finish = Some(Finish::Stop);
            continue;
        }
        seq.output.push(token);
        handed += 1;
        if !seq.send(Event::Token(token)) {
            seq.queued.cancel.store(true, Ordering::Release);
        }
        seq.next = Some(token);
        if seq.output.len() == seq.queued.request.max_tokens {
            seq.finish = Some(Finish::Length);
        }
    }
    handed
}

/// End the sequences that have produced all they may.
fn finish_ended(running: &mut Vec<Sequence>, pool: &mut PagePool, ended: &mut Vec<Ended>) {
    let (finished, kept): (Vec<_>, Vec<_>) = std::mem::take(running)
        .into_iter()
        .partition(|seq| seq.finish.is_some());
    *running = kept;
    for seq in finished {
        let stats = seq.stats(seq.finish.unwrap_or(Finish::Length));
        ended.push(seq.end(pool, Event::Done(stats)));
    }
}

/// A step failed: every running request ends with its error.
fn fail_all(running: &mut Vec<Sequence>, pool: &mut PagePool, ended: &mut Vec<Ended>, e: &Error) {
    for seq in running.drain(..) {
        ended.push(seq.end(pool, Event::Failed(copy_error(e))));
    }
}

/// The same failure, for each request it ended.
fn copy_error(e: &Error) -> Error {
    match e {
        Error::InvalidArgument(m) => Error::InvalidArgument(m.clone()),
        Error::OutOfMemory { bytes, what } => Error::OutOfMemory {
            bytes: *bytes,
            what: what.clone(),
        },
        Error::Cancelled => Error::Cancelled,
        other => Error::Device(other.to_string()),
    }
}
