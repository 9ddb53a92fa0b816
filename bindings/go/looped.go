package tinyloop

/*
#include <stdint.h>
#include <stdlib.h>
#include "tinyloop.h"

// Each looped-model call on a model (m) or a session (s, when m is NULL): one Go method serves
// both handle kinds.

static enum tl_status tinyloop_lens(const tl_model *m, const tl_session *s, const int32_t *t,
                                    size_t n, int32_t loops, float *out, size_t cap, size_t *len) {
	return m ? tl_score_logit_lens(m, t, n, loops, out, cap, len)
	         : tl_session_score_logit_lens(s, t, n, loops, out, cap, len);
}

static enum tl_status tinyloop_trajectory(const tl_model *m, const tl_session *s,
                                          const int32_t *t, size_t n, int32_t loops,
                                          tl_trajectory_point *out, size_t cap, size_t *len) {
	return m ? tl_score_trajectory(m, t, n, loops, out, cap, len)
	         : tl_session_score_trajectory(s, t, n, loops, out, cap, len);
}

static enum tl_status tinyloop_score_exit(const tl_model *m, const tl_session *s, const int32_t *t,
                                         size_t n, size_t prompt_len, const tl_generate_params *p,
                                         float *out, size_t cap, size_t *len, int32_t *steps) {
	return m ? tl_score_exit(m, t, n, prompt_len, p, out, cap, len, steps)
	         : tl_session_score_exit(s, t, n, prompt_len, p, out, cap, len, steps);
}

static enum tl_status tinyloop_speculative(const tl_model *m, const tl_session *s,
                                           const int32_t *t, size_t n,
                                           const tl_generate_params *p,
                                           const tl_speculative_params *spec, int32_t *out,
                                           size_t cap, size_t *len) {
	return m ? tl_generate_speculative(m, t, n, p, spec, out, cap, len)
	         : tl_session_generate_speculative(s, t, n, p, spec, out, cap, len);
}

static enum tl_status tinyloop_prefix_cache_new(const tl_model *m, const tl_session *s,
                                                const int32_t *t, size_t n, int32_t loops,
                                                tl_prefix_cache **out) {
	return m ? tl_prefix_cache_new(m, t, n, loops, out)
	         : tl_session_prefix_cache_new(s, t, n, loops, out);
}

static enum tl_status tinyloop_resume_handle_new(const tl_model *m, const tl_session *s,
                                                 const int32_t *t, size_t n, int32_t loops,
                                                 tl_resume_handle **out) {
	return m ? tl_resume_handle_new(m, t, n, loops, out)
	         : tl_session_resume_handle_new(s, t, n, loops, out);
}

static enum tl_status tinyloop_resume_generate(const tl_model *m, const tl_session *s,
                                               const tl_resume_handle *h,
                                               const tl_generate_params *p, int32_t *out,
                                               size_t cap, size_t *len) {
	return m ? tl_resume_generate(m, h, p, out, cap, len)
	         : tl_session_resume_generate(s, h, p, out, cap, len);
}

static enum tl_status tinyloop_last_generate_stats(const tl_model *m, const tl_session *s,
                                                   tl_generate_stats *out) {
	return m ? tl_last_generate_stats(m, out) : tl_session_last_generate_stats(s, out);
}
*/
import "C"

import (
	"context"
	"fmt"
	"runtime"
	"sync"
	"unsafe"
)

// MaxDraftLen is the largest SpeculativeOptions.DraftLen (TL_MAX_DRAFT_LEN).
const MaxDraftLen = C.TL_MAX_DRAFT_LEN

// TrajectoryPoint is one loop iteration of the last position (ScoreTrajectory).
type TrajectoryPoint struct {
	HiddenNorm float64 // L2 norm of the residual stream after the iteration
	RelChange  float64 // ||h_i - h_{i-1}|| / ||h_{i-1}||
	KLPrev     float64 // KL(p_i || p_{i-1}) in nats; 0 for the first iteration
	Entropy    float64 // entropy of p_i in bits
	Argmax     int32   // the most likely token of p_i
}

// SpeculativeOptions configure GenerateSpeculative. Start from DefaultSpeculativeOptions()
// and set DraftLoops.
type SpeculativeOptions struct {
	DraftLoops int  // loops of the draft steps, 1..verify loops - 1
	DraftLen   int  // tokens drafted per round, 1..MaxDraftLen
	Reuse      bool // verify from the draft's state (true), or recompute every block (baseline)
}

