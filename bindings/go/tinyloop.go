// Package tinyloop is the Go binding of libtinyloop, an inference runtime for looped
// (weight-shared) transformers. It wraps the C ABI of include/tinyloop.h (see docs/ABI.md).
//
// Linking: through pkg-config (`#cgo pkg-config: tinyloop`), so install the library first:
// `scripts/install PREFIX` in the repository, then PKG_CONFIG_PATH=PREFIX/lib/pkgconfig unless
// PREFIX is a system one. The flags it gives record PREFIX/lib as the program's run-time search
// path.
//
// Threads: a Model is a set of weights plus a default session, safe to share between
// goroutines; one call at a time runs on the default session (a concurrent one fails with
// ErrBusy). For concurrency, give each goroutine its own Session (Model.NewSession); sessions
// share the model's weights. Close may be called from any goroutine, at any time, repeatedly.
package tinyloop

/*
#cgo pkg-config: tinyloop
#include <stdint.h>
#include <stdlib.h>
#include "tinyloop.h"

extern _Bool goTinyloopToken(int32_t token, uintptr_t handle);

static bool tinyloop_trampoline(int32_t token, void *user_data) {
	return goTinyloopToken(token, (uintptr_t)user_data);
}

static enum tl_status tinyloop_model_stream(const tl_model *m, const int32_t *tokens, size_t n,
                                       const tl_generate_params *p, uintptr_t handle) {
	return tl_generate_stream(m, tokens, n, p, tinyloop_trampoline, (void *)handle);
}

static enum tl_status tinyloop_session_stream(const tl_session *s, const int32_t *tokens, size_t n,
                                         const tl_generate_params *p, uintptr_t handle) {
	return tl_session_generate_stream(s, tokens, n, p, tinyloop_trampoline, (void *)handle);
}
*/
import "C"

import (
	"context"
	"fmt"
	"runtime"
	"runtime/cgo"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"
)

// ABIVersion is the C ABI version this package was written against (TL_ABI_VERSION).
const ABIVersion = 1

// LoopsDefault selects the model's default_loops (TL_LOOPS_DEFAULT).
const LoopsDefault = -1

// LibraryABIVersion is the ABI version of the linked library (tl_abi_version()).
func LibraryABIVersion() int { return int(C.tl_abi_version()) }

var (
	abiOnce sync.Once
	abiErr  error
)

// checkABI runs before every Open and call: a library of another ABI version is refused.
func checkABI() error {
	abiOnce.Do(func() {
		if v := LibraryABIVersion(); v != ABIVersion {
			abiErr = &Error{Status: StatusInvalidArgument, Message: fmt.Sprintf(
				"libtinyloop implements C ABI version %d, this package needs %d", v, ABIVersion)}
		}
	})
	return abiErr
}

// Options configure Open. Start from DefaultOptions(); Open(path, nil) uses the defaults.
type Options struct {
	MaxSeqLen    int    // upper bound on prompt + generated tokens; 0: 2048, or MaxPosition if smaller
	PrefillChunk int    // > 0: chunked prefill and a cap on score lengths; 0: off
	Device       string // "auto", "cpu", "cuda", "cuda:N"; "" uses TINYLOOP_DEVICE or auto
	MaxLoops     int    // the largest loops a call may ask for; > 0
	// KVMode is the KV cache mode: "fp16", "fp16-h", "int8-h", "int4-h", "int8", "delta",
	// "age" or "age:A:B"; "" uses TINYLOOP_KV_INT8 / TINYLOOP_KV_DELTA, else fp16.
	KVMode string
	Log    bool // print the load log on stderr
	// FP16Body 1 keeps an FP16 copy of the transformer blocks' quantized weights on the GPU for
	// prefill GEMMs through cuBLAS (more memory; weights rounded to f16 on that path), 0 does
	// not, -1 (the default) follows TINYLOOP_EXPERIMENTAL_FP16_BODY=1. No effect on the CPU.
	FP16Body int
	// StateInit is how a model whose loop starts from a random state (Huginn) draws it:
	// "model" (its own rule, from seed 0; also ""), "zeros" or "seed:N". Other models accept
	// only "model".
	StateInit string
}

// DefaultOptions returns the library's defaults (tl_model_default_params).
func DefaultOptions() Options {
	var p C.tl_model_params
	C.tl_model_default_params(&p)
	return Options{
		MaxSeqLen:    int(p.max_seq_len),
		PrefillChunk: int(p.prefill_chunk),
		MaxLoops:     int(p.max_loops),
		Log:          bool(p.log),
		FP16Body:     int(p.fp16_body),
	}
}

