package tinyloop

/*
#include <stdint.h>
#include <stdlib.h>
#include "tinyloop.h"

extern _Bool goTinyloopText(char *piece, size_t len, uintptr_t handle);

static bool tinyloop_text_trampoline(const char *piece, size_t len, void *user_data) {
	return goTinyloopText((char *)piece, len, (uintptr_t)user_data);
}

// Each text call on a model (m) or a session (s, when m is NULL): one Go method serves both
// handle kinds.

static enum tl_status tinyloop_generate_text(const tl_model *m, const tl_session *s,
                                             const char *prompt, const tl_generate_params *p,
                                             const tl_text_params *t, char *out, size_t cap,
                                             size_t *len) {
	return m ? tl_generate_text(m, prompt, p, t, out, cap, len)
	         : tl_session_generate_text(s, prompt, p, t, out, cap, len);
}

static enum tl_status tinyloop_generate_text_stream(const tl_model *m, const tl_session *s,
                                                    const char *prompt,
                                                    const tl_generate_params *p,
                                                    const tl_text_params *t, uintptr_t handle) {
	return m ? tl_generate_text_stream(m, prompt, p, t, tinyloop_text_trampoline, (void *)handle)
	         : tl_session_generate_text_stream(s, prompt, p, t, tinyloop_text_trampoline,
	                                           (void *)handle);
}

static enum tl_status tinyloop_score_text(const tl_model *m, const tl_session *s,
                                          const char *text, int32_t loops, float *out,
                                          size_t cap, size_t *len) {
	return m ? tl_score_text(m, text, loops, out, cap, len)
	         : tl_session_score_text(s, text, loops, out, cap, len);
}
*/
import "C"

import (
	"context"
	"runtime/cgo"
	"strings"
	"unsafe"
)

// TextOptions configure how a text call tokenizes its prompt and turns the generated tokens
// into text. Start from DefaultTextOptions(); nil means the defaults.
type TextOptions struct {
	// Stop strings: generation ends once the generated text contains one (also across
	// tokens), and the text returned ends before it. None may be empty.
	Stop []string
	// AddSpecialTokens adds the tokenizer's special tokens (its BOS, ...) to the prompt; a
	// prompt from ApplyChatTemplate has them already (false).
	AddSpecialTokens bool
	// SkipSpecialTokens leaves special tokens out of the generated text.
	SkipSpecialTokens bool
}

// DefaultTextOptions returns the library's defaults (tl_text_default_params): no stop strings,
// special tokens added to the prompt and left out of the output.
func DefaultTextOptions() TextOptions {
	var p C.tl_text_params
	C.tl_text_default_params(&p)
	return TextOptions{AddSpecialTokens: bool(p.add_special_tokens), SkipSpecialTokens: bool(p.skip_special_tokens)}
}

// ChatMessage is one message of a conversation for ApplyChatTemplate.
type ChatMessage struct {
	Role    string // "system", "user", "assistant", or another role the template knows
	Content string
}

// cString is s as C memory (free with C.free); an error names what holds a NUL byte, which a
// C string cannot carry.
func cString(s, what string) (*C.char, error) {
	if strings.IndexByte(s, 0) >= 0 {
		return nil, invalid("%s contains a NUL byte", what)
	}
	return C.CString(s), nil
}

// cTextParams converts text options to C memory (a params struct in Go memory must not point to
// Go memory); call the returned release function when the call is done.
func cTextParams(t *TextOptions) (*C.tl_text_params, func(), error) {
	p := (*C.tl_text_params)(C.malloc(C.size_t(unsafe.Sizeof(C.tl_text_params{}))))
	C.tl_text_default_params(p)
	var strs []*C.char
	release := func() {
		for _, s := range strs {
			C.free(unsafe.Pointer(s))
		}
		C.free(unsafe.Pointer(p.stop))
		C.free(unsafe.Pointer(p))
	}
	if t == nil {
		return p, release, nil
	}
	p.add_special_tokens = C.bool(t.AddSpecialTokens)
	p.skip_special_tokens = C.bool(t.SkipSpecialTokens)
	if len(t.Stop) > 0 {
		p.stop = (**C.char)(C.malloc(C.size_t(len(t.Stop)) * C.size_t(unsafe.Sizeof((*C.char)(nil)))))
		p.n_stop = C.size_t(len(t.Stop))
		slots := unsafe.Slice(p.stop, len(t.Stop))
		for i, s := range t.Stop {
			cs, err := cString(s, "TextOptions.Stop entry")
			if err != nil {
				p.n_stop = C.size_t(i)
				return p, release, err
			}
			strs = append(strs, cs)
			slots[i] = cs
		}
	}
	return p, release, nil
}

