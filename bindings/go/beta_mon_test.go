package tinyloop

import (
	"context"
	"math"
	"reflect"
	"strings"
	"testing"
)

// BETA-MON from Go: GenerateOptions.BetaMonitor turns it on for a call, GenerateStats.BetaMon
// carries the summary, and bad thresholds are invalid arguments naming the field. The model runs
// on the CPU, whose entropies are the library's f64 reference stored as f32.

// entropyBits is the f64 entropy in bits of softmax(logits).
func entropyBits(logits []float32) float64 {
	max := float64(logits[0])
	for _, v := range logits {
		max = math.Max(max, float64(v))
	}
	s, t := 0.0, 0.0
	for _, v := range logits {
		z := float64(v) - max
		e := math.Exp(z)
		s += e
		t += z * e
	}
	return (math.Log(s) - t/s) / math.Ln2
}

func TestBetaMonSummaryEqualsARecomputationFromScoreLast(t *testing.T) {
	m := open(t, 256)
	ctx := context.Background()
	o := DefaultGenerateOptions()
	o.MaxTokens, o.Loops = 24, 4
	plain, err := m.Generate(ctx, prompt, &o)
	if err != nil {
		t.Fatal(err)
	}
	stats, err := m.LastGenerateStats()
	if err != nil || stats.BetaMon != nil {
		t.Fatalf("an unmonitored call has a summary: %+v, %v", stats.BetaMon, err)
	}
	monitor := DefaultBetaMonitor()
	if monitor != (BetaMonitor{LowEntropyBits: 0.5, HighEntropyBits: 6, AgreementFloor: 0.95}) {
		t.Fatalf("defaults %+v", monitor)
	}
	o.BetaMonitor = &monitor
	out, err := m.Generate(ctx, prompt, &o)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(out, plain) {
		t.Fatalf("monitoring changed the tokens: %v vs %v", out, plain)
	}
	stats, err = m.LastGenerateStats()
	if err != nil || stats.BetaMon == nil {
		t.Fatalf("no summary: %v", err)
	}
	b := stats.BetaMon
	ref := make([]float64, len(out))
	mean, min, max := 0.0, math.Inf(1), math.Inf(-1)
	for i := range out {
		logits, err := m.ScoreLast(append(append([]int32{}, prompt...), out[:i]...), 4)
		if err != nil {
			t.Fatal(err)
		}
		ref[i] = entropyBits(logits)
		mean += ref[i] / float64(len(out))
		min, max = math.Min(min, ref[i]), math.Max(max, ref[i])
	}
	// The library stores each f64 entropy as f32 (2^-24 relative): 1e-6 (1 + H) bits is ample.
	tol := 1e-6 * (1 + max)
	if b.NTokens != 24 || math.Abs(b.EntropyMeanBits-mean) > tol ||
		math.Abs(b.EntropyMinBits-min) > tol || math.Abs(b.EntropyMaxBits-max) > tol {
		t.Fatalf("summary %+v vs reference mean %v min %v max %v", b, mean, min, max)
	}
	if b.Thresholds != monitor || b.AgreementBelowFloor {
		t.Fatalf("summary %+v", b)
	}
}

func TestBetaMonReportsTheSpeculativeAgreement(t *testing.T) {
	m := open(t, 256)
	o := DefaultGenerateOptions()
	o.MaxTokens, o.Loops = 24, 4
	monitor := DefaultBetaMonitor()
	monitor.AgreementFloor = 1
	o.BetaMonitor = &monitor
	spec := DefaultSpeculativeOptions()
	spec.DraftLoops = 1
	if _, err := m.GenerateSpeculative(context.Background(), prompt, &o, spec); err != nil {
		t.Fatal(err)
	}
	stats, err := m.LastGenerateStats()
	if err != nil || stats.BetaMon == nil || stats.Drafted == 0 {
		t.Fatalf("stats %+v, %v", stats, err)
	}
	b := stats.BetaMon
	if b.AgreementRate != stats.Agreement || b.AgreementBelowFloor != (stats.Agreement < 1) {
		t.Fatalf("summary %+v, stats %+v", b, stats)
	}
}

func TestBetaMonBadThresholdsNameTheField(t *testing.T) {
	m := open(t, 256)
	for _, c := range []struct {
		monitor BetaMonitor
		want    string
	}{
		{BetaMonitor{-1, 6, 0.95}, "beta_monitor.low_entropy_bits"},
		{BetaMonitor{0.5, math.Inf(1), 0.95}, "beta_monitor.high_entropy_bits"},
		{BetaMonitor{3, 2, 0.95}, "must not exceed"},
		{BetaMonitor{0.5, 6, 1.5}, "beta_monitor.agreement_floor"},
	} {
		o := DefaultGenerateOptions()
		o.MaxTokens = 2
		o.BetaMonitor = &c.monitor
		_, err := m.Generate(context.Background(), prompt, &o)
		wantStatus(t, err, StatusInvalidArgument, c.want)
		if !strings.Contains(err.Error(), c.want) {
			t.Fatalf("%+v: %v", c.monitor, err)
		}
	}
}
