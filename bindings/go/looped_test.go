package tinyloop

import (
	"context"
	"errors"
	"math"
	"reflect"
	"strings"
	"testing"
)

// The looped-model calls run on the CPU, whose results do not depend on how the work is split
// into steps, so the equalities below are exact (as in the Rust tests, tests/looped.rs).

var prefix = []int32{84, 111, 32, 98, 101, 32, 111, 114, 32, 110, 111, 116, 32} // "To be or not "

func TestLogitLensRowsAreScoreLastAndTheTrajectoryReadsThem(t *testing.T) {
	m := open(t, 256)
	cfg, err := m.Config()
	if err != nil {
		t.Fatal(err)
	}
	vocab := cfg.VocabSize
	lens, err := m.ScoreLogitLens(prompt, 5)
	if err != nil {
		t.Fatal(err)
	}
	if len(lens) != 5*vocab {
		t.Fatalf("lens has %d values, want %d", len(lens), 5*vocab)
	}
	for l := 1; l <= 5; l++ {
		last, err := m.ScoreLast(prompt, l)
		if err != nil {
			t.Fatal(err)
		}
		if !reflect.DeepEqual(lens[(l-1)*vocab:l*vocab], last) {
			t.Fatalf("lens row %d differs from ScoreLast at %d loops", l, l)
		}
	}
	path, err := m.ScoreTrajectory(prompt, 5)
	if err != nil {
		t.Fatal(err)
	}
	if len(path) != 5 || path[0].KLPrev != 0 {
		t.Fatalf("trajectory %+v", path)
	}
	var previous []float64
	for i, point := range path {
		row := lens[i*vocab : (i+1)*vocab]
		best, max := 0, row[0]
		for j, v := range row {
			if v > max {
				best, max = j, v
			}
		}
		p := make([]float64, vocab)
		total := 0.0
		for j, v := range row {
			p[j] = math.Exp(float64(v) - float64(max))
			total += p[j]
		}
		entropy, kl := 0.0, 0.0
		for j := range p {
			p[j] /= total
			if p[j] > 0 {
				entropy -= p[j] * math.Log2(p[j])
			}
			if previous != nil {
				kl += p[j] * math.Log(p[j]/previous[j])
			}
		}
		// The library sums the same f64 terms, in another order: 1e-9 relative.
		if math.Abs(point.Entropy-entropy) > 1e-9*math.Max(entropy, 1) || math.Abs(point.KLPrev-kl) > 1e-9*math.Max(kl, 1) {
			t.Fatalf("point %d: %+v, lens gives entropy %v, kl %v", i, point, entropy, kl)
		}
		if int(point.Argmax) != best || !(point.HiddenNorm > 0) || !(point.RelChange > 0) {
			t.Fatalf("point %d: %+v, lens argmax %d", i, point, best)
		}
		previous = p
	}
	s, err := m.NewSession()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	short, err := s.ScoreTrajectory(prompt, 2)
	if err != nil || !reflect.DeepEqual(short, path[:2]) {
		t.Fatalf("session trajectory at 2 loops: %v %+v, want the first points at 5", err, short)
	}
	_, err = m.ScoreLogitLens(prompt, 0)
	wantStatus(t, err, StatusInvalidArgument, "ScoreLogitLens loops 0")
}

