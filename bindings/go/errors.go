package tinyloop

// #include "tinyloop.h"
import "C"

// Status is a tl_status code of the C ABI.
type Status int

// The tl_status codes (include/tinyloop.h).
const (
	StatusOK              Status = 0
	StatusInvalidArgument Status = 1
	StatusIO              Status = 2
	StatusFormat          Status = 3
	StatusOutOfMemory     Status = 4
	StatusDevice          Status = 5
	StatusClosed          Status = 6
	StatusBusy            Status = 7
	StatusCancelled       Status = 8
	StatusPanic           Status = 9
	StatusBufferTooSmall  Status = 10
)

// String is the C name of the code, e.g. "TL_ERR_BUSY".
func (s Status) String() string { return C.GoString(C.tl_status_string(C.int32_t(s))) }

// Error is a failed call: the status and the library's message (which names the C function
// and the failure point). errors.Is(err, ErrBusy) etc. compare statuses; an error caused by a
// context also matches ctx.Err().
type Error struct {
	Status  Status
	Message string
	cause   error
}

func (e *Error) Error() string {
	if e.Message == "" {
		return "tinyloop: " + e.Status.String()
	}
	return "tinyloop: " + e.Message + " (" + e.Status.String() + ")"
}

// Unwrap returns the context error behind a cancellation, if any.
func (e *Error) Unwrap() error { return e.cause }

// Is matches any *Error with the same Status (such as the Err* values below).
func (e *Error) Is(target error) bool {
	t, ok := target.(*Error)
	return ok && t.Status == e.Status
}

// Sentinels for errors.Is.
var (
	ErrInvalidArgument = &Error{Status: StatusInvalidArgument}
	ErrIO              = &Error{Status: StatusIO}
	ErrFormat          = &Error{Status: StatusFormat}
	ErrOutOfMemory     = &Error{Status: StatusOutOfMemory}
	ErrDevice          = &Error{Status: StatusDevice}
	ErrClosed          = &Error{Status: StatusClosed}
	ErrBusy            = &Error{Status: StatusBusy}
	ErrCancelled       = &Error{Status: StatusCancelled}
	ErrPanic           = &Error{Status: StatusPanic}
)
