package tinyloop

import (
	"context"
	"errors"
	"fmt"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"
)

// modelPath is a byte-vocabulary model: TINYLOOP_TEST_MODEL, or one synthesized by the CLI
// (TINYLOOP_BIN, or ../../target/release/tinyloop).
var modelPath string

func TestMain(m *testing.M) {
	os.Exit(run(m))
}

func run(m *testing.M) int {
	modelPath = os.Getenv("TINYLOOP_TEST_MODEL")
	if modelPath == "" {
		dir, err := os.MkdirTemp("", "tinyloop-go-test")
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		defer os.RemoveAll(dir)
		modelPath = filepath.Join(dir, "tiny.tinyloop")
		out, err := exec.Command(cli(), "synth", "--preset", "tiny", "--seed", "1", "--out", modelPath).CombinedOutput()
		if err != nil {
			fmt.Fprintf(os.Stderr, "cannot synthesize a test model with %s: %v\n%s", cli(), err, out)
			return 1
		}
	}
	return m.Run()
}

// cli is the tinyloop CLI that synthesizes test models: TINYLOOP_BIN, or
// ../../target/release/tinyloop.
func cli() string {
	if path := os.Getenv("TINYLOOP_BIN"); path != "" {
		return path
	}
	return filepath.Join("..", "..", "target", "release", "tinyloop")
}

var prompt = []int32{82, 79, 77, 69, 79, 58} // "ROMEO:"

func open(t *testing.T, maxSeqLen int) *Model {
	t.Helper()
	opts := DefaultOptions()
	opts.MaxSeqLen = maxSeqLen
	opts.Device = "cpu"
	opts.Log = false
	m, err := Open(modelPath, &opts)
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	t.Cleanup(func() { _ = m.Close() })
	return m
}

func gen(maxTokens int) *GenerateOptions {
	o := DefaultGenerateOptions()
	o.MaxTokens = maxTokens
	return &o
}

func wantStatus(t *testing.T, err error, want Status, label string) {
	t.Helper()
	var e *Error
	if !errors.As(err, &e) {
		t.Fatalf("%s: got %v, want a *Error with %v", label, err, want)
	}
	if e.Status != want {
		t.Fatalf("%s: got %v, want %v", label, e, want)
	}
}

func TestABIVersion(t *testing.T) {
	if LibraryABIVersion() != ABIVersion {
		t.Fatalf("library ABI %d, package %d", LibraryABIVersion(), ABIVersion)
	}
	if StatusBusy.String() != "TL_ERR_BUSY" {
		t.Fatalf("StatusBusy.String() = %q", StatusBusy.String())
	}
}

func TestOpenFailures(t *testing.T) {
	_, err := Open(filepath.Join(t.TempDir(), "missing.tinyloop"), nil)
	wantStatus(t, err, StatusIO, "missing file")
	if !strings.Contains(err.Error(), "missing.tinyloop") {
		t.Errorf("message does not name the file: %v", err)
	}
	garbage := filepath.Join(t.TempDir(), "garbage.tinyloop")
	if err := os.WriteFile(garbage, []byte(strings.Repeat("not a model ", 10)), 0o644); err != nil {
		t.Fatal(err)
	}
	_, err = Open(garbage, nil)
	wantStatus(t, err, StatusFormat, "garbage file")
	if !errors.Is(err, ErrFormat) {
		t.Errorf("errors.Is(err, ErrFormat) is false for %v", err)
	}
	opts := DefaultOptions()
	opts.MaxSeqLen = 1 << 20
	_, err = Open(modelPath, &opts)
	wantStatus(t, err, StatusInvalidArgument, "MaxSeqLen above MaxPosition")
	opts = DefaultOptions()
	opts.Device = "tpu"
	_, err = Open(modelPath, &opts)
	wantStatus(t, err, StatusInvalidArgument, "device tpu")
	opts = DefaultOptions()
	opts.KVMode = "int3"
	_, err = Open(modelPath, &opts)
	wantStatus(t, err, StatusInvalidArgument, "kv mode int3")
	if !strings.Contains(err.Error(), "fp16, fp16-h, int8-h, int4-h, int8, delta, age") {
		t.Errorf("message does not list the modes: %v", err)
	}
}