func TestGreedySpeculationEqualsPlainGeneration(t *testing.T) {
	m := open(t, 256)
	o := gen(24)
	o.Loops = 4
	plain, err := m.Generate(context.Background(), prompt, o)
	if err != nil {
		t.Fatal(err)
	}
	s, err := m.NewSession()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	for _, spec := range []SpeculativeOptions{{1, 1, true}, {3, 4, false}, {2, MaxDraftLen, true}} {
		for _, r := range []*runner{&m.runner, &s.runner} {
			out, err := r.GenerateSpeculative(context.Background(), prompt, o, spec)
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(out, plain) {
				t.Fatalf("%+v on the %s: %v, plain %v", spec, r.h.what, out, plain)
			}
			stats, err := r.LastGenerateStats()
			if err != nil {
				t.Fatal(err)
			}
			if stats.Tokens != len(out) || stats.Drafted == 0 || stats.Accepted > stats.Drafted {
				t.Fatalf("%+v: stats %+v", spec, stats)
			}
		}
	}
	for _, r := range []*runner{&m.runner, &s.runner} {
		withoutReuse, err := r.GenerateSpeculative(context.Background(), prompt, o, SpeculativeOptions{2, 4, false})
		if err != nil {
			t.Fatal(err)
		}
		out, err := r.GenerateSpeculativeNoCache(context.Background(), prompt, o, 2, 4)
		if err != nil {
			t.Fatal(err)
		}
		if !reflect.DeepEqual(out, withoutReuse) || !reflect.DeepEqual(out, plain) {
			t.Fatalf("no cache on the %s: %v, without reuse %v, plain %v", r.h.what, out, withoutReuse, plain)
		}
	}
	_, err = m.GenerateSpeculativeNoCache(context.Background(), prompt, o, 4, 4)
	wantStatus(t, err, StatusInvalidArgument, "GenerateSpeculativeNoCache at draft loops = verify loops")
	def := DefaultSpeculativeOptions()
	if def.DraftLoops != 0 || def.DraftLen != 4 || !def.Reuse {
		t.Fatalf("defaults %+v", def)
	}
	for _, bad := range []struct {
		spec   SpeculativeOptions
		needle string
	}{{def, "draft_loops"}, {SpeculativeOptions{4, 4, true}, "draft_loops"}, {SpeculativeOptions{2, 0, true}, "draft_len"}, {SpeculativeOptions{2, MaxDraftLen + 1, true}, "draft_len"}} {
		_, err := m.GenerateSpeculative(context.Background(), prompt, o, bad.spec)
		wantStatus(t, err, StatusInvalidArgument, "bad speculative options")
		if !strings.Contains(err.Error(), bad.needle) {
			t.Fatalf("%+v: %v does not name %s", bad.spec, err, bad.needle)
		}
	}
}

func TestPrefixCacheEqualsGeneratingFromTheWholeText(t *testing.T) {
	m := open(t, 256)
	o := gen(12)
	o.Loops = 3
	whole := append(append([]int32{}, prefix...), prompt...)
	expected, err := m.Generate(context.Background(), whole, o)
	if err != nil {
		t.Fatal(err)
	}
	cache, err := m.BuildPrefixCache(prefix, 3)
	if err != nil {
		t.Fatal(err)
	}
	if mb, err := cache.MemoryMB(); err != nil || mb <= 0 {
		t.Fatalf("MemoryMB: %v %v", mb, err)
	}
	o.PrefixCache = cache
	s, err := m.NewSession()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	for _, r := range []*runner{&m.runner, &s.runner} {
		out, err := r.doGenerate(context.Background(), prompt, o)
		if err != nil || !reflect.DeepEqual(out, expected) {
			t.Fatalf("with the cache on the %s: %v %v, want %v", r.h.what, err, out, expected)
		}
	}
	var streamed []int32
	if err := m.GenerateStream(context.Background(), prompt, o, func(tok int32) bool { streamed = append(streamed, tok); return true }); err != nil || !reflect.DeepEqual(streamed, expected) {
		t.Fatalf("streamed with the cache: %v %v", err, streamed)
	}
	o.Loops = 4
	_, err = m.Generate(context.Background(), prompt, o)
	wantStatus(t, err, StatusInvalidArgument, "a cache built at other loops")
	o.Loops = 3
	cache.Close()
	cache.Close() // idempotent
	_, err = m.Generate(context.Background(), prompt, o)
	if !errors.Is(err, ErrClosed) || !strings.Contains(err.Error(), "prefix cache") {
		t.Fatalf("a closed cache: %v", err)
	}
}

