//! The handle a call runs on. Every operation that runs on a session has one implementation,
//! taking a [`Target`]; its `tl_*` entry point passes a model handle (whose calls run on the
//! model's default session) and its `tl_session_*` entry point a session handle. Resolving the
//! handle happens here and nowhere else.

use std::sync::Arc;

use super::model::{default_session, tl_model};
use super::session::{session, tl_session, SessionSlot};
use super::FfiResult;
use crate::Session;

/// A model handle (its default session) or a session handle.
#[derive(Clone, Copy)]
pub(crate) enum Target {
    Model(*const tl_model),
    Session(*const tl_session),
}

impl Target {
    /// The session slot behind the handle that `func` was called on: `TL_ERR_INVALID_ARGUMENT`
    /// for NULL or a value that is not a handle of the kind, `TL_ERR_CLOSED` for a closed one.
    pub fn slot(self, func: &str) -> FfiResult<Arc<SessionSlot>> {
        match self {
            Target::Model(model) => default_session(model, func),
            Target::Session(s) => session(s, func),
        }
    }

    /// Run `f`, the body of `func`, on the session behind the handle (`TL_ERR_BUSY` when
    /// another call is running on it).
    pub fn run<R>(self, func: &str, f: impl FnOnce(&mut Session) -> FfiResult<R>) -> FfiResult<R> {
        self.slot(func)?.run(func, f)
    }
}