// GenerateOptions configure one generation call. Start from DefaultGenerateOptions();
// a nil *GenerateOptions means the defaults (greedy, 128 tokens, default loops).
type GenerateOptions struct {
	MaxTokens   int     // >= 1; the number of tokens generated at most
	Loops       int     // 1..MaxLoops, or LoopsDefault
	Temperature float32 // 0: greedy
	TopK        int     // 0: all tokens
	TopP        float32 // (0, 1]
	Seed        uint64  // sampler seed; the same seed and inputs give the same tokens
	Stop        []int32 // generation ends at any of these (not returned)
	// PrefixCache, when set (BuildPrefixCache, at the same loops), is generated after: the same
	// tokens as generating from its prefix followed by the prompt. Generate and GenerateStream
	// only.
	PrefixCache *PrefixCache
	// CtxTier, when set, is the call's CTX-TIER policy (nil: the TINYLOOP_CTX_TIER*
	// environment's policy when the model was opened, or no tiers).
	CtxTier *CtxTier
	// BetaMonitor, when set, BETA-MONitors the call with these thresholds (start from
	// DefaultBetaMonitor()); the summary is then GenerateStats.BetaMon. nil: monitored only when
	// the environment says so (TINYLOOP_BETA_MONITOR=1).
	BetaMonitor *BetaMonitor
	// Adaptive exit (docs/ABI.md "Adaptive exit"): ExitThreshold, in [0, 1], or Exit ("gate":
	// the model's own threshold, or "gate:T"; not both) takes each token from the first loop
	// iteration whose cumulative exit probability reaches the threshold, on a model with an
	// exit gate (Ouro). Exit also takes Huginn's criteria, on any model: "entropy-diff",
	// "latent-diff", "cosine", "kl", "minp-kl" (each optionally ":T") and "argmax-stability"
	// or "argmax" (optionally ":N"), which stop each call at the first iteration where they
	// fire. nil and "": no exit rule. ExitPolicy "reference" (also "": the model's own code's
	// semantics) or "skip" (generated tokens stop at their exit iteration and copy its KV into
	// the slots they skip). Generate, GenerateStream, GenerateText, GenerateTextStream and
	// ScoreExit only.
	ExitThreshold *float64
	Exit          string
	ExitPolicy    string
}

// CtxTier is a CTX-TIER policy: the loop body is re-packed to INT2 once the sequence reaches
// LongT tokens, and back to INT4 on a call whose first step is below ShortT. Start from
// DefaultCtxTier().
type CtxTier struct {
	ShortT   int    // >= 1
	LongT    int    // >= ShortT
	LongBits int    // 2 (the only narrower encoding)
	Verbose  bool   // add every transition to the summary on stderr
	File     string // receives the call's summary as JSON ("": none)
}

// DefaultCtxTier returns the library's defaults (tl_ctx_tier_default_params).
func DefaultCtxTier() CtxTier {
	var p C.tl_ctx_tier_params
	C.tl_ctx_tier_default_params(&p)
	return CtxTier{ShortT: int(p.short_t), LongT: int(p.long_t), LongBits: int(p.long_bits)}
}

// cCtxTier converts a policy to C memory (the params struct that points to it lives in Go
// memory, so it must not point to Go memory); free it with freeCtxTier.
func cCtxTier(t *CtxTier) (*C.tl_ctx_tier_params, error) {
	for _, v := range []struct {
		name  string
		value int
	}{{"ShortT", t.ShortT}, {"LongT", t.LongT}, {"LongBits", t.LongBits}} {
		if v.value < 0 || v.value > 1<<32-1 {
			return nil, invalid("CtxTier.%s %d out of range", v.name, v.value)
		}
	}
	p := (*C.tl_ctx_tier_params)(C.malloc(C.size_t(unsafe.Sizeof(C.tl_ctx_tier_params{}))))
	C.tl_ctx_tier_default_params(p)
	p.short_t = C.uint32_t(t.ShortT)
	p.long_t = C.uint32_t(t.LongT)
	p.long_bits = C.uint32_t(t.LongBits)
	p.verbose = C.bool(t.Verbose)
	if t.File != "" {
		p.file = C.CString(t.File)
	}
	return p, nil
}

func freeCtxTier(p *C.tl_ctx_tier_params) {
	if p != nil {
		C.free(unsafe.Pointer(p.file))
		C.free(unsafe.Pointer(p))
	}
}

// BetaMonitor holds the thresholds of a BETA-MONitored call (docs/ABI.md "BETA-MON").
type BetaMonitor struct {
	LowEntropyBits  float64 // entropies below this count in LowRate (finite, >= 0)
	HighEntropyBits float64 // entropies above this count in HighRate (finite, >= LowEntropyBits)
	AgreementFloor  float64 // speculative calls: an agreement below this is flagged ([0, 1])
}

