package tinyloop

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"testing"
)

// helloIDs are the ids of "Hello, world!" under the tokenizer fixture (tests/data/tokenizer,
// expected.json), BOS (<|endoftext|>, 381) first.
var helloIDs = []int32{381, 39, 68, 272, 78, 11, 262, 273, 311, 0}

// eos are generation_config.json's eos_token_id: <|im_end|>, <|endoftext|>.
var eos = []int32{383, 381}

var (
	textModelOnce sync.Once
	textModelPath string
	textModelErr  error
)

// openText opens a model that carries the tokenizer fixture: TINYLOOP_TEST_TEXT_MODEL, or one
// synthesized by the CLI (TINYLOOP_BIN, or ../../target/release/tinyloop).
func openText(t *testing.T) *Model {
	t.Helper()
	textModelOnce.Do(func() {
		textModelPath = os.Getenv("TINYLOOP_TEST_TEXT_MODEL")
		if textModelPath != "" {
			return
		}
		textModelPath = filepath.Join(os.TempDir(), "tinyloop-go-test-text.tinyloop")
		out, err := exec.Command(cli(), "synth", "--preset", "tiny", "--seed", "1", "--tokenizer",
			filepath.Join("..", "..", "tests", "data", "tokenizer"), "--out", textModelPath).CombinedOutput()
		if err != nil {
			textModelErr = errors.New(err.Error() + ": " + string(out))
		}
	})
	if textModelErr != nil {
		t.Fatalf("cannot synthesize the text model: %v", textModelErr)
	}
	opts := DefaultOptions()
	opts.MaxSeqLen = 256
	opts.Device = "cpu"
	opts.Log = false
	m, err := Open(textModelPath, &opts)
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	t.Cleanup(func() { _ = m.Close() })
	return m
}

func greedyText(max int) *GenerateOptions {
	o := DefaultGenerateOptions()
	o.MaxTokens = max
	o.Loops = 2
	return &o
}

func TestTokenizeAndDetokenize(t *testing.T) {
	m := openText(t)
	ids, err := m.Tokenize("Hello, world!", true)
	if err != nil || !reflect.DeepEqual(ids, helloIDs) {
		t.Fatalf("Tokenize = %v, %v; want %v", ids, err, helloIDs)
	}
	plain, _ := m.Tokenize("Hello, world!", false)
	if !reflect.DeepEqual(plain, helloIDs[1:]) {
		t.Fatalf("without special tokens: %v", plain)
	}
	if empty, err := m.Tokenize("", false); err != nil || len(empty) != 0 {
		t.Fatalf("empty text: %v, %v", empty, err)
	}
	for skip, want := range map[bool]string{true: "Hello, world!", false: "<|endoftext|>Hello, world!"} {
		if text, err := m.Detokenize(ids, skip); err != nil || text != want {
			t.Fatalf("Detokenize(skip %v) = %q, %v; want %q", skip, text, err, want)
		}
	}
	for _, text := range []string{"café 日本 مرحبا 👨‍👩‍👧", "tabs\t\tand\n\nnew lines  "} {
		ids, _ := m.Tokenize(text, false)
		if back, _ := m.Detokenize(ids, false); back != text {
			t.Fatalf("round trip of %q gives %q", text, back)
		}
	}
	if _, err := m.Detokenize([]int32{384}, false); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("token 384: %v", err)
	}
	if _, err := m.Tokenize("a\x00b", true); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("NUL byte: %v", err)
	}
	if _, err := m.Tokenize("a\xc3", true); !errors.Is(err, ErrInvalidArgument) || !strings.Contains(err.Error(), "not valid UTF-8") {
		t.Fatalf("not UTF-8: %v", err)
	}
}