// DefaultSpeculativeOptions returns the library's defaults (tl_speculative_default_params):
// DraftLen 4, Reuse true, and DraftLoops 0, which the caller must set.
func DefaultSpeculativeOptions() SpeculativeOptions {
	var p C.tl_speculative_params
	C.tl_speculative_default_params(&p)
	return SpeculativeOptions{
		DraftLoops: int(p.draft_loops),
		DraftLen:   int(p.draft_len),
		Reuse:      bool(p.reuse),
	}
}

// GenerateStats is what the last successful generation call on a model or session did.
type GenerateStats struct {
	Tokens         int     // tokens returned
	PrefillMS      float64 // milliseconds to the first token
	DecodeMS       float64 // milliseconds from the first token to the end
	Drafted        int     // speculative calls: tokens drafted
	Accepted       int     // speculative calls: drafted tokens accepted
	AcceptanceRate float64 // Accepted / Drafted (0 without drafts)
	Agreement      float64 // share of drafted positions where draft and verify argmax agree
	// CtxTier is what CTX-TIER observed, or nil when the call had no tier policy.
	CtxTier *CtxTierStats

	// BetaMon is the BETA-MON summary of a monitored call; nil otherwise.
	BetaMon *BetaMonSummary

	// ExitTokens counts the tokens returned with an exit iteration (all of them in a call with
	// an exit rule, 0 otherwise); ExitMeanSteps is their mean exit iteration (1-based).
	ExitTokens    int
	ExitMeanSteps float64
}

// CtxTierStats is what CTX-TIER observed in one call.
type CtxTierStats struct {
	Observations int     // steps observed
	ShortSteps   int     // steps run at the SHORT tier (INT4 loop body)
	LongSteps    int     // steps run at the LONG tier (INT2 loop body)
	Transitions  int     // tier changes
	LastSeqLen   int     // sequence length at the last observation
	ElapsedMS    float64 // from the first observation to the end of the call
	ApplyMS      float64 // spent re-packing or uploading loop bodies at transitions
	FreedBytes   int64   // net device bytes the transitions freed (negative: allocated)
	Long         bool    // the session's tier at the end of the call is LONG
}

// BetaMonSummary is BETA-MON's account of one call: the entropy in bits of the distribution
// each returned token was chosen from (all 0 when no token was returned).
type BetaMonSummary struct {
	NTokens             int
	EntropyMeanBits     float64
	EntropyStdBits      float64 // population standard deviation
	EntropyMinBits      float64
	EntropyMaxBits      float64
	LowRate             float64 // share below Thresholds.LowEntropyBits
	HighRate            float64 // share above Thresholds.HighEntropyBits
	Thresholds          BetaMonitor
	AgreementRate       float64 // speculative calls (Drafted > 0): the draft/verify agreement
	AgreementBelowFloor bool    // speculative calls: AgreementRate < Thresholds.AgreementFloor
}

// bound is a prefix cache or resume handle: its handle value, freed once by Close.
type bound struct {
	mu   sync.Mutex
	ptr  unsafe.Pointer
	noun string
	free func(unsafe.Pointer)
}

// get returns the handle for a call named method, or ErrClosed once Close ran.
func (b *bound) get(method string) (unsafe.Pointer, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.ptr == nil {
		return nil, b.released(method)
	}
	return b.ptr, nil
}

func (b *bound) released(method string) error {
	return &Error{Status: StatusClosed, Message: fmt.Sprintf(
		"%s called with a %s that was closed, or whose model was closed; build a new one", method, b.noun)}
}

// Close releases it (idempotent, any goroutine); a call using it in another goroutine
// finishes normally.
func (b *bound) Close() error {
	b.mu.Lock()
	ptr := b.ptr
	b.ptr = nil
	b.mu.Unlock()
	if ptr != nil {
		b.free(ptr)
	}
	return nil
}

// PrefixCache holds the KV entries of a prefix (BuildPrefixCache); set it as
// GenerateOptions.PrefixCache. Several sessions may use one cache at once. It is released by
// Close, or with the model it was built on.
type PrefixCache struct{ bound }

// ResumeHandle holds a prompt run at some loop count (BuildResumeHandle); ResumeGenerate
// continues it at any depth. It is released by Close, or with the model it was built on.
type ResumeHandle struct{ bound }

