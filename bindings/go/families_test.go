package tinyloop

import (
	"context"
	"math"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

// The options of the public looped families (docs/MODELS.md): Ouro's adaptive exit on the
// tiny-sandwich preset, Huginn's initial state on tiny-recurrent. The Rust tests (tests/hf.rs,
// src/generate/exit.rs) check the numerics; here the binding's plumbing.

// synth writes the model of preset (seed 1) with the CLI and returns its path.
func synth(t *testing.T, preset string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), preset+".tinyloop")
	out, err := exec.Command(cli(), "synth", "--preset", preset, "--seed", "1", "--out", path).CombinedOutput()
	if err != nil {
		t.Fatalf("cannot synthesize %s with %s: %v\n%s", preset, cli(), err, out)
	}
	return path
}

func openFamily(t *testing.T, path, stateInit string) (*Model, error) {
	t.Helper()
	opts := DefaultOptions()
	opts.MaxSeqLen = 256
	opts.Device = "cpu"
	opts.Log = false
	opts.StateInit = stateInit
	m, err := Open(path, &opts)
	if err == nil {
		t.Cleanup(func() { _ = m.Close() })
	}
	return m, err
}

func openSandwich(t *testing.T) *Model {
	t.Helper()
	m, err := openFamily(t, synth(t, "tiny-sandwich"), "")
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	return m
}

func withExit(threshold *float64, exit, policy string) *GenerateOptions {
	o := gen(12)
	o.ExitThreshold, o.Exit, o.ExitPolicy = threshold, exit, policy
	return o
}

func half() *float64 {
	t := 0.5
	return &t
}

// checkExitStats: every returned token has an exit iteration, within the default 4 loops.
func checkExitStats(t *testing.T, r *runner, tokens int) {
	t.Helper()
	s, err := r.LastGenerateStats()
	if err != nil {
		t.Fatal(err)
	}
	if s.Tokens != tokens || s.ExitTokens != tokens || s.ExitMeanSteps < 1 || s.ExitMeanSteps > 4 {
		t.Fatalf("stats on the %s after %d tokens: %+v", r.h.what, tokens, s)
	}
}

func TestAnExitThresholdReportsEveryTokensExitIteration(t *testing.T) {
	m := openSandwich(t)
	ctx := context.Background()
	if cfg, err := m.Config(); err != nil || cfg.DefaultLoops != 4 {
		t.Fatalf("Config: %+v, %v", cfg, err)
	}
	if _, err := m.Generate(ctx, prompt, gen(12)); err != nil {
		t.Fatal(err)
	}
	if s, _ := m.LastGenerateStats(); s.ExitTokens != 0 || s.ExitMeanSteps != 0 {
		t.Fatalf("a call without an exit rule reports exits: %+v", s)
	}
	out, err := m.Generate(ctx, prompt, withExit(half(), "", ""))
	if err != nil || len(out) != 12 {
		t.Fatalf("Generate with ExitThreshold 0.5: %v %v", out, err)
	}
	checkExitStats(t, &m.runner, len(out))
	s, err := m.NewSession()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	for _, r := range []*runner{&m.runner, &s.runner} {
		// "gate:T" is the same rule as the threshold T.
		got, err := r.doGenerate(ctx, prompt, withExit(nil, "gate:0.5", ""))
		if err != nil || !reflect.DeepEqual(got, out) {
			t.Fatalf("Exit gate:0.5 on the %s: %v %v, want %v", r.h.what, got, err, out)
		}
		checkExitStats(t, r, len(out))
		var streamed []int32
		err = r.doStream(ctx, prompt, withExit(half(), "", ""), func(tok int32) bool { streamed = append(streamed, tok); return true })
		if err != nil || !reflect.DeepEqual(streamed, out) {
			t.Fatalf("streamed on the %s: %v %v, want %v", r.h.what, streamed, err, out)
		}
		checkExitStats(t, r, len(out))
	}
}

func TestTheSkipPolicy(t *testing.T) {
	m := openSandwich(t)
	ctx := context.Background()
	out, err := m.Generate(ctx, prompt, withExit(half(), "", "skip"))
	if err != nil || len(out) != 12 {
		t.Fatalf("Generate with the skip policy: %v %v", out, err)
	}
	checkExitStats(t, &m.runner, len(out))
	var streamed []int32
	err = m.GenerateStream(ctx, prompt, withExit(nil, "gate:0.5", "skip"), func(tok int32) bool { streamed = append(streamed, tok); return true })
	if err != nil || !reflect.DeepEqual(streamed, out) {
		t.Fatalf("streamed with the skip policy: %v %v, want %v", streamed, err, out)
	}
	checkExitStats(t, &m.runner, len(out))
}