// Tokenize returns the token ids of text under the model's tokenizer; with addSpecialTokens,
// those the tokenizer adds around a text (its BOS, ...). Special tokens written in the text
// ("<|im_start|>") are recognized either way. It does not wait for running calls.
func (m *Model) Tokenize(text string, addSpecialTokens bool) ([]int32, error) {
	const method = "Tokenize"
	ctext, err := cString(text, "text")
	if err != nil {
		return nil, err
	}
	defer C.free(unsafe.Pointer(ctext))
	if err := m.h.enter(method); err != nil {
		return nil, err
	}
	defer m.h.mu.RUnlock()
	var n C.size_t
	// A size query (no work beyond tokenizing), then the call.
	if err := call(method, "model", func() C.enum_tl_status {
		return C.tl_tokenize(m.ptr, ctext, C.bool(addSpecialTokens), nil, 0, &n)
	}); err != nil {
		if e, ok := err.(*Error); !ok || e.Status != StatusBufferTooSmall {
			return nil, err
		}
	}
	out := make([]int32, int(n)+1)
	err = call(method, "model", func() C.enum_tl_status {
		return C.tl_tokenize(m.ptr, ctext, C.bool(addSpecialTokens), (*C.int32_t)(unsafe.Pointer(&out[0])), C.size_t(len(out)), &n)
	})
	if err != nil {
		return nil, err
	}
	return out[:int(n)], nil
}

// Detokenize returns the text of tokens (special tokens left out with skipSpecialTokens);
// bytes that do not form UTF-8 become U+FFFD. It does not wait for running calls.
func (m *Model) Detokenize(tokens []int32, skipSpecialTokens bool) (string, error) {
	return m.sizedText("Detokenize", func(out *C.char, outCap C.size_t, n *C.size_t) C.enum_tl_status {
		return C.tl_detokenize(m.ptr, tokensPtr(tokens), C.size_t(len(tokens)), C.bool(skipSpecialTokens), out, outCap, n)
	})
}

// SpecialToken returns the id of the special token written text (e.g. "<|im_end|>"); an
// unknown one is StatusInvalidArgument with a message that names it.
func (m *Model) SpecialToken(text string) (int32, error) {
	const method = "SpecialToken"
	ctext, err := cString(text, "text")
	if err != nil {
		return 0, err
	}
	defer C.free(unsafe.Pointer(ctext))
	if err := m.h.enter(method); err != nil {
		return 0, err
	}
	defer m.h.mu.RUnlock()
	var id C.int32_t
	err = call(method, "model", func() C.enum_tl_status { return C.tl_special_token(m.ptr, ctext, &id) })
	return int32(id), err
}

// ApplyChatTemplate renders messages with the model's chat template; with
// addGenerationPrompt, followed by the start of the assistant's reply. Generate from it with
// TextOptions.AddSpecialTokens false.
func (m *Model) ApplyChatTemplate(messages []ChatMessage, addGenerationPrompt bool) (string, error) {
	n := len(messages)
	if n == 0 {
		n = 1
	}
	array := (*C.tl_chat_message)(C.calloc(C.size_t(n), C.size_t(unsafe.Sizeof(C.tl_chat_message{}))))
	slots := unsafe.Slice(array, n)
	defer func() {
		for _, s := range slots {
			C.free(unsafe.Pointer(s.role))
			C.free(unsafe.Pointer(s.content))
		}
		C.free(unsafe.Pointer(array))
	}()
	for i, msg := range messages {
		var err error
		if slots[i].role, err = cString(msg.Role, "ChatMessage.Role"); err != nil {
			return "", err
		}
		if slots[i].content, err = cString(msg.Content, "ChatMessage.Content"); err != nil {
			return "", err
		}
	}
	return m.sizedText("ApplyChatTemplate", func(out *C.char, outCap C.size_t, nOut *C.size_t) C.enum_tl_status {
		return C.tl_apply_chat_template(m.ptr, array, C.size_t(len(messages)), C.bool(addGenerationPrompt), out, outCap, nOut)
	})
}

// sizedText returns the NUL-terminated text a model function writes to (out, cap, len): a size
// query, then the call.
func (m *Model) sizedText(method string, get func(*C.char, C.size_t, *C.size_t) C.enum_tl_status) (string, error) {
	if err := m.h.enter(method); err != nil {
		return "", err
	}
	defer m.h.mu.RUnlock()
	var n C.size_t
	if err := call(method, "model", func() C.enum_tl_status { return get(nil, 0, &n) }); err != nil {
		if e, ok := err.(*Error); !ok || e.Status != StatusBufferTooSmall {
			return "", err
		}
	}
	buf := make([]byte, int(n))
	err := call(method, "model", func() C.enum_tl_status {
		return get((*C.char)(unsafe.Pointer(&buf[0])), C.size_t(len(buf)), &n)
	})
	if err != nil {
		return "", err
	}
	return string(buf[:int(n)-1]), nil
}

// textCall is the C form of a text call's arguments.
type textCall struct {
	prompt  *C.char
	params  C.tl_generate_params
	text    *C.tl_text_params
	release func()
}