// MemoryMB is the device memory the cache holds, in MB (10^6 bytes).
func (c *PrefixCache) MemoryMB() (float64, error) {
	return c.memoryMB(func(p unsafe.Pointer, mb *C.double) C.enum_tl_status {
		return C.tl_prefix_cache_memory_mb((*C.tl_prefix_cache)(p), mb)
	})
}

// MemoryMB is the device memory the handle holds, in MB (10^6 bytes).
func (h *ResumeHandle) MemoryMB() (float64, error) {
	return h.memoryMB(func(p unsafe.Pointer, mb *C.double) C.enum_tl_status {
		return C.tl_resume_handle_memory_mb((*C.tl_resume_handle)(p), mb)
	})
}

func (b *bound) memoryMB(get func(unsafe.Pointer, *C.double) C.enum_tl_status) (float64, error) {
	ptr, err := b.get("MemoryMB")
	if err != nil {
		return 0, err
	}
	var mb C.double
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if st := get(ptr, &mb); st != C.TL_OK {
		if Status(st) == StatusClosed {
			return 0, b.released("MemoryMB")
		}
		return 0, lastError(st, "MemoryMB", b.noun)
	}
	return float64(mb), nil
}

func newPrefixCache(ptr *C.tl_prefix_cache) *PrefixCache {
	c := &PrefixCache{bound{ptr: unsafe.Pointer(ptr), noun: "prefix cache",
		free: func(p unsafe.Pointer) { C.tl_prefix_cache_free((*C.tl_prefix_cache)(p)) }}}
	runtime.SetFinalizer(c, func(c *PrefixCache) { _ = c.Close() })
	return c
}

func newResumeHandle(ptr *C.tl_resume_handle) *ResumeHandle {
	h := &ResumeHandle{bound{ptr: unsafe.Pointer(ptr), noun: "resume handle",
		free: func(p unsafe.Pointer) { C.tl_resume_handle_free((*C.tl_resume_handle)(p)) }}}
	runtime.SetFinalizer(h, func(h *ResumeHandle) { _ = h.Close() })
	return h
}

// callBound is call for a C call that uses b: StatusClosed while this handle is open means b
// was released (closed, or its model closed).
func (r *runner) callBound(method string, b *bound, f func() C.enum_tl_status) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	st := f()
	if Status(st) == StatusClosed && b != nil && !r.h.closed.Load() {
		return b.released(method)
	}
	return lastError(st, method, r.h.what)
}

func checkLoops(method string, loops int) error {
	if loops < -1<<31 || loops > 1<<31-1 {
		return invalid("%s: loops %d out of range", method, loops)
	}
	return nil
}

// ScoreLogitLens returns the logit lens: logits [loops * vocab] (row-major) at the last
// position, read out after each loop iteration (loops: LoopsDefault or 1..MaxLoops). Row L-1
// equals ScoreLast(tokens, L).
func (r *runner) ScoreLogitLens(tokens []int32, loops int) ([]float32, error) {
	const method = "ScoreLogitLens"
	if err := checkLoops(method, loops); err != nil {
		return nil, err
	}
	if err := r.h.enter(method); err != nil {
		return nil, err
	}
	defer r.h.mu.RUnlock()
	lens := func(out *C.float, outCap C.size_t, n *C.size_t) C.enum_tl_status {
		return C.tinyloop_lens(r.model, r.session, tokensPtr(tokens), C.size_t(len(tokens)),
			C.int32_t(loops), out, outCap, n)
	}
	need, err := r.required(method, func(n *C.size_t) C.enum_tl_status { return lens(nil, 0, n) })
	if err != nil {
		return nil, err
	}
	out := make([]float32, need)
	var n C.size_t
	err = call(method, r.h.what, func() C.enum_tl_status {
		return lens((*C.float)(unsafe.Pointer(&out[0])), C.size_t(len(out)), &n)
	})
	if err != nil {
		return nil, err
	}
	return out[:int(n)], nil
}