// MaxSeqLen 0, the default, opens a model for 2048 tokens or its MaxPosition when smaller.
func TestDefaultMaxSeqLenIsTheModels(t *testing.T) {
	opts := DefaultOptions()
	if opts.MaxSeqLen != 0 {
		t.Fatalf("DefaultOptions().MaxSeqLen = %d, want 0 (the model's default)", opts.MaxSeqLen)
	}
	opts.Device = "cpu"
	opts.Log = false
	m, err := Open(modelPath, &opts)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	cfg, err := m.Config()
	if err != nil {
		t.Fatal(err)
	}
	want := 2048
	if cfg.MaxPosition < want {
		want = cfg.MaxPosition
	}
	if cfg.MaxSeqLen != want {
		t.Errorf("MaxSeqLen %d, want min(2048, MaxPosition %d) = %d", cfg.MaxSeqLen, cfg.MaxPosition, want)
	}
}

func TestKVModes(t *testing.T) {
	for _, mode := range []string{"fp16", "fp16-h", "int8-h", "int4-h", "int8", "delta", "age:64:128"} {
		opts := DefaultOptions()
		opts.Device, opts.KVMode, opts.Log = "cpu", mode, false
		m, err := Open(modelPath, &opts)
		if err != nil {
			t.Fatalf("%s: %v", mode, err)
		}
		if got, err := m.KVMode(); err != nil || got != mode {
			t.Errorf("KVMode() = %q, %v; want %q", got, err, mode)
		}
		out, err := m.Generate(context.Background(), []int32{1, 2, 3, 4, 5}, nil)
		if err != nil || len(out) == 0 {
			t.Errorf("%s: Generate = %v, %v", mode, out, err)
		}
		m.Close()
	}
}

func TestConfigAndMemory(t *testing.T) {
	m := open(t, 128)
	cfg, err := m.Config()
	if err != nil {
		t.Fatal(err)
	}
	if cfg.VocabSize != 256 || cfg.Dim <= 0 || cfg.NHeads <= 0 || cfg.FFNDim <= 0 || cfg.DefaultLoops <= 0 || cfg.NPreBlocks < 0 {
		t.Fatalf("unexpected config %+v", cfg)
	}
	if cfg.MaxSeqLen != 128 || (cfg.Norm != "rmsnorm" && cfg.Norm != "layernorm") {
		t.Fatalf("unexpected config %+v", cfg)
	}
	mb, err := m.VRAMUsageMB()
	if err != nil || mb <= 0 {
		t.Fatalf("VRAMUsageMB = %v, %v", mb, err)
	}
	dev, err := m.Device()
	if err != nil || !strings.HasPrefix(dev, "cpu") {
		t.Fatalf("Device = %q, %v", dev, err)
	}
}