func newTextCall(prompt string, o *GenerateOptions, t *TextOptions, method string) (*textCall, error) {
	c := &textCall{release: func() {}}
	var err error
	if c.prompt, err = cString(prompt, "prompt"); err != nil {
		return nil, err
	}
	params, releaseParams, err := cParams(o, method)
	c.params = params
	text, releaseText, errText := cTextParams(t)
	c.text = text
	c.release = func() {
		releaseText()
		releaseParams()
		C.free(unsafe.Pointer(c.prompt))
	}
	if err == nil {
		err = errText
	}
	if err != nil {
		c.release()
		return nil, err
	}
	return c, nil
}

// GenerateText generates after the text prompt, tokenized by the model's tokenizer, and
// returns the generated text. Generation ends after opts.MaxTokens tokens, at the tokenizer's
// end-of-sequence tokens, or at a stop string of text (nil opts / text: defaults).
// Cancellation as for Generate.
func (r *runner) GenerateText(ctx context.Context, prompt string, opts *GenerateOptions, text *TextOptions) (string, error) {
	const method = "GenerateText"
	if err := ctx.Err(); err != nil {
		return "", cancelledByCtx(ctx, &Error{Status: StatusCancelled})
	}
	c, err := newTextCall(prompt, opts, text, method)
	if err != nil {
		return "", err
	}
	defer c.release()
	if err := r.h.enter(method); err != nil {
		return "", err
	}
	defer r.h.mu.RUnlock()
	var n C.size_t
	// The size the library asks for (before any work), then the call.
	if err := call(method, r.h.what, func() C.enum_tl_status {
		return C.tinyloop_generate_text(r.model, r.session, c.prompt, &c.params, c.text, nil, 0, &n)
	}); err != nil {
		if e, ok := err.(*Error); !ok || e.Status != StatusBufferTooSmall {
			return "", err
		}
	}
	buf := (*C.char)(C.malloc(n))
	defer C.free(unsafe.Pointer(buf))
	unwatch := watch(ctx, func() { r.cancelFn() })
	err = call(method, r.h.what, func() C.enum_tl_status {
		return C.tinyloop_generate_text(r.model, r.session, c.prompt, &c.params, c.text, buf, n, &n)
	})
	unwatch()
	if err != nil {
		if e, ok := err.(*Error); ok && e.Status == StatusCancelled {
			return "", cancelledByCtx(ctx, err)
		}
		return "", err
	}
	return C.GoStringN(buf, C.int(n-1)), nil
}

// GenerateTextStream is GenerateText calling fn with each piece of generated text as soon as it
// is known (whole characters, never part of a stop string), on the calling goroutine's thread;
// fn returning false stops generation (nil error). fn must not call methods of this model other
// than Cancel, VRAMUsageMB, Config and Device.
func (r *runner) GenerateTextStream(ctx context.Context, prompt string, opts *GenerateOptions, text *TextOptions, fn func(piece string) bool) error {
	const method = "GenerateTextStream"
	if fn == nil {
		return invalid("GenerateTextStream: fn is nil")
	}
	if err := ctx.Err(); err != nil {
		return cancelledByCtx(ctx, &Error{Status: StatusCancelled})
	}
	c, err := newTextCall(prompt, opts, text, method)
	if err != nil {
		return err
	}
	defer c.release()
	if err := r.h.enter(method); err != nil {
		return err
	}
	defer r.h.mu.RUnlock()
	state := &textStreamState{fn: fn, ctxDone: func() bool { return ctx.Err() != nil }}
	h := cgo.NewHandle(state)
	defer h.Delete()
	unwatch := watch(ctx, func() { r.cancelFn() })
	err = call(method, r.h.what, func() C.enum_tl_status {
		return C.tinyloop_generate_text_stream(r.model, r.session, c.prompt, &c.params, c.text, C.uintptr_t(h))
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

// ScoreText returns log p(token[i+1] | tokens[..i]) for the tokens of text under the model's
// tokenizer, with its special tokens (a BOS makes the first text token scored too): one value
// per token after the first.
func (r *runner) ScoreText(text string, loops int) ([]float32, error) {
	const method = "ScoreText"
	if err := checkLoops(method, loops); err != nil {
		return nil, err
	}
	ctext, err := cString(text, "text")
	if err != nil {
		return nil, err
	}
	defer C.free(unsafe.Pointer(ctext))
	if err := r.h.enter(method); err != nil {
		return nil, err
	}
	defer r.h.mu.RUnlock()
	var n C.size_t
	if err := call(method, r.h.what, func() C.enum_tl_status {
		return C.tinyloop_score_text(r.model, r.session, ctext, C.int32_t(loops), nil, 0, &n)
	}); err != nil {
		if e, ok := err.(*Error); !ok || e.Status != StatusBufferTooSmall {
			return nil, err
		}
	}
	out := make([]float32, int(n))
	err = call(method, r.h.what, func() C.enum_tl_status {
		return C.tinyloop_score_text(r.model, r.session, ctext, C.int32_t(loops), (*C.float)(unsafe.Pointer(&out[0])), C.size_t(len(out)), &n)
	})
	if err != nil {
		return nil, err
	}
	return out[:int(n)], nil
}