// ScoreTrajectory returns the last position's path through the loop iterations, one point per
// iteration (loops: LoopsDefault or 1..MaxLoops).
func (r *runner) ScoreTrajectory(tokens []int32, loops int) ([]TrajectoryPoint, error) {
	const method = "ScoreTrajectory"
	if err := checkLoops(method, loops); err != nil {
		return nil, err
	}
	if err := r.h.enter(method); err != nil {
		return nil, err
	}
	defer r.h.mu.RUnlock()
	path := func(out *C.tl_trajectory_point, outCap C.size_t, n *C.size_t) C.enum_tl_status {
		return C.tinyloop_trajectory(r.model, r.session, tokensPtr(tokens), C.size_t(len(tokens)),
			C.int32_t(loops), out, outCap, n)
	}
	need, err := r.required(method, func(n *C.size_t) C.enum_tl_status { return path(nil, 0, n) })
	if err != nil {
		return nil, err
	}
	out := make([]C.tl_trajectory_point, need)
	var n C.size_t
	if err := call(method, r.h.what, func() C.enum_tl_status { return path(&out[0], C.size_t(len(out)), &n) }); err != nil {
		return nil, err
	}
	points := make([]TrajectoryPoint, int(n))
	for i, p := range out[:int(n)] {
		points[i] = TrajectoryPoint{
			HiddenNorm: float64(p.hidden_norm), RelChange: float64(p.rel_change),
			KLPrev: float64(p.kl_prev), Entropy: float64(p.entropy), Argmax: int32(p.argmax),
		}
	}
	return points, nil
}

// ScoreExit scores tokens under the exit rule of opts (ExitThreshold or Exit, and ExitPolicy;
// a rule is required) at opts.Loops: logits [len(tokens) * vocab] (row-major), each position's
// from its exit iteration, and those iterations (1-based). tokens[:promptLen] run as a
// generation call's prompt and every later token as a generated one (its own step at the rule's
// policy), so scoring a greedy generation's prompt and tokens gives, from row promptLen-1 on,
// its tokens as the argmax and its exit iterations. The other options are not read, but
// PrefixCache must be nil.
func (r *runner) ScoreExit(tokens []int32, promptLen int, opts *GenerateOptions) ([]float32, []int32, error) {
	const method = "ScoreExit"
	if promptLen < 0 {
		return nil, nil, invalid("%s: promptLen %d must be in 1..=len(tokens)", method, promptLen)
	}
	p, release, err := cParams(opts, method)
	defer release()
	if err != nil {
		return nil, nil, err
	}
	if err := r.h.enter(method); err != nil {
		return nil, nil, err
	}
	defer r.h.mu.RUnlock()
	score := func(out *C.float, outCap C.size_t, n *C.size_t, steps *C.int32_t) C.enum_tl_status {
		return C.tinyloop_score_exit(r.model, r.session, tokensPtr(tokens), C.size_t(len(tokens)),
			C.size_t(promptLen), &p, out, outCap, n, steps)
	}
	need, err := r.required(method, func(n *C.size_t) C.enum_tl_status { return score(nil, 0, n, nil) })
	if err != nil {
		return nil, nil, err
	}
	// The size query refused no tokens, so need >= vocab and tokens is not empty.
	out := make([]float32, need)
	steps := make([]int32, len(tokens))
	var n C.size_t
	err = call(method, r.h.what, func() C.enum_tl_status {
		return score((*C.float)(unsafe.Pointer(&out[0])), C.size_t(len(out)), &n,
			(*C.int32_t)(unsafe.Pointer(&steps[0])))
	})
	if err != nil {
		return nil, nil, err
	}
	return out[:int(n)], steps, nil
}

// required asks a buffer call for its output length (a NULL buffer of capacity 0): invalid
// arguments fail here, before anything is allocated.
func (r *runner) required(method string, query func(*C.size_t) C.enum_tl_status) (int, error) {
	var n C.size_t
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if st := query(&n); st != C.TL_ERR_BUFFER_TOO_SMALL {
		if err := lastError(st, method, r.h.what); err != nil {
			return 0, err
		}
	}
	return int(n), nil
}

// GenerateSpeculative generates like Generate at opts.Loops (the verify loops), drafting
// spec.DraftLen tokens at a time at spec.DraftLoops. Greedy output equals Generate's; sampled
// output has its distribution. Acceptance counts: LastGenerateStats. Cancellation as Generate.
func (r *runner) GenerateSpeculative(ctx context.Context, tokens []int32, opts *GenerateOptions, spec SpeculativeOptions) ([]int32, error) {
	return r.speculative(ctx, "GenerateSpeculative", tokens, opts, spec)
}