func TestGenerateStreamAndScore(t *testing.T) {
	m := open(t, 256)
	ctx := context.Background()
	a, err := m.Generate(ctx, prompt, gen(16))
	if err != nil {
		t.Fatal(err)
	}
	if len(a) != 16 {
		t.Fatalf("got %d tokens, want 16", len(a))
	}
	b, err := m.Generate(ctx, prompt, gen(16))
	if err != nil || !reflect.DeepEqual(a, b) {
		t.Fatalf("greedy not deterministic: %v vs %v (%v)", a, b, err)
	}
	var streamed []int32
	if err := m.GenerateStream(ctx, prompt, gen(16), func(tok int32) bool {
		streamed = append(streamed, tok)
		return true
	}); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(streamed, a) {
		t.Fatalf("stream %v != generate %v", streamed, a)
	}
	// Returning false stops early without an error.
	n := 0
	if err := m.GenerateStream(ctx, prompt, gen(16), func(int32) bool { n++; return n < 3 }); err != nil || n != 3 {
		t.Fatalf("early stop: n=%d err=%v", n, err)
	}
	// Stop tokens: generation ends before the first occurrence.
	o := gen(16)
	o.Stop = []int32{a[5]}
	stopped, err := m.Generate(ctx, prompt, o)
	first := 0
	for a[first] != a[5] {
		first++
	}
	if err != nil || !reflect.DeepEqual(stopped, a[:first]) {
		t.Fatalf("stop: got %v want %v (%v)", stopped, a[:first], err)
	}
	// Seeded sampling is reproducible.
	s := gen(20)
	s.Temperature, s.TopP, s.Seed = 0.9, 0.95, 42
	x, err1 := m.Generate(ctx, prompt, s)
	y, err2 := m.Generate(ctx, prompt, s)
	if err1 != nil || err2 != nil || !reflect.DeepEqual(x, y) {
		t.Fatalf("seeded sampling: %v %v (%v %v)", x, y, err1, err2)
	}

	last, err := m.ScoreLast(prompt, LoopsDefault)
	if err != nil || len(last) != 256 {
		t.Fatalf("ScoreLast: %d logits, %v", len(last), err)
	}
	all, err := m.Score(prompt, LoopsDefault)
	if err != nil || len(all) != 256*len(prompt) {
		t.Fatalf("Score: %d values, %v", len(all), err)
	}
	// Same computation on the same device: the last row equals ScoreLast bit for bit.
	if !reflect.DeepEqual(all[256*(len(prompt)-1):], last) {
		t.Fatal("last row of Score differs from ScoreLast")
	}
	lp, err := m.Logprobs(prompt, 2)
	if err != nil || len(lp) != len(prompt)-1 {
		t.Fatalf("Logprobs: %v, %v", lp, err)
	}
	for _, v := range lp {
		if v > 0 || math.IsNaN(float64(v)) {
			t.Fatalf("logprob %v", v)
		}
	}
}

// On the CPU a row is computed alike in a one-row decode step and in a one-step score
// (docs/NUMERICS.md "Scoring through the decode path"): the two agree bit for bit.
func TestLogprobsDecodeEqualsLogprobsOnCPU(t *testing.T) {
	m := open(t, 64)
	tokens := append(append([]int32{}, prompt...), prompt...)
	for _, loops := range []int{1, 4} {
		want, err := m.Logprobs(tokens, loops)
		if err != nil {
			t.Fatalf("Logprobs: %v", err)
		}
		got, err := m.LogprobsDecode(tokens, loops)
		if err != nil || !reflect.DeepEqual(got, want) {
			t.Fatalf("LogprobsDecode at %d loops: %v (%v), want %v", loops, got, err, want)
		}
	}
	s, err := m.NewSession()
	if err != nil {
		t.Fatalf("NewSession: %v", err)
	}
	defer s.Close()
	if _, err := s.LogprobsDecode(tokens[:1], LoopsDefault); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("one token: %v, want ErrInvalidArgument", err)
	}
}

func TestGenerationStopsAtMaxSeqLen(t *testing.T) {
	m := open(t, 64)
	toks, err := m.Generate(context.Background(), prompt, gen(60))
	if err != nil || len(toks) != 64-len(prompt) {
		t.Fatalf("Generate(MaxTokens 60) with max_seq_len 64: %d tokens, %v", len(toks), err)
	}
}