func TestTextGenerationTakesTheExitOptions(t *testing.T) {
	// A byte-level model (vocab 256, no stored tokenizer) takes text too.
	m := openSandwich(t)
	o := withExit(half(), "", "")
	o.MaxTokens = 8
	if _, err := m.GenerateText(context.Background(), "ROMEO:", o, nil); err != nil {
		t.Fatal(err)
	}
	if s, _ := m.LastGenerateStats(); s.ExitTokens == 0 || s.ExitTokens != s.Tokens {
		t.Fatalf("GenerateText stats: %+v", s)
	}
	o.ExitPolicy = "skip"
	err := m.GenerateTextStream(context.Background(), "ROMEO:", o, nil, func(string) bool { return true })
	if err != nil {
		t.Fatal(err)
	}
	if s, _ := m.LastGenerateStats(); s.ExitTokens == 0 {
		t.Fatalf("GenerateTextStream stats: %+v", s)
	}
}

func TestBadExitOptions(t *testing.T) {
	m := openSandwich(t)
	ctx := context.Background()
	over, negative, nan := 1.5, -0.5, math.NaN()
	for _, bad := range []struct {
		o      *GenerateOptions
		needle string
	}{
		{withExit(&over, "", ""), "exit_threshold"},
		{withExit(&negative, "", ""), "ExitThreshold"},
		{withExit(&nan, "", ""), "exit_threshold"},
		{withExit(nil, "kl:x", ""), "exit rule"},
		{withExit(half(), "gate:0.5", ""), "exit_threshold or exit, not both"},
		{withExit(nil, "", "skip"), "exit_policy is set without an exit rule"},
		{withExit(nil, "gate:0.5", "fast"), "exit_policy"},
		{withExit(nil, "gate\x000.5", ""), "GenerateOptions.Exit contains a NUL byte"},
		// The preset names no default threshold.
		{withExit(nil, "gate", ""), "no default threshold"},
	} {
		_, err := m.Generate(ctx, prompt, bad.o)
		wantStatus(t, err, StatusInvalidArgument, bad.needle)
		if !strings.Contains(err.Error(), bad.needle) {
			t.Fatalf("Generate: %v does not say %q", err, bad.needle)
		}
		err = m.GenerateStream(ctx, prompt, bad.o, func(int32) bool { return true })
		wantStatus(t, err, StatusInvalidArgument, bad.needle)
		if !strings.Contains(err.Error(), bad.needle) {
			t.Fatalf("GenerateStream: %v does not say %q", err, bad.needle)
		}
	}
}

func TestAnExitRuleNeedsAnExitGate(t *testing.T) {
	m := open(t, 256)
	for _, o := range []*GenerateOptions{withExit(half(), "", ""), withExit(nil, "gate:0.5", "")} {
		_, err := m.Generate(context.Background(), prompt, o)
		wantStatus(t, err, StatusInvalidArgument, "an exit rule on tiny")
		if !strings.Contains(err.Error(), "no exit gate") {
			t.Fatalf("%v does not say no exit gate", err)
		}
	}
}

func TestAnExitCriterionNeedsNoGate(t *testing.T) {
	m, err := openFamily(t, synth(t, "tiny-recurrent"), "zeros")
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	ctx := context.Background()
	for _, rule := range []string{"kl:1e-3", "argmax-stability:1", "latent-diff"} {
		for _, policy := range []string{"", "skip"} {
			out, err := m.Generate(ctx, prompt, withExit(nil, rule, policy))
			if err != nil || len(out) != 12 {
				t.Fatalf("Generate with Exit %q, ExitPolicy %q: %v %v", rule, policy, out, err)
			}
			checkExitStats(t, &m.runner, len(out))
		}
	}
}

func argmax(row []float32) int32 {
	best := 0
	for i, v := range row {
		if v > row[best] {
			best = i
		}
	}
	return int32(best)
}

