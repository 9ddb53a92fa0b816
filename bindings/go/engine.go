package tinyloop

// #include <stdint.h>
// #include <stdlib.h>
// #include "tinyloop.h"
import "C"

import (
	"context"
	"fmt"
	"runtime"
	"unsafe"
)

// EngineOptions size an Engine. Start from DefaultEngineOptions().
type EngineOptions struct {
	MaxStepRows   int    // rows one step runs at most (decode rows and prompt chunks together)
	MaxRunning    int    // requests that run at once; more wait in the queue
	PageSize      int    // positions per KV page
	MaxQueued     int    // requests waiting at most; Submit beyond it fails with ErrBusy
	PoolPositions uint64 // positions of the KV pool (whole pages); 0: 8 × max_seq_len
}

// DefaultEngineOptions returns the library's defaults (tl_engine_default_params).
func DefaultEngineOptions() EngineOptions {
	var p C.tl_engine_params
	C.tl_engine_default_params(&p)
	return EngineOptions{
		MaxStepRows:   int(p.max_step_rows),
		MaxRunning:    int(p.max_running),
		PageSize:      int(p.page_size),
		MaxQueued:     int(p.max_queued),
		PoolPositions: uint64(p.pool_positions),
	}
}

// Engine serves many concurrent requests of one model, batched at every step (continuous
// batching; docs/ABI.md "Engines"): each request's tokens are those Model.Generate gives it
// alone. Safe to share between goroutines. CPU models only, KV modes fp16, int8 and delta.
type Engine struct {
	h   *handle
	ptr *C.tl_engine
}

// RequestStats say what a finished request did.
type RequestStats struct {
	PromptTokens int
	CachedTokens int // prompt tokens taken from cached pages of an earlier request's prefix
	Tokens       int
	Finish       string // "length" or "stop"
	QueueMS      float64
	FirstTokenMS float64
	TotalMS      float64
}

// EngineStats are an engine's queue, running requests, KV pool use and step counts.
type EngineStats struct {
	Queued, Running, PoolPages, PagesUsed, CachedPages, PageSize, Steps, Rows, Tokens, Preemptions uint64
}

// Request is a submitted request. Its tokens arrive on Tokens, which is closed when the
// request ends; Wait then gives its statistics, or the error that ended it (ErrCancelled after
// Engine.Cancel, the cancellation of Submit's context, or Engine.Close).
type Request struct {
	ID     uint64
	Tokens <-chan int32
	done   chan struct{}
	stats  RequestStats
	err    error
}

// Wait blocks until the request has ended (reading any tokens not yet read is not needed).
func (r *Request) Wait() (RequestStats, error) {
	<-r.done
	return r.stats, r.err
}

// NewEngine starts an engine over m (opts == nil: defaults). The engine keeps the weights alive
// until it is closed, also after m.Close().
func NewEngine(m *Model, opts *EngineOptions) (*Engine, error) {
	if err := m.h.enter("NewEngine"); err != nil {
		return nil, err
	}
	defer m.h.mu.RUnlock()
	var p C.tl_engine_params
	C.tl_engine_default_params(&p)
	if opts != nil {
		for name, v := range map[string]int{"MaxStepRows": opts.MaxStepRows, "MaxRunning": opts.MaxRunning, "PageSize": opts.PageSize, "MaxQueued": opts.MaxQueued} {
			if v < 0 || v > 1<<32-1 {
				return nil, invalid("NewEngine: %s %d out of range", name, v)
			}
		}
		p.max_step_rows = C.uint32_t(opts.MaxStepRows)
		p.max_running = C.uint32_t(opts.MaxRunning)
		p.page_size = C.uint32_t(opts.PageSize)
		p.max_queued = C.uint32_t(opts.MaxQueued)
		p.pool_positions = C.uint64_t(opts.PoolPositions)
	}
	var ptr *C.tl_engine
	if err := call("NewEngine", "engine", func() C.enum_tl_status { return C.tl_engine_new(m.ptr, &p, &ptr) }); err != nil {
		return nil, err
	}
	e := &Engine{h: &handle{what: "engine"}, ptr: ptr}
	runtime.SetFinalizer(e, func(e *Engine) { _ = e.Close() })
	return e, nil
}