func TestSpecialTokenAndChatTemplate(t *testing.T) {
	m := openText(t)
	if id, err := m.SpecialToken("<|im_end|>"); err != nil || id != 383 {
		t.Fatalf("SpecialToken = %d, %v", id, err)
	}
	if _, err := m.SpecialToken("<|tool|>"); !errors.Is(err, ErrInvalidArgument) || !strings.Contains(err.Error(), "unknown special token") {
		t.Fatalf("unknown special token: %v", err)
	}
	text, err := m.ApplyChatTemplate([]ChatMessage{{Role: "user", Content: "Hello, who are you?"}}, true)
	want := "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n" +
		"<|im_start|>user\nHello, who are you?<|im_end|>\n<|im_start|>assistant\n"
	if err != nil || text != want {
		t.Fatalf("ApplyChatTemplate = %q, %v", text, err)
	}
	if _, err := m.ApplyChatTemplate([]ChatMessage{{Role: "tool", Content: "x"}}, true); err == nil || !strings.Contains(err.Error(), "unknown role: tool") {
		t.Fatalf("refused role: %v", err)
	}
	bytes := open(t, 256)
	if _, err := bytes.ApplyChatTemplate([]ChatMessage{{Role: "user", Content: "hi"}}, true); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("byte-level model: %v", err)
	}
}

func TestGenerateTextIsGeneratedTokensDecoded(t *testing.T) {
	m := openText(t)
	ctx := context.Background()
	text, err := m.GenerateText(ctx, "ROMEO:", greedyText(20), nil)
	if err != nil {
		t.Fatal(err)
	}
	prompt, _ := m.Tokenize("ROMEO:", true)
	o := greedyText(20)
	o.Stop = eos
	tokens, err := m.Generate(ctx, prompt, o)
	if err != nil {
		t.Fatal(err)
	}
	if want, _ := m.Detokenize(tokens, true); text != want {
		t.Fatalf("GenerateText = %q, decoded tokens %q", text, want)
	}
	var pieces []string
	err = m.GenerateTextStream(ctx, "ROMEO:", greedyText(20), nil, func(p string) bool {
		pieces = append(pieces, p)
		return true
	})
	if err != nil || strings.Join(pieces, "") != text || len(pieces) == 0 {
		t.Fatalf("GenerateTextStream: %q, %v; want %q", pieces, err, text)
	}
	s, err := m.NewSession()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if again, err := s.GenerateText(ctx, "ROMEO:", greedyText(20), nil); err != nil || again != text {
		t.Fatalf("Session.GenerateText = %q, %v", again, err)
	}
}

func TestStopStrings(t *testing.T) {
	m := openText(t)
	ctx := context.Background()
	full, err := m.GenerateText(ctx, "Hello", greedyText(40), nil)
	runes := []rune(full)
	if err != nil || len(runes) < 5 {
		t.Fatalf("GenerateText = %q, %v", full, err)
	}
	stop := string(runes[3:5])
	to := DefaultTextOptions()
	to.Stop = []string{"never there", stop}
	cut, err := m.GenerateText(ctx, "Hello", greedyText(40), &to)
	if want := full[:strings.Index(full, stop)]; err != nil || cut != want {
		t.Fatalf("with stop %q: %q, %v; want %q", stop, cut, err, want)
	}
	to.Stop = []string{""}
	if _, err := m.GenerateText(ctx, "Hello", greedyText(4), &to); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("empty stop string: %v", err)
	}
}

func TestScoreText(t *testing.T) {
	m := openText(t)
	got, err := m.ScoreText("Hello, world!", 2)
	if err != nil {
		t.Fatal(err)
	}
	want, _ := m.Logprobs(helloIDs, 2)
	if len(got) != len(want) || len(got) != len(helloIDs)-1 {
		t.Fatalf("ScoreText: %d values, Logprobs %d", len(got), len(want))
	}
	for i := range got {
		if got[i] != want[i] {
			t.Fatalf("ScoreText[%d] = %v, Logprobs %v", i, got[i], want[i])
		}
	}
	if _, err := m.ScoreText("", 2); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("a text of one token: %v", err)
	}
}