func TestInvalidArguments(t *testing.T) {
	m := open(t, 64)
	ctx := context.Background()
	cases := []struct {
		name   string
		tokens []int32
		edit   func(o *GenerateOptions)
	}{
		{"empty prompt", nil, nil},
		{"token >= vocab", []int32{1, 256}, nil},
		{"negative token", []int32{-1}, nil},
		{"temperature < 0", prompt, func(o *GenerateOptions) { o.Temperature = -1 }},
		{"temperature NaN", prompt, func(o *GenerateOptions) { o.Temperature = float32(math.NaN()) }},
		{"top_p 0", prompt, func(o *GenerateOptions) { o.TopP = 0 }},
		{"top_p > 1", prompt, func(o *GenerateOptions) { o.TopP = 1.01 }},
		{"loops 0", prompt, func(o *GenerateOptions) { o.Loops = 0 }},
		{"loops above max", prompt, func(o *GenerateOptions) { o.Loops = 65 }},
		{"max_tokens 0", prompt, func(o *GenerateOptions) { o.MaxTokens = 0 }},
		{"prompt fills max_seq_len", make([]int32, 64), nil},
		{"stop token >= vocab", prompt, func(o *GenerateOptions) { o.Stop = []int32{300} }},
	}
	for _, c := range cases {
		o := gen(4)
		if c.edit != nil {
			c.edit(o)
		}
		_, err := m.Generate(ctx, c.tokens, o)
		wantStatus(t, err, StatusInvalidArgument, c.name)
		if !errors.Is(err, ErrInvalidArgument) {
			t.Errorf("%s: errors.Is(ErrInvalidArgument) false", c.name)
		}
	}
	_, err := m.ScoreLast(prompt, 0)
	wantStatus(t, err, StatusInvalidArgument, "ScoreLast loops 0")
	long := make([]int32, 65)
	_, err = m.ScoreLast(long, LoopsDefault)
	wantStatus(t, err, StatusInvalidArgument, "prompt longer than max_seq_len")
}

func TestCloseIsIdempotentAndConcurrent(t *testing.T) {
	m := open(t, 64)
	s, err := m.NewSession()
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	for i := 0; i < 8; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := m.Close(); err != nil {
				t.Errorf("Close: %v", err)
			}
		}()
	}
	wg.Wait()
	ctx := context.Background()
	checks := map[string]error{}
	_, checks["Generate"] = m.Generate(ctx, prompt, gen(2))
	checks["GenerateStream"] = m.GenerateStream(ctx, prompt, gen(2), func(int32) bool { return true })
	_, checks["ScoreLast"] = m.ScoreLast(prompt, LoopsDefault)
	_, checks["Config"] = m.Config()
	_, checks["VRAMUsageMB"] = m.VRAMUsageMB()
	_, checks["NewSession"] = m.NewSession()
	checks["Cancel"] = m.Cancel()
	for method, err := range checks {
		wantStatus(t, err, StatusClosed, method+" after Close")
		if !strings.Contains(err.Error(), method) {
			t.Errorf("%s: message does not name the method: %v", method, err)
		}
	}
	// A session made before Close keeps working.
	if _, err := s.Generate(ctx, prompt, gen(3)); err != nil {
		t.Fatalf("session after model Close: %v", err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	_, err = s.Generate(ctx, prompt, gen(3))
	wantStatus(t, err, StatusClosed, "session Generate after Close")
}

func TestBusyWhileStreaming(t *testing.T) {
	m := open(t, 256)
	started := make(chan struct{})
	release := make(chan struct{})
	done := make(chan error, 1)
	go func() {
		first := true
		done <- m.GenerateStream(context.Background(), prompt, gen(8), func(int32) bool {
			if first {
				first = false
				close(started)
				<-release
			}
			return true
		})
	}()
	<-started
	_, err := m.Generate(context.Background(), prompt, gen(2))
	wantStatus(t, err, StatusBusy, "Generate while streaming")
	if !errors.Is(err, ErrBusy) {
		t.Errorf("errors.Is(err, ErrBusy) false: %v", err)
	}
	if _, err := m.VRAMUsageMB(); err != nil {
		t.Errorf("VRAMUsageMB while streaming: %v", err)
	}
	close(release)
	if err := <-done; err != nil {
		t.Fatalf("stream: %v", err)
	}
}

func TestContextCancelsAStream(t *testing.T) {
	m := open(t, 512)
	s, err := m.NewSession()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ctx, cancel := context.WithCancel(context.Background())
	count := 0
	err = s.GenerateStream(ctx, prompt, gen(300), func(int32) bool {
		count++
		if count == 2 {
			cancel()
			time.Sleep(5 * time.Millisecond) // let the watcher reach tl_session_cancel
		}
		return true
	})
	wantStatus(t, err, StatusCancelled, "stream with cancelled ctx")
	if !errors.Is(err, context.Canceled) || !errors.Is(err, ErrCancelled) {
		t.Fatalf("error %v should match context.Canceled and ErrCancelled", err)
	}
	if count >= 300 {
		t.Fatalf("stream ran to completion (%d tokens)", count)
	}
	// Generate with a ctx that is already done fails at once.
	_, err = s.Generate(ctx, prompt, gen(4))
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("Generate with a done ctx: %v", err)
	}
	// A deadline stops a long Generate (tl_session_cancel from the watcher goroutine).
	dctx, dcancel := context.WithTimeout(context.Background(), 2*time.Millisecond)
	defer dcancel()
	out, err := s.Generate(dctx, prompt, gen(500))
	if err == nil {
		if len(out) != 500 {
			t.Fatalf("no error but %d tokens", len(out))
		}
		t.Log("generation finished before the deadline; cancellation path not exercised")
	} else if !errors.Is(err, context.DeadlineExceeded) || !errors.Is(err, ErrCancelled) {
		t.Fatalf("deadline: %v", err)
	}
	// The session is usable afterwards.
	if _, err := s.Generate(context.Background(), prompt, gen(3)); err != nil {
		t.Fatal(err)
	}
}