func TestResumeEqualsAFreshGenerationAtAnyDepth(t *testing.T) {
	m := open(t, 256)
	h, err := m.BuildResumeHandle(prompt, 4)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	s, err := m.NewSession()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	for _, depth := range []int{1, 2, 4, 6} {
		o := gen(16)
		o.Loops = depth
		fresh, err := m.Generate(context.Background(), prompt, o)
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range []*runner{&m.runner, &s.runner} {
			resumed, err := r.ResumeGenerate(context.Background(), h, o)
			if err != nil || !reflect.DeepEqual(resumed, fresh) {
				t.Fatalf("resumed at %d on the %s: %v %v, fresh %v", depth, r.h.what, err, resumed, fresh)
			}
		}
	}
}

func TestBoundHandlesAreReleasedWithTheirModel(t *testing.T) {
	m := open(t, 256)
	s, err := m.NewSession()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	cache, err := m.BuildPrefixCache(prefix, LoopsDefault)
	if err != nil {
		t.Fatal(err)
	}
	h, err := s.BuildResumeHandle(prompt, LoopsDefault)
	if err != nil {
		t.Fatal(err)
	}
	if err := m.Close(); err != nil {
		t.Fatal(err)
	}
	o := gen(4)
	o.PrefixCache = cache
	_, err = s.Generate(context.Background(), prompt, o)
	if !errors.Is(err, ErrClosed) || !strings.Contains(err.Error(), "whose model was closed") {
		t.Fatalf("a cache of a closed model: %v", err)
	}
	_, err = s.ResumeGenerate(context.Background(), h, gen(4))
	if !errors.Is(err, ErrClosed) || !strings.Contains(err.Error(), "resume handle") {
		t.Fatalf("a resume handle of a closed model: %v", err)
	}
	if _, err := cache.MemoryMB(); !errors.Is(err, ErrClosed) {
		t.Fatalf("MemoryMB of a released cache: %v", err)
	}
	if out, err := s.Generate(context.Background(), prompt, gen(4)); err != nil || len(out) != 4 {
		t.Fatalf("the session keeps working: %v %v", out, err)
	}
	cache.Close()
	h.Close()
	_, err = m.ScoreLogitLens(prompt, LoopsDefault)
	wantStatus(t, err, StatusClosed, "ScoreLogitLens after Close")
	_, err = m.BuildPrefixCache(prefix, LoopsDefault)
	wantStatus(t, err, StatusClosed, "BuildPrefixCache after Close")
}

func TestCtxTierSwitchesTheLoopBodyInTheMiddleOfGeneration(t *testing.T) {
	m := open(t, 256)
	ctx := context.Background()
	opts := DefaultGenerateOptions()
	opts.MaxTokens, opts.Loops = 10, 3
	plain, err := m.Generate(ctx, prompt, &opts)
	if err != nil {
		t.Fatal(err)
	}
	if s, _ := m.LastGenerateStats(); s.CtxTier != nil {
		t.Fatalf("a call without a policy reports %+v", *s.CtxTier)
	}
	tier := DefaultCtxTier()
	tier.ShortT, tier.LongT = 4, 9
	opts.CtxTier = &tier
	out, err := m.Generate(ctx, prompt, &opts)
	if err != nil {
		t.Fatal(err)
	}
	s, err := m.LastGenerateStats()
	if err != nil || s.CtxTier == nil {
		t.Fatalf("stats %+v, %v", s, err)
	}
	// 6 prompt tokens: observations at seq_len 6, 7, 8 run at INT4, from 9 on at INT2.
	got := *s.CtxTier
	if got.Observations != 10 || got.ShortSteps != 3 || got.LongSteps != 7 || got.Transitions != 1 || !got.Long {
		t.Fatalf("ctx tier stats %+v", got)
	}
	if !reflect.DeepEqual(out[:3], plain[:3]) {
		t.Fatalf("tokens before the transition differ: %v vs %v", out[:3], plain[:3])
	}
	tier.LongBits = 3
	_, err = m.Generate(ctx, prompt, &opts)
	wantStatus(t, err, StatusInvalidArgument, "CtxTier.LongBits 3")
	if !strings.Contains(err.Error(), "long_bits") {
		t.Fatalf("the error does not name long_bits: %v", err)
	}
}