// GenerateSpeculativeNoCache is GenerateSpeculative with Reuse false, under the reference
// pages' name (generate_speculative_no_cache): the verify pass recomputes every block
// application instead of continuing from the draft's KV and hidden state. The same tokens,
// slower; the baseline that draft reuse is measured against.
func (r *runner) GenerateSpeculativeNoCache(ctx context.Context, tokens []int32, opts *GenerateOptions, draftLoops, draftLen int) ([]int32, error) {
	spec := SpeculativeOptions{DraftLoops: draftLoops, DraftLen: draftLen, Reuse: false}
	return r.speculative(ctx, "GenerateSpeculativeNoCache", tokens, opts, spec)
}

// speculative runs tl_generate_speculative for method.
func (r *runner) speculative(ctx context.Context, method string, tokens []int32, opts *GenerateOptions, spec SpeculativeOptions) ([]int32, error) {
	if spec.DraftLoops < 0 || spec.DraftLoops > 1<<32-1 || spec.DraftLen < 0 || spec.DraftLen > 1<<32-1 {
		return nil, invalid("%s: DraftLoops %d or DraftLen %d out of range", method, spec.DraftLoops, spec.DraftLen)
	}
	var sp C.tl_speculative_params
	C.tl_speculative_default_params(&sp)
	sp.draft_loops = C.uint32_t(spec.DraftLoops)
	sp.draft_len = C.uint32_t(spec.DraftLen)
	sp.reuse = C.bool(spec.Reuse)
	return r.generateWith(ctx, method, opts, nil, func(p *C.tl_generate_params, out *C.int32_t, outCap C.size_t, n *C.size_t) C.enum_tl_status {
		return C.tinyloop_speculative(r.model, r.session, tokensPtr(tokens), C.size_t(len(tokens)), p, &sp, out, outCap, n)
	})
}

// ResumeGenerate generates after the prompt of h at opts.Loops (any depth): the same tokens as
// Generate from that prompt at those loops, reusing the iterations h already ran. h is only
// read: it may be resumed any number of times, from any session of its model.
func (r *runner) ResumeGenerate(ctx context.Context, h *ResumeHandle, opts *GenerateOptions) ([]int32, error) {
	const method = "ResumeGenerate"
	if h == nil {
		return nil, invalid("%s: h is nil", method)
	}
	ptr, err := h.get(method)
	if err != nil {
		return nil, err
	}
	return r.generateWith(ctx, method, opts, &h.bound, func(p *C.tl_generate_params, out *C.int32_t, outCap C.size_t, n *C.size_t) C.enum_tl_status {
		return C.tinyloop_resume_generate(r.model, r.session, (*C.tl_resume_handle)(ptr), p, out, outCap, n)
	})
}

// generateWith runs one generation call gen with the converted opts, ctx cancellation and a
// buffer of MaxTokens; b is the prefix cache or resume handle it uses, if any.
func (r *runner) generateWith(ctx context.Context, method string, o *GenerateOptions, b *bound,
	gen func(p *C.tl_generate_params, out *C.int32_t, outCap C.size_t, n *C.size_t) C.enum_tl_status) ([]int32, error) {
	if err := ctx.Err(); err != nil {
		return nil, cancelledByCtx(ctx, &Error{Status: StatusCancelled})
	}
	p, release, err := cParams(o, method)
	defer release()
	if err != nil {
		return nil, err
	}
	if b == nil && o != nil && o.PrefixCache != nil {
		b = &o.PrefixCache.bound
	}
	if err := r.h.enter(method); err != nil {
		return nil, err
	}
	defer r.h.mu.RUnlock()
	out := make([]int32, int(p.max_tokens)+1)
	var n C.size_t
	unwatch := watch(ctx, func() { r.cancelFn() })
	err = r.callBound(method, b, func() C.enum_tl_status {
		return gen(&p, (*C.int32_t)(unsafe.Pointer(&out[0])), C.size_t(len(out)), &n)
	})
	unwatch()
	if err != nil {
		if e, ok := err.(*Error); ok && e.Status == StatusCancelled {
			return nil, cancelledByCtx(ctx, err)
		}
		return nil, err
	}
	return out[:int(n)], nil
}