func TestCloseWhileAnotherGoroutineGenerates(t *testing.T) {
	m := open(t, 512)
	started := make(chan struct{})
	done := make(chan error, 1)
	go func() {
		first := true
		done <- m.GenerateStream(context.Background(), prompt, gen(400), func(int32) bool {
			if first {
				first = false
				close(started)
			}
			time.Sleep(time.Millisecond)
			return true
		})
	}()
	<-started
	if err := m.Close(); err != nil {
		t.Fatal(err)
	}
	err := <-done
	wantStatus(t, err, StatusCancelled, "stream interrupted by Close")
}

func TestSessionsRunConcurrentlyWithSequentialResults(t *testing.T) {
	m := open(t, 256)
	prompts := [][]int32{{72, 101, 108, 108, 111}, {84, 111, 32, 98, 101}}
	opts := []*GenerateOptions{gen(40), gen(40)}
	opts[1].Temperature, opts[1].Seed = 0.8, 9
	sessions := make([]*Session, 2)
	want := make([][]int32, 2)
	for i := range sessions {
		s, err := m.NewSession()
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		sessions[i] = s
		if want[i], err = s.Generate(context.Background(), prompts[i], opts[i]); err != nil {
			t.Fatal(err)
		}
	}
	var wg sync.WaitGroup
	for i := range sessions {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			for rep := 0; rep < 3; rep++ {
				got, err := sessions[i].Generate(context.Background(), prompts[i], opts[i])
				if err != nil {
					t.Errorf("session %d: %v", i, err)
					return
				}
				if !reflect.DeepEqual(got, want[i]) {
					t.Errorf("session %d: concurrent %v != sequential %v", i, got, want[i])
				}
			}
		}(i)
	}
	wg.Wait()
}

func TestPanicInCallbackIsReraised(t *testing.T) {
	m := open(t, 64)
	defer func() {
		if p := recover(); p != "boom" {
			t.Fatalf("recovered %v, want boom", p)
		}
		// The model is usable after the panic.
		if _, err := m.Generate(context.Background(), prompt, gen(2)); err != nil {
			t.Fatal(err)
		}
	}()
	_ = m.GenerateStream(context.Background(), prompt, gen(4), func(int32) bool { panic("boom") })
	t.Fatal("GenerateStream returned normally")
}