// Scoring a greedy generation's prompt and tokens with its rule gives, from row len(prompt)-1
// on, its tokens as the argmax and its exit iterations (their mean: the statistics keep no
// more). On the CPU the two paths run the same block applications, so the comparisons are exact.
func TestScoreExitOfAGenerationGivesItsTokensAndExits(t *testing.T) {
	m := openSandwich(t)
	s, err := m.NewSession()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	for _, o := range []*GenerateOptions{
		withExit(half(), "", ""), withExit(nil, "gate:0.7", "skip"), withExit(nil, "argmax:1", ""),
	} {
		o.Loops = 4
		out, err := m.Generate(context.Background(), prompt, o)
		if err != nil || len(out) != 12 {
			t.Fatalf("Generate: %v %v", out, err)
		}
		stats, _ := m.LastGenerateStats()
		tokens := append(append([]int32{}, prompt...), out[:len(out)-1]...)
		n := len(prompt)
		logits, steps, err := m.ScoreExit(tokens, n, o)
		if err != nil || len(logits) != len(tokens)*256 || len(steps) != len(tokens) {
			t.Fatalf("ScoreExit: %d logits, %v, %v", len(logits), steps, err)
		}
		sum, early := 0, false
		for i := n - 1; i < len(tokens); i++ {
			if got := argmax(logits[i*256 : (i+1)*256]); got != out[i-n+1] {
				t.Fatalf("%+v: row %d argmax %d, generated %d", o, i, got, out[i-n+1])
			}
			if steps[i] < 1 || steps[i] > 4 {
				t.Fatalf("%+v: exit iterations %v outside 1..4", o, steps)
			}
			sum += int(steps[i])
			early = early || steps[i] < 4
		}
		// A sum of 12 small integers is exact in float64: the means are equal, not near.
		if mean := float64(sum) / float64(len(out)); !early || mean != stats.ExitMeanSteps {
			t.Fatalf("%+v: exit iterations %v (mean %v), generation's mean %v", o, steps, mean, stats.ExitMeanSteps)
		}
		sl, ss, err := s.ScoreExit(tokens, n, o)
		if err != nil || !reflect.DeepEqual(sl, logits) || !reflect.DeepEqual(ss, steps) {
			t.Fatalf("ScoreExit on the session differs: %v %v", ss, err)
		}
	}
}

func TestScoreExitBadArguments(t *testing.T) {
	m := openSandwich(t)
	gate := withExit(half(), "", "")
	for _, bad := range []struct {
		promptLen int
		o         *GenerateOptions
		needle    string
	}{
		{0, gate, "prompt_len 0 must be in 1..=6"},
		{7, gate, "prompt_len 7 must be in 1..=6"},
		{-1, gate, "promptLen -1"},
		{6, nil, "no exit rule"},
		{6, gen(4), "no exit rule"},
		{6, withExit(nil, "kl:x", ""), "exit rule"},
	} {
		_, _, err := m.ScoreExit(prompt, bad.promptLen, bad.o)
		wantStatus(t, err, StatusInvalidArgument, bad.needle)
		if !strings.Contains(err.Error(), bad.needle) {
			t.Fatalf("ScoreExit: %v does not say %q", err, bad.needle)
		}
	}
	plain := open(t, 256)
	_, _, err := plain.ScoreExit(prompt, 6, gate)
	wantStatus(t, err, StatusInvalidArgument, "the gate on tiny")
	if !strings.Contains(err.Error(), "no exit gate") {
		t.Fatalf("%v does not say no exit gate", err)
	}
}

func TestStateInitDrawsTheInitialState(t *testing.T) {
	path := synth(t, "tiny-recurrent")
	greedy := func(stateInit string) []int32 {
		t.Helper()
		m, err := openFamily(t, path, stateInit)
		if err != nil {
			t.Fatalf("Open with StateInit %q: %v", stateInit, err)
		}
		out, err := m.Generate(context.Background(), prompt, gen(12))
		if err != nil || len(out) != 12 {
			t.Fatalf("Generate with StateInit %q: %v %v", stateInit, out, err)
		}
		return out
	}
	greedy("zeros")
	seeded := greedy("seed:3")
	if again := greedy("seed:3"); !reflect.DeepEqual(again, seeded) {
		t.Fatalf("seed:3 twice: %v, then %v", seeded, again)
	}
	// "model" (also "") is the model's own rule from seed 0.
	def := greedy("")
	for _, same := range []string{"model", "seed:0"} {
		if got := greedy(same); !reflect.DeepEqual(got, def) {
			t.Fatalf("StateInit %q: %v, the default %v", same, got, def)
		}
	}
	_, err := openFamily(t, path, "seed:x")
	wantStatus(t, err, StatusInvalidArgument, "StateInit seed:x")
	if !strings.Contains(err.Error(), "state_init") {
		t.Fatalf("%v does not name state_init", err)
	}
	// A loop that carries its state from the pre blocks has no initial state to draw.
	_, err = openFamily(t, modelPath, "zeros")
	wantStatus(t, err, StatusInvalidArgument, "StateInit zeros on tiny")
	if !strings.Contains(err.Error(), "state_init") {
		t.Fatalf("%v does not name state_init", err)
	}
}