// DefaultBetaMonitor returns the library's default thresholds (0.5 bits, 6 bits, 0.95).
func DefaultBetaMonitor() BetaMonitor {
	var p C.tl_generate_params
	C.tl_generate_default_params(&p)
	return BetaMonitor{
		LowEntropyBits:  float64(p.beta_mon_low_entropy_bits),
		HighEntropyBits: float64(p.beta_mon_high_entropy_bits),
		AgreementFloor:  float64(p.beta_mon_agreement_floor),
	}
}

// DefaultGenerateOptions returns the library's defaults (tl_generate_default_params).
func DefaultGenerateOptions() GenerateOptions {
	var p C.tl_generate_params
	C.tl_generate_default_params(&p)
	return GenerateOptions{
		MaxTokens:   int(p.max_tokens),
		Loops:       int(p.loops),
		Temperature: float32(p.temperature),
		TopK:        int(p.top_k),
		TopP:        float32(p.top_p),
		Seed:        uint64(p.seed),
	}
}

// Config is the static architecture of a model plus the options it was opened with.
type Config struct {
	Dim, NHeads, NKVHeads, FFNDim, VocabSize, EmbedFactorDim int
	NPreBlocks, NLoopBlocks, NPostBlocks, DefaultLoops       int
	Norm                                                     string // "rmsnorm" | "layernorm"
	NormEps, RopeTheta                                       float64
	MaxPosition                                              int
	Head                                                     string // "untied" | "tied"
	MaxSeqLen, PrefillChunk, MaxLoops                        int
}

// handle guards a C pointer shared by goroutines: calls hold the read lock; Close marks the
// handle closed, releases native resources, then takes the write lock to free the pointer.
type handle struct {
	mu      sync.RWMutex
	closeMu sync.Mutex
	closed  atomic.Bool
	what    string
}

// enter starts a call named method; the caller must call h.mu.RUnlock() when done.
func (h *handle) enter(method string) error {
	if err := checkABI(); err != nil {
		return err
	}
	h.mu.RLock()
	if h.closed.Load() {
		h.mu.RUnlock()
		return closedError(method, h.what)
	}
	return nil
}

func closedError(method, what string) error {
	return &Error{Status: StatusClosed, Message: fmt.Sprintf(
		"%s called on a closed %s; construct a new one", method, what)}
}

// lastError turns a status into an error, reading the thread-local message. The caller must
// be locked to its OS thread across the C call and this read.
func lastError(st C.enum_tl_status, method, what string) error {
	if st == C.TL_OK {
		return nil
	}
	if Status(st) == StatusClosed {
		return closedError(method, what)
	}
	return &Error{Status: Status(st), Message: C.GoString(C.tl_last_error_message())}
}

// call runs f (one C call) on a locked OS thread and converts its status.
func call(method, what string, f func() C.enum_tl_status) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	return lastError(f(), method, what)
}

// cToken copies Go tokens into a C array (NULL for none); free with C.free.
func cTokens(tokens []int32) *C.int32_t {
	if len(tokens) == 0 {
		return nil
	}
	p := (*C.int32_t)(C.malloc(C.size_t(len(tokens)) * C.size_t(unsafe.Sizeof(C.int32_t(0)))))
	copy(unsafe.Slice((*int32)(unsafe.Pointer(p)), len(tokens)), tokens)
	return p
}

