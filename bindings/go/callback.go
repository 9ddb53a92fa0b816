package tinyloop

// The stream callbacks: C calls tinyloop_trampoline (tinyloop.go) or tinyloop_text_trampoline
// (text.go), which call these exported Go functions with the cgo.Handle of the stream's state.
// (A file with //export may only declare in its preamble, so the C shims live in those files.)

// #include <stdbool.h>
// #include <stddef.h>
// #include <stdint.h>
import "C"

import (
	"runtime/cgo"
)

// streamState is what a stream's callback sees: the user's function and what it did.
type streamState struct {
	fn       func(token int32) bool
	count    int
	stopped  bool        // the ctx was done; the callback asked C to stop
	panicked interface{} // a panic in fn, re-raised after the C call returns
	ctxDone  func() bool
}

//export goTinyloopToken
func goTinyloopToken(token C.int32_t, handle C.uintptr_t) (keepGoing C.bool) {
	state := cgo.Handle(handle).Value().(*streamState)
	// A panic must not unwind through C frames: record it and stop generation.
	defer func() {
		if p := recover(); p != nil {
			state.panicked = p
			keepGoing = false
		}
	}()
	if state.ctxDone() {
		state.stopped = true
		return false
	}
	state.count++
	return C.bool(state.fn(int32(token)))
}

// textStreamState is what a text stream's callback sees.
type textStreamState struct {
	fn       func(piece string) bool
	stopped  bool        // the ctx was done; the callback asked C to stop
	panicked interface{} // a panic in fn, re-raised after the C call returns
	ctxDone  func() bool
}

//export goTinyloopText
func goTinyloopText(piece *C.char, length C.size_t, handle C.uintptr_t) (keepGoing C.bool) {
	state := cgo.Handle(handle).Value().(*textStreamState)
	defer func() {
		if p := recover(); p != nil {
			state.panicked = p
			keepGoing = false
		}
	}()
	if state.ctxDone() {
		state.stopped = true
		return false
	}
	return C.bool(state.fn(C.GoStringN(piece, C.int(length))))
}