// BuildPrefixCache runs tokens at loops (LoopsDefault or 1..MaxLoops) and keeps their KV
// entries: generating with GenerateOptions.PrefixCache set to it, at the same loops, gives the
// tokens of generating from tokens followed by the prompt, on any session of this model.
func (r *runner) BuildPrefixCache(tokens []int32, loops int) (*PrefixCache, error) {
	const method = "BuildPrefixCache"
	if err := checkLoops(method, loops); err != nil {
		return nil, err
	}
	if err := r.h.enter(method); err != nil {
		return nil, err
	}
	defer r.h.mu.RUnlock()
	var ptr *C.tl_prefix_cache
	err := call(method, r.h.what, func() C.enum_tl_status {
		return C.tinyloop_prefix_cache_new(r.model, r.session, tokensPtr(tokens), C.size_t(len(tokens)), C.int32_t(loops), &ptr)
	})
	if err != nil {
		return nil, err
	}
	return newPrefixCache(ptr), nil
}

// BuildResumeHandle runs the prompt tokens at loops (LoopsDefault or 1..MaxLoops) and keeps what
// ResumeGenerate needs to generate after it at any loop count.
func (r *runner) BuildResumeHandle(tokens []int32, loops int) (*ResumeHandle, error) {
	const method = "BuildResumeHandle"
	if err := checkLoops(method, loops); err != nil {
		return nil, err
	}
	if err := r.h.enter(method); err != nil {
		return nil, err
	}
	defer r.h.mu.RUnlock()
	var ptr *C.tl_resume_handle
	err := call(method, r.h.what, func() C.enum_tl_status {
		return C.tinyloop_resume_handle_new(r.model, r.session, tokensPtr(tokens), C.size_t(len(tokens)), C.int32_t(loops), &ptr)
	})
	if err != nil {
		return nil, err
	}
	return newResumeHandle(ptr), nil
}

// LastGenerateStats reports what the last successful generation call here did (all zero
// before the first one).
func (r *runner) LastGenerateStats() (GenerateStats, error) {
	const method = "LastGenerateStats"
	if err := r.h.enter(method); err != nil {
		return GenerateStats{}, err
	}
	defer r.h.mu.RUnlock()
	var s C.tl_generate_stats
	s.struct_size = C.size_t(unsafe.Sizeof(s))
	if err := call(method, r.h.what, func() C.enum_tl_status { return C.tinyloop_last_generate_stats(r.model, r.session, &s) }); err != nil {
		return GenerateStats{}, err
	}
	stats := GenerateStats{
		Tokens: int(s.tokens), PrefillMS: float64(s.prefill_ms), DecodeMS: float64(s.decode_ms),
		Drafted: int(s.drafted), Accepted: int(s.accepted),
		AcceptanceRate: float64(s.acceptance_rate), Agreement: float64(s.agreement),
		ExitTokens: int(s.exit_tokens), ExitMeanSteps: float64(s.exit_mean_steps),
	}
	if s.ctx_tier_final != 0 {
		stats.CtxTier = &CtxTierStats{
			Observations: int(s.ctx_tier_observations), ShortSteps: int(s.ctx_tier_short_steps),
			LongSteps: int(s.ctx_tier_long_steps), Transitions: int(s.ctx_tier_transitions),
			LastSeqLen: int(s.ctx_tier_last_seq_len), ElapsedMS: float64(s.ctx_tier_elapsed_ms),
			ApplyMS: float64(s.ctx_tier_apply_ms), FreedBytes: int64(s.ctx_tier_freed_bytes),
			Long: s.ctx_tier_final == 2,
		}
	}
	if s.beta_mon {
		stats.BetaMon = &BetaMonSummary{
			NTokens:         int(s.beta_mon_n_tokens),
			EntropyMeanBits: float64(s.beta_mon_entropy_mean_bits),
			EntropyStdBits:  float64(s.beta_mon_entropy_std_bits),
			EntropyMinBits:  float64(s.beta_mon_entropy_min_bits),
			EntropyMaxBits:  float64(s.beta_mon_entropy_max_bits),
			LowRate:         float64(s.beta_mon_low_rate),
			HighRate:        float64(s.beta_mon_high_rate),
			Thresholds: BetaMonitor{
				LowEntropyBits:  float64(s.beta_mon_low_entropy_bits),
				HighEntropyBits: float64(s.beta_mon_high_entropy_bits),
				AgreementFloor:  float64(s.beta_mon_agreement_floor),
			},
			AgreementRate:       float64(s.agreement),
			AgreementBelowFloor: bool(s.beta_mon_agreement_below_floor),
		}
	}
	return stats, nil
}