// cParams converts options of a call named method to C; call the returned release function
// when the call is done (it frees the C memory the params point to).
func cParams(o *GenerateOptions, method string) (C.tl_generate_params, func(), error) {
	var p C.tl_generate_params
	C.tl_generate_default_params(&p)
	none := func() {}
	if o == nil {
		return p, none, nil
	}
	if o.MaxTokens < 0 || o.MaxTokens > 1<<32-1 {
		return p, none, invalid("MaxTokens %d out of range", o.MaxTokens)
	}
	if o.TopK < 0 || o.TopK > 1<<32-1 {
		return p, none, invalid("TopK %d out of range", o.TopK)
	}
	if o.Loops < -1<<31 || o.Loops > 1<<31-1 {
		return p, none, invalid("Loops %d out of range", o.Loops)
	}
	if t := o.ExitThreshold; t != nil {
		// The C ABI reads a negative threshold as none; here that is nil.
		if *t < 0 {
			return p, none, invalid("ExitThreshold %v must lie in [0, 1] (nil: no threshold)", *t)
		}
		p.exit_threshold = C.double(*t)
	}
	p.max_tokens = C.uint32_t(o.MaxTokens)
	p.loops = C.int32_t(o.Loops)
	p.temperature = C.float(o.Temperature)
	p.top_k = C.uint32_t(o.TopK)
	p.top_p = C.float(o.TopP)
	p.seed = C.uint64_t(o.Seed)
	if o.PrefixCache != nil {
		cache, err := o.PrefixCache.get(method)
		if err != nil {
			return p, none, err
		}
		p.prefix_cache = (*C.tl_prefix_cache)(cache)
	}
	if o.CtxTier != nil {
		tier, err := cCtxTier(o.CtxTier)
		if err != nil {
			return p, none, err
		}
		p.ctx_tier = tier
	}
	if b := o.BetaMonitor; b != nil {
		p.beta_monitor = true
		p.beta_mon_low_entropy_bits = C.double(b.LowEntropyBits)
		p.beta_mon_high_entropy_bits = C.double(b.HighEntropyBits)
		p.beta_mon_agreement_floor = C.double(b.AgreementFloor)
	}
	// The params struct lives in Go memory, so the stop array must be C memory (cgo rules).
	stop := cTokens(o.Stop)
	p.stop_tokens = stop
	p.n_stop_tokens = C.size_t(len(o.Stop))
	release := func() {
		C.free(unsafe.Pointer(stop))
		freeCtxTier(p.ctx_tier)
		C.free(unsafe.Pointer(p.exit))
		C.free(unsafe.Pointer(p.exit_policy))
	}
	var err error
	if p.exit, err = cOptional(o.Exit, "GenerateOptions.Exit"); err == nil {
		p.exit_policy, err = cOptional(o.ExitPolicy, "GenerateOptions.ExitPolicy")
	}
	return p, release, err
}

// cOptional is s as C memory, or NULL for "" (free with C.free).
func cOptional(s, what string) (*C.char, error) {
	if s == "" {
		return nil, nil
	}
	return cString(s, what)
}

func invalid(format string, args ...interface{}) error {
	return &Error{Status: StatusInvalidArgument, Message: fmt.Sprintf(format, args...)}
}

// tokensPtr is a pointer to the first token, or nil for an empty slice (the library rejects
// an empty prompt with StatusInvalidArgument).
func tokensPtr(tokens []int32) *C.int32_t {
	if len(tokens) == 0 {
		return nil
	}
	return (*C.int32_t)(unsafe.Pointer(&tokens[0]))
}

// watch calls cancel once ctx is done, and keeps calling it every millisecond until stopped
// (a cancel that lands just before the C call starts would otherwise be reset by it).
func watch(ctx context.Context, cancel func()) (stop func()) {
	if ctx.Done() == nil {
		return func() {}
	}
	done := make(chan struct{})
	finished := make(chan struct{})
	go func() {
		defer close(finished)
		select {
		case <-done:
			return
		case <-ctx.Done():
		}
		ticker := time.NewTicker(time.Millisecond)
		defer ticker.Stop()
		for {
			cancel()
			select {
			case <-done:
				return
			case <-ticker.C:
			}
		}
	}()
	return func() {
		close(done)
		<-finished
	}
}

// cancelledByCtx wraps a cancellation caused by ctx so that errors.Is matches both
// ErrCancelled and ctx.Err().
func cancelledByCtx(ctx context.Context, err error) error {
	if ctx.Err() == nil {
		return err
	}
	msg := "cancelled: " + ctx.Err().Error()
	if e, ok := err.(*Error); ok && e.Message != "" {
		msg = e.Message + " (" + ctx.Err().Error() + ")"
	}
	return &Error{Status: StatusCancelled, Message: msg, cause: ctx.Err()}
}

// runner holds the calls shared by Model (its default session) and Session.
type runner struct {
	h *handle
	// The handle the calls run on: a model (its default session) or, when model is nil, a
	// session.
	model    *C.tl_model
	session  *C.tl_session
	generate func(tok *C.int32_t, n C.size_t, p *C.tl_generate_params, out *C.int32_t, outCap C.size_t, outLen *C.size_t) C.enum_tl_status
	stream   func(tok *C.int32_t, n C.size_t, p *C.tl_generate_params, handle C.uintptr_t) C.enum_tl_status
	scoreFn  func(kind int, tok *C.int32_t, n C.size_t, loops C.int32_t, out *C.float, outCap C.size_t, outLen *C.size_t) C.enum_tl_status
	cancelFn func() C.enum_tl_status
}

const (
	scoreLast = iota
	scoreAll
	scoreLogprobs
	scoreLogprobsDecode
)