// Submit queues a request (opts as for Model.Generate; nil: defaults) and returns at once; its
// tokens arrive on the returned Request's channel. Cancelling ctx cancels the request.
func (e *Engine) Submit(ctx context.Context, tokens []int32, opts *GenerateOptions) (*Request, error) {
	if err := e.h.enter("Submit"); err != nil {
		return nil, err
	}
	defer e.h.mu.RUnlock()
	p, release, err := cParams(opts, "Submit")
	if err != nil {
		return nil, err
	}
	defer release()
	tok := cTokens(tokens)
	defer C.free(unsafe.Pointer(tok))
	var id C.uint64_t
	if err := call("Submit", "engine", func() C.enum_tl_status {
		return C.tl_engine_submit(e.ptr, tok, C.size_t(len(tokens)), &p, &id)
	}); err != nil {
		return nil, err
	}
	out := make(chan int32, 64)
	r := &Request{ID: uint64(id), Tokens: out, done: make(chan struct{})}
	go e.follow(ctx, r, out)
	return r, nil
}

// follow takes the request's events until it ends.
func (e *Engine) follow(ctx context.Context, r *Request, out chan<- int32) {
	defer close(r.done)
	defer close(out)
	stop := watch(ctx, func() { _ = e.Cancel(r.ID) })
	defer stop()
	for {
		event, err := e.next(r.ID)
		if err != nil {
			r.err = cancelledByCtx(ctx, err)
			return
		}
		switch event.kind {
		case C.TL_EVENT_TOKEN:
			out <- int32(event.token)
		case C.TL_EVENT_DONE:
			s := event.stats
			finish := "length"
			if s.finish == C.TL_FINISH_STOP {
				finish = "stop"
			}
			r.stats = RequestStats{
				PromptTokens: int(s.prompt_tokens),
				CachedTokens: int(s.cached_tokens),
				Tokens:       int(s.tokens),
				Finish:       finish,
				QueueMS:      float64(s.queue_ms),
				FirstTokenMS: float64(s.first_token_ms),
				TotalMS:      float64(s.total_ms),
			}
			return
		}
	}
}

// next waits for the next event of request id.
func (e *Engine) next(id uint64) (C.tl_engine_event, error) {
	var event C.tl_engine_event
	if err := e.h.enter("Submit"); err != nil {
		return event, &Error{Status: StatusCancelled, Message: fmt.Sprintf(
			"request %d was cancelled: its engine was closed", id)}
	}
	defer e.h.mu.RUnlock()
	err := call("Submit", "engine", func() C.enum_tl_status {
		return C.tl_engine_next(e.ptr, C.uint64_t(id), -1, &event)
	})
	return event, err
}

// Cancel cancels request id: its Wait then returns ErrCancelled. A request that has ended is
// ErrInvalidArgument.
func (e *Engine) Cancel(id uint64) error {
	if err := e.h.enter("Cancel"); err != nil {
		return err
	}
	defer e.h.mu.RUnlock()
	return call("Cancel", "engine", func() C.enum_tl_status { return C.tl_engine_cancel(e.ptr, C.uint64_t(id)) })
}

// Stats returns the engine's queue, running requests, KV pool use and step counts now.
func (e *Engine) Stats() (EngineStats, error) {
	if err := e.h.enter("Stats"); err != nil {
		return EngineStats{}, err
	}
	defer e.h.mu.RUnlock()
	var s C.tl_engine_stats
	err := call("Stats", "engine", func() C.enum_tl_status { return C.tl_engine_get_stats(e.ptr, &s) })
	return EngineStats{
		Queued: uint64(s.queued), Running: uint64(s.running), PoolPages: uint64(s.pool_pages),
		PagesUsed: uint64(s.pages_used), CachedPages: uint64(s.cached_pages),
		PageSize: uint64(s.page_size), Steps: uint64(s.steps),
		Rows: uint64(s.rows), Tokens: uint64(s.tokens), Preemptions: uint64(s.preemptions),
	}, err
}

// Close stops the engine: queued and running requests end with ErrCancelled. Idempotent and
// safe from any goroutine.
func (e *Engine) Close() error {
	return e.h.close(func() C.enum_tl_status {
		C.tl_engine_free(e.ptr)
		return C.TL_OK
	}, func() {})
}
