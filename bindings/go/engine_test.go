package tinyloop

import (
	"context"
	"errors"
	"reflect"
	"strings"
	"sync"
	"testing"
)

func openCPU(t *testing.T) *Model {
	t.Helper()
	opts := DefaultOptions()
	opts.Device, opts.MaxSeqLen, opts.Log = "cpu", 256, false
	m, err := Open(modelPath, &opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = m.Close() })
	return m
}

// Requests submitted from many goroutines get the tokens Model.Generate gives each alone.
func TestEngineRequestsEqualGenerationAlone(t *testing.T) {
	m := openCPU(t)
	opts := DefaultEngineOptions()
	opts.MaxStepRows, opts.PageSize = 8, 4
	e, err := NewEngine(m, &opts)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	var wg sync.WaitGroup
	for i := 0; i < 6; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			prompt := []int32{82, 79, 77, 69, 79, 58}[:1+i%6]
			g := DefaultGenerateOptions()
			g.MaxTokens, g.Loops = 5+i, 1+i%4
			r, err := e.Submit(context.Background(), prompt, &g)
			if err != nil {
				t.Error(err)
				return
			}
			var got []int32
			for tok := range r.Tokens {
				got = append(got, tok)
			}
			stats, err := r.Wait()
			if err != nil {
				t.Error(err)
				return
			}
			alone, err := m.NewSession()
			if err != nil {
				t.Error(err)
				return
			}
			defer alone.Close()
			want, err := alone.Generate(context.Background(), prompt, &g)
			if err != nil {
				t.Error(err)
				return
			}
			if !reflect.DeepEqual(got, want) || stats.Tokens != len(want) || stats.Finish != "length" {
				t.Errorf("request %d: %v (%+v), alone %v", i, got, stats, want)
			}
		}(i)
	}
	wg.Wait()
	stats, err := e.Stats()
	if err != nil || stats.Running != 0 || stats.PagesUsed != 0 || stats.Steps == 0 {
		t.Fatalf("%+v %v", stats, err)
	}
}

// A cancelled context and Close end requests with ErrCancelled; bad input is ErrInvalidArgument.
func TestEngineCancellationAndBadInput(t *testing.T) {
	m := openCPU(t)
	opts := DefaultEngineOptions()
	opts.MaxRunning = 1
	e, err := NewEngine(m, &opts)
	if err != nil {
		t.Fatal(err)
	}
	g := DefaultGenerateOptions()
	g.MaxTokens, g.Loops = 200, 6
	ctx, cancel := context.WithCancel(context.Background())
	r, err := e.Submit(ctx, []int32{1, 2, 3}, &g)
	if err != nil {
		t.Fatal(err)
	}
	<-r.Tokens
	cancel()
	if _, err := r.Wait(); !errors.Is(err, ErrCancelled) || !errors.Is(err, context.Canceled) {
		t.Fatalf("want a cancellation by the context, got %v", err)
	}
	if err := e.Cancel(r.ID); !errors.Is(err, ErrInvalidArgument) || !strings.Contains(err.Error(), "has already ended") {
		t.Fatalf("cancel after the end: %v", err)
	}
	if _, err := e.Submit(context.Background(), nil, &g); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("empty prompt: %v", err)
	}
	bad := DefaultEngineOptions()
	bad.PageSize = 0
	if _, err := NewEngine(m, &bad); !errors.Is(err, ErrInvalidArgument) || !strings.Contains(err.Error(), "page_size") {
		t.Fatalf("page size 0: %v", err)
	}
	running, err := e.Submit(context.Background(), []int32{4, 5}, &g)
	if err != nil {
		t.Fatal(err)
	}
	<-running.Tokens
	if err := e.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := running.Wait(); !errors.Is(err, ErrCancelled) {
		t.Fatalf("a request running at Close: %v", err)
	}
	if _, err := e.Submit(context.Background(), []int32{1}, &g); !errors.Is(err, ErrClosed) {
		t.Fatalf("Submit after Close: %v", err)
	}
	if err := e.Close(); err != nil {
		t.Fatalf("Close twice: %v", err)
	}
}