func (r *runner) doGenerate(ctx context.Context, tokens []int32, o *GenerateOptions) ([]int32, error) {
	return r.generateWith(ctx, "Generate", o, nil, func(p *C.tl_generate_params, out *C.int32_t, outCap C.size_t, n *C.size_t) C.enum_tl_status {
		return r.generate(tokensPtr(tokens), C.size_t(len(tokens)), p, out, outCap, n)
	})
}

func (r *runner) doStream(ctx context.Context, tokens []int32, o *GenerateOptions, fn func(int32) bool) error {
	if fn == nil {
		return invalid("GenerateStream: fn is nil")
	}
	if err := ctx.Err(); err != nil {
		return cancelledByCtx(ctx, &Error{Status: StatusCancelled})
	}
	p, release, err := cParams(o, "GenerateStream")
	defer release()
	if err != nil {
		return err
	}
	var cache *bound
	if o != nil && o.PrefixCache != nil {
		cache = &o.PrefixCache.bound
	}
	if err := r.h.enter("GenerateStream"); err != nil {
		return err
	}
	defer r.h.mu.RUnlock()
	state := &streamState{fn: fn, ctxDone: func() bool { return ctx.Err() != nil }}
	h := cgo.NewHandle(state)
	defer h.Delete()
	unwatch := watch(ctx, func() { r.cancelFn() })
	err = r.callBound("GenerateStream", cache, func() C.enum_tl_status {
		return r.stream(tokensPtr(tokens), C.size_t(len(tokens)), &p, C.uintptr_t(h))
	})
	unwatch()
	if state.panicked != nil {
		panic(state.panicked)
	}
	if err != nil {
		if e, ok := err.(*Error); ok && e.Status == StatusCancelled {
			return cancelledByCtx(ctx, err)
		}
		return err
	}
	if state.stopped {
		return cancelledByCtx(ctx, &Error{Status: StatusCancelled})
	}
	return nil
}

func (r *runner) doScore(method string, kind int, vocab int, tokens []int32, loops int) ([]float32, error) {
	if loops < -1<<31 || loops > 1<<31-1 {
		return nil, invalid("%s: loops %d out of range", method, loops)
	}
	size := vocab
	switch kind {
	case scoreAll:
		size = vocab * len(tokens)
	case scoreLogprobs, scoreLogprobsDecode:
		size = len(tokens) - 1
	}
	if size < 1 {
		size = 1
	}
	if err := r.h.enter(method); err != nil {
		return nil, err
	}
	defer r.h.mu.RUnlock()
	out := make([]float32, size)
	var n C.size_t
	err := call(method, r.h.what, func() C.enum_tl_status {
		return r.scoreFn(kind, tokensPtr(tokens), C.size_t(len(tokens)), C.int32_t(loops),
			(*C.float)(unsafe.Pointer(&out[0])), C.size_t(len(out)), &n)
	})
	if err != nil {
		return nil, err
	}
	return out[:int(n)], nil
}

func (r *runner) doCancel() error {
	if err := r.h.enter("Cancel"); err != nil {
		return err
	}
	defer r.h.mu.RUnlock()
	return call("Cancel", r.h.what, r.cancelFn)
}

// Model is an open .tinyloop model: weights on one device plus a default session.
type Model struct {
	runner
	ptr       *C.tl_model
	vocabMu   sync.Mutex
	vocabSize int
}

// Open loads a .tinyloop file. opts == nil uses DefaultOptions(). The error carries
// StatusIO (missing/unreadable file), StatusFormat (the message names the failure point),
// StatusInvalidArgument, StatusDevice or StatusOutOfMemory.
func Open(path string, opts *Options) (*Model, error) {
	if err := checkABI(); err != nil {
		return nil, err
	}
	var params C.tl_model_params
	C.tl_model_default_params(&params)
	if opts != nil {
		for name, v := range map[string]int{"MaxSeqLen": opts.MaxSeqLen, "PrefillChunk": opts.PrefillChunk, "MaxLoops": opts.MaxLoops} {
			if v < 0 || v > 1<<32-1 {
				return nil, invalid("Open: %s %d out of range", name, v)
			}
		}
		params.max_seq_len = C.uint32_t(opts.MaxSeqLen)
		params.prefill_chunk = C.uint32_t(opts.PrefillChunk)
		params.max_loops = C.uint32_t(opts.MaxLoops)
		params.log = C.bool(opts.Log)
		if opts.FP16Body < -1 || opts.FP16Body > 1 {
			return nil, invalid("Open: FP16Body %d must be -1, 0 or 1", opts.FP16Body)
		}
		params.fp16_body = C.int32_t(opts.FP16Body)
		if opts.Device != "" {
			device := C.CString(opts.Device)
			defer C.free(unsafe.Pointer(device))
			params.device = device
		}
		if opts.KVMode != "" {
			kvMode := C.CString(opts.KVMode)
			defer C.free(unsafe.Pointer(kvMode))
			params.kv_mode = kvMode
		}
		if opts.StateInit != "" {
			stateInit := C.CString(opts.StateInit)
			defer C.free(unsafe.Pointer(stateInit))
			params.state_init = stateInit
		}
	}
	cpath := C.CString(path)
	defer C.free(unsafe.Pointer(cpath))
	var ptr *C.tl_model
	if err := call("Open", "model", func() C.enum_tl_status { return C.tl_model_open(cpath, &params, &ptr) }); err != nil {
		return nil, err
	}
	// The closures capture the C pointer, not m, so that m can be collected (and finalized).
	m := &Model{ptr: ptr}
	m.h = &handle{what: "model"}
	m.model = ptr
	m.generate = func(tok *C.int32_t, n C.size_t, p *C.tl_generate_params, out *C.int32_t, outCap C.size_t, outLen *C.size_t) C.enum_tl_status {
		return C.tl_generate(ptr, tok, n, p, out, outCap, outLen)
	}
	m.stream = func(tok *C.int32_t, n C.size_t, p *C.tl_generate_params, h C.uintptr_t) C.enum_tl_status {
		return C.tinyloop_model_stream(ptr, tok, n, p, h)
	}
	m.scoreFn = func(kind int, tok *C.int32_t, n C.size_t, loops C.int32_t, out *C.float, outCap C.size_t, outLen *C.size_t) C.enum_tl_status {
		switch kind {
		case scoreAll:
			return C.tl_score(ptr, tok, n, loops, out, outCap, outLen)
		case scoreLogprobs:
			return C.tl_logprobs(ptr, tok, n, loops, out, outCap, outLen)
		case scoreLogprobsDecode:
			return C.tl_logprobs_decode(ptr, tok, n, loops, out, outCap, outLen)
		}
		return C.tl_score_last(ptr, tok, n, loops, out, outCap, outLen)
	}
	m.cancelFn = func() C.enum_tl_status { return C.tl_cancel(ptr) }
	runtime.SetFinalizer(m, func(m *Model) { _ = m.Close() })
	return m, nil
}

func (m *Model) vocab(method string) (int, error) {
	m.vocabMu.Lock()
	defer m.vocabMu.Unlock()
	if m.vocabSize == 0 {
		if m.h.closed.Load() {
			return 0, closedError(method, "model")
		}
		cfg, err := m.Config()
		if err != nil {
			return 0, err
		}
		m.vocabSize = cfg.VocabSize
	}
	return m.vocabSize, nil
}

// Close releases the weights and the default session; a call running on the default session
// is cancelled and awaited. Idempotent and safe from any goroutine, but not from inside a
// stream callback of the same model (that returns ErrBusy and closes nothing). Sessions made
// with NewSession keep working and keep the weights alive until they are closed.
func (m *Model) Close() error {
	return m.h.close(func() C.enum_tl_status { return C.tl_close(m.ptr) }, func() {
		C.tl_model_free(m.ptr)
		m.ptr = nil
	})
}

// close: mark closed, release native resources with release() (which cancels and awaits the
// running call), then wait for calls in flight and free with free().
//
// A Close that finds the handle closed or closing returns at once (without waiting for the
// other Close to finish), so that concurrent Closes cannot deadlock with a running call.
func (h *handle) close(release func() C.enum_tl_status, free func()) error {
	if h.closed.Load() {
		return nil
	}
	h.closeMu.Lock()
	defer h.closeMu.Unlock()
	if h.closed.Load() {
		return nil
	}
	h.closed.Store(true)
	if err := call("Close", h.what, release); err != nil {
		h.closed.Store(false)
		return err
	}
	h.mu.Lock()
	free()
	h.mu.Unlock()
	return nil
}

// Config returns the architecture and open options. It does not wait for running calls.
func (m *Model) Config() (Config, error) {
	if err := m.h.enter("Config"); err != nil {
		return Config{}, err
	}
	defer m.h.mu.RUnlock()
	var c C.tl_config
	c.struct_size = C.size_t(unsafe.Sizeof(c))
	if err := call("Config", "model", func() C.enum_tl_status { return C.tl_model_config(m.ptr, &c) }); err != nil {
		return Config{}, err
	}
	return Config{
		Dim: int(c.dim), NHeads: int(c.n_heads), NKVHeads: int(c.n_kv_heads), FFNDim: int(c.ffn_dim),
		VocabSize: int(c.vocab_size), EmbedFactorDim: int(c.embed_factor_dim),
		NPreBlocks: int(c.n_pre_blocks), NLoopBlocks: int(c.n_loop_blocks),
		NPostBlocks: int(c.n_post_blocks), DefaultLoops: int(c.default_loops),
		Norm: C.GoString(c.norm), NormEps: float64(c.norm_eps), RopeTheta: float64(c.rope_theta),
		MaxPosition: int(c.max_position), Head: C.GoString(c.head),
		MaxSeqLen: int(c.max_seq_len), PrefillChunk: int(c.prefill_chunk), MaxLoops: int(c.max_loops),
	}, nil
}

// VRAMUsageMB returns the device memory held by the weights and all live sessions, in MB
// (10^6 bytes). It does not wait for running calls.
func (m *Model) VRAMUsageMB() (float64, error) {
	if err := m.h.enter("VRAMUsageMB"); err != nil {
		return 0, err
	}
	defer m.h.mu.RUnlock()
	var mb C.double
	err := call("VRAMUsageMB", "model", func() C.enum_tl_status { return C.tl_vram_usage_mb(m.ptr, &mb) })
	return float64(mb), err
}

// Device describes the device the weights live on.
func (m *Model) Device() (string, error) {
	return m.text("Device", func(buf *C.char, n C.size_t, out *C.size_t) C.enum_tl_status {
		return C.tl_model_device(m.ptr, buf, n, out)
	})
}

// KVMode is the KV cache mode of the model's sessions (as chosen at Open or by the environment).
func (m *Model) KVMode() (string, error) {
	return m.text("KVMode", func(buf *C.char, n C.size_t, out *C.size_t) C.enum_tl_status {
		return C.tl_model_kv_mode(m.ptr, buf, n, out)
	})
}

// text returns the string a tl_model_* text accessor writes.
func (m *Model) text(method string, get func(*C.char, C.size_t, *C.size_t) C.enum_tl_status) (string, error) {
	if err := m.h.enter(method); err != nil {
		return "", err
	}
	defer m.h.mu.RUnlock()
	buf := make([]byte, 256)
	var n C.size_t
	err := call(method, "model", func() C.enum_tl_status {
		return get((*C.char)(unsafe.Pointer(&buf[0])), C.size_t(len(buf)), &n)
	})
	if err != nil {
		return "", err
	}
	return string(buf[:int(n)-1]), nil
}

// Generate returns up to opts.MaxTokens new tokens after the prompt (nil opts: defaults). When
// ctx is done the call stops at the next token; the error then matches both ErrCancelled and
// ctx.Err() under errors.Is. A concurrent call on the same model fails with ErrBusy.
func (m *Model) Generate(ctx context.Context, tokens []int32, opts *GenerateOptions) ([]int32, error) {
	return m.doGenerate(ctx, tokens, opts)
}

// GenerateStream calls fn with each new token as soon as it exists, on the calling goroutine's
// thread; fn returning false stops generation (nil error). Cancellation as for Generate. fn
// must not call methods of this model other than Cancel, VRAMUsageMB, Config and Device.
func (m *Model) GenerateStream(ctx context.Context, tokens []int32, opts *GenerateOptions, fn func(token int32) bool) error {
	return m.doStream(ctx, tokens, opts, fn)
}

// ScoreLast returns the logits [vocab] at the last position (loops: LoopsDefault or 1..MaxLoops).
func (m *Model) ScoreLast(tokens []int32, loops int) ([]float32, error) {
	vocab, err := m.vocab("ScoreLast")
	if err != nil {
		return nil, err
	}
	return m.doScore("ScoreLast", scoreLast, vocab, tokens, loops)
}

// Score returns the logits [len(tokens) * vocab] (row-major) for every position.
func (m *Model) Score(tokens []int32, loops int) ([]float32, error) {
	vocab, err := m.vocab("Score")
	if err != nil {
		return nil, err
	}
	return m.doScore("Score", scoreAll, vocab, tokens, loops)
}

// Logprobs returns log p(tokens[i+1] | tokens[:i+1]) for i < len(tokens)-1.
func (m *Model) Logprobs(tokens []int32, loops int) ([]float32, error) {
	vocab, err := m.vocab("Logprobs")
	if err != nil {
		return nil, err
	}
	return m.doScore("Logprobs", scoreLogprobs, vocab, tokens, loops)
}

// LogprobsDecode is Logprobs computed through the decode path: each token but the last is fed
// as its own one-row decode step, exactly as generation feeds the tokens it produces.
func (m *Model) LogprobsDecode(tokens []int32, loops int) ([]float32, error) {
	vocab, err := m.vocab("LogprobsDecode")
	if err != nil {
		return nil, err
	}
	return m.doScore("LogprobsDecode", scoreLogprobsDecode, vocab, tokens, loops)
}

// Cancel stops the call running on the default session: a generation at its next token, a
// score call at its next block application. The call then returns an error matching
// ErrCancelled.
func (m *Model) Cancel() error { return m.doCancel() }

// Session is one sequence's buffers and KV cache over a Model's shared weights. Use it from
// one goroutine at a time (a concurrent call fails with ErrBusy); Cancel and Close may be
// called from any goroutine.
type Session struct {
	runner
	ptr   *C.tl_session
	vsize int
}

// NewSession creates a session over the model's weights.
func (m *Model) NewSession() (*Session, error) {
	vocab, err := m.vocab("NewSession")
	if err != nil {
		return nil, err
	}
	if err := m.h.enter("NewSession"); err != nil {
		return nil, err
	}
	defer m.h.mu.RUnlock()
	var ptr *C.tl_session
	if err := call("NewSession", "model", func() C.enum_tl_status { return C.tl_session_new(m.ptr, &ptr) }); err != nil {
		return nil, err
	}
	s := &Session{ptr: ptr, vsize: vocab}
	s.h = &handle{what: "session"}
	s.session = ptr
	s.generate = func(tok *C.int32_t, n C.size_t, p *C.tl_generate_params, out *C.int32_t, outCap C.size_t, outLen *C.size_t) C.enum_tl_status {
		return C.tl_session_generate(ptr, tok, n, p, out, outCap, outLen)
	}
	s.stream = func(tok *C.int32_t, n C.size_t, p *C.tl_generate_params, h C.uintptr_t) C.enum_tl_status {
		return C.tinyloop_session_stream(ptr, tok, n, p, h)
	}
	s.scoreFn = func(kind int, tok *C.int32_t, n C.size_t, loops C.int32_t, out *C.float, outCap C.size_t, outLen *C.size_t) C.enum_tl_status {
		switch kind {
		case scoreAll:
			return C.tl_session_score(ptr, tok, n, loops, out, outCap, outLen)
		case scoreLogprobs:
			return C.tl_session_logprobs(ptr, tok, n, loops, out, outCap, outLen)
		case scoreLogprobsDecode:
			return C.tl_session_logprobs_decode(ptr, tok, n, loops, out, outCap, outLen)
		}
		return C.tl_session_score_last(ptr, tok, n, loops, out, outCap, outLen)
	}
	s.cancelFn = func() C.enum_tl_status { return C.tl_session_cancel(ptr) }
	runtime.SetFinalizer(s, func(s *Session) { _ = s.Close() })
	return s, nil
}

// Close cancels a running call, waits for it, and frees the session. Idempotent; safe from any
// goroutine except from inside this session's own stream callback.
func (s *Session) Close() error {
	return s.h.close(func() C.enum_tl_status { return C.tl_session_cancel(s.ptr) }, func() {
		C.tl_session_free(s.ptr)
		s.ptr = nil
	})
}

// Generate is Model.Generate on this session.
func (s *Session) Generate(ctx context.Context, tokens []int32, opts *GenerateOptions) ([]int32, error) {
	return s.doGenerate(ctx, tokens, opts)
}

// GenerateStream is Model.GenerateStream on this session.
func (s *Session) GenerateStream(ctx context.Context, tokens []int32, opts *GenerateOptions, fn func(token int32) bool) error {
	return s.doStream(ctx, tokens, opts, fn)
}

// ScoreLast is Model.ScoreLast on this session.
func (s *Session) ScoreLast(tokens []int32, loops int) ([]float32, error) {
	return s.doScore("ScoreLast", scoreLast, s.vsize, tokens, loops)
}

// Score is Model.Score on this session.
func (s *Session) Score(tokens []int32, loops int) ([]float32, error) {
	return s.doScore("Score", scoreAll, s.vsize, tokens, loops)
}

// Logprobs is Model.Logprobs on this session.
func (s *Session) Logprobs(tokens []int32, loops int) ([]float32, error) {
	return s.doScore("Logprobs", scoreLogprobs, s.vsize, tokens, loops)
}

// LogprobsDecode is Model.LogprobsDecode on this session.
func (s *Session) LogprobsDecode(tokens []int32, loops int) ([]float32, error) {
	return s.doScore("LogprobsDecode", scoreLogprobsDecode, s.vsize, tokens, loops)
}

// Cancel stops the call running on this session, as Model.Cancel does.
func (s *Session) Cancel() error { return s.doCancel() }
